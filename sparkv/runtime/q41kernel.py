"""A product with Q4_1 weight blocks that reads the blocks, for a few rows (an answer token).

An answer token's pass is bound by reading the weights: float32 reads 32 bits a weight, the Q4_1
blocks (:mod:`sparkv.runtime.q41`) 5. :func:`q41_matmul` multiplies ``x [R, in]`` (float32, a
few rows: an answer token, or the answer tokens of a few asks decoded as one pass) by the
blocks' weights in **one numba call**, parallel over output rows, without making the float32
weight: per block it makes its 32 weights once, as the checkpoint holds them (``q * d + m``,
two float32 roundings, ``d`` and ``m`` widened exactly from float16: the weights
:meth:`Q41Weight.dequantize <sparkv.runtime.q41.Q41Weight.dequantize>` gives bit for bit), and
adds their products with every row of the call. The result is float32's product with the same
weights up to the order of the sums (tested at ``1e-4``).

**One kernel per row count** (1 to :data:`MAX_ROWS`, made by :func:`_make_kernel`, compiled on
first use and cached by numba): the row count is a literal, so the loop over rows unrolls
inside the loop over a block's weights and the weights stay in registers. A high nibble
``c >> 4`` is made as ``(c & 0xF0) * (d / 16)``: the same product (``16 q`` and ``d / 16`` are
exact, so one rounding of ``q d`` either way), but a 32-bit mask where the shift took numba's
64-bit lanes and a repacking (an answer token's projections 1.4-1.8x faster alone).

Layout (:func:`pack_blocks`): ``packed [out, in / 2]`` uint8, byte ``j`` of block ``b`` holding
code ``j`` (low nibble) and code ``j + 16`` (high nibble), so a block's two halves meet
contiguous inputs; ``d``, ``m`` ``[out, in / 32]`` as float16 bits (uint16).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numba as nb
import numpy as np
import numpy.typing as npt
import torch

from sparkv.kernels import use_torch_threads
from sparkv.runtime.q41 import BLOCK, Q41Weight
from sparkv.runtime.rowkernels import MAX_ROWS, half_float, run_rows, store_sums

#: no "contract": ``q * d + m`` rounds twice, as the checkpoint's weights were made
_FAST = {"nsz", "arcp", "afn", "reassoc"}

_U8 = npt.NDArray[np.uint8]
_U16 = npt.NDArray[np.uint16]
_F32 = npt.NDArray[np.float32]


def pack_blocks(q: Q41Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed, d, m)`` of ``q`` in this module's layout (module docstring)."""
    rows, cols = q.shape
    codes = q.codes.view(rows, cols // BLOCK, BLOCK)
    packed = codes[:, :, :BLOCK // 2] | (codes[:, :, BLOCK // 2:] << 4)
    return (packed.reshape(rows, cols // 2).contiguous(), q.d.view(torch.int16).contiguous(),
            q.m.view(torch.int16).contiguous())


def unpack_blocks(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Q41Weight:
    """The :class:`~sparkv.runtime.q41.Q41Weight` :func:`pack_blocks` was given."""
    rows, half = packed.shape
    p = packed.view(rows, -1, BLOCK // 2)
    codes = torch.cat([p & 0x0F, p >> 4], dim=-1).reshape(rows, 2 * half)
    return Q41Weight(codes, d.view(torch.float16), m.view(torch.float16))


@functools.cache
def _make_kernel(rows: int) -> Callable[..., None]:
    """The kernel for passes of exactly ``rows`` rows (a literal: its loops over rows unroll, and
    each weight made once serves every row)."""

    @nb.njit(parallel=True, fastmath=_FAST, error_model="numpy", nogil=True, cache=True,
             boundscheck=False)
    def matmul(x: _F32, packed: _U8, d: _U16, m: _U16, y: _F32) -> None:  # pragma: no cover
        """``y [rows, out] = x [rows, in] @ W.T`` with ``W`` the blocks' weights (module
        docstring): per output row, 16 partial sums a row (a block's halves side by side)."""
        K = x.shape[1]
        half = 16                  # BLOCK // 2 (a literal: numba unrolls the loops over it)
        for o in nb.prange(packed.shape[0]):
            acc = np.zeros((rows, half), dtype=np.float32)
            for b in range(K // 32):
                db, mb = half_float(d[o, b]), half_float(m[o, b])
                dh = db * np.float32(0.0625)
                for j in range(half):
                    c = packed[o, b * half + j]
                    w0 = np.float32(c & 15) * db + mb
                    w1 = np.float32(c & 240) * dh + mb
                    for r in range(rows):
                        acc[r, j] += x[r, b * 32 + j] * w0 + x[r, b * 32 + half + j] * w1
            store_sums(acc, y, o)

    return matmul


class KernelBlocks(NamedTuple):
    """numpy views (no copy) of blocks packed by :func:`pack_blocks`, as the kernel reads them:
    made once per weight (:meth:`of`), since making them costs about as much as a small
    projection's product."""

    packed: _U8
    d: _U16
    m: _U16

    @classmethod
    def of(cls, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> KernelBlocks:
        return cls(packed.numpy(), d.numpy().view(np.uint16), m.numpy().view(np.uint16))


def q41_matmul(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor
               ) -> torch.Tensor:
    """``x [..., in]`` (float32, CPU) times the weights of blocks packed by
    :func:`pack_blocks` -> ``[..., out]`` float32 (:func:`blocks_matmul`)."""
    return blocks_matmul(x, KernelBlocks.of(packed, d, m))


def blocks_matmul(x: torch.Tensor, blocks: KernelBlocks) -> torch.Tensor:
    """``x [..., in]`` (float32, CPU) times the blocks' weights -> ``[..., out]`` float32; up
    to :data:`~sparkv.runtime.rowkernels.MAX_ROWS` rows a call of the kernel."""
    return run_rows(x, blocks, blocks.packed.shape[0], _make_kernel)


@nb.njit(parallel=True, fastmath=_FAST, error_model="numpy", nogil=True, cache=True,
         boundscheck=False)
def _dequantize(packed: _U8, d: _U16, m: _U16, w: _F32) -> None:  # pragma: no cover - numba
    """``w [out, in]`` = the blocks' weights, made as the product kernels make them."""
    half = 16
    for o in nb.prange(packed.shape[0]):
        for b in range(d.shape[1]):
            db, mb = half_float(d[o, b]), half_float(m[o, b])
            dh = db * np.float32(0.0625)
            for j in range(half):
                c = packed[o, b * half + j]
                w[o, b * 32 + j] = np.float32(c & 15) * db + mb
                w[o, b * 32 + half + j] = np.float32(c & 240) * dh + mb


def blocks_dequantize(blocks: KernelBlocks) -> torch.Tensor:
    """The blocks' float32 weight ``[out, in]``, bit for bit :meth:`Q41Weight.dequantize
    <sparkv.runtime.q41.Q41Weight.dequantize>`'s, in one numba call (a pass of many rows
    multiplies with it: 5-10x faster than torch's unpacking, which made a prefill of ``int4``
    pay ~2-3 ms a projection per pass)."""
    rows, half_cols = blocks.packed.shape
    w = np.empty((rows, 2 * half_cols), dtype=np.float32)
    use_torch_threads()
    _dequantize(*blocks, w)
    return torch.from_numpy(w)


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernel."""
    from sparkv.runtime.q41 import quantize_q41

    blocks = pack_blocks(quantize_q41(torch.randn(8, 64)))
    for rows in range(1, MAX_ROWS + 1):
        q41_matmul(torch.randn(rows, 64), *blocks)
    blocks_dequantize(KernelBlocks.of(*blocks))


__all__ = ["KernelBlocks", "MAX_ROWS", "blocks_dequantize", "blocks_matmul", "pack_blocks",
           "q41_matmul", "unpack_blocks", "warm_up"]
