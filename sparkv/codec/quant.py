"""Uniform b-bit asymmetric quantization of one K or V tensor ``[heads, tokens, head_dim]``.

A *group* of values shares one ``(min, step)`` pair:

* ``AXIS_TOKEN`` (per token): one group per ``(head, token)``, i.e. the ``head_dim`` channels of
  one token; ``heads * tokens`` groups.
* ``AXIS_CHANNEL`` (per channel): one group per ``(head, channel)``, i.e. one channel over all the
  chunk's tokens; ``heads * head_dim`` groups. This isolates K's outlier channels.

Symbols: ``q = clip(round((x - min) / step), 0, 2**b - 1)``; value back: ``min + q * step``.
``min`` is the group minimum rounded *down* to the parameter dtype and ``step`` is
``(max - min) / (2**b - 1)`` rounded *up*, so the group's range is covered and every element is
within ``step / 2`` of its reconstruction (plus float32 rounding of ``min + q * step``).

Packing: for ``b <= 4`` several values share one byte symbol before entropy coding, so that the
Huffman code works on a larger alphabet (less integer-length waste): ``p = 8 // b`` values per
symbol (b=2: 4, b=3: 2, b=4: 2), first value in the most significant bits; the last symbol is
padded with zero values. See :func:`values_per_symbol`.
"""

from __future__ import annotations

import numba as nb
import numpy as np

AXIS_TOKEN = 1
AXIS_CHANNEL = 2
AXIS_NAMES = {AXIS_TOKEN: "token", AXIS_CHANNEL: "channel"}

PARAM_FP16 = 1
PARAM_FP32 = 2
PARAM_DTYPES = {PARAM_FP16: np.dtype("<f2"), PARAM_FP32: np.dtype("<f4")}

MIN_BITS = 2
MAX_BITS = 8


def values_per_symbol(bits: int) -> int:
    """How many b-bit values one coded symbol packs: ``8 // b`` for ``b <= 4``, else 1."""
    return 8 // bits if bits <= 4 else 1


def num_groups(shape: tuple[int, int, int], axis: int) -> int:
    h, n, d = shape
    return h * n if axis == AXIS_TOKEN else h * d


# ------------------------------------------------------------------------------------------------
# Parameters
# ------------------------------------------------------------------------------------------------
def _round_down(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    y = x.astype(dtype)
    low = y.astype(np.float64) > x
    y[low] = np.nextafter(y[low], dtype.type(-np.inf))
    return y


def _round_up(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    y = x.astype(dtype)
    high = y.astype(np.float64) < x
    y[high] = np.nextafter(y[high], dtype.type(np.inf))
    return y


def quant_params(x: np.ndarray, bits: int, axis: int, param_dtype: int = PARAM_FP16
                 ) -> tuple[np.ndarray, np.ndarray, int]:
    """Per-group ``(mins, steps)`` for ``x`` (float32 ``[H, N, D]``, finite).

    Returns:
        ``(mins, steps, param_dtype)``: arrays of the parameter dtype, shaped ``[H, N]``
        (per token) or ``[H, D]`` (per channel). ``param_dtype`` is upgraded from fp16 to fp32
        when a parameter does not fit fp16.
    """
    reduce_axis = 2 if axis == AXIS_TOKEN else 1
    lo = x.min(axis=reduce_axis).astype(np.float64)
    hi = x.max(axis=reduce_axis).astype(np.float64)
    levels = (1 << bits) - 1
    for code in ((param_dtype, PARAM_FP32) if param_dtype == PARAM_FP16 else (PARAM_FP32,)):
        dt = PARAM_DTYPES[code]
        with np.errstate(over="ignore", invalid="ignore"):
            mins = _round_down(lo, dt)
            steps = _round_up((hi - mins.astype(np.float64)) / levels, dt)
        if np.isfinite(mins).all() and np.isfinite(steps).all():
            return mins, steps, code
    raise ValueError("quantization parameters overflow float32")


# ------------------------------------------------------------------------------------------------
# Kernels
# ------------------------------------------------------------------------------------------------
@nb.njit(nogil=True, cache=True, boundscheck=False)
def _quantize(x, mins, steps, levels, per_token, out):  # pragma: no cover - numba
    h_, n_, d_ = x.shape
    for h in range(h_):
        for n in range(n_):
            for d in range(d_):
                if per_token:
                    mn = np.float64(mins[h, n])
                    st = np.float64(steps[h, n])
                else:
                    mn = np.float64(mins[h, d])
                    st = np.float64(steps[h, d])
                q = 0.0
                if st > 0.0:
                    q = np.rint((np.float64(x[h, n, d]) - mn) / st)
                    q = min(max(q, 0.0), np.float64(levels))
                out[h, n, d] = np.uint8(q)


def quantize(x: np.ndarray, mins: np.ndarray, steps: np.ndarray, bits: int, axis: int
             ) -> np.ndarray:
    """``uint8 [H, N, D]`` symbols in ``[0, 2**bits)`` for float32 ``x``."""
    out = np.empty(x.shape, dtype=np.uint8)
    _quantize(x, mins.astype(np.float32), steps.astype(np.float32), (1 << bits) - 1,
              axis == AXIS_TOKEN, out)
    return out


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _dequantize(q, mins, steps, per_token, out):  # pragma: no cover - numba
    h_, n_, d_ = out.shape
    for h in range(h_):
        for n in range(n_):
            base = (h * n_ + n) * d_
            if per_token:
                mn = mins[h, n]
                st = steps[h, n]
                for d in range(d_):
                    out[h, n, d] = mn + np.float32(q[base + d]) * st
            else:
                for d in range(d_):
                    out[h, n, d] = mins[h, d] + np.float32(q[base + d]) * steps[h, d]


def dequantize(q: np.ndarray, mins: np.ndarray, steps: np.ndarray, axis: int, out: np.ndarray
               ) -> None:
    """Writes ``min + q * step`` (float32) into ``out`` (``[H, N, D]``, any strides).

    ``q`` is the flat ``uint8`` value array in C order of ``[H, N, D]``.
    """
    _dequantize(q, np.ascontiguousarray(mins, dtype=np.float32),
                np.ascontiguousarray(steps, dtype=np.float32), axis == AXIS_TOKEN, out)


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _pack(q, bits, per, out):  # pragma: no cover - numba
    n = q.size
    for s in range(out.size):
        v = np.uint32(0)
        for j in range(per):
            i = s * per + j
            v = v << np.uint32(bits)
            if i < n:
                v |= np.uint32(q[i])
        out[s] = np.uint8(v)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Packs flat b-bit values into byte symbols (``values_per_symbol(bits)`` per symbol)."""
    per = values_per_symbol(bits)
    q = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1)
    if per == 1:
        return q
    out = np.empty(-(-q.size // per), dtype=np.uint8)
    _pack(q, bits, per, out)
    return out


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _unpack(syms, bits, per, out):  # pragma: no cover - numba
    n = out.size
    mask = np.uint8((1 << bits) - 1)
    full = n // per
    for s in range(full):
        v = syms[s]
        for j in range(per):
            out[s * per + j] = (v >> np.uint8(bits * (per - 1 - j))) & mask
    for i in range(full * per, n):
        j = i - full * per
        out[i] = (syms[full] >> np.uint8(bits * (per - 1 - j))) & mask


def unpack(syms: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The ``n`` flat b-bit values packed in ``syms``."""
    per = values_per_symbol(bits)
    if per == 1:
        return syms[:n]
    out = np.empty(n, dtype=np.uint8)
    _unpack(syms, bits, per, out)
    return out


# ------------------------------------------------------------------------------------------------
# Token-delta prediction (lossless, on the symbols)
# ------------------------------------------------------------------------------------------------
def apply_delta(q: np.ndarray, shape: tuple[int, int, int], bits: int) -> np.ndarray:
    """``(q[h, n, d] - q[h, n-1, d]) mod 2**bits`` (the first token kept), flat ``uint8``."""
    x = q.reshape(shape)
    out = x.copy()
    out[:, 1:, :] = (x[:, 1:, :] - x[:, :-1, :]) & np.uint8((1 << bits) - 1)
    return out.reshape(-1)


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _undo_delta(v, h_, n_, d_, mask):  # pragma: no cover - numba
    for h in range(h_):
        for n in range(1, n_):
            base = (h * n_ + n) * d_
            for d in range(d_):
                v[base + d] = (v[base - d_ + d] + v[base + d]) & mask


def undo_delta(values: np.ndarray, shape: tuple[int, int, int], bits: int) -> None:
    """Inverts :func:`apply_delta` in place on the flat ``uint8`` values."""
    h, n, d = shape
    _undo_delta(values, h, n, d, np.uint8((1 << bits) - 1))
