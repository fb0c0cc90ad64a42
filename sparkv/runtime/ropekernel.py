"""RoPE for a few rows (an answer token's q and k) in one numba call, bit for bit torch's.

:func:`sparkv.runtime.fastops.apply_rope` computes ``x * cos`` and then two in-place
``addcmul_`` on its halves: about 63 us for one answer token's queries on a 2-core AVX2 CPU
(five dispatches on strided views of a few hundred floats), twice a layer (q and k), 3.8 ms of
SmolLM2's ~70 ms token. :func:`rope_qk` makes both in one call (~25 us).

The same roundings as torch: ``x1 * c`` rounded, then ``addcmul_``'s fused multiply-add
(torch's vectorized ``addcmul`` on this CPU is an FMA: measured, every value of 400 random
cases matched the FMA and a quarter differed from two roundings), written here with LLVM's
``fma`` intrinsic, which numba's own arithmetic never contracts to. Whether the machine's torch
computes it so is checked once per process (:func:`matches_torch`): where not, the kernel is
not used.
"""

from __future__ import annotations

import functools
from typing import Any

import numba as nb
import torch
from numba import types
from numba.extending import intrinsic

#: most rows (batch x positions) :func:`rope_qk` takes; a longer pass keeps torch's kernels
MAX_ROWS = 8


@intrinsic
def _fma_intrinsic(typingctx: Any, a: Any, b: Any, c: Any) -> Any:  # pragma: no cover - numba
    """``a * b + c`` rounded once (float32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.fma(*args)

    return sig, codegen


#: ``_fma(a, b, c)`` in a numba function (the intrinsic without its typing context argument)
_fma: Any = _fma_intrinsic


@nb.njit(error_model="numpy", boundscheck=False, nogil=True)   # compiled into _rotate_qk
def _rotate(x: Any, cos: Any, sin: Any, out: Any) -> None:  # pragma: no cover - numba
    """``out [B, H, n, D]`` = RoPE of ``x`` (any strides) with ``cos/sin [B, n, D]``."""
    batch, heads, n, dim = x.shape
    h = dim // 2
    for b in range(batch):
        for i in range(n):
            for hh in range(heads):
                for j in range(h):
                    x1 = x[b, hh, i, j]
                    x2 = x[b, hh, i, h + j]
                    out[b, hh, i, j] = _fma(-x2, sin[b, i, j], x1 * cos[b, i, j])
                    out[b, hh, i, h + j] = _fma(x1, sin[b, i, h + j], x2 * cos[b, i, h + j])


def _rotate_qk(q: Any, k: Any, cos: Any, sin: Any, qo: Any,
               ko: Any) -> None:  # pragma: no cover - numba
    _rotate(q, cos, sin, qo)
    _rotate(k, cos, sin, ko)


#: the kernel's one signature: any strides (a contiguous array passes as one of any strides,
#: so no layout a caller hands it compiles another)
_SIGNATURE = "void(f4[:,:,:,:], f4[:,:,:,:], f4[:,:,:], f4[:,:,:], f4[:,:,:,:], f4[:,:,:,:])"


@functools.cache
def _kernel() -> Any:
    """The compiled kernel (on first use, or loaded from numba's cache)."""
    return nb.njit(_SIGNATURE, error_model="numpy", boundscheck=False, nogil=True,
                   cache=True)(_rotate_qk)


def takes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`rope_qk` takes ``x [B, H, n, D]`` with ``cos, sin [B, n, D]`` (exactly
    those shapes: no broadcasting): float32 on a CPU, at most :data:`MAX_ROWS` rows, the whole
    head dimension rotated, no tensor that autograd follows (the kernel is not differentiable),
    and this machine's torch computing RoPE as the kernel does (:func:`matches_torch`)."""
    if x.dim() != 4 or x.shape[-1] % 2 or x.requires_grad or cos.requires_grad \
            or sin.requires_grad:
        return False
    shape = (x.shape[0], x.shape[2], x.shape[3])
    return (cos.shape == shape and sin.shape == shape and x.shape[0] * x.shape[2] <= MAX_ROWS
            and x.dtype == cos.dtype == sin.dtype == torch.float32
            and x.device.type == cos.device.type == sin.device.type == "cpu"
            and matches_torch())


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q`` and ``k`` ``[B, H, n, D]`` (new contiguous tensors) with ``cos/sin [B, n,
    D]``, in one call; both must pass :func:`takes` (the kernel does not check bounds)."""
    qo = torch.empty(q.shape, dtype=torch.float32)
    ko = torch.empty(k.shape, dtype=torch.float32)
    _kernel()(q.numpy(), k.numpy(), cos.numpy(), sin.numpy(), qo.numpy(), ko.numpy())
    return qo, ko


@functools.cache
def matches_torch() -> bool:
    """Whether :func:`rope_qk` gives torch's RoPE (``apply_rope``'s operations) bit for bit
    here, on random queries of a few shapes and scales (once per process)."""
    gen = torch.Generator().manual_seed(11)
    for rows, scale in ((1, 1.0), (3, 1e-3), (8, 1e3)):
        x = torch.randn(1, rows, 4, 64, generator=gen).mul_(scale).transpose(1, 2)
        ang = torch.rand(1, rows, 32, generator=gen) * 3e4
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        got, _ = rope_qk(x, x, cos, sin)
        if not torch.equal(got, torch_rope(x, cos, sin)):
            return False
    return True


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE with torch's operations (:func:`sparkv.runtime.fastops.apply_rope`'s, the whole head
    dimension rotated): ``x * cos`` and two in-place ``addcmul_`` on its halves (no
    ``rotate_half`` copy, no negation, no concatenation). A new tensor."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    h = x.shape[-1] // 2
    out = x * c
    out[..., :h].addcmul_(x[..., h:], s[..., :h], value=-1.0)
    out[..., h:].addcmul_(x[..., :h], s[..., h:])
    return out


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the kernel and checks it against torch."""
    matches_torch()
    x = torch.randn(1, 2, 1, 8)
    emb = torch.zeros(1, 1, 8)
    rope_qk(x, x, emb.cos(), emb.sin())


__all__ = ["MAX_ROWS", "matches_torch", "rope_qk", "takes", "torch_rope", "warm_up"]
