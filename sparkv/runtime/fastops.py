"""The work around the matmuls, with fewer passes over memory: RMSNorm, RoPE, the MLP's gate.

On a 2-core CPU the elementwise work of a layer step (RMSNorm's upcast, square, mean, scale;
RoPE's two products, negation and concatenation; SiLU and the gate product) took about a third
of a float32 prefill at 2K tokens, as much as half the weights' matmuls (docs/runtime.md,
"Overheads around the matmuls"). :func:`install_fast_ops` switches a model's modules to versions
that compute the same thing in fewer passes:

* **RMSNorm**: ``torch.nn.functional.rms_norm`` (one fused kernel) in float32, then the weight in
  the activations' dtype, as transformers orders it (bit for bit its float32 result).
* **RoPE** (:func:`apply_rope`): ``x * cos`` and two in-place ``addcmul_`` on its halves
  (``- x2 * sin1``, ``+ x1 * sin2``): no ``rotate_half`` copy, no negation, no concatenation.
  An answer token's q and k take one numba call instead (:func:`rope_pair`, bit for bit).
* **The decoder layer** (transformers 5.x): its children's forwards called directly where no
  hook could tell (:func:`_decoder_forward`).
* **MLP**: SiLU in place on the gate's output, then the up projection multiplied into it.
* **Linear** (:func:`linear`; float32 on a CPU, 2 to :data:`FEW_ROWS` rows: answer
  tokens of several asks as one pass, a question's pass): ``W @ x^T``, transposed back, instead
  of ``x @ W^T``. On this 2-core AVX2 CPU torch's ``linear`` with a few rows costs 1.3-2.5x
  what the same product costs with the weight as the left operand (SmolLM2's projections,
  2-4 rows 2.3-2.5x, 8 rows 1.6x, 16-64 rows 1.3-1.5x, 128 rows 1.1x): with two answer tokens
  as one pass a decode took 1.7x one token's time, with this 1.0-1.1x (docs/runtime.md,
  "Few rows"). One row (a single answer token) keeps torch's ``linear``, bit for bit (the same
  kernel either way); 2-64 rows differ from it by float32 rounding, as ``linear`` with another
  number of rows does.

The modules keep their class (a subclass with another ``forward``: ``isinstance`` checks, hooks
and state dicts are unchanged) and their parameters. The attention module's forward is the Llama
family's (projections, Qwen3's ``q_norm``/``k_norm``, RoPE, the cache's ``update``, the
attention implementation, ``o_proj``) with :func:`apply_rope`. Every path runs these modules, so
the layer stepper and the model's own forward stay equal (tested).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from sparkv.runtime import ropekernel
from sparkv.runtime.hooks import offer_queries
from sparkv.runtime.ropekernel import torch_rope

#: the modules of the supported families (``sparkv.runtime.model.SUPPORTED_MODEL_TYPES``) whose
#: forward is replaced, by class-name suffix
RMSNORM_SUFFIX = "RMSNorm"
ATTENTION_SUFFIX = "Attention"
MLP_SUFFIX = "MLP"
#: ``nn.Linear`` itself (not a subclass: the compute configurations' layers compute their own way)
LINEAR = "Linear"
#: the decoder layer (transformers 5.x's forward: :func:`_decoder_forward`)
DECODER_SUFFIX = "DecoderLayer"
#: the children a decoder layer's fast forward calls, in order
LAYER_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the Llama family applies it (``x * cos + rotate_half(x) * sin``); ``x [B, H, n,
    D]``, ``cos/sin [B, n, D]``. A new tensor; ``x`` is not modified."""
    if cos.shape[-1] != x.shape[-1]:       # a partial rotary dimension: the plain formula
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)
    return torch_rope(x, cos, sin)


def rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` of ``q`` and ``k``: a pass of a few float32 rows on a CPU (an answer
    token) in one numba call (:mod:`sparkv.runtime.ropekernel`, bit for bit the same)."""
    if ropekernel.takes(q, cos, sin) and ropekernel.takes(k, cos, sin):
        return ropekernel.rope_qk(q, k, cos, sin)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _rms_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = hidden_states.dtype
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
    normed = F.rms_norm(hidden_states.to(torch.float32), hidden_states.shape[-1:], eps=eps)
    if dtype == torch.float32 and self.weight.dtype == torch.float32:
        return normed.mul_(self.weight)
    return self.weight * normed.to(dtype)


#: the attribute of an MLP module whose activations between its matmuls are kept in a lower
#: dtype (the ``mixed-mlp`` configuration, :func:`sparkv.runtime.compute.apply_compute`): its
#: projections are :class:`~sparkv.runtime.linears.Bf16Linear` layers whose ``matmul`` takes and
#: returns that dtype, so the input is rounded once and only the output is cast back
MLP_DTYPE = "sparkv_mlp_dtype"


#: the attribute of an attention or MLP module holding one product for its layers that take
#: one input (q, k, v; gate, up): called with the input, it returns their outputs, or ``None``
#: for a pass it does not take (``int4``: :class:`~sparkv.runtime.linears.SharedQ41`)
SHARED_PRODUCT = "sparkv_shared_product"


def _shared(module: Any, x: torch.Tensor) -> list[torch.Tensor] | None:
    """``module``'s :data:`SHARED_PRODUCT` of ``x``, or ``None``."""
    shared = getattr(module, SHARED_PRODUCT, None)
    return None if shared is None else shared(x)


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    low = getattr(self, MLP_DTYPE, None)
    if low is not None:
        return _low_mlp(self, x, low)
    shared = _shared(self, x)
    gate, up = (self.gate_proj(x), self.up_proj(x)) if shared is None else shared
    return self.down_proj(_activate(self, gate).mul_(up))


def _activate(self: Any, gate: torch.Tensor) -> torch.Tensor:
    """The MLP's activation of ``gate`` (SiLU in place)."""
    if isinstance(self.act_fn, nn.SiLU):
        return F.silu(gate, inplace=True)
    return self.act_fn(gate)


def _low_mlp(self: Any, x: torch.Tensor, low: torch.dtype) -> torch.Tensor:
    """The MLP with its activations in ``low`` (:data:`MLP_DTYPE`): one rounding of the input,
    the gate's activation and the product in ``low``, the output cast back to ``x``'s dtype.
    On a 2K-token pass of SmolLM2 (AMX CPU) 7 ms a layer against 15-18 with every matmul's
    output cast to float32 and the activation and product computed there."""
    xl = x.to(low)
    gate = _activate(self, self.gate_proj.matmul(xl))
    return self.down_proj.matmul(gate.mul_(self.up_proj.matmul(xl))).to(x.dtype)


#: the most token rows :func:`linear` computes as ``W @ x^T`` (more: torch's ``linear``)
FEW_ROWS = 64
#: the byte boundary a model's tensors start on (torch's CPU allocator's): :func:`_align`
ALIGN = 64


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; with 2 to :data:`FEW_ROWS` rows of float32 on a CPU,
    computed as ``weight @ x^T`` (module docstring). Every float32 linear layer of a loaded
    model goes through it (``nn.Linear`` here, the compute configurations' float32 matmuls in
    :mod:`sparkv.runtime.linears`), so they stay equal to one another bit for bit."""
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if (2 <= rows <= FEW_ROWS and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu"):
        y = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t()
        if bias is not None:
            y = y + bias
        return y.contiguous().view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def _linear_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def project_qkv(attn: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention module's q, k (after Qwen3's ``q_norm``/``k_norm`` and RoPE) and v
    ``[B, H, n, D]`` of the normed rows ``h`` ``[B, n, hidden]``: the fast attention forward's
    first half (also the graphed steps', :mod:`sparkv.runtime.graphs`)."""
    shape = (*h.shape[:-1], -1, attn.head_dim)
    shared = _shared(attn, h)
    if shared is None:
        shared = project_shared((attn.q_proj, attn.k_proj, attn.v_proj), h)
    q, k, v = (p.view(shape) for p in shared)
    if getattr(attn, "q_norm", None) is not None:           # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope_pair(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def project_shared(layers: tuple[nn.Module, ...], h: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``layers`` applied to ``h``. Layers that all round their input to one dtype first
    (:attr:`WeightLinear.rounds_input_to <sparkv.runtime.linears.WeightLinear.rounds_input_to>`:
    ``mixed``'s bf16 matmuls) take it rounded once, bit for bit what each would compute."""
    low = {getattr(m, "rounds_input_to", None) for m in layers}
    if len(low) != 1 or None in low or h.dtype in low:
        return [m(h) for m in layers]
    hl = h.to(low.pop())
    linears: list[Any] = list(layers)      # WeightLinears (their rounds_input_to says so)
    return [m.project(hl, h.dtype) for m in linears]


def is_fast_attention(module: nn.Module) -> bool:
    """Whether ``module`` runs the fast attention forward (:func:`install_fast_ops`)."""
    return getattr(type(module), "forward", None) is _attention_forward


def _attention_forward(self: Any, hidden_states: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                       attention_mask: torch.Tensor | None = None, cache: Any = None,
                       past_key_values: Any = None, **kwargs: Any
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    cos, sin = position_embeddings                          # type: ignore[misc]
    q, k, v = project_qkv(self, hidden_states, cos, sin)
    offer_queries(self, q)
    store = cache if cache is not None else past_key_values
    if store is not None:
        k, v = _update(store, k, v, self.layer_idx, cos, sin, kwargs)
    window = getattr(self, "sliding_window", getattr(self.config, "sliding_window", None))
    if window is not None:
        kwargs["sliding_window"] = window
    out, weights = _attention_function(self)(self, q, k, v, attention_mask, dropout=0.0,
                                             scaling=self.scaling, **kwargs)
    out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
    return self.o_proj(out), weights


def _update(store: Any, k: torch.Tensor, v: torch.Tensor, layer: int, cos: torch.Tensor,
            sin: torch.Tensor, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``cache.update`` as the installed transformers' attention calls it (5.x passes its
    keyword arguments; 4.x a ``cache_kwargs`` dict)."""
    if _TRANSFORMERS_MAJOR >= 5:
        return store.update(k, v, layer, kwargs=kwargs)
    return store.update(k, v, layer, {"sin": sin, "cos": cos,
                                      "cache_position": kwargs.get("cache_position")})


def _decoder_forward(self: Any, hidden_states: torch.Tensor,
                     attention_mask: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, cache: Any = None,
                     use_cache: bool | None = False,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                     past_key_values: Any = None, **kwargs: Any) -> torch.Tensor:
    """The decoder layer's forward (transformers 5.x's, with ``past_key_values`` its old name
    for ``cache``), calling its children's forwards directly when no hook of theirs, no global
    hook and no autograd could see the difference (:func:`direct_calls`): ``Module.__call__``
    costs 4-8 us a call, ~1 ms of a ~70 ms answer token over SmolLM2's 30 layers' 120 calls.
    The same operations in the same order: bit for bit the layer's own result."""
    norm1, attn, norm2, mlp = _children(self)
    residual = hidden_states
    h, _ = attn(hidden_states=norm1(hidden_states), attention_mask=attention_mask,
                position_ids=position_ids, cache=cache if cache is not None else past_key_values,
                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    hidden_states = residual + h
    return hidden_states + mlp(norm2(hidden_states))


def _children(layer: nn.Module) -> list[Any]:
    """The :data:`LAYER_CHILDREN` of ``layer`` as its fast forward calls them: each one's
    forward where :func:`direct_calls` allows it, else the module (so a hook on the attention
    alone, the density recorder's or transformers' output capture, leaves the others direct)."""
    mods = [getattr(layer, name) for name in LAYER_CHILDREN]
    if not _nothing_global_could_tell():
        return mods
    return [m if _hooked(m) else m.forward for m in mods]


def direct_calls(modules: list[nn.Module]) -> bool:
    """Whether calling ``modules``' forwards directly computes what calling the modules does:
    no forward or backward hook on them or global, autograd off, not traced or compiled."""
    return _nothing_global_could_tell() and not any(_hooked(m) for m in modules)


def _nothing_global_could_tell() -> bool:
    """Autograd off, not traced or compiled, and no global module hook."""
    if torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    return not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
                or nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks)


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _attention_function(module: nn.Module) -> Any:
    """The attention implementation the model is configured with (``sparkv`` for a loaded
    model), or its modeling file's eager one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(module.config, "_attn_implementation", None) or "eager"
    if impl != "eager" and impl in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[impl]
    return sys.modules[type(module).__module__].eager_attention_forward


def _transformers_major() -> int:
    import transformers

    return int(transformers.__version__.split(".")[0])


_TRANSFORMERS_MAJOR = _transformers_major()
_FORWARDS = {RMSNORM_SUFFIX: _rms_forward, ATTENTION_SUFFIX: _attention_forward,
             MLP_SUFFIX: _mlp_forward, LINEAR: _linear_forward}
if _TRANSFORMERS_MAJOR >= 5:               # 4.x's decoder layers take and return other things
    _FORWARDS[DECODER_SUFFIX] = _decoder_forward
_FAST: dict[type, type] = {}


def _fast_class(cls: type, forward: Any) -> type:
    if cls not in _FAST:
        _FAST[cls] = type(f"Fast{cls.__name__}", (cls,), {"forward": forward,
                                                          "__module__": cls.__module__})
    return _FAST[cls]


def _kind(module: nn.Module) -> str | None:
    if type(module) is nn.Linear:
        return LINEAR
    name = type(module).__name__
    if name.startswith("Fast"):
        return None
    for suffix in _FORWARDS:
        if name.endswith(suffix) and name[:-len(suffix)] in _FAMILIES:
            return suffix
    return None


#: the class-name prefixes of the supported families
_FAMILIES = ("Llama", "Qwen2", "Qwen3", "Mistral")


def install_fast_ops(model: nn.Module) -> int:
    """Switches ``model``'s RMSNorm, attention and MLP modules of the supported families, and
    its ``nn.Linear`` modules, to the fast forwards (module docstring), once; returns how many
    modules it switched."""
    _align(model)
    n = 0
    for module in model.modules():
        kind = _kind(module)
        if kind is None:
            continue
        module.__class__ = _fast_class(type(module), _FORWARDS[kind])
        n += 1
    return n


def _align(model: nn.Module) -> None:
    """Moves every CPU parameter and buffer of ``model`` that does not start on a 64-byte
    boundary to memory that does (torch's allocator's). A checkpoint's tensors are views into
    its file mapping at any offset, and ``weight @ x^T``'s rounding depends on where the weight
    lies: a configuration's weight made at load (aligned) must compute what the model's own
    computes. Moving all of them, not only the linear layers', lets the file mapping go (the
    process would otherwise hold both copies)."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and tensor.data_ptr() % ALIGN:
                tensor.data = tensor.data.clone()


def uninstall_fast_ops(model: nn.Module) -> int:
    """Puts ``model``'s modules back on transformers' own forwards (the measurement of what
    :func:`install_fast_ops` buys: ``sparkv bench compute --compare-ops``); returns how many."""
    n = 0
    for module in model.modules():
        cls = type(module)
        if cls in _FAST.values():
            module.__class__ = cls.__mro__[1]
            n += 1
    return n


__all__ = ["apply_rope", "project_qkv", "is_fast_attention", "linear", "install_fast_ops",
           "uninstall_fast_ops", "FEW_ROWS"]
