"""The linear layers of the compute configurations (:mod:`sparkv.runtime.compute`).

Each replaces one ``nn.Linear`` of a decoder layer (the attention's and the MLP's projections),
stores its weight its own way, and returns its output in the activations' dtype (the input's):
the residual stream, the norms, RoPE and attention around it are untouched.

=====================  ==========================  ===============================================
class                  weight stored as            the matmul
=====================  ==========================  ===============================================
:class:`Bf16Linear`    bfloat16                    bfloat16 (input rounded to bf16; the kernel
                                                   accumulates in fp32 and writes bf16)
:class:`Bf16WeightLinear`  bfloat16                float32 (the weight upcast at each call)
:class:`Int8Linear`    int8, one fp32 scale per    float32 (the weight dequantized at each call)
                       output channel (symmetric)
:class:`Q41Linear`     Q4_1 blocks (4-bit codes,   float32 (dequantized at each call, bit for bit
                       fp16 scale and min per 32)  the converted checkpoint's weight); a pass of
                                                   <= 4 rows on the CPU: a numba product reading
                                                   the blocks (the same weights, float32 sums)
:class:`Int4KernelLinear`  torch's int4 pack, the  torch's CPU int4 kernel
                       Q4_1 blocks' scale and      (``_weight_int4pack_mm_for_cpu``): on x86 it is
                       zero in bf16                vectorized for bfloat16 only, so the input,
                                                   the scales and zeros and the output are bf16
:class:`Int4DecodeLinear`  float32 and the int4     the int4 kernel for answer tokens (passes
                       pack (both)                 marked by :func:`answer_tokens`), float32 for
                                                   every other pass (a prefill)
:class:`MixedInt4DecodeLinear`  bfloat16 and the   the int4 kernel for answer tokens, bf16 (as
                       int4 pack (both)            :class:`Bf16Linear`) for every other pass
:class:`Q80AnswerLinear`  Q8_0 blocks and float32  as :class:`Q80Linear` for answer tokens,
                       (an LM head)                float32 for every other pass
=====================  ==========================  ===============================================

A bias (Qwen2's projections) stays float32 and is added to the output.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparkv.runtime.fastops import SHARED_PRODUCT, linear as fast_linear
from sparkv.runtime.q41 import BLOCK, Q41Weight, quantize_q41
from sparkv.runtime.q41kernel import (MAX_ROWS, KernelBlocks, blocks_dequantize, blocks_matmul,
                                       pack_blocks, unpack_blocks)
from sparkv.runtime.q80 import kernel_arrays, q80_matmul, quantize_q80, Q80Weight


class WeightLinear(nn.Module):
    """A linear layer whose weight is stored some other way than ``nn.Linear``'s; subclasses
    implement :meth:`matmul` (``x [..., in] -> [..., out]``, any dtype)."""

    bias: nn.Parameter | None
    #: the dtype :meth:`matmul` rounds its input to before anything else (``None``: none or
    #: another treatment): callers with several layers of one input round it once
    #: (:func:`sparkv.runtime.fastops.project_shared`), exactly as each layer would
    rounds_input_to: torch.dtype | None = None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = int(linear.in_features)
        self.out_features = int(linear.out_features)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x, x.dtype)

    def project(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The layer's output in ``dtype`` (:meth:`forward` is ``project(x, x.dtype)``): the
        matmul's output cast, then the bias added in ``dtype``. ``x`` may already be rounded
        to :attr:`rounds_input_to`: the same bits as the unrounded input."""
        y = self.matmul(x).to(dtype)
        return y if self.bias is None else y + self.bias.to(dtype)

    def weight_nbytes(self) -> int:
        """Bytes the stored weight takes (buffers, the bias left out)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Bf16Linear(WeightLinear):
    """bfloat16 weight and matmul: the input is rounded to bf16; the output (bf16) is cast back
    to the input's dtype (``mixed``)."""

    weight: torch.Tensor
    rounds_input_to = torch.bfloat16

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(torch.bfloat16), self.weight)


class Bf16WeightLinear(WeightLinear):
    """bfloat16 weight, float32 matmul: only the weight is rounded (``bf16-weights``)."""

    weight: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16).contiguous())

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight.to(x.dtype))


class Int8Linear(WeightLinear):
    """int8 weight, symmetric per output channel (``scale = max |w| / 127``), dequantized to the
    input's dtype at each call (``int8``)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        w = linear.weight.detach().to(torch.float32)
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scale", scale)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.to(x.dtype) * self.scale.to(x.dtype)[:, None]
        return fast_linear(x, w)


_Views = tuple[tuple[int, ...], Any]


def kernel_views(views: _Views | None, make: Callable[..., Any], *held: torch.Tensor | None
                 ) -> _Views:
    """``views`` if they still view the tensors ``held``, else ``(pointers, make(*held))``:
    keyed by the tensors' data pointers, so weights loaded in place keep them and replaced
    buffers (``to()``, assigned, a deep copy) make them again (the views hold their tensors,
    so a pointer cannot be reused while they live)."""
    ptrs = tuple(0 if t is None else t.data_ptr() for t in held)
    if views is None or views[0] != ptrs:
        assert all(t is not None for t in held)
        views = (ptrs, make(*held))
    return views


def _layer_views(layer: Any, make: Callable[..., Any], names: tuple[str, ...]) -> Any:
    """``layer``'s kernel views of its buffers ``names``, kept in its ``_views``
    (:func:`kernel_views`)."""
    old = layer._views
    views = kernel_views(old, make, *(layer._buffers[n] for n in names))
    if views is not old:
        layer._views = views
    return views[1]


class Q41Linear(WeightLinear):
    """Q4_1 blocks (:mod:`sparkv.runtime.q41`): on SmolLM2 exactly the weights float32 computes
    with, at 5 bits a weight instead of 32 (``int4``). A pass of many rows (a prefill)
    dequantizes them to float32 (on the CPU in one numba call) and multiplies (float32's
    product bit for bit); a pass of at
    most :attr:`KERNEL_ROWS` rows on the CPU (an answer token: bound by reading the weights)
    multiplies with the blocks in one numba call (:mod:`sparkv.runtime.q41kernel`: the same
    weights, float32 sums in another order).

    Attributes:
        exact: whether the blocks are the original weight bit for bit (SmolLM2's are).
    """

    #: most rows a pass may have to take the blocks' kernel (an answer token, or those of up to
    #: 8 asks decoded as one pass)
    KERNEL_ROWS = MAX_ROWS
    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q = quantize_q41(linear.weight)
        self.exact = q.exact(linear.weight.detach().to(torch.float32))
        codes, d, m = pack_blocks(q)
        self.register_buffer("codes", codes)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        self._views: _Views | None = None

    def blocks(self) -> Q41Weight:
        return unpack_blocks(self.codes, self.d, self.m)

    def kernel_blocks(self) -> KernelBlocks:
        """The kernel's views of the buffers (:func:`kernel_views`)."""
        return _layer_views(self, KernelBlocks.of, ("codes", "d", "m"))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu and x.dtype == torch.float32 and self._buffers["codes"].is_cpu:  # type: ignore
            if x.numel() <= self.KERNEL_ROWS * self.in_features:
                return blocks_matmul(x, self.kernel_blocks())
            return fast_linear(x, blocks_dequantize(self.kernel_blocks()))
        return fast_linear(x, self.blocks().dequantize(x.dtype))


class SharedQ41:
    """Q4_1 layers that take one input (an attention's q, k and v; an MLP's gate and up) as one
    product: their blocks concatenated along the output rows, each layer's buffers made views
    of the concatenation (no second copy), so that one kernel call makes all their outputs for
    a pass of few rows (each output row computed as the layer's own kernel computes it: bit
    for bit). Installed on the layers' parent as :data:`~sparkv.runtime.fastops.SHARED_PRODUCT`
    by :func:`share_inputs`; a pass it does not take, or layers whose buffers were replaced
    since (``to()``, assigned), go layer by layer."""

    def __init__(self, layers: Sequence[Q41Linear]) -> None:
        self.splits = [m.out_features for m in layers]
        self.rows = Q41Linear.KERNEL_ROWS * layers[0].in_features
        whole = [torch.cat([getattr(m, n) for m in layers]) for n in ("codes", "d", "m")]
        a = 0
        for m, n in zip(layers, self.splits):
            for name, t in zip(("codes", "d", "m"), whole):
                setattr(m, name, t[a:a + n])
            a += n
        self._layers = list(layers)
        self._whole = whole
        self._offsets = self._layer_offsets()
        self._views: _Views | None = None

    def _layer_offsets(self) -> list[int]:
        """Where each layer's buffers lie from the concatenations' starts (the same in a deep
        copy, whose buffers are views of its own concatenations; not for replaced buffers)."""
        return [m._buffers[n].data_ptr() - w.data_ptr()   # type: ignore[union-attr]
                for m in self._layers for n, w in zip(("codes", "d", "m"), self._whole)]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The layers' outputs for ``x``, or ``None`` when the pass is not one it takes."""
        if not (x.numel() <= self.rows and x.is_cpu and x.dtype == torch.float32):
            return None
        if self._layer_offsets() != self._offsets or not self._whole[0].is_cpu:
            return None
        self._views = kernel_views(self._views, KernelBlocks.of, *self._whole)
        return list(blocks_matmul(x, self._views[1]).split(self.splits, dim=-1))


#: per parent module of :func:`share_inputs`, the layers that take one input
SHARED_INPUTS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def share_inputs(layer: nn.Module) -> int:
    """Installs a :class:`SharedQ41` on ``layer``'s attention and MLP where the layers of
    :data:`SHARED_INPUTS` are bias-free :class:`Q41Linear` layers of one input width; returns
    how many it installed."""
    done = 0
    for parent_name, names in SHARED_INPUTS:
        parent = getattr(layer, parent_name, None)
        mods = [getattr(parent, n, None) for n in names]
        if all(isinstance(m, Q41Linear) and m.bias is None for m in mods) and len(
                {m.in_features for m in mods if m is not None}) == 1:
            setattr(parent, SHARED_PRODUCT, SharedQ41(mods))   # type: ignore[arg-type]
            done += 1
    return done


class Q80Linear(WeightLinear):
    """A layer whose weight is Q8_0 values (:mod:`sparkv.runtime.q80`): SmolLM2's LM head, tied
    to its token embedding (``int4``). A pass of at most :attr:`KERNEL_ROWS` rows on the CPU (an
    answer token's logits) multiplies with the Q8_0 blocks, reading 8.5 bits a weight instead of
    32 (the same weights, float32 sums in another order); a longer pass multiplies with the
    float32 weight it keeps (the embedding's own tensor when tied: no copy), float32's product
    bit for bit.

    Attributes:
        exact: whether the blocks are the weight bit for bit (SmolLM2's are).
    """

    #: most rows a pass may have to take the blocks' kernel
    KERNEL_ROWS = MAX_ROWS
    weight: torch.Tensor
    codes: torch.Tensor
    d: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.weight = linear.weight
        q = quantize_q80(linear.weight)
        self.exact = q.exact(linear.weight.detach().to(torch.float32))
        self.register_buffer("codes", q.codes)
        self.register_buffer("d", q.d.view(torch.int16))
        self._views: _Views | None = None

    def blocks(self) -> Q80Weight:
        return Q80Weight(self.codes, self.d.view(torch.float16))

    def _arrays(self) -> tuple[Any, Any]:
        """The kernel's views of the buffers (:func:`kernel_views`)."""
        return _layer_views(self, _q80_arrays, ("codes", "d"))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if (x.numel() <= self.KERNEL_ROWS * self.in_features and x.is_cpu
                and x.dtype == torch.float32 and self._buffers["codes"].is_cpu):  # type: ignore
            return q80_matmul(x, self._arrays())
        return fast_linear(x, self.weight.to(x.dtype))


class Q80AnswerLinear(Q80Linear):
    """:class:`Q80Linear` for answer tokens only (passes marked by :func:`answer_tokens`); any
    other pass, the first token's logits included, multiplies with the float32 weight, float32's
    product bit for bit (``mixed-mlp-int4-decode``: its first token stays ``mixed-mlp``'s)."""

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if answering():
            return super().matmul(x)
        return fast_linear(x, self.weight.to(x.dtype))


def _q80_arrays(codes: torch.Tensor, d: torch.Tensor) -> tuple[Any, Any]:
    return kernel_arrays(Q80Weight(codes, d.view(torch.float16)))


class Int4KernelLinear(WeightLinear):
    """The Q4_1 blocks through torch's CPU int4 kernel (``int4-kernel``). The kernel computes
    ``w = (q - 8) * scale + zero``, so a block's ``d`` is the scale and ``m + 8 d`` the zero; on
    x86 it is vectorized only for bfloat16 (float32 runs a scalar loop, ~50x slower), so the
    scale and zero are rounded to bf16 (a second rounding of the weights) and the input and
    output are bf16."""

    INNER_K_TILES = 2
    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q = quantize_q41(linear.weight)
        if self.out_features % 32:
            raise ValueError(f"torch's int4 kernel needs out_features a multiple of 32, got "
                             f"{self.out_features}")
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.codes.to(torch.int32), self.INNER_K_TILES))
        d, m = q.d.to(torch.float32), q.m.to(torch.float32)
        sz = torch.stack((d, m + 8 * d), dim=-1)              # [out, in / 32, 2]
        self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous()
                             .to(torch.bfloat16))            # [in / 32, out, 2]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, BLOCK,
                                                       self.scales_zeros)
        return y.view(*x.shape[:-1], self.out_features)


class Float32Linear(WeightLinear):
    """The float32 weight and matmul (float32's product bit for bit): the prefill side of
    :class:`Int4DecodeLinear`."""

    weight: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.register_buffer("weight", linear.weight.detach().to(torch.float32))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight.to(x.dtype))


class Int4Answers(WeightLinear):
    """Answer tokens (passes marked by :func:`answer_tokens`) through :class:`Int4KernelLinear`
    (the Q4_1 blocks), every other pass through the next class's :meth:`matmul`: mixed in
    before the prefill's linear layer. An answer token's pass (one row, or one per ask when
    the device service decodes several asks together:
    :func:`~sparkv.runtime.batchdecode.decode_together` marks it) is bound by reading the
    weights, not by FLOPs (5 bits a weight instead of 16 or 32); a prefill is compute-bound,
    where that kernel is slower (0.65x float32 on the CPU). Both forms are kept."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.kernel = Int4KernelLinear(linear)
        self.kernel.bias = None                                # added once, by this module

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if answering():
            return self.kernel.matmul(x)
        return super().matmul(x)


class Int4DecodeLinear(Int4Answers, Float32Linear):
    """float32 for a prefill, torch's int4 kernel for answer tokens (``int4-decode``; 1.65x
    faster a token on SmolLM2 here): the KV a context's prefill makes, and the first token, are
    float32's, bit for bit. SmolLM2: 430 + 60 MB."""


class MixedInt4DecodeLinear(Int4Answers, Bf16Linear):
    """``mixed-mlp``'s bf16 weight and matmul for a prefill, torch's int4 kernel for answer
    tokens (``mixed-mlp-int4-decode``): on a CPU with bf16 hardware a prefill's bf16 matmuls
    run ~1.5x float32's, and an answer token ~2x faster from the Q4_1 blocks than from bf16.
    Both paths round the input to bf16 and return bf16, so the MLP keeps its activations in bf16
    (``mixed-mlp``) either way. The KV a prefill makes, and the first token, are ``mixed-mlp``'s
    bit for bit. SmolLM2: 215 + 60 MB."""


_answer = threading.local()


@contextlib.contextmanager
def answer_tokens() -> Iterator[None]:
    """Marks this thread's forward passes in the block as answer tokens (what
    :class:`Int4DecodeLinear` runs through the int4 kernel)."""
    before = getattr(_answer, "on", False)
    _answer.on = True
    try:
        yield
    finally:
        _answer.on = before


def answering() -> bool:
    """Whether this thread runs answer tokens (:func:`answer_tokens`)."""
    return bool(getattr(_answer, "on", False))


#: the children of a decoder layer whose ``nn.Linear`` modules a configuration replaces
LINEAR_PARENTS = ("self_attn", "mlp")


def replace_linears(layer: nn.Module, cls: type[WeightLinear]) -> list[WeightLinear]:
    """Replaces every ``nn.Linear`` child of ``layer``'s :data:`LINEAR_PARENTS` by ``cls`` made
    from it; returns the new modules."""
    out = []
    for parent_name in LINEAR_PARENTS:
        parent = getattr(layer, parent_name, None)
        if parent is None:
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                new = cls(child).to(child.weight.device)
                setattr(parent, name, new)
                out.append(new)
    return out


__all__ = ["LINEAR_PARENTS", "replace_linears", "Bf16Linear", "Bf16WeightLinear",
           "Float32Linear", "Int4Answers", "Int4DecodeLinear", "Int4KernelLinear",
           "MixedInt4DecodeLinear", "Int8Linear",
           "Q41Linear", "Q80AnswerLinear", "Q80Linear",
           "SHARED_INPUTS", "SharedQ41", "WeightLinear", "kernel_views", "share_inputs",
           "answer_tokens", "answering"]
