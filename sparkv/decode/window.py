"""A clustered layer's always-resident window: :class:`RecentWindow`.

Every KV head keeps its first ``sinks`` positions (the attention sinks) and its last ``recent``
positions in RAM, attended at every step whatever the selection. The decoding thread owns it:
a step's new entries join the recent part (:meth:`RecentWindow.append`) and the step's end
slides it back to ``recent`` entries (:meth:`RecentWindow.slide`); the upkeep thread never
touches it.
"""

from __future__ import annotations

import torch


class RecentWindow:
    """The sinks ``[0, sink_n)`` and the recent positions ``[rec_start, rec_start + R)`` of
    every KV head: ``sink_k, sink_v [H, sink_n, D]`` and ``rec_k, rec_v [H, R, D]``.

    Args:
        k_all, v_all: every entry of the prompt, ``[H, n, D]`` (positions ``0 .. n-1``).
        sinks, recent: the entries kept at the start and at the end.
    """

    def __init__(self, k_all: torch.Tensor, v_all: torch.Tensor, sinks: int, recent: int) -> None:
        n = int(k_all.shape[1])
        s = min(sinks, n)
        self.recent = recent
        self.sink_n = s
        self.sink_k, self.sink_v = k_all[:, :s].clone(), v_all[:, :s].clone()
        r0 = max(s, n - recent)
        self.rec_start = r0
        self.rec_k, self.rec_v = k_all[:, r0:].clone(), v_all[:, r0:].clone()

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """New entries ``[H, q, D]`` at the positions after the last one."""
        self.rec_k = torch.cat([self.rec_k, k], 1)
        self.rec_v = torch.cat([self.rec_v, v], 1)

    def slide(self) -> None:
        """Drops the oldest recent entries beyond ``recent`` (the step's upkeep clusters them)."""
        keep = max(0, int(self.rec_k.shape[1]) - self.recent)
        if keep:
            self.rec_k, self.rec_v = self.rec_k[:, keep:].clone(), self.rec_v[:, keep:].clone()
            self.rec_start += keep

    def bounds(self) -> tuple[int, int]:
        """``(sink_n, rec_start)``: the positions in between are outside the window."""
        return self.sink_n, self.rec_start

    def entries(self) -> int:
        """Entries per KV head."""
        return self.sink_n + int(self.rec_k.shape[1])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head's window: ``(k, v [H, W, D], pos [W])``."""
        s_end, w0 = self.sink_n, self.rec_start
        rec_n = int(self.rec_k.shape[1])
        wpos = torch.cat([torch.arange(s_end), torch.arange(w0, w0 + rec_n)])
        return (torch.cat([self.sink_k, self.rec_k], 1), torch.cat([self.sink_v, self.rec_v], 1),
                wpos)
