"""Attention backends behind one interface.

Every backend computes causal attention of a query chunk over a key prefix with *bottom-right*
alignment: query ``i`` sits at absolute position ``q_offset + i`` and may see keys ``0 ..
q_offset + i``. Shapes (``B`` batch, ``Hq`` query heads, ``Hkv`` KV heads, ``D`` head_dim):

* ``q``: ``[B, Hq, nq, D]``; ``k``, ``v``: ``[B, Hkv, nk, D]`` with ``Hq % Hkv == 0`` (GQA) and
  ``nk >= q_offset + nq`` (keys past the last query are never seen).
* returns ``out [B, Hq, nq, D]`` and :class:`AttentionStats`.

Backends:

* :class:`DenseAttention` - PyTorch SDPA (GQA without repeating K/V).
* :class:`BlockSparseAttention` - SpargeAttention-style mean-similarity mask prediction over
  128-query x 64-key blocks (cdf-threshold or top-k), run in plain PyTorch by gathering the kept key
  blocks of each query block so that skipped blocks are work SDPA never does.
* :class:`SpasSageAttention` - the ``spas_sage_attn`` CUDA kernel, used only when it imports and CUDA
  is present; query chunks after a prefix (where its top-left causal alignment would be wrong) fall
  back to :class:`BlockSparseAttention`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F

from sparkv.cache.attention import causal_sdpa
from sparkv.errors import SparkvError
from sparkv.runtime.selfsim import not_self_similar, per_head
from sparkv.runtime.thresholds import SparseThresholds, load_thresholds

Q_BLOCK = 128
K_BLOCK = 64


@dataclass
class AttentionStats:
    """What one attention call did.

    Attributes:
        backend: the backend's name.
        active_blocks: ``[Hq]`` number of (query-block, key-block) pairs computed per query head
            (summed over the batch) - the predictor's feature ``s``.
        causal_blocks: the number of causally visible blocks per head (what dense computes).
    """

    backend: str
    active_blocks: torch.Tensor
    causal_blocks: int

    @property
    def density(self) -> float:
        """Fraction of the causally visible blocks that were computed (1.0 for dense)."""
        if self.causal_blocks == 0:
            return 1.0
        return float(self.active_blocks.float().mean()) / self.causal_blocks


class AttentionBackend(Protocol):
    name: str

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        ...


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int) -> None:
    """Raises ``ValueError`` unless ``q`` is ``[B, Hq, nq, D]``, ``k`` and ``v`` are
    ``[B, Hkv, nk, D]`` with ``Hq`` a multiple of ``Hkv``, and the keys cover ``q_offset + nq``
    positions: what every :class:`AttentionBackend`'s ``attend`` checks first."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected q [B,Hq,nq,D], k/v [B,Hkv,nk,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k.shape[1]}")
    if q_offset < 0 or k.shape[2] < q_offset + q.shape[2]:
        raise ValueError(f"keys ({k.shape[2]}) must cover q_offset ({q_offset}) + queries "
                         f"({q.shape[2]})")


def causal_block_count(nq: int, nk: int, q_offset: int, bq: int = Q_BLOCK,
                       bk: int = K_BLOCK) -> int:
    """Number of (query block, key block) pairs with at least one visible (query, key) pair."""
    total = 0
    for i in range(math.ceil(nq / bq)):
        last_q = q_offset + min((i + 1) * bq, nq) - 1
        total += min(last_q // bk + 1, math.ceil(nk / bk))
    return total


def causal_mask(nq: int, nk: int, q_offset: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``[nq, nk]`` mask, True where query ``i`` may see key ``j`` (``j <= q_offset+i``)."""
    qpos = torch.arange(nq, device=device).unsqueeze(1) + q_offset
    kpos = torch.arange(nk, device=device).unsqueeze(0)
    return kpos <= qpos


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
                 scale: float | None, split: bool = True) -> torch.Tensor:
    """Causal SDPA with bottom-right alignment. A chunk after a prefix runs as two fast-kernel
    calls merged by LSE (:mod:`sparkv.runtime.split`; CUDA's kernels, the CPU's flash kernel)
    unless ``split`` is False; else :func:`~sparkv.cache.attention.causal_sdpa` (the kernel's
    own causal form from position 0, a boolean mask after a prefix)."""
    if split and q_offset > 0 and q.shape[2] > 1:
        from sparkv.runtime.split import lse_kernel, split_attention

        chosen = lse_kernel(q.device, q.dtype)
        if chosen is not None:
            return split_attention(q, k, v, q_offset, scale, kernel=chosen[1])
    return causal_sdpa(q, k, v, q_offset, scale)


class DenseAttention:
    """Exact causal attention with PyTorch SDPA.

    Args:
        split: run a chunk after a prefix as prefix + own keys merged by LSE (the fast kernels,
            on CUDA and on the CPU); False keeps SDPA with a boolean mask (the benchmarks'
            baseline).
    """

    name = "dense"

    def __init__(self, split: bool = True) -> None:
        self.split = split

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        check_shapes(q, k, v, q_offset)
        out = _sdpa_causal(q, k, v, q_offset, scale, self.split)
        blocks = causal_block_count(q.shape[2], k.shape[2], q_offset)
        stats = AttentionStats(self.name, torch.full((q.shape[1],), blocks * q.shape[0]), blocks)
        return out, stats


def _block_mean(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over token blocks and the blocks' self-similarity.

    Args:
        x: ``[B, H, n, D]``.
    Returns:
        ``mean [B, H, nb, D]`` and ``sim [B, H, nb]`` = mean pairwise cosine similarity of the
        tokens of each block (excluding self pairs; 1.0 for single-token blocks).
    """
    b, h, n, d = x.shape
    nb = math.ceil(n / block)
    pad = nb * block - n
    xp = F.pad(x, (0, 0, 0, pad)) if pad else x
    xb = xp.view(b, h, nb, block, d)
    counts = torch.full((nb,), float(block), device=x.device, dtype=x.dtype)
    counts[-1] = block - pad
    mean = xb.sum(3) / counts.view(1, 1, nb, 1)
    unit = F.normalize(xb, dim=-1)  # padded rows are zero vectors: they add nothing
    s = unit.sum(3)
    sq = (s * s).sum(-1)  # = n + sum_{i != j} cos(i, j)
    c = counts.view(1, 1, nb)
    sim = torch.where(c > 1, (sq - c) / (c * (c - 1)).clamp_min(1), torch.ones_like(sq))
    return mean, sim


def _pool(x: torch.Tensor, block: int) -> torch.Tensor:
    """Mean over token blocks of ``x [B, H, n, D]`` -> ``[B, H, nb, D]`` in fp32, accumulated
    in fp32 without an fp32 copy of ``x`` (the last block may be short)."""
    b, h, n, d = x.shape
    full = n // block
    parts = []
    if full:
        parts.append(x[:, :, :full * block].reshape(b, h, full, block, d)
                     .sum(3, dtype=torch.float32) / block)
    if n % block:
        parts.append(x[:, :, full * block:].sum(2, keepdim=True, dtype=torch.float32)
                     / (n % block))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@dataclass
class SparsityConfig:
    """Mask-prediction settings.

    Attributes:
        estimator: ``"meansim"`` - SpargeAttention's estimate: mean-pooled Q blocks against
            mean-pooled K blocks, softmax over blocks; or ``"qpool"`` -
            mean-pooled query sub-blocks (``q_sub`` tokens) against every key, token-level causal
            softmax summed per key block, averaged over the block's sub-blocks. ``qpool`` costs a
            few percent of dense attention and tracks the true block mass far better on small
            models whose key blocks are not self-similar (see docs/runtime.md).
        cdf_threshold: keep the smallest set of key blocks holding this share of the estimated
            attention mass per (head, query block); one value, or one per query head. Used when
            ``topk`` is None.
        topk: if set, keep this fraction of the causally visible key blocks instead.
        sim_threshold: the self-similarity test (:mod:`sparkv.runtime.selfsim`), both
            estimators: a query or key block one of whose pooled groups (the estimator's pooled
            tokens) has a mean pairwise cosine similarity below it is "not self-similar": its
            pooled estimate is unreliable, so it is always computed. One value, or one per query
            head. Keys are compared after removing their sequence mean.
        attention_sink: always keep key block 0.
        min_keys: query blocks with at most this many visible keys are computed densely.
        dense_below: calls whose queries see at most this many keys run dense SDPA outright (the
            prediction and the gathers cost more than they save on short prefixes: on a 2-core
            CPU, whole prefills at 2K tokens were 0.85-0.99x dense with sparse on).
        max_density: when the predicted mask keeps at least this share of the causally visible
            blocks, the call runs dense SDPA instead (the gathered execution is no faster there).
        q_sub: (qpool) query tokens per pooled sub-block.
        k_sub: (qpool) key tokens per pooled sub-block.
        group_blocks: query blocks executed together in one batched SDPA call.
        force_dense: keep every visible block (for testing the execution path).

    The key blocks the causal boundary cuts through (each query block's local window) are always
    kept, so that every query sees at least itself.
    """

    estimator: str = "qpool"
    cdf_threshold: float | tuple[float, ...] = 0.95
    topk: float | None = None
    sim_threshold: float | tuple[float, ...] = 0.2
    attention_sink: bool = True
    min_keys: int = 4 * K_BLOCK
    dense_below: int = 2048
    max_density: float = 0.7
    q_sub: int = 32
    k_sub: int = 8
    group_blocks: int = 4
    force_dense: bool = False


class BlockSparseAttention:
    """Block-sparse causal attention in plain PyTorch (works on CPU and CUDA).

    The mask is predicted per query head and query block (GQA: against the K of the head's KV
    group, never repeated in memory). Execution takes ``group_blocks`` query blocks at a time and
    runs one SDPA over only their kept key blocks (gathered per head and block, padded to the
    largest count in the group, padding masked out), so skipped blocks are work SDPA never does.
    """

    name = "block_sparse"

    def __init__(self, config: SparsityConfig | None = None, q_block: int = Q_BLOCK,
                 k_block: int = K_BLOCK, thresholds: SparseThresholds | None = None) -> None:
        self.config = config or SparsityConfig()
        if self.config.estimator not in ("qpool", "meansim"):
            raise ValueError(f"unknown estimator {self.config.estimator!r}")
        self.q_block = q_block
        self.k_block = k_block
        #: per-layer thresholds; loaded by :meth:`bind_model` when no config was given
        self.thresholds = thresholds
        self.calibrated = config is None and thresholds is None
        self._layers: dict[int, BlockSparseAttention] = {}
        self._threshold_tensors: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- per model and layer -------------------------------------------------------------------
    def bind_model(self, fingerprint: str) -> None:
        """Uses the thresholds calibrated for this model (docs/runtime.md), if this backend was
        built without an explicit config and they exist; else keeps its config."""
        if self.calibrated:
            found = load_thresholds(fingerprint)
            if found is not self.thresholds:
                self.thresholds, self._layers = found, {}

    def for_layer(self, layer: int) -> "BlockSparseAttention":
        """This backend with decoder layer ``layer``'s calibrated thresholds (itself when it has
        none for that layer)."""
        lt = self.thresholds.layer(layer) if self.thresholds is not None else None
        if lt is None:
            return self
        if layer not in self._layers:
            cdf = lt.cdf[0] if len(lt.cdf) == 1 else tuple(lt.cdf)
            cfg = replace(self.config, cdf_threshold=cdf, sim_threshold=lt.sim, topk=None)
            self._layers[layer] = BlockSparseAttention(cfg, self.q_block, self.k_block)
        return self._layers[layer]

    # ---- mask prediction ---------------------------------------------------------------------
    def _geometry(self, nq: int, nk: int, q_offset: int, device: torch.device
                  ) -> tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]:
        bq, bk = self.q_block, self.k_block
        nqb, nkb = math.ceil(nq / bq), math.ceil(nk / bk)
        qi = torch.arange(nqb, device=device)
        first_q = q_offset + qi * bq
        last_q = q_offset + torch.clamp((qi + 1) * bq, max=nq) - 1
        kj = torch.arange(nkb, device=device)
        visible = (kj * bk).unsqueeze(0) <= last_q.unsqueeze(1)  # [nqb, nkb]
        diagonal = visible & (((kj + 1) * bk - 1).unsqueeze(0) > first_q.unsqueeze(1))
        return nqb, nkb, last_q, visible, diagonal

    def _mass_meansim(self, q: torch.Tensor, k: torch.Tensor, q_offset: int, scale: float,
                      visible: torch.Tensor, sim: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """SpargeAttention's pooled estimate; returns (mass, always_keep) ``[B,Hq,nqb,nkb]``."""
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        group = hq // hkv
        nqb, nkb = visible.shape
        always = self._not_self_similar(q, k, self.q_block, self.k_block, sim) & visible
        q_mean = _pool(q, self.q_block)
        k_mean = _pool(k, self.k_block)  # smoothing the keys would shift every score equally
        scores = torch.matmul(q_mean.view(b, hkv, group * nqb, d), k_mean.transpose(-1, -2))
        scores = (scores * scale).view(b, hq, nqb, nkb).masked_fill(~visible | always, -math.inf)
        mass = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return mass, always

    def _not_self_similar(self, q: torch.Tensor, k: torch.Tensor, q_sub: int, k_sub: int,
                          sim: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks the self-similarity test says must be computed (``[B,Hq,nqb,nkb]``);
        ``sim``: the threshold as a tensor (default: the config's)."""
        return not_self_similar(q, k, self.config.sim_threshold if sim is None else sim,
                                self.q_block, self.k_block, q_sub, k_sub)

    def _mass_qpool(self, q: torch.Tensor, k: torch.Tensor, q_offset: int, scale: float,
                    visible: torch.Tensor, sim: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pooled query sub-blocks against finely pooled keys; returns (mass, always_keep).

        Query sub-blocks of ``q_sub`` tokens and key sub-blocks of ``k_sub`` tokens are mean-pooled;
        the estimated mass of a key block for a query sub-block is its share of
        ``sum_subblocks k_sub * exp(q_mean . k_mean * scale)`` under a sub-block-causal mask; a
        query block's mass is the average over its sub-blocks.
        """
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        group = hq // hkv
        nqb, nkb = visible.shape
        qs, ksub = self.config.q_sub, self.config.k_sub
        per_q, per_k = self.q_block // qs, self.k_block // ksub
        q_mean = _pool(q, qs)  # [B,Hq,nsq,D]
        k_mean = _pool(k, ksub)  # [B,Hkv,nsk,D]
        nsq, nsk = q_mean.shape[2], k_mean.shape[2]
        scores = torch.matmul(q_mean.view(b, hkv, group * nsq, d), k_mean.transpose(-1, -2))
        scores = scores.view(b, hq, nsq, nsk) * scale
        last_q = q_offset + torch.clamp((torch.arange(nsq, device=q.device) + 1) * qs, max=nq) - 1
        first_k = torch.arange(nsk, device=q.device) * ksub
        scores = scores.masked_fill(first_k.view(1, nsk) > last_q.view(nsq, 1), -math.inf)
        sizes = torch.clamp(nk - first_k, max=ksub).float()  # tokens per key sub-block
        probs = torch.softmax(scores + torch.log(sizes), dim=-1)
        pad = nkb * per_k - nsk
        if pad:
            probs = F.pad(probs, (0, pad))
        block_mass = probs.view(b, hq, nsq, nkb, per_k).sum(-1)  # [B,Hq,nsq,nkb]
        pad_s = nqb * per_q - nsq
        weight = torch.ones(nqb * per_q, device=q.device)
        if pad_s:
            block_mass = F.pad(block_mass, (0, 0, 0, pad_s))
            weight[-pad_s:] = 0.0
        weight = weight.view(nqb, per_q)
        mass = (block_mass.view(b, hq, nqb, per_q, nkb) * weight.view(1, 1, nqb, per_q, 1)
                ).sum(3) / weight.sum(-1).view(1, 1, nqb, 1)
        return mass, self._not_self_similar(q, k, qs, ksub, sim) & visible

    def threshold_tensors(self, heads: int, device: torch.device
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cdf, sim)``, this predictor's thresholds as ``[heads]`` fp32 tensors on
        ``device`` (made once per heads and device): what :meth:`predict_mask` takes so that a
        compiled caller sees every layer's thresholds as data, not as constants to guard on."""
        cfg = self.config
        key = (heads, str(device), repr(cfg.cdf_threshold), repr(cfg.sim_threshold))
        if key not in self._threshold_tensors:
            self._threshold_tensors[key] = (
                per_head(cfg.cdf_threshold, heads, device).contiguous(),
                per_head(cfg.sim_threshold, heads, device).contiguous())
        return self._threshold_tensors[key]

    def predict_mask(self, q: torch.Tensor, k: torch.Tensor, q_offset: int,
                     scale: float | None = None,
                     thresholds: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> torch.Tensor:
        """Boolean ``[B, Hq, nqb, nkb]``: True where the (query block, key block) is computed.

        Kept: the blocks the estimate ranks into ``cdf_threshold`` of the mass (or ``topk``), and
        always the blocks that are not self-similar, the diagonal (local) blocks, the sink block 0
        and every block of query blocks with at most ``min_keys`` visible keys. ``thresholds``:
        ``(cdf, sim)`` as :meth:`threshold_tensors` makes them (default: the config's)."""
        cfg = self.config
        b, hq, nq, d = q.shape
        nqb, nkb, last_q, visible, diagonal = self._geometry(nq, k.shape[2], q_offset, q.device)
        if cfg.force_dense:
            return visible.expand(b, hq, nqb, nkb).clone()
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        estimate = self._mass_qpool if cfg.estimator == "qpool" else self._mass_meansim
        cdf_t, sim_t = thresholds if thresholds is not None else (None, None)
        mass, always = estimate(q, k, q_offset, scale, visible, sim_t)
        if cfg.topk is not None:
            n_keep = torch.ceil(visible.sum(-1).float() * cfg.topk).long().view(1, 1, nqb, 1)
            order = torch.argsort(mass, dim=-1, descending=True)
            rank = torch.empty_like(order)
            rank.scatter_(-1, order, torch.arange(nkb, device=q.device).expand_as(order))
            keep = rank < n_keep
        else:
            sorted_m, order = torch.sort(mass, dim=-1, descending=True)
            before = torch.cumsum(sorted_m, dim=-1) - sorted_m  # mass of the blocks ranked higher
            keep = torch.zeros_like(order, dtype=torch.bool)
            cdf = (per_head(cfg.cdf_threshold, hq, q.device) if cdf_t is None
                   else cdf_t).view(1, hq, 1, 1)
            keep.scatter_(-1, order, before < cdf * sorted_m.sum(-1, keepdim=True))
            keep |= cdf >= 1.0  # a head at cdf 1.0 is dense (whatever the float sums say)
        keep |= always | diagonal
        if cfg.attention_sink:
            keep[..., 0] = True
        keep |= ((last_q + 1) <= cfg.min_keys).view(nqb, 1)
        return keep & visible

    def density_of(self, mask: torch.Tensor, nq: int, nk: int, q_offset: int,
                   kv_heads: int | None = None) -> float:
        """The share of causally visible blocks ``mask`` ``[B,Hq,nqb,nkb]`` keeps (all heads);
        with ``kv_heads``, of the union over each GQA group (what :meth:`attend` executes)."""
        _, _, _, visible, _ = self._geometry(nq, nk, q_offset, mask.device)
        if kv_heads is not None:
            b, hq = mask.shape[:2]
            mask = mask.view(b, kv_heads, hq // kv_heads, *mask.shape[2:]).any(2)
        return float(mask.sum()) / max(1, int(visible.sum()) * mask.shape[0] * mask.shape[1])

    # ---- execution -----------------------------------------------------------------------------
    def _dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None) -> tuple[torch.Tensor, AttentionStats]:
        """Dense SDPA, reported as every causal block computed."""
        out = _sdpa_causal(q, k, v, q_offset, scale)
        blocks = causal_block_count(q.shape[2], k.shape[2], q_offset, self.q_block, self.k_block)
        return out, AttentionStats(self.name, torch.full((q.shape[1],), blocks * q.shape[0]),
                                   blocks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None, mask: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, AttentionStats]:
        """Runs the kept blocks in two batched passes merged by log-sum-exp.

        * Off-diagonal blocks (fully visible to every query of the block, no mask needed): rows
          ``(batch, KV head, query block)`` are bucketed by their number of kept blocks, and each
          bucket is one unmasked attention call over the gathered key blocks. The query heads of a
          GQA group are stacked as extra query rows of their KV head, so K/V are never repeated;
          the kept set of a row is the union over the group's query heads.
        * Diagonal blocks (cut by the causal boundary): one masked call per distinct shape, over a
          contiguous key window.
        """
        check_shapes(q, k, v, q_offset)
        cfg = self.config
        if mask is None and not cfg.force_dense:
            if q_offset + q.shape[2] <= cfg.dense_below or _all_dense(cfg.cdf_threshold, cfg.topk):
                return self._dense(q, k, v, q_offset, scale)
            mask = self.predict_mask(q, k, q_offset, scale)
            executed = self.density_of(mask, q.shape[2], k.shape[2], q_offset, k.shape[1])
            if executed >= cfg.max_density:
                return self._dense(q, k, v, q_offset, scale)
        elif mask is None:
            mask = self.predict_mask(q, k, q_offset, scale)
        b, hq, nq, d = q.shape
        hkv, nk = k.shape[1], k.shape[2]
        group = hq // hkv
        bq, bk = self.q_block, self.k_block
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        nqb, nkb, last_q, visible, diagonal = self._geometry(nq, nk, q_offset, q.device)
        # the union over each GQA group is what actually runs, and what the stats report
        off = (mask & ~diagonal).view(b, hkv, group, nqb, nkb).any(2)  # [B,Hkv,nqb,nkb]
        pad_k, pad_q = nkb * bk - nk, nqb * bq - nq
        # keys and values per (batch, KV head), padded to whole key blocks
        kp = (F.pad(k, (0, 0, 0, pad_k)) if pad_k else k).reshape(b * hkv, nkb * bk, d)
        vp = (F.pad(v, (0, 0, 0, pad_k)) if pad_k else v).reshape(b * hkv, nkb * bk, d)
        # queries as rows (b, kv head, q block) of group*bq query vectors each
        qr = (F.pad(q, (0, 0, 0, pad_q)) if pad_q else q).reshape(b, hkv, group, nqb, bq, d)
        qr = qr.permute(0, 1, 3, 2, 4, 5).reshape(b * hkv * nqb, group * bq, d)
        rows = b * hkv * nqb
        out = torch.empty_like(qr)
        lse = torch.full((rows, group * bq), -math.inf, dtype=torch.float32, device=q.device)
        _diagonal_pass(qr, kp, vp, out, lse, diagonal, q_offset, nk, group, bq, bk, scale)
        _off_diagonal_pass(qr, kp, vp, out, lse, off.reshape(rows, nkb), nqb, bk, scale)
        res = out.view(b, hkv, nqb, group, bq, d).permute(0, 1, 3, 2, 4, 5)
        res = res.reshape(b, hq, nqb * bq, d)[:, :, :nq]
        ran = (off | diagonal).repeat_interleave(group, dim=1)  # what ran, per query head
        active = ran.sum(dim=(2, 3)).sum(0)
        stats = AttentionStats(self.name, active, causal_block_count(nq, nk, q_offset, bq, bk))
        return res.contiguous(), stats


def _all_dense(cdf: float | tuple[float, ...], topk: float | None) -> bool:
    """True when the settings keep every block whatever the estimate (cdf 1.0 on every head)."""
    if topk is not None:
        return topk >= 1.0
    return min(cdf) >= 1.0 if isinstance(cdf, tuple) else cdf >= 1.0


def _diagonal_pass(qr: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, diagonal: torch.Tensor, q_offset: int, nk: int, group: int,
                   bq: int, bk: int, scale: float) -> None:
    """Pass 1 of :meth:`BlockSparseAttention.attend`: each query block against its diagonal
    window (contiguous keys, causally masked), bucketed by (offset in the first key block, width)
    so that each bucket is one call. Writes every row of ``out`` ``[rows, group*bq, D]`` and
    ``lse`` ``[rows, group*bq]``; ``kp``/``vp`` are ``[B*Hkv, nkb*bk, D]``."""
    dev, d = qr.device, qr.shape[-1]
    nqb = diagonal.shape[0]
    first_q = q_offset + torch.arange(nqb, device=dev) * bq
    j0 = (first_q // bk).tolist()
    width = diagonal.sum(-1).tolist()
    shapes: dict[tuple[int, int], list[int]] = {}
    for i in range(nqb):
        shapes.setdefault((int(first_q[i]) - j0[i] * bk, width[i]), []).append(i)
    qpos_local = torch.arange(bq, device=dev).repeat(group)  # [group*bq]
    for (rel, w), blocks in shapes.items():
        idx = torch.tensor(blocks, device=dev)
        key_idx = (torch.tensor([j0[i] * bk for i in blocks], device=dev).view(-1, 1)
                   + torch.arange(w * bk, device=dev))  # [nb, w*bk]
        ks = kp[:, key_idx]  # [B*Hkv, nb, w*bk, d]
        vs = vp[:, key_idx]
        row_idx = (torch.arange(kp.shape[0], device=dev).view(-1, 1) * nqb + idx).reshape(-1)
        ok = torch.arange(w * bk, device=dev).view(1, -1) <= (qpos_local + rel).view(-1, 1)
        ok &= (torch.arange(w * bk, device=dev) + j0[blocks[0]] * bk < nk).view(1, -1) \
            if len(blocks) == 1 else ok
        add = torch.zeros(ok.shape, dtype=qr.dtype, device=dev).masked_fill_(~ok, -math.inf)
        o, l_ = _attention_lse(qr[row_idx].unsqueeze(0), ks.reshape(1, -1, w * bk, d),
                               vs.reshape(1, -1, w * bk, d), add, scale)
        out[row_idx], lse[row_idx] = o[0], l_[0]


def _off_diagonal_pass(qr: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, off_rows: torch.Tensor, nqb: int, bk: int,
                       scale: float) -> None:
    """Pass 2 of :meth:`BlockSparseAttention.attend`: each row's kept off-diagonal key blocks
    (``off_rows`` ``[rows, nkb]``), rows bucketed by their count, one unmasked call per bucket,
    merged into pass 1's ``out`` and ``lse`` by log-sum-exp (in place)."""
    nkb, d = off_rows.shape[1], qr.shape[-1]
    kb = kp.reshape(kp.shape[0], nkb, bk, d)
    vb = vp.reshape(vp.shape[0], nkb, bk, d)
    counts = off_rows.sum(-1)
    sel_all = torch.argsort((~off_rows).to(torch.int8), dim=-1, stable=True)
    head_of_row = torch.arange(off_rows.shape[0], device=qr.device) // nqb
    for n in torch.unique(counts).tolist():
        if n == 0:
            continue
        row_idx = torch.nonzero(counts == n).view(-1)
        sel = sel_all[row_idx, :n]  # [r, n]
        hs = head_of_row[row_idx].view(-1, 1)
        ks = kb[hs, sel].reshape(1, -1, n * bk, d)
        vs = vb[hs, sel].reshape(1, -1, n * bk, d)
        o2, l2 = _attention_lse(qr[row_idx].unsqueeze(0), ks, vs, None, scale)
        o1, l1 = out[row_idx], lse[row_idx]
        m = torch.maximum(l1, l2[0])
        w1, w2 = torch.exp(l1 - m), torch.exp(l2[0] - m)
        out[row_idx] = ((o1 * w1.unsqueeze(-1) + o2[0] * w2.unsqueeze(-1))
                        / (w1 + w2).unsqueeze(-1)).to(out.dtype)
        lse[row_idx] = m + torch.log(w1 + w2)


def _attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output and its log-sum-exp per query (``q [1,R,n,D]``, ``k/v [1,R,m,D]``)."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return o, lse.float()
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        s = s + mask.float()
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype)
    return o, lse


class SpasSageAttention:
    """SpargeAttention's CUDA kernel (``spas_sage_attn``), optional.

    Used for square causal calls (a query chunk at offset 0 over its own keys), where the kernel's
    top-left causal alignment is right. Query chunks after a prefix need bottom-right alignment, which
    the kernel lacks, so they go to :class:`BlockSparseAttention` on the same device.
    """

    name = "spas_sage"

    def __init__(self, config: SparsityConfig | None = None) -> None:
        if not spas_sage_available():
            raise BackendUnavailableError(
                "spas_sage_attn is not usable here: it needs CUDA and the package built from "
                "https://github.com/thu-ml/SpargeAttn; use the block_sparse backend instead")
        import spas_sage_attn  # type: ignore[import-not-found]

        self._kernel = spas_sage_attn.spas_sage2_attn_meansim_cuda
        self.config = config or SparsityConfig()
        self._fallback = BlockSparseAttention(self.config)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        check_shapes(q, k, v, q_offset)
        nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
        if not (q.is_cuda and q_offset == 0 and nk == nq and d in (64, 128)):
            return self._fallback.attend(q, k, v, q_offset, scale)
        group = q.shape[1] // k.shape[1]
        kr = k.repeat_interleave(group, dim=1) if group > 1 else k
        vr = v.repeat_interleave(group, dim=1) if group > 1 else v
        out, sparsity = self._kernel(q.half(), kr.half(), vr.half(), is_causal=True, scale=scale,
                                     cdfthreshd=self.config.cdf_threshold,
                                     simthreshd1=self.config.sim_threshold,
                                     return_sparsity=True)
        blocks = causal_block_count(nq, nk, 0)
        active = torch.full((q.shape[1],), round(blocks * (1.0 - float(sparsity))))
        return out.to(q.dtype), AttentionStats(self.name, active, blocks)


class BackendUnavailableError(SparkvError):
    """The requested attention backend cannot run on this machine."""


def spas_sage_available() -> bool:
    """True when ``spas_sage_attn`` imports and CUDA is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import spas_sage_attn  # noqa: F401  # type: ignore[import-not-found]
    except Exception:  # any import failure (missing, ABI mismatch) means unavailable
        return False
    return True


def layer_backend(backend: AttentionBackend, layer: int) -> AttentionBackend:
    """``backend`` as it runs decoder layer ``layer``: ``backend.for_layer(layer)`` where the
    backend keeps per-layer settings (calibrated block-sparse thresholds), else itself."""
    pick = getattr(backend, "for_layer", None)
    return pick(layer) if pick is not None else backend


def bind_model(backend: AttentionBackend, fingerprint: str) -> None:
    """Tells ``backend`` which model it runs (it may load that model's calibrated settings)."""
    bind = getattr(backend, "bind_model", None)
    if bind is not None:
        bind(fingerprint)


BACKENDS = ("dense", "block_sparse", "spas_sage", "flex_dense", "flex_sparse", "auto")

#: backends defined in modules above this one (flex_attention, auto), registered on import
_FACTORIES: dict[str, Callable[[SparsityConfig | None], AttentionBackend]] = {}


def register_backend(name: str,
                     factory: Callable[[SparsityConfig | None], AttentionBackend]) -> None:
    """Makes ``get_backend(name)`` build ``factory(config)``."""
    _FACTORIES[name] = factory


def get_backend(name: str = "auto", config: SparsityConfig | None = None) -> AttentionBackend:
    """``dense``, ``block_sparse``, ``spas_sage``, ``flex_dense``, ``flex_sparse`` or ``auto``.

    ``auto``: on a machine with CUDA, :class:`~sparkv.runtime.autoattn.AutoAttention` (dense or
    flex block-sparse per call from the GPU's measured profile; CPU tensors still get
    block-sparse); with ``spas_sage_attn`` installed, that kernel; otherwise (every CPU-only
    machine) :class:`BlockSparseAttention`."""
    if name == "dense":
        return DenseAttention()
    if name == "block_sparse":
        return BlockSparseAttention(config)
    if name == "spas_sage":
        return SpasSageAttention(config)
    if name == "auto":
        if spas_sage_available():
            return SpasSageAttention(config)
        if torch.cuda.is_available() and "auto" in _FACTORIES:
            return _FACTORIES["auto"](config)
        return BlockSparseAttention(config)
    if name in _FACTORIES:
        return _FACTORIES[name](config)
    raise BackendUnavailableError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
