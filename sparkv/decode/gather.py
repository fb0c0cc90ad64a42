"""One layer's attended entries, every KV head in one padded tensor, and one attention call.

A clustered layer attends, per KV head, a different number of entries (its window, selected
clusters, tails and buffers). :class:`Gathered` holds them padded to the longest head:
``k, v [H, L, D]``, ``pos [H, L]`` and ``valid [H, L]`` (False on padding).
:func:`padded_attention` runs every head's query group over them in one
``scaled_dot_product_attention`` call (the KV heads are the batch), masked by validity and
position; it equals :func:`sparkv.cache.ragged_attention` over the per-head entries (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Gathered:
    """Every KV head's attended entries, padded: ``k, v [H, L, D]``, ``pos [H, L]`` (int64),
    ``valid [H, L]`` (bool; each head's entries first, then padding)."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    valid: torch.Tensor
    #: entries per head (``valid.sum(1)``)
    lengths: np.ndarray

    def heads(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per KV head ``(k [n, D], v [n, D], pos [n])`` without the padding."""
        return [(self.k[h, :n], self.v[h, :n], self.pos[h, :n])
                for h, n in enumerate(self.lengths.tolist())]


#: one KV head's entries beyond the window: ``k`` and ``v`` pieces (``[n_i, D]`` each), their
#: positions concatenated (``[sum n_i]``) and which of them to keep (None: all)
HeadParts = tuple[list[torch.Tensor], list[torch.Tensor], np.ndarray, "np.ndarray | None"]


def pad_heads(window_k: torch.Tensor, window_v: torch.Tensor, window_pos: torch.Tensor,
              heads: list[HeadParts]) -> Gathered:
    """The window ``[H, W, D]`` (positions ``window_pos [W]``, the same in every head) followed,
    per head, by its :data:`HeadParts` -> :class:`Gathered`. A head's pieces are concatenated
    straight into its row of the padded tensor (no intermediate copy unless some are dropped)."""
    w = int(window_k.shape[1])
    h, d = int(window_k.shape[0]), int(window_k.shape[2])
    counts = np.array([len(p) if keep is None else int(keep.sum()) for _, _, p, keep in heads],
                      np.int64)
    lengths = w + counts
    length = int(lengths.max())
    gk = window_k.new_empty(h, length, d)
    gv = window_v.new_empty(h, length, d)
    gp = torch.full((h, length), -1, dtype=torch.long)
    gk[:, :w], gv[:, :w], gp[:, :w] = window_k, window_v, window_pos
    for r, (ks, vs, pos, keep) in enumerate(heads):
        n = int(counts[r])
        if length > w + n:                      # padding: finite values, masked out
            gk[r, w + n:] = 0
            gv[r, w + n:] = 0
        if not n:
            continue
        if keep is None:
            torch.cat(ks, out=gk[r, w:w + n])
            torch.cat(vs, out=gv[r, w:w + n])
            gp[r, w:w + n] = torch.from_numpy(pos)
        else:
            kt = torch.from_numpy(keep)
            gk[r, w:w + n] = torch.cat(ks)[kt]
            gv[r, w:w + n] = torch.cat(vs)[kt]
            gp[r, w:w + n] = torch.from_numpy(pos[keep])
    valid = torch.arange(length)[None, :] < torch.from_numpy(lengths)[:, None]
    return Gathered(gk, gv, gp, valid, lengths)


def padded_attention(q: torch.Tensor, g: Gathered, q_pos: torch.Tensor,
                     scale: float | None) -> torch.Tensor:
    """``q [1, Hq, nq, D]`` over :class:`Gathered` ``g`` (``H`` KV heads, query heads grouped
    ``Hq / H`` per KV head) -> ``[1, Hq, nq, D]``. A key is visible to a query if it is valid and
    its position is at most the query's; a query that sees no key gets zeros."""
    b, hq, nq, d = q.shape
    h, length = int(g.k.shape[0]), int(g.k.shape[1])
    group = hq // h
    qs = q.reshape(h, 1, group * nq, d)                                  # batch = KV heads
    kk = g.k.to(q.dtype).unsqueeze(1)                                   # [H, 1, L, D]
    vv = g.v.to(q.dtype).unsqueeze(1)
    visible = g.valid[:, None, :] & (g.pos[:, None, :] <= q_pos.to(torch.long).view(1, nq, 1))
    if bool(visible.all()):
        out = F.scaled_dot_product_attention(qs, kk, vv, scale=scale)
    else:
        mask = visible[:, None].expand(h, group, nq, length).reshape(h, 1, group * nq, length)
        out = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask, scale=scale)
        out = torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))
    return out.reshape(b, hq, nq, d)
