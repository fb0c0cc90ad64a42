"""DynamicKV: layer-adaptive, task-aware budgets (shared/papers/dynamickv.md, Algorithm 1).

Per layer, window scores (pooled) over the candidates; each layer first buffers its top
``r_max * b`` entries per head (``b`` the average budget per head, ``r_max = 10``). Every ``m``
layers (and at the last layer) a top-``b * H * l`` over the scores of the ``l`` layers processed so
far counts how many of the best entries each layer holds; the counts, scaled to the buffer size
and normalised so that they sum to ``b * L``, are the new budgets, and every processed layer's
buffer is truncated to its budget (a truncated entry is gone: a later update cannot bring it
back). The same count for every head of a layer.

Compression in sparkv happens after the prefill (the scores do not depend on it, since prefill
attention is full), so the progressive updates are replayed in order over the saved scores; what
the earlier truncations leave below the last update's budgets goes, in proportion, to the layers
with room left, so the budgets sum exactly to ``b * L`` [inferred: the paper's integer rounding
leaves a remainder, which its code gives to the last layer].
"""

from __future__ import annotations

from typing import ClassVar

import torch

from sparkv.presses.base import PressError, round_to_total
from sparkv.presses.snapkv import SnapKVPress


class DynamicKVPress(SnapKVPress):
    """See the module docstring. ``r_max``: buffer scale; ``m``: update interval in layers."""

    name: ClassVar[str] = "dynamickv"

    def __init__(self, window: int = 32, kernel: int = 7, pooling: str = "max",
                 r_max: float = 10.0, m: int = 4, compression_ratio: float | None = None
                 ) -> None:
        super().__init__(window, kernel, pooling, compression_ratio)
        if r_max < 1 or m < 1:
            raise PressError(f"r_max must be >= 1 and m >= 1, got {r_max}, {m}")
        self.r_max, self.m = float(r_max), int(m)

    def layer_budgets(self, scores: list[torch.Tensor], per_head: int, candidates: int
                      ) -> list[int]:
        num_layers = len(scores)
        if per_head == 0:
            return [0] * num_layers
        total = per_head * num_layers
        cap = min(candidates, int(round(self.r_max * per_head)))
        room = [cap] * num_layers            # what each layer's buffer still holds
        last: list[float] = [1.0] * num_layers
        updates = [l for l in range(num_layers) if (l + 1) % self.m == 0]  # noqa: E741
        if not updates or updates[-1] != num_layers - 1:
            updates.append(num_layers - 1)
        heads = int(scores[0].shape[0])
        for j, l in enumerate(updates):  # noqa: E741
            gathered = torch.stack([s.float() for s in scores[:l + 1]])       # [l+1, H, n]
            k = min(per_head * heads * (l + 1), gathered.numel())
            top = torch.topk(gathered.flatten(), k, sorted=False).indices
            counts = torch.bincount(top // (heads * candidates), minlength=l + 1).float()
            norm = counts / counts.max().clamp_min(1)
            z = [cap * float(t) for t in norm]                                 # eq. (5)
            r = sum(z) / total if sum(z) > 0 else 1.0
            zp = [x / r for x in z]                                            # eq. (6)
            if j == len(updates) - 1:
                last = zp
                break
            for i in range(l + 1):                 # truncate the processed layers' buffers
                room[i] = min(room[i], int(zp[i]))
        # the last update's budgets, within what the buffers still hold, summing to b * L (if
        # the earlier truncations left too little room, within the buffer size alone)
        if sum(room) < total:
            room = [cap] * num_layers
        return round_to_total([max(x, 1e-9) for x in last], total, room)
