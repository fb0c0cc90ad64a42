"""Residency and resident levels of a KV chunk, and the resident quantizer.

A chunk's **residency** says where its entries are (:class:`Residency`): in RAM at a level, on the
flash tier, or nowhere (recompute it from its tokens, or fetch it from the server).

Resident **levels** (:data:`LEVELS`): ``fp`` (the model's dtype, exact), ``int8`` / ``int4`` /
``int2``, and ``k8v4`` (K at int8, V at int4: the keys carry the loss of a low level, so a level
that keeps them at int8 holds 0.75 of int8's bytes for a fraction of int4's loss;
docs/device-service.md). :data:`SIDE_BITS` gives each quantized level's bits of K and of V; the
levels ordered from the best to the lowest are :data:`QUALITY_ORDER`. Quantization is
asymmetric per entry (one group = one token of one head, ``head_dim`` values) with a float16
``scale`` and ``zero`` per group, K and V alike::

    q = clamp(round((x - zero) / scale), 0, 2^b - 1)        x^ = zero + q * scale

with ``zero = min`` rounded down to float16 and ``scale = (max - zero) / (2^b - 1)`` rounded up
to float16 (so every value of the group stays in range), hence ``|x - x^| <= scale / 2`` (plus
float32 arithmetic slack): :func:`error_bound` gives the bound a test can check. Lower levels
are made **from the int8 base** (as LLMS does): ``q_b = round(q_8 * (2^b - 1) / 255)``,
``scale_b = scale_8 * 255 / (2^b - 1)``, so a chunk can be pushed down 8 -> 4 -> 2 bits without
its float values, side by side (``int8`` -> ``k8v4`` requantizes V alone, ``k8v4`` -> ``int4`` K
alone: the same values as ``int8`` -> ``int4``; :func:`reachable`). Codes are packed (two int4 or
four int2 codes per byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from sparkv.errors import SparkvError


class Residency(str, Enum):
    """Where a chunk's entries are."""

    RESIDENT = "resident"   # in RAM, at a level
    FLASH = "flash"         # in a file of the flash tier (nothing in RAM but metadata)
    ABSENT = "absent"       # nowhere: recompute from the tokens, or fetch from the server

    def __str__(self) -> str:
        return self.value


class Source(str, Enum):
    """How a chunk's entries came to be."""

    COMPUTED = "computed"     # a local layer step
    STREAMED = "streamed"     # decoded from a frame the server sent
    INJECTED = "injected"     # put by a caller (a test, an offline prefill)
    RESTORED = "restored"     # read back from the flash tier
    APPENDED = "appended"     # decoded tokens appended during generation

    def __str__(self) -> str:
        return self.value


class LevelError(SparkvError):
    """An unknown level, or a conversion a level cannot make."""


#: every resident level; a level's index is its code in tables, pages and the flash records
#: (new levels go at the end: the codes are on disk)
LEVELS = ("fp", "int8", "int4", "int2", "k8v4")
#: bits of K and of V per quantized level
SIDE_BITS = {"int8": (8, 8), "int4": (4, 4), "int2": (2, 2), "k8v4": (8, 4)}
#: the levels from the best (exact) to the lowest: a chunk's quality is the lowest it went through
QUALITY_ORDER = ("fp", "int8", "k8v4", "int4", "int2")


def side_bits(level: str) -> tuple[int, int]:
    """Bits of K and of V at a quantized ``level``."""
    if level not in SIDE_BITS:
        raise LevelError(f"unknown quantized level {level!r}; known: {', '.join(SIDE_BITS)}")
    return SIDE_BITS[level]


def reachable(src: str, level: str) -> bool:
    """Whether entries held at ``src`` can be held at ``level``: back to ``fp`` always, else each
    side keeps its bits or comes down from fp or the int8 base."""
    if level == "fp" or src == level:
        return True
    was = (16, 16) if src == "fp" else side_bits(src)
    return all(b == a or a >= 8 for a, b in zip(was, side_bits(level)))


@dataclass
class QuantizedTensor:
    """``[n, D]`` values quantized per row (one group per row) at ``bits`` bits.

    Attributes:
        codes: uint8 ``[n, ceil(D * bits / 8)]`` (packed, low bits first).
        scale, zero: float16 ``[n]``.
        bits: 8, 4 or 2.
        dim: D.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    dim: int

    @property
    def rows(self) -> int:
        return int(self.scale.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def sliced(self, a: int, b: int) -> "QuantizedTensor":
        """Rows ``a..b``, views of this tensor's."""
        return QuantizedTensor(self.codes[a:b], self.scale[a:b], self.zero[a:b], self.bits,
                               self.dim)

    def taken(self, a: int, b: int) -> "QuantizedTensor":
        """Rows ``a..b``, copied (holding none of this tensor's storage)."""
        return QuantizedTensor(self.codes[a:b].clone(), self.scale[a:b].clone(),
                               self.zero[a:b].clone(), self.bits, self.dim)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        """The same rows on ``device`` (itself when they are there already)."""
        if self.codes.device == torch.device(device):
            return self
        return QuantizedTensor(self.codes.to(device), self.scale.to(device),
                               self.zero.to(device), self.bits, self.dim)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[n, D]`` (values < 2^bits) -> packed ``[n, ceil(D*bits/8)]``."""
    if bits == 8:
        return q.contiguous()
    per = 8 // bits
    n, d = q.shape
    pad = (-d) % per
    if pad:
        q = torch.nn.functional.pad(q, (0, pad))
    q = q.view(n, (d + pad) // per, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=q.device) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return q.reshape(packed.shape[0], packed.shape[1] * per)[:, :dim].to(torch.uint8)


def quantize(x: torch.Tensor, bits: int = 8) -> QuantizedTensor:
    """Rows of ``x [n, D]`` (any float dtype) at ``bits`` bits (8, 4 or 2)."""
    if bits not in (8, 4, 2):
        raise LevelError(f"bits must be 8, 4 or 2, not {bits}")
    if x.dim() != 2:
        raise LevelError(f"quantize expects [n, D], got {tuple(x.shape)}")
    xf = x.float()
    levels = (1 << bits) - 1
    if xf.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.float16, device=x.device)
        return QuantizedTensor(_pack(torch.zeros(0, x.shape[1], dtype=torch.uint8,
                                                 device=x.device), bits), empty, empty.clone(),
                               bits, int(x.shape[1]))
    lo = xf.amin(dim=1)
    hi = xf.amax(dim=1)
    zero = lo.to(torch.float16)
    # the zero is rounded to fp16, downwards, so that no value falls below it
    zero = torch.where(zero.float() > lo,
                       torch.nextafter(zero, torch.full_like(zero, float("-inf"))), zero)
    lo32 = zero.float()
    step = ((hi - lo32) / levels).clamp_min(0.0)
    scale = step.to(torch.float16)
    scale = torch.where(scale.float() * levels < hi - lo32,
                        torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    s32 = scale.float()
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    q = torch.round((xf - lo32.unsqueeze(1)) / safe.unsqueeze(1)).clamp_(0, levels)
    q = torch.where(s32.unsqueeze(1) > 0, q, torch.zeros_like(q)).to(torch.uint8)
    return QuantizedTensor(_pack(q, bits), scale, zero, bits, int(x.shape[1]))


def dequantize(t: QuantizedTensor, dtype: torch.dtype = torch.float32,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, D]`` values of ``t`` (into ``out`` when given)."""
    q = _unpack(t.codes, t.bits, t.dim).float()
    x = t.zero.float().unsqueeze(1) + q * t.scale.float().unsqueeze(1)
    if out is not None:
        out.copy_(x)
        return out
    return x.to(dtype)


def requantize(t: QuantizedTensor, bits: int) -> QuantizedTensor:
    """A lower level made from an int8 base (no float values needed)."""
    if t.bits != 8:
        raise LevelError(f"lower levels are made from the int8 base, not from int{t.bits}")
    if bits == 8:
        return t
    if bits not in (4, 2):
        raise LevelError(f"bits must be 4 or 2, not {bits}")
    levels = (1 << bits) - 1
    q8 = _unpack(t.codes, 8, t.dim).float()
    q = torch.round(q8 * (levels / 255.0)).clamp_(0, levels).to(torch.uint8)
    scale = (t.scale.float() * (255.0 / levels)).to(torch.float16)
    return QuantizedTensor(_pack(q, bits), scale, t.zero.clone(), bits, t.dim)


def error_bound(x: torch.Tensor, t: QuantizedTensor) -> torch.Tensor:
    """Per row, the largest ``|x - dequantize(t)|`` the scheme allows (``[n]``): half a step,
    plus for levels made from int8 half an int8 step, plus float rounding slack."""
    s = t.scale.float()
    bound = 0.5 * s
    if t.bits < 8:
        bound = bound + 0.5 * s * ((1 << t.bits) - 1) / 255.0
    mag = x.float().abs().amax(dim=1) if x.numel() else torch.zeros_like(s)
    return bound * (1 + 1e-5) + mag * 1e-6 + 1e-12
