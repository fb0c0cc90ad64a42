"""Dense attention of a query chunk after a key prefix, from two fast-kernel calls.

A layer step's queries (positions ``o .. o+n-1``) see every key of the prefix ``0 .. o-1`` and,
causally, the chunk's own keys. SDPA's fast kernels (cuDNN, flash) take ``is_causal`` only with
top-left alignment, so a chunk after a prefix used to pass a boolean ``[n, o+n]`` mask, which sends
SDPA to a slower path (measured on an H100: ~1.7x the time per visible pair, plus building the
mask at every step: ../shared/notes/measured-gpu.md). Here the chunk instead runs

* the prefix, unmasked: the query heads of each GQA group stacked as rows of their KV head (no
  K/V repeat), and
* its own keys, a square causal call,

each returning its log-sum-exp, and the two are merged exactly
(``out = o_own + (o_prefix - o_own) * sigmoid(lse_prefix - lse_own)``).

The kernel that returns the LSE is private to PyTorch (``aten._scaled_dot_product_*``); which one
works is decided once per device by a numerical self-check against plain math, trying cuDNN, then
flash, then memory-efficient attention; on the CPU its flash kernel (the masked call computes
every masked pair and converts the mask at each step: the split is 1.1-1.7x faster per step, most
in bfloat16). When none passes, :func:`lse_kernel` is None and callers keep the mask.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch

LseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float],
                     tuple[torch.Tensor, torch.Tensor]]

_CHOSEN: dict[str, tuple[str, LseKernel] | None] = {}
_LOCK = threading.Lock()


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal,
                                                           False, scale=scale)
    return r[0], r[1]


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                           scale=scale)
    return r[0], r[1]


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                               scale=scale)
    return r[0], r[1]


def _cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
         ) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                   scale=scale)
    return r[0], r[1]


CUDA_KERNELS: tuple[tuple[str, LseKernel], ...] = (("cudnn", _cudnn), ("flash", _flash),
                                                   ("efficient", _efficient))
CPU_KERNELS: tuple[tuple[str, LseKernel], ...] = (("cpu_flash", _cpu),)


def _lse(kernel: LseKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B,H,n,D], lse [B,H,n] fp32)``; the kernels' LSE layouts differ (padded rows,
    a trailing unit axis), so it is reshaped and cut to ``n``."""
    o, lse = kernel(q, k, v, causal, scale)
    b, h, n, _ = q.shape
    return o, lse.reshape(b, h, -1)[..., :n].float()


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()), lse


def _self_check(kernel: LseKernel, device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(7)
    # K/V as the KV memory hands them over: slices of a longer arena (strided, not contiguous)
    q, kb, vb = (torch.randn(1, 2, n, 64, generator=gen).to(device, dtype) for n in (128, 384, 384))
    k, v = kb[:, :, :256], vb[:, :, :256]
    try:
        for causal, kk, vv in ((False, k, v), (True, k[:, :, :128], v[:, :, :128])):
            o, lse = _lse(kernel, q, kk, vv, causal, 0.125)
            ro, rl = _reference(q, kk, vv, causal, 0.125)
            if not (torch.allclose(o.float(), ro, atol=3e-2, rtol=3e-2)
                    and torch.allclose(lse, rl, atol=3e-2, rtol=1e-2)):
                return False
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return False
    return True


def lse_kernel(device: torch.device, dtype: torch.dtype) -> tuple[str, LseKernel] | None:
    """The first LSE-returning kernel that passes the self-check on ``device`` (cached), or None
    (callers keep the masked path). On the CPU: its flash kernel (``cpu_flash``), which with a
    boolean mask computes every masked pair and converts the mask at every step, so the split
    is faster there too (1.1-1.7x per step at 1-3K of prefix, most in bfloat16)."""
    key = f"{device}:{dtype}"
    kernels = CUDA_KERNELS if device.type == "cuda" else CPU_KERNELS
    with _LOCK:
        if key not in _CHOSEN:
            _CHOSEN[key] = next(((name, kern) for name, kern in kernels
                                 if _self_check(kern, device, dtype)), None)
        return _CHOSEN[key]


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
                    scale: float | None = None, kernel: LseKernel | None = None) -> torch.Tensor:
    """Causal attention of ``q [B,Hq,n,D]`` at ``q_offset`` (> 0) over ``k/v [B,Hkv,>=o+n,D]``:
    the prefix unmasked plus the chunk's own keys causally, merged by LSE (module docstring).
    ``kernel``: an LSE kernel (default: this device's, else the CPU's flash kernel)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if kernel is None:
        chosen = lse_kernel(q.device, q.dtype)
        kernel = chosen[1] if chosen else _cpu
    # the prefix: query heads of one KV head stacked as rows (no mask, no K/V repeat)
    qs = q.reshape(b, hkv, group * n, d)
    o1, l1 = _lse(kernel, qs, k[:, :, :q_offset], v[:, :, :q_offset], False, scale)
    # the chunk's own keys: square, causal (top-left = bottom-right); its K/V repeated per head
    ko, vo = k[:, :, q_offset:q_offset + n], v[:, :, q_offset:q_offset + n]
    if group > 1:
        ko, vo = ko.repeat_interleave(group, 1), vo.repeat_interleave(group, 1)
    o2, l2 = _lse(kernel, q.contiguous(), ko, vo, True, scale)
    w = torch.sigmoid(l1.reshape(b, hq, n) - l2).unsqueeze(-1)
    return torch.lerp(o2, o1.reshape(b, hq, n, d), w.to(o2.dtype))


__all__ = ["split_attention", "lse_kernel", "CUDA_KERNELS", "CPU_KERNELS"]
