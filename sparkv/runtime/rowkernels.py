"""Running a few-rows weight kernel (an answer token's projections) from torch: the thread
count, the row groups and the output, shared by the block formats' kernels
(:mod:`sparkv.runtime.q41kernel`, :mod:`sparkv.runtime.q80`).

A block kernel is made per row count (a literal in its loops, so that the loop over rows unrolls
inside the loop over a block's weights and each weight made once serves every row): a kernel
family gives :func:`run_rows` ``kernel_for(rows)``, for 1 to :data:`MAX_ROWS` rows.
"""

from __future__ import annotations

from typing import Any, Callable

import numba as nb
import numpy as np
import torch

from sparkv.kernels import use_torch_threads

#: most rows one kernel call takes; a longer input takes several calls
MAX_ROWS = 8
#: ``2 ** (e - 25)`` for a float16 exponent field ``e`` (``2 ** -24`` for a subnormal, e = 0)
_POW2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], dtype=np.float32)


@nb.njit(boundscheck=False, error_model="numpy")
def half_float(h: np.uint16) -> np.float32:  # pragma: no cover - numba
    """float16 bits -> float32, exactly (finite values: an 11-bit integer times a power of 2)."""
    b = np.int32(h)
    e = (b >> 10) & 31
    f = b & 1023
    mag = np.float32(f + 1024 if e else f) * _POW2[e]
    return -mag if b >> 15 else mag


@nb.njit(fastmath={"nsz", "arcp", "afn", "reassoc"}, boundscheck=False, error_model="numpy")
def store_sums(acc: Any, y: Any, o: int) -> None:  # pragma: no cover - numba
    """``y[r, o]`` = the sum of row ``r``'s partial sums ``acc [rows, lanes]``, every row."""
    for r in range(acc.shape[0]):
        t = np.float32(0.0)
        for j in range(acc.shape[1]):
            t += acc[r, j]
        y[r, o] = t


def run_rows(x: torch.Tensor, arrays: tuple[Any, ...], out_features: int,
             kernel_for: Callable[[int], Callable[..., None]]) -> torch.Tensor:
    """``kernel_for(rows)(x_rows, *arrays, y_rows)`` over ``x [..., in]`` (float32, CPU) in
    groups of at most :data:`MAX_ROWS` rows -> ``y [..., out_features]`` float32. The shapes
    are made on the numpy side (a torch ``view`` costs ~5 us, numpy's reshape ~1)."""
    shape = x.shape
    xs = (x if x.is_contiguous() else x.contiguous()).numpy()
    if xs.ndim != 2:
        xs = xs.reshape(-1, shape[-1])
    rows = xs.shape[0]
    y = np.empty((rows, out_features), dtype=np.float32)
    use_torch_threads()
    for a in range(0, rows, MAX_ROWS):
        b = min(a + MAX_ROWS, rows)
        kernel_for(b - a)(xs[a:b], *arrays, y[a:b])
    return torch.from_numpy(y if len(shape) == 2 else y.reshape(*shape[:-1], out_features))


__all__ = ["MAX_ROWS", "half_float", "run_rows", "store_sums"]
