"""Q8_0 weight blocks and a product that reads them, for a few rows (the LM head of ``int4``'s
answer tokens).

A Q8_0 block holds 32 consecutive weights of one row as ``w = q * d``: ``q`` an int8 code in
-127..127 and ``d`` float16, one per block (34 bytes per 32 weights, 8.5 bits a weight). The
bundled SmolLM2 GGUF holds its token embedding, which is also its LM head (tied), as Q8_0, and
the converted checkpoint holds those values in float32: ``q * d`` is exact in float32 (7 bits
times 11), so :func:`quantize_q80` finds the GGUF's blocks again and :meth:`Q80Weight.exact`
holds (tested on SmolLM2's).

:func:`q80_matmul` multiplies ``x [R, in]`` (float32, a few rows) by the blocks' weights in
**one numba call**, parallel over output rows: per block it makes the 32 weights (``q * d``,
exact) once and adds their products with every row of the call (one kernel per row count:
:mod:`sparkv.runtime.rowkernels`). The result is float32's product with the same weights up to
the order of its sums. An answer token's LM head reads 8.5 bits a weight instead of 32.

Layout: ``codes [out, in]`` int8, ``d [out, in / 32]`` float16 bits (int16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numba as nb
import numpy as np
import numpy.typing as npt
import torch

from sparkv.runtime.q41 import BLOCK
from sparkv.runtime.rowkernels import MAX_ROWS, half_float, run_rows, store_sums

#: the weights are exact products, so contracting a product into its sum changes no weight
_FAST = {"nsz", "arcp", "afn", "reassoc", "contract"}

_I8 = npt.NDArray[np.int8]
_U16 = npt.NDArray[np.uint16]
_F32 = npt.NDArray[np.float32]


@dataclass
class Q80Weight:
    """One ``[out, in]`` weight in Q8_0 blocks.

    Attributes:
        codes: ``int8 [out, in]``, each -127..127.
        d: ``float16 [out, in / 32]``, the blocks' scales.
    """

    codes: torch.Tensor
    d: torch.Tensor

    def exact(self, weight: torch.Tensor) -> bool:
        """Whether these blocks are ``weight`` exactly (``dequantize()`` equals it bit for bit)."""
        return bool(torch.equal(self.dequantize(weight.dtype), weight.detach()))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * d`` in float32 (exact), then cast to ``dtype``."""
        rows, cols = self.codes.shape
        q = self.codes.to(torch.float32).view(rows, -1, BLOCK)
        return (q * self.d.to(torch.float32).unsqueeze(-1)).view(rows, cols).to(dtype)


def quantize_q80(weight: torch.Tensor) -> Q80Weight:
    """``weight [out, in]`` (``in`` a multiple of 32) in Q8_0 blocks, llama.cpp's format:
    ``d = max |w| / 127`` per block as float16, ``q = round(w / d)`` from that float16 value (so
    that weights that are Q8_0 values come back exactly)."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"Q8_0 needs the input dimension to be a multiple of {BLOCK}, "
                         f"got {cols}")
    w = weight.detach().to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    d = (w.abs().amax(-1) / 127).to(torch.float16)
    df = d.to(torch.float32).unsqueeze(-1)
    q = torch.where(df == 0, torch.zeros_like(w), torch.round(w / df.clamp_min(1e-30)))
    return Q80Weight(q.clamp(-127, 127).to(torch.int8).reshape(rows, cols), d)


@functools.cache
def _make_kernel(rows: int) -> Callable[..., None]:
    """The kernel for passes of exactly ``rows`` rows (:mod:`sparkv.runtime.rowkernels`): a
    block's halves side by side (16 partial sums a row) for two rows or more; one row keeps 32
    partial sums (the paired form ran 2.4x slower there, LLVM vectorizing it worse)."""
    if rows == 1:
        return _one_row

    @nb.njit(parallel=True, fastmath=_FAST, error_model="numpy", nogil=True, cache=True,
             boundscheck=False)
    def matmul(x: _F32, codes: _I8, d: _U16, y: _F32) -> None:  # pragma: no cover - numba
        """``y [rows, out] = x [rows, in] @ W.T``, ``W = q * d``."""
        K = x.shape[1]
        half = 16                  # BLOCK // 2 (a literal: numba unrolls the loops over it)
        for o in nb.prange(codes.shape[0]):
            acc = np.zeros((rows, half), dtype=np.float32)
            for b in range(K // 32):
                db = half_float(d[o, b])
                for j in range(half):
                    w0 = np.float32(codes[o, b * 32 + j]) * db
                    w1 = np.float32(codes[o, b * 32 + half + j]) * db
                    for r in range(rows):
                        acc[r, j] += x[r, b * 32 + j] * w0 + x[r, b * 32 + half + j] * w1
            store_sums(acc, y, o)

    return matmul


@nb.njit(parallel=True, fastmath=_FAST, error_model="numpy", nogil=True, cache=True,
         boundscheck=False)
def _one_row(x: _F32, codes: _I8, d: _U16, y: _F32) -> None:  # pragma: no cover - numba
    """``y [1, out] = x [1, in] @ W.T``, ``W = q * d``: 32 partial sums."""
    K = x.shape[1]
    for o in nb.prange(codes.shape[0]):
        acc = np.zeros(32, dtype=np.float32)
        for b in range(K // 32):
            db = half_float(d[o, b])
            for j in range(32):
                acc[j] += x[0, b * 32 + j] * (np.float32(codes[o, b * 32 + j]) * db)
        t = np.float32(0.0)
        for j in range(32):
            t += acc[j]
        y[0, o] = t


def kernel_arrays(q: Q80Weight) -> tuple[_I8, _U16]:
    """The numpy views (no copy) :func:`q80_matmul` reads: make them once per weight."""
    return q.codes.numpy(), q.d.view(torch.int16).numpy().view(np.uint16)


def q80_matmul(x: torch.Tensor, arrays: tuple[_I8, _U16]) -> torch.Tensor:
    """``x [..., in]`` (float32, CPU) times the weights of the blocks ``arrays``
    (:func:`kernel_arrays`) -> ``[..., out]`` float32."""
    return run_rows(x, arrays, arrays[0].shape[0], _make_kernel)


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernels."""
    arrays = kernel_arrays(quantize_q80(torch.randn(8, 64)))
    for rows in range(1, MAX_ROWS + 1):
        q80_matmul(torch.randn(rows, 64), arrays)


__all__ = ["Q80Weight", "kernel_arrays", "q80_matmul", "quantize_q80", "warm_up"]
