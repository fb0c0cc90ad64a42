"""The self-similarity test of block-sparse mask prediction (SpargeAttention's accuracy filter).

A pooled estimate of a block's attention mass (the mean query of a block against the mean key of a
block) is only trustworthy when the tokens pooled together point the same way. This module measures
that: the mean pairwise cosine similarity of the tokens of each pooled group, and the blocks whose
groups fall below a threshold. Such blocks are *not self-similar*: the mask predictor never skips
them (a query block that is not self-similar computes every visible key block; a key block that is
not self-similar is computed by every query block that sees it).

Shapes: ``x [B, H, n, D]``; blocks of ``block`` tokens are pooled in sub-blocks of ``sub`` tokens
(``block % sub == 0``; ``sub == block`` pools whole blocks, as SpargeAttention does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def self_similarity(x: torch.Tensor, group: int) -> torch.Tensor:
    """Mean pairwise cosine similarity of the tokens of each ``group``-token slice of ``x``.

    Computed from the norm of the sum of each slice's unit vectors,
    ``sum_{i != j} cos(x_i, x_j) = |sum_i x_i / |x_i||^2 - (non-zero tokens)``, in two passes
    over ``x`` (its row norms, then one batched weighted sum), never a normalized copy of it.

    Args:
        x: ``[B, H, n, D]`` (any float dtype; norms and sums accumulate in fp32).
        group: tokens per slice (the last slice may be short).
    Returns:
        ``[B, H, ceil(n / group)]`` in fp32: the mean of ``cos(x_i, x_j)`` over pairs ``i != j`` of
        the slice; 1.0 for a slice of one token. Zero vectors count as orthogonal to everything.
    """
    b, h, n, d = x.shape
    ng = math.ceil(n / group)
    pad = ng * group - n
    norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)          # [B, H, n]
    inv = torch.where(norms > 0, 1.0 / norms.clamp_min(1e-30), torch.zeros_like(norms))
    if pad:   # zero rows and zero weights add nothing to the sums
        x = F.pad(x, (0, 0, 0, pad))
        inv = F.pad(inv, (0, pad))
    weights = inv.to(x.dtype).view(b, h, ng, 1, group)
    s = torch.matmul(weights, x.view(b, h, ng, group, d)).view(b, h, ng, d).float()
    nonzero = F.pad((norms > 0).float(), (0, pad)).view(b, h, ng, group).sum(-1)
    counts = torch.full((ng,), float(group), device=x.device)
    counts[-1] = group - pad
    pairs = (counts * (counts - 1)).clamp_min(1.0)
    sim = ((s * s).sum(-1) - nonzero) / pairs
    return torch.where(counts > 1, sim, torch.ones_like(sim))


def block_similarity(x: torch.Tensor, block: int, sub: int) -> torch.Tensor:
    """Per ``block``-token block, the lowest self-similarity of its ``sub``-token pooled groups.

    Returns ``[B, H, ceil(n / block)]`` (fp32). A block is only as predictable as its least
    coherent pooled group.
    """
    if block % sub:
        raise ValueError(f"block ({block}) must be a multiple of the pooled group ({sub})")
    sims = self_similarity(x, sub)  # [B, H, ceil(n / sub)]
    per = block // sub
    nb = math.ceil(x.shape[2] / block)
    pad = nb * per - sims.shape[2]
    if pad:
        sims = F.pad(sims, (0, pad), value=math.inf)  # missing groups never lower the minimum
    return sims.view(*sims.shape[:2], nb, per).amin(-1)


def per_head(value: float | Sequence[float] | torch.Tensor, heads: int,
             device: torch.device) -> torch.Tensor:
    """A setting given once or once per head, as ``[heads]`` fp32 (ValueError otherwise)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(-1)
    if t.numel() not in (1, heads):
        raise ValueError(f"expected one value or one per query head ({heads}), got {t.numel()}")
    return t.expand(heads)


def not_self_similar(q: torch.Tensor, k: torch.Tensor,
                     threshold: float | Sequence[float] | torch.Tensor,
                     q_block: int, k_block: int, q_sub: int, k_sub: int) -> torch.Tensor:
    """The (query block, key block) pairs the predictor must compute, whatever it estimates.

    Args:
        q: ``[B, Hq, nq, D]``; k: ``[B, Hkv, nk, D]`` (GQA: ``Hq % Hkv == 0``); the keys are
            compared after removing their mean over the sequence (a shift that changes no softmax).
        threshold: a float, or one per query head (``[Hq]``); a pooled group whose mean pairwise
            cosine similarity is below it is not self-similar.
        q_block, k_block: block sizes of the mask; q_sub, k_sub: the estimator's pooled groups.
    Returns:
        ``[B, Hq, nqb, nkb]`` bool: True where the query block or the key block (of the head's KV
        group) is not self-similar.
    """
    hq, hkv = q.shape[1], k.shape[1]
    thr = per_head(threshold, hq, q.device).view(1, hq, 1)
    q_bad = block_similarity(q, q_block, q_sub) < thr  # [B, Hq, nqb]
    smooth = k - k.mean(dim=2, keepdim=True, dtype=torch.float32).to(k.dtype)
    k_sim = block_similarity(smooth, k_block, k_sub).repeat_interleave(hq // hkv, dim=1)
    k_bad = k_sim < thr  # [B, Hq, nkb]
    return q_bad.unsqueeze(-1) | k_bad.unsqueeze(-2)
