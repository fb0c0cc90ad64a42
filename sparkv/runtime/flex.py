"""Block-sparse and chunked dense attention through ``torch.nn.attention.flex_attention``.

A real block-sparse kernel for CUDA: the kept (query block, key block) pairs become a
``BlockMask`` built **from block indices** (``BlockMask.from_kv_blocks``), never from a
``mask_mod`` over every (query, key) pair (which costs more than the attention it saves at 16-32K
tokens, measured: ../shared/notes/measured-gpu.md) and never eagerly (which allocates a dense
[Q, K] mask). Blocks fully visible to every query of their query block are "full" blocks (no
mask applied inside); only the blocks the causal boundary cuts carry the ``mask_mod``
(bottom-right causal at the chunk's offset).

* :class:`FlexAttention` ``(sparse=True)``: the predicted mask of
  :class:`~sparkv.runtime.attention.BlockSparseAttention` (same estimator, same defaults), run by
  flex_attention. ``sparse=False``: every causally visible block (the chunked dense prefill with
  no per-step mask tensor).
* On CUDA the kernel is ``torch.compile(flex_attention, dynamic=True)``, compiled once per process
  and head geometry: the chunk's offset reaches the ``mask_mod`` as a tensor and the key length is
  a symbolic size, so a prefill's steps (every one a new key length) reuse one kernel instead of
  recompiling per step until dynamo's recompile limit sends every call to the eager path (seen on
  the CPU's inductor: one graph per step with ``dynamic=False`` and an int offset). Elsewhere the
  eager implementation runs (it materialises scores: correct, for tests, never chosen by ``auto``
  on a CPU).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from sparkv.runtime.attention import (K_BLOCK, Q_BLOCK, AttentionStats, BackendUnavailableError,
                                      BlockSparseAttention, SparsityConfig, check_shapes,
                                      causal_block_count, register_backend)

_COMPILED: dict[str, Any] = {}


def flex_available() -> bool:
    """Whether ``torch.nn.attention.flex_attention`` (with ``BlockMask.from_kv_blocks``) imports."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return hasattr(BlockMask, "from_kv_blocks")


#: the kernel's tiles: they must divide the mask's blocks (128 queries x 64 keys); left to
#: itself inductor picks 128 x 128 tiles for head_dim 64 and refuses the mask (seen on an H200)
KERNEL_OPTIONS = {"BLOCK_M": Q_BLOCK, "BLOCK_N": K_BLOCK}


def _kernel(device: torch.device, dynamic: bool = True) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    key = f"cuda:{'dynamic' if dynamic else 'static'}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(flex_attention, dynamic=dynamic)
    return _COMPILED[key]


def _indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, H, nqb, nkb]`` bool -> ``(num [B, H, nqb] int32, indices [B, H, nqb, nkb] int32)``,
    the kept key blocks of each query block first, in ascending order (the slots past ``num``
    hold block indices flex never reads). One cumulative sum and one scatter: no sort."""
    nkb = mask.shape[-1]
    rank = torch.cumsum(mask, dim=-1, dtype=torch.int32) - 1   # slot of each kept block
    num = (rank[..., -1] + 1).contiguous()
    # dropped blocks all go to the last slot, which is past ``num`` whenever one is dropped
    slot = torch.where(mask, rank, torch.full_like(rank, nkb - 1)).long()
    src = torch.arange(nkb, dtype=torch.int32, device=mask.device).expand_as(rank)
    idx = torch.zeros_like(rank).scatter_(-1, slot, torch.where(mask, src, 0))
    return num, idx.contiguous()


def mask_indices(keep: torch.Tensor, diagonal: torch.Tensor, nk: int, k_block: int = K_BLOCK
                 ) -> tuple[torch.Tensor, ...]:
    """``(num, idx, full_num, full_idx)`` of a ``BlockMask``: the kept blocks on the causal
    ``diagonal [nqb, nkb]`` (and the last key block when it runs past the keys) are partial
    (masked), the others full. Tensor operations only: no host synchronisation."""
    nkb = diagonal.shape[-1]
    if nk % k_block:
        last = torch.arange(nkb, device=diagonal.device) == nkb - 1
        diagonal = diagonal | last      # the last key block runs past the keys: keep it masked
    return (*_indices(keep & diagonal), *_indices(keep & ~diagonal))


def predicted_mask(pred: BlockSparseAttention, q: torch.Tensor, k: torch.Tensor, q_offset: int,
                   scale: float | None, visible: torch.Tensor, diagonal: torch.Tensor,
                   thresholds: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The kept blocks ``keep [B, Hq, nqb, nkb]`` of the predictor's mask and the ``BlockMask``
    indices of them (:func:`mask_indices`; ``k`` holds the keys up to the last query): the
    whole per-call mask pipeline, one function so that a GPU compiles it as one
    (:func:`_pipeline`). ``thresholds``: the layer's ``(cdf, sim)`` as tensors (:meth:`BlockSparseAttention.threshold_tensors`), data to the compiled
    graph, so that every layer and length runs the one graph."""
    keep = pred.predict_mask(q, k, q_offset, scale, thresholds) & visible
    return (keep, *mask_indices(keep, diagonal, k.shape[2]))


def _pipeline(device: torch.device) -> Any:
    """:func:`predicted_mask` as this device runs it: on CUDA compiled once per process
    (``dynamic=True``: one graph for every length and offset), fusing the prediction's ~80
    small operations (pooling, the self-similarity filter's sums, block scores, the cdf cut,
    the indices), each of which paid ~25 us of launch on an H100 (docs/gpu.md); eager
    elsewhere (on the CPU inductor took 74 s to compile it, and the prediction is a few ms)."""
    if device.type != "cuda":
        return predicted_mask
    if "predict" not in _COMPILED:
        _COMPILED["predict"] = torch.compile(predicted_mask, dynamic=True)
    return _COMPILED["predict"]


def block_mask(keep: torch.Tensor, diagonal: torch.Tensor, nq: int, nk: int, q_offset: int,
               q_block: int = Q_BLOCK, k_block: int = K_BLOCK,
               indices: tuple[torch.Tensor, ...] | None = None) -> Any:
    """A flex ``BlockMask`` from a kept-block mask ``keep [B, H, nqb, nkb]`` (bool): blocks on the
    causal ``diagonal [nqb, nkb]`` get the bottom-right causal ``mask_mod``, the others are full
    (``indices``: :func:`mask_indices` of them, when already built)."""
    from torch.nn.attention.flex_attention import BlockMask

    offset = torch.tensor(q_offset, dtype=torch.int32, device=keep.device)
    if keep.is_cuda:
        # the compiled kernel visits listed blocks only, and the only masked ones are kept
        # diagonal blocks: the causal bound is all it needs
        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return kv_idx <= q_idx + offset
    else:
        keep_i = keep.to(torch.int8)

        def causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            # the eager implementation (tests, CPU) applies this function to every pair: the
            # block structure has to be in it too
            return (kv_idx <= q_idx + offset) & (keep_i[b, h, q_idx // q_block,
                                                        kv_idx // k_block] > 0)

    num, idx, fnum, fidx = indices if indices is not None else mask_indices(keep, diagonal, nk,
                                                                             k_block)
    kwargs: dict[str, Any] = {"BLOCK_SIZE": (q_block, k_block), "mask_mod": causal,
                              "seq_lengths": (nq, nk)}
    try:   # forward only: no transposed (query-block) indices, which cost two sorts per call
        return BlockMask.from_kv_blocks(num, idx, fnum, fidx, compute_q_blocks=False, **kwargs)
    except TypeError:   # a PyTorch without the option
        return BlockMask.from_kv_blocks(num, idx, fnum, fidx, **kwargs)


class FlexAttention:
    """Attention through flex_attention (module docstring).

    Args:
        sparse: predict and skip blocks (as :class:`BlockSparseAttention` does) or run every
            visible block.
        config: the block predictor's settings (``sparse`` only).
        dynamic: compile once for every sequence length (the default); False compiles a kernel
            per shape (faster kernels, a compilation per new length: benchmarks only).
    """

    def __init__(self, sparse: bool = True, config: SparsityConfig | None = None,
                 dynamic: bool = True) -> None:
        if not flex_available():
            raise BackendUnavailableError("torch.nn.attention.flex_attention is not available in "
                                          f"PyTorch {torch.__version__}")
        self.sparse = sparse
        self.dynamic = dynamic
        self.name = "flex_sparse" if sparse else "flex_dense"
        self._predictor = BlockSparseAttention(config)
        self.config = self._predictor.config
        self.failure: str | None = None     # why the compiled mask pipeline was dropped

    def predict(self, q: torch.Tensor, k: torch.Tensor, q_offset: int,
                scale: float | None = None, predictor: BlockSparseAttention | None = None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(keep, indices)``: the kept blocks ``[B, Hq, nqb, nkb]`` that ``predictor`` (this
        backend's own by default; :class:`~sparkv.runtime.autoattn.AutoAttention` passes its
        per-layer one) predicts for ``q`` after ``q_offset`` keys, and their ``BlockMask``
        indices, through this device's pipeline (:func:`_pipeline`). A compiled pipeline that
        fails is dropped for this backend (:attr:`failure` says why) and the eager one runs."""
        pred = predictor or self._predictor
        nq = q.shape[2]
        nk = q_offset + nq
        _, _, _, visible, diagonal = pred._geometry(nq, nk, q_offset, q.device)
        args = (pred, q, k[:, :, :nk], q_offset, scale, visible, diagonal,
                pred.threshold_tensors(q.shape[1], q.device))
        run = _pipeline(q.device) if self.failure is None else predicted_mask
        try:
            out = run(*args)
        except Exception as exc:  # noqa: BLE001 - a compiler failure: eager from now on
            if run is predicted_mask:
                raise
            self.failure = f"compiled mask prediction failed, eager from now on: {exc!r}"[:500]
            out = predicted_mask(*args)
        return out[0], tuple(out[1:])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None, mask: torch.Tensor | None = None,
               indices: tuple[torch.Tensor, ...] | None = None
               ) -> tuple[torch.Tensor, AttentionStats]:
        """Attention over ``mask``'s blocks (default: the predicted ones when ``sparse``, every
        visible block otherwise); ``indices``: the ``BlockMask`` indices of ``mask`` when
        :meth:`predict` built them with it."""
        check_shapes(q, k, v, q_offset)
        b, hq, nq, d = q.shape
        nk = q_offset + nq                      # keys past the last query are never seen
        k, v = k[:, :, :nk], v[:, :, :nk]
        pred = self._predictor
        nqb, nkb, _, visible, diagonal = pred._geometry(nq, nk, q_offset, q.device)
        if mask is None and self.sparse:
            keep, indices = self.predict(q, k, q_offset, scale)
        else:
            keep = (visible.expand(b, hq, nqb, nkb) if mask is None else mask) & visible
            indices = indices if mask is not None else None
        bm = block_mask(keep, diagonal, nq, nk, q_offset, indices=indices)
        scale = scale if scale is not None else 1.0 / math.sqrt(d)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # eager-mode notices on a CPU
            options = KERNEL_OPTIONS if q.is_cuda else None
            out = _kernel(q.device, self.dynamic)(q, k, v, block_mask=bm, scale=scale,
                                                  enable_gqa=hq != k.shape[1],
                                                  kernel_options=options)
        active = keep.sum(dim=(2, 3)).sum(0)
        return out, AttentionStats(self.name, active,
                                   causal_block_count(nq, nk, q_offset, Q_BLOCK, K_BLOCK))


register_backend("flex_dense", lambda config: FlexAttention(sparse=False, config=config))
register_backend("flex_sparse", lambda config: FlexAttention(sparse=True, config=config))
