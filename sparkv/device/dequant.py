"""Quantized rows dequantized straight into a dense working memory: one numba call per block of
chunks of one (layer, group) and side, reading the codes and writing the arena's slots once (no
fp temporary, no second pass), without the GIL (the reader threads fill in parallel).

The values are bit for bit :func:`sparkv.cache.dequantize` (``float32(code) * scale + zero``,
each step rounded to float32: no fused multiply-add), tested against it.
"""

from __future__ import annotations

from typing import Any, Sequence

import numba as nb
from numba.typed import List
import numpy as np
import torch

from sparkv.cache import QuantizedTensor
from sparkv.cache.hostmem import host_addressable


@nb.njit(boundscheck=False, error_model="numpy", nogil=True, cache=True, inline="always")
def _row_into(row: np.ndarray, codes: np.ndarray, r: int, s: Any, z: Any, bits: int,
              dim: int) -> None:  # pragma: no cover - numba
    """Row ``r`` of ``codes`` dequantized into ``row`` (``float32(code) * s + z``)."""
    if bits == 8:
        for j in range(dim):
            row[j] = np.float32(codes[r, j]) * s + z
    else:                  # a byte at a time: no division or modulo per value
        per = 8 // bits
        mask = (1 << bits) - 1
        full = dim // per
        if bits == 4:
            for b in range(full):
                c = codes[r, b]
                row[2 * b] = np.float32(c & 15) * s + z
                row[2 * b + 1] = np.float32(c >> 4) * s + z
        else:              # int2 (the levels are 8, 4 and 2 bits)
            for b in range(full):
                c = codes[r, b]
                row[4 * b] = np.float32(c & 3) * s + z
                row[4 * b + 1] = np.float32((c >> 2) & 3) * s + z
                row[4 * b + 2] = np.float32((c >> 4) & 3) * s + z
                row[4 * b + 3] = np.float32(c >> 6) * s + z
        for j in range(full * per, dim):      # a head_dim that is not a multiple
            q = (codes[r, j // per] >> ((j % per) * bits)) & mask
            row[j] = np.float32(q) * s + z


@nb.njit(boundscheck=False, error_model="numpy", nogil=True, cache=True)
def _rows_into(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int, dim: int,
               r0: int, stride: int, ts: np.ndarray, n: int, T: int, dst: np.ndarray
               ) -> None:  # pragma: no cover - numba
    """Rows of ``codes`` (chunk ``ci`` of ``ts`` from row ``r0 + ci * stride``: ``hg`` heads of
    ``n`` tokens) into ``dst`` ``[hg, slots, dim]`` at slot ``t * T + k``."""
    hg = dst.shape[0]
    for ci in range(ts.shape[0]):
        r = r0 + ci * stride
        p0 = ts[ci] * T
        for hh in range(hg):
            for k in range(n):
                _row_into(dst[hh, p0 + k], codes, r, scale[r], zero[r], bits, dim)
                r += 1


@nb.njit(boundscheck=False, error_model="numpy", nogil=True, cache=True)
def _records_into(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, bits: int, dim: int,
                  ts: np.ndarray, n: int, T: int, groups: int, dsts: Any
                  ) -> None:  # pragma: no cover - numba
    """Rows of whole token chunk records (record ``ci`` holds token chunk ``ts[ci]``: every
    ``(layer, group)``, layer-major, ``hg`` heads of ``n`` tokens each) into the layers' arenas
    ``dsts[l]`` ``[H, slots, dim]`` at slot ``t * T + k``."""
    L = len(dsts)
    hg = dsts[0].shape[0] // groups
    r = 0
    for ci in range(ts.shape[0]):
        p0 = ts[ci] * T
        for l in range(L):
            dst = dsts[l]
            for h in range(groups * hg):
                for k in range(n):
                    _row_into(dst[h, p0 + k], codes, r, scale[r], zero[r], bits, dim)
                    r += 1


class Arena:
    """A dense float32 working memory's layers as the arrays :meth:`records_into` writes (made
    once per load: every layer's K and V ``[H, slots, D]``)."""

    def __init__(self, stores: Sequence[Any]) -> None:
        self.k, self.v = List(), List()
        for store in stores:
            self.k.append(store.k[0].numpy())
            self.v.append(store.v[0].numpy())

    def records_into(self, k: QuantizedTensor, v: QuantizedTensor, ts: Sequence[int], n: int,
                     T: int, groups: int) -> None:
        """Whole token chunk records' rows (``k``, ``v``: record after record, each layer-major;
        token chunks ``ts`` of ``n`` tokens) dequantized into every layer: one call per side."""
        tsa = np.asarray(ts, dtype=np.int64)
        for x, dsts in ((k, self.k), (v, self.v)):
            _records_into(x.codes.numpy(), x.scale.float().numpy(), x.zero.float().numpy(),
                          x.bits, x.dim, tsa, n, T, groups, dsts)


def supported(dst: torch.Tensor) -> bool:
    """Whether :func:`dequantize_into` can write ``dst`` (float32 host memory:
    :func:`~sparkv.cache.hostmem.host_addressable`)."""
    return dst.dtype == torch.float32 and host_addressable(dst)


def dequantize_into(dst: torch.Tensor, x: QuantizedTensor, r0: int, ts: Sequence[int], n: int,
                    T: int, scale: np.ndarray | None = None, zero: np.ndarray | None = None,
                    stride: int | None = None) -> None:
    """Writes the rows of ``x`` of chunks ``ts`` (``n`` tokens, ``hg`` heads each, in payload
    order; chunk ``i`` from row ``r0 + i * stride``, default one after the other) dequantized
    into ``dst`` ``[hg, slots, D]`` (a float32 view of an arena) at slots ``t * T + k``.
    ``scale`` / ``zero``: ``x``'s as float32 arrays (computed once by the caller for many
    blocks)."""
    sc = x.scale.float().numpy() if scale is None else scale
    ze = x.zero.float().numpy() if zero is None else zero
    step = int(dst.shape[0]) * n if stride is None else stride
    _rows_into(x.codes.numpy(), sc, ze, x.bits, x.dim, r0, step, np.asarray(ts, dtype=np.int64),
               n, T, dst.numpy())


def warm_up() -> None:
    """Compiles (or loads from numba's cache) both kernels: a few int8 rows into a small
    arena, chunk by chunk and as whole records (the bit width is a run-time argument, so one
    call compiles every level)."""
    from types import SimpleNamespace

    from sparkv.cache.levels import quantize

    hg, n, T, dim = 2, 4, 4, 16
    gen = torch.Generator().manual_seed(0)
    layer = SimpleNamespace(k=[torch.zeros(hg, 2 * T, dim)], v=[torch.zeros(hg, 2 * T, dim)])
    rows = quantize(torch.randn(2 * hg * n, dim, generator=gen), 8)
    dequantize_into(layer.k[0], rows, 0, [0, 1], n, T)
    Arena([layer]).records_into(rows, rows, [0, 1], n, T, 1)
