"""Q4_1 weight blocks: the bundled SmolLM2's own 4-bit weights, without a second rounding.

A Q4_1 block holds 32 consecutive weights of one row (along the input dimension) as
``w = q * d + m``: ``q`` in 0..15 (4 bits), ``d`` and ``m`` float16, one pair per block (20 bytes
per 32 weights, 5 bits a weight). SmolLM2 ships as a Q4_1 GGUF, and the converted checkpoint
(:func:`sparkv.runtime.model.default_checkpoint`) holds those values dequantized to float32.

:func:`quantize_q41` quantizes as llama.cpp does. On weights that already are Q4_1 values it
finds the same blocks again: for every decoder projection of SmolLM2 (210 of them)
``quantize_q41(w).dequantize()`` equals ``w`` bit for bit, and the codes equal the GGUF's own
(checked against the file: ``tests/test_runtime_compute.py``). So the ``int4`` compute
configuration (:mod:`sparkv.runtime.compute`) computes with exactly the weights float32 uses;
:meth:`Q41Weight.exact` says whether that held for a weight (on another model's weights
quantizing is a first rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: weights per Q4_1 block
BLOCK = 32


@dataclass
class Q41Weight:
    """One ``[out, in]`` weight in Q4_1 blocks.

    Attributes:
        codes: ``uint8 [out, in]``, each 0..15.
        d: ``float16 [out, in / 32]``, the blocks' scales.
        m: ``float16 [out, in / 32]``, the blocks' minima.
    """

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.codes.shape[0]), int(self.codes.shape[1])

    def exact(self, weight: torch.Tensor) -> bool:
        """Whether these blocks are ``weight`` exactly (``dequantize()`` equals it bit for bit)."""
        return bool(torch.equal(self.dequantize(weight.dtype), weight.detach()))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``q * d + m`` in float32 (two roundings, in gguf's order: bit for bit the converted
        checkpoint's weight), then cast to ``dtype``."""
        q = self.codes.to(torch.float32).view(self.shape[0], -1, BLOCK)
        w = q * self.d.to(torch.float32).unsqueeze(-1)
        w = w + self.m.to(torch.float32).unsqueeze(-1)
        return w.view(self.shape).to(dtype)


def quantize_q41(weight: torch.Tensor) -> Q41Weight:
    """``weight [out, in]`` (``in`` a multiple of 32) in Q4_1 blocks, llama.cpp's format:
    ``d = (max - min) / 15`` and ``m = min`` per block, as float16, and ``q = round((w - m) /
    d)`` clipped to 0..15 from those float16 values (so that weights that are Q4_1 values come
    back exactly)."""
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"Q4_1 needs the input dimension to be a multiple of {BLOCK}, "
                         f"got {cols}")
    w = weight.detach().to(torch.float32).reshape(rows, cols // BLOCK, BLOCK)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).to(torch.float16)
    m = lo.to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(lo), 1.0 / d.to(torch.float32))
    q = torch.trunc((w - m.to(torch.float32).unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5)
    return Q41Weight(q.clamp(0, 15).to(torch.uint8).reshape(rows, cols), d, m)


__all__ = ["BLOCK", "Q41Weight", "quantize_q41"]
