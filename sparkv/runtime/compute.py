"""Compute configurations: how a model's weights are stored and which operations run in which
dtype (docs/dtypes.md).

A configuration is applied to the loaded model once (:func:`apply_compute`): the decoder layers'
linear layers are replaced by those of :mod:`sparkv.runtime.linears` (or the whole model is cast,
for the plain dtypes). Every path that computes KV or logits runs the model's own modules (the
layer stepper, the reference forward and generation, the server's encode, the device service's
recompute, decode), so all of them compute in the model's configuration; nothing else converts.
``lm.compute`` names it, and the manifest of a context says which one made its KV.

====================  ===========  ===================================  ==========================
name                  activations  the decoder layers' linear layers    norms, RoPE, softmax
====================  ===========  ===================================  ==========================
``float32``           float32      float32                              float32
``bfloat16``          bfloat16     bfloat16 (the whole model cast)      bfloat16 (the norms
                                                                        upcast internally)
``float16``           float16      float16 (CUDA only)                  float16
``mixed``             float32      bf16 weights, bf16 matmul            float32
``mixed-attn``        float32      ``mixed``; a prefill's attention     float32 (softmax
                                   products in bf16 too                 inside the kernel)
``mixed-mlp``         float32      ``mixed-attn``; the MLP's            float32 (softmax
                                   activations between its matmuls      inside the kernel);
                                   in bf16 too                          the MLP's SiLU bf16
``mixed-layers``      float32      ``mixed`` on the layers the model's  float32
                                   measured sensitivity allows, the
                                   others float32
``bf16-weights``      float32      bf16 weights, float32 matmul         float32
``int8``              float32      int8 per output channel, float32     float32
                                   matmul
``int4``              float32      Q4_1 blocks (SmolLM2's own, no       float32; an
                                   second rounding), float32 matmul;    answer token's
                                   a few rows: kernels reading them     attention from 1K
                                                                        keys: a kernel
``int4-kernel``       float32      Q4_1 through torch's CPU int4        float32
                                   kernel: bf16 input, scales, output
``int4-decode``       float32      float32 for a prefill and the first  float32
                                   token, ``int4-kernel``'s for the
                                   other answer tokens
``mixed-mlp-int4-      float32      ``mixed-mlp`` for a prefill and the  as ``mixed-mlp``; an
decode``                           first token, ``int4-kernel``'s for   answer token's
                                   the other answer tokens (their LM    attention as
                                   head: ``int4``'s Q8_0 blocks)        ``int4``'s
====================  ===========  ===================================  ==========================

The residual stream (the hidden state between and within layers), the KV memory and the logits
are in the activations' dtype; the embeddings and the LM head keep the checkpoint's weights
(``int4`` multiplies a pass of few rows by SmolLM2's LM head through its Q8_0 blocks: the same
weights, :class:`~sparkv.runtime.linears.Q80Linear`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from sparkv.errors import SparkvError
from sparkv.runtime.linears import (Bf16Linear, Bf16WeightLinear, Int4DecodeLinear,
                                    Int4KernelLinear, Int8Linear, MixedInt4DecodeLinear,
                                    Q41Linear, Q80AnswerLinear, Q80Linear, WeightLinear,
                                    replace_linears, share_inputs)


class ComputeError(SparkvError):
    """An unknown configuration, or one that cannot run on this device or model."""


@dataclass(frozen=True)
class ComputeConfig:
    """One compute configuration (module docstring).

    Attributes:
        name: the registry's key (``--dtype NAME``).
        summary: one line for tables and ``sparkv model``.
        dtype: the activations' dtype: residual stream, norms, RoPE, softmax, KV memory, logits.
        weights: how the decoder layers' linear weights are stored (``float32``, ``bfloat16``,
            ``int8``, ``q4_1``).
        matmul: the dtype those layers' matmuls run in.
        linear: the module replacing their ``nn.Linear`` (``None``: kept, the model cast to
            ``dtype``).
        bf16_matmuls: its matmuls are bf16: faster than float32 only on a CPU that computes bf16
            in hardware (AVX512-BF16, AMX); slower elsewhere.
        cuda: it runs on CUDA too (the int4 kernel is the CPU's).
        per_layer: the linear layers are replaced only in the layers the model's measured
            sensitivity allows (:mod:`sparkv.runtime.layerprec`; :func:`apply_compute` takes
            them).
        stepper_tolerance: the largest ``|K/V|`` difference between the layer stepper and the
            same configuration's own full forward that the tests allow.
        attention: the dtype a prefill pass's attention products run in (Q, K and V cast,
            the output cast back; :data:`sparkv.cache.attention.PRODUCTS_DTYPE`), ``None``:
            the activations'.
        mlp: the dtype the MLP's activations between its matmuls are kept in (the gate and up
            projections' bf16 outputs, their SiLU and product: :data:`sparkv.runtime.fastops.
            MLP_DTYPE`), ``None``: the activations' (each matmul's output cast back).
        answers_differ: its answer tokens compute another way than its prefill (``int4-decode``;
            ``int4``: the same weights, float32 sums in another order),
            so a judge of its answers feeds them one token a pass, as generation does
            (:func:`~sparkv.runtime.generate.teacher_forced_agreement`).
        head: the module replacing the LM head when its weight is that module's format
            exactly (``int4``: :class:`~sparkv.runtime.linears.Q80Linear`, SmolLM2's Q8_0
            embedding; ``mixed-mlp-int4-decode``: :class:`~sparkv.runtime.linears.
            Q80AnswerLinear`, the same for answer tokens only), ``None``: kept.
        one_query: an answer token's attention over a dense prefix of at least
            :data:`~sparkv.runtime.decodeattn.MIN_ROWS` keys on the CPU runs the numba kernel
            of :mod:`sparkv.runtime.decodeattn` (each KV head read once for its query group;
            SDPA's result up to the order of sums) instead of SDPA.
        prefill_as: the configuration whose passes its prefill passes are, bit for bit (a
            configuration that differs only in its answer tokens): its layer steps' latency
            profile is that one's (:func:`sparkv.predictor.device.compute_name`); ``None``:
            its own.
    """

    name: str
    summary: str
    dtype: torch.dtype
    weights: str
    matmul: str
    linear: type[WeightLinear] | None = None
    bf16_matmuls: bool = False
    cuda: bool = True
    per_layer: bool = False
    stepper_tolerance: float = 1e-4
    attention: torch.dtype | None = None
    mlp: torch.dtype | None = None
    answers_differ: bool = False
    head: type[WeightLinear] | None = None
    one_query: bool = False
    prefill_as: str | None = None

    @property
    def plain(self) -> bool:
        """The whole model in one dtype (``float32``, ``bfloat16``, ``float16``)."""
        return self.linear is None

    @property
    def prefill_name(self) -> str:
        """The configuration its prefill passes are, bit for bit: :attr:`prefill_as`, else its
        own name (what a profile of its steps and a manifest of the KV it makes name)."""
        return self.prefill_as or self.name

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


CONFIGS: dict[str, ComputeConfig] = {c.name: c for c in (
    ComputeConfig("float32", "float32 everywhere", torch.float32, "float32", "float32"),
    ComputeConfig("bfloat16", "bfloat16 everywhere (weights, activations, residual stream)",
                  torch.bfloat16, "bfloat16", "bfloat16", bf16_matmuls=True,
                  stepper_tolerance=0.0625),
    ComputeConfig("float16", "float16 everywhere (CUDA only)", torch.float16, "float16",
                  "float16", stepper_tolerance=0.0625),
    ComputeConfig("mixed", "bf16 matmuls; float32 residual stream, RMSNorm, RoPE, softmax",
                  torch.float32, "bfloat16", "bfloat16", Bf16Linear, bf16_matmuls=True,
                  stepper_tolerance=0.03),
    ComputeConfig("mixed-attn", "mixed, and a prefill's attention products in bf16 (softmax "
                  "float32)", torch.float32, "bfloat16", "bfloat16", Bf16Linear,
                  bf16_matmuls=True, cuda=False, stepper_tolerance=0.0625,
                  attention=torch.bfloat16),
    ComputeConfig("mixed-mlp", "mixed-attn, and the MLP's activations between its matmuls in "
                  "bf16 (gate, up, SiLU, product)", torch.float32, "bfloat16", "bfloat16",
                  Bf16Linear, bf16_matmuls=True, cuda=False, stepper_tolerance=0.0625,
                  attention=torch.bfloat16, mlp=torch.bfloat16),
    ComputeConfig("mixed-layers", "mixed on the layers whose rounding does not move the output "
                  "(measured), float32 on the others", torch.float32, "bfloat16+float32",
                  "bfloat16+float32", Bf16Linear, bf16_matmuls=True, per_layer=True,
                  stepper_tolerance=0.03),
    ComputeConfig("bf16-weights", "bf16 weights, float32 matmuls and activations",
                  torch.float32, "bfloat16", "float32", Bf16WeightLinear),
    ComputeConfig("int8", "int8 weights (per output channel), float32 matmuls and activations",
                  torch.float32, "int8", "float32", Int8Linear),
    ComputeConfig("int4", "the Q4_1 blocks (no second rounding on SmolLM2), float32 matmuls "
                  "(a pass of <= 8 rows: kernels reading the blocks, the LM head's Q8_0 ones; an "
                  "answer token's attention over >= 1K keys: a kernel reading each KV head "
                  "once)",
                  torch.float32, "q4_1", "float32", Q41Linear, answers_differ=True,
                  head=Q80Linear, one_query=True),
    ComputeConfig("int4-kernel", "the Q4_1 blocks through torch's CPU int4 kernel (bf16 input, "
                  "scales and output)", torch.float32, "q4_1", "bfloat16", Int4KernelLinear,
                  bf16_matmuls=True, cuda=False, stepper_tolerance=0.03),
    ComputeConfig("int4-decode", "float32 prefill and first token; the other answer tokens "
                  "through torch's CPU int4 kernel", torch.float32, "float32+q4_1",
                  "float32+bfloat16", Int4DecodeLinear, cuda=False, answers_differ=True,
                  prefill_as="float32"),
    ComputeConfig("mixed-mlp-int4-decode", "mixed-mlp prefill and first token; the other answer "
                  "tokens through torch's CPU int4 kernel (the LM head's Q8_0 blocks, an "
                  "answer token's attention over >= 1K keys: the kernels int4 takes)",
                  torch.float32, "bfloat16+q4_1",
                  "bfloat16", MixedInt4DecodeLinear, bf16_matmuls=True, cuda=False,
                  stepper_tolerance=0.0625, attention=torch.bfloat16, mlp=torch.bfloat16,
                  answers_differ=True, head=Q80AnswerLinear, one_query=True,
                  prefill_as="mixed-mlp"),
)}

#: the plain configuration of each dtype
PLAIN = {c.dtype: c for c in CONFIGS.values() if c.plain}


def get_compute(name: str | ComputeConfig) -> ComputeConfig:
    """The configuration ``name`` (a registry key); raises :class:`ComputeError` naming the
    known ones."""
    if isinstance(name, ComputeConfig):
        return name
    key = str(name).strip().lower()
    if key in CONFIGS:
        return CONFIGS[key]
    raise ComputeError(f"unknown compute configuration {name!r}; choose one of "
                       f"{', '.join(CONFIGS)} (docs/dtypes.md)")


def plain_compute(dtype: torch.dtype) -> ComputeConfig:
    """The configuration that computes everything in ``dtype``."""
    return PLAIN[dtype]


def compute_of(lm: Any) -> ComputeConfig:
    """The configuration ``lm`` (a :class:`~sparkv.runtime.model.LoadedModel`) computes in: the
    one applied to it, else its dtype's plain one."""
    name = getattr(lm, "extra", {}).get("compute")
    return get_compute(name) if name else plain_compute(lm.dtype)


def check_device(config: ComputeConfig, device: torch.device) -> None:
    """Raises :class:`ComputeError` when ``config`` cannot run on ``device``."""
    if device.type == "cuda" and not config.cuda:
        raise ComputeError(f"compute configuration {config.name} runs on the CPU only")
    if device.type == "cpu" and config.dtype == torch.float16:
        raise ComputeError("float16 on the CPU is not supported (slow and inexact kernels); "
                           "use float32 or bfloat16")


#: on a CPU with bf16 hardware, the configurations ``auto`` may take, fastest first (bf16 matmuls
#: run about 3x faster there; fewer float32 products first: measured on an AMX CPU, bfloat16
#: 1.9-2.5x float32, mixed-attn 2.0-2.2x, mixed 1.2-1.3x; mixed-mlp takes a float32 cast and
#: a float32 SiLU and product off each MLP; mixed-mlp-int4-decode is mixed-mlp's prefill with
#: answer tokens ~2x faster); a CPU without it takes float32, every other configuration being
#: slower there (docs/dtypes.md)
CPU_BF16_ORDER = ("bfloat16", "mixed-mlp-int4-decode", "mixed-mlp", "mixed-attn", "mixed",
                  "mixed-layers", "int4-kernel")
#: on CUDA, when the table fails bfloat16: the configurations ``auto`` may take instead
CUDA_FALLBACK_ORDER = ("mixed", "mixed-layers")


def auto_compute(device: torch.device, verdicts: Mapping[str, bool | None] | None = None,
                 cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> tuple[ComputeConfig, str]:
    """What ``--dtype auto`` computes with on ``device``, and why (one line).

    Args:
        verdicts: per configuration name, whether the model's quality table passes it
            (``True``), fails it or leaves it undecided (``False``), or has no verdict
            (``None``, or absent). Only a pass lets a configuration other than float32 be
            chosen on the CPU; on CUDA half precision is the default unless the table does not
            pass bfloat16 (the same measured loss would follow a model to the GPU).
        cpuinfo: the file :func:`~sparkv.runtime.device.cpu_bf16_flags` reads (tests pass a
            fake one).
    """
    from sparkv.runtime.device import cpu_bf16_flags

    verdicts = verdicts or {}
    if device.type == "cuda":
        if verdicts.get("bfloat16") is not False:
            if torch.cuda.is_bf16_supported():
                return CONFIGS["bfloat16"], "CUDA device with bfloat16"
            return CONFIGS["float16"], "CUDA device without bfloat16"
        for name in CUDA_FALLBACK_ORDER:
            if verdicts.get(name):
                return CONFIGS[name], (f"CUDA device; the model's quality table fails "
                                       f"bfloat16 and passes {name}")
        return CONFIGS["float32"], "CUDA device, but the model's quality table fails bfloat16"
    if device.type != "cpu":
        return CONFIGS["float32"], f"{device.type}: float32"
    flags = cpu_bf16_flags(cpuinfo)
    if not flags:
        return CONFIGS["float32"], ("CPU without bfloat16 hardware (no AVX512-BF16 or AMX): "
                                    "float32 is the fastest configuration here")
    hw = "+".join(flags)
    for name in CPU_BF16_ORDER:
        if verdicts.get(name):
            return CONFIGS[name], f"CPU has {hw} and the model's quality table passes {name}"
    judged = ", ".join(f"{n} {_verdict_word(verdicts.get(n))}" for n in CPU_BF16_ORDER)
    return CONFIGS["float32"], (f"CPU has {hw}, but the model's quality table passes no bf16 "
                                f"configuration ({judged})")


def _verdict_word(verdict: bool | None) -> str:
    return {True: "passes", False: "does not pass"}.get(verdict, "has no verdict")  # type: ignore


def resolve_compute(name: str | torch.dtype | ComputeConfig | None,
                    device: torch.device) -> ComputeConfig:
    """The configuration ``name`` means on ``device``: a configuration or its name, a dtype or a
    dtype's name (its plain configuration), or ``auto`` (:func:`auto_compute` without a quality
    table). Raises :class:`ComputeError` for an unknown name or one ``device`` cannot run."""
    from sparkv.runtime.device import DTYPES, DeviceUnavailable, plain_dtype

    if isinstance(name, ComputeConfig):
        config = name
    elif isinstance(name, torch.dtype) or (name or "auto").strip().lower() in DTYPES:
        try:
            return plain_compute(plain_dtype(name, device))  # type: ignore[arg-type]
        except DeviceUnavailable as exc:
            raise ComputeError(str(exc)) from None
    elif (name or "auto").strip().lower() == "auto":
        return auto_compute(device)[0]
    else:
        config = get_compute(str(name))
    check_device(config, device)
    return config


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The activations' dtype for ``name`` on ``device`` (:func:`resolve_compute`: a dtype, a
    dtype's name, a configuration's name, ``auto``); raises
    :class:`~sparkv.runtime.device.DeviceUnavailable` for an unknown name or one that cannot run
    on ``device`` (callers check a ``--dtype`` with it before loading anything)."""
    from sparkv.runtime.device import DeviceUnavailable

    try:
        return resolve_compute(name, device).dtype
    except ComputeError as exc:
        raise DeviceUnavailable(str(exc)) from None


def apply_compute(lm: Any, config: ComputeConfig | str,
                  layers: list[int] | None = None) -> dict[str, Any]:
    """Turns ``lm`` (loaded in float32, or already in ``config``'s plain dtype) into ``config``,
    in place, and records it in ``lm.extra["compute"]``. ``layers``: the decoder layers whose
    linear layers are replaced (default: all; a per-layer configuration needs them:
    :func:`sparkv.runtime.layerprec.bf16_layers`). Returns facts for the record (``layers``,
    ``weight_bytes``, ``exact`` for Q4_1)."""
    config = get_compute(config)
    check_device(config, lm.device)
    info: dict[str, Any] = {"name": config.name}
    linear = config.linear
    if linear is None:                                     # a plain configuration
        if lm.dtype != config.dtype:
            lm.model.to(config.dtype)
    else:
        if lm.dtype != torch.float32:
            raise ComputeError(f"compute configuration {config.name} starts from a float32 "
                               f"model, not {lm.dtype}")
        decoder_layers = lm.decoder.layers
        if layers is None and config.per_layer:
            raise ComputeError(f"{config.name} converts only the layers the model's measured "
                               "sensitivity allows: pass them (sparkv.predictor.dtypes."
                               "load_model_in_dtype reads the model's, docs/dtypes.md)")
        chosen = list(range(len(decoder_layers))) if layers is None else list(layers)
        replaced = [replace_linears(decoder_layers[i], linear) for i in chosen]
        flat = [m for layer in replaced for m in layer]
        info["layers"] = sorted(chosen)
        info["weight_bytes"] = sum(m.weight_nbytes() for m in flat)
        if linear is Q41Linear:
            info["exact"] = all(m.exact for m in flat)
            info["shared_products"] = sum(share_inputs(decoder_layers[i]) for i in chosen)
        if config.attention is not None:
            from sparkv.cache.attention import PRODUCTS_DTYPE

            for i in chosen:
                setattr(decoder_layers[i].self_attn, PRODUCTS_DTYPE, config.attention)
            info["attention"] = str(config.attention).replace("torch.", "")
        if config.mlp is not None:
            info["mlp_layers"] = _low_mlps(decoder_layers, chosen, config.mlp)
        if config.head is not None:
            info["head"] = _replace_head(lm.model, config.head)
        if config.one_query and lm.device.type == "cpu":
            info["one_query"] = _one_query_kernel(decoder_layers, chosen)
    lm.extra["compute"] = config.name
    lm.extra["compute_info"] = info
    return info


def _replace_head(model: Any, head: type[WeightLinear]) -> str:
    """Replaces ``model``'s LM head by ``head`` made from it when that holds its weight exactly
    (``head``'s ``exact``); returns what the head is now (for the record)."""
    old = model.get_output_embeddings()
    if not isinstance(old, torch.nn.Linear) or old.in_features % 32:
        return "kept (not a linear layer of whole 32-weight blocks)"
    new = head(old)
    if not getattr(new, "exact", False):
        return f"kept (its weight is not {head.__name__}'s format exactly)"
    model.set_output_embeddings(new.to(old.weight.device))
    return head.__name__


def _one_query_kernel(decoder_layers: Any, chosen: list[int]) -> str:
    """Gives the attention of layers ``chosen`` the one-query kernel
    (:data:`~sparkv.cache.attention.ONE_QUERY`); returns what it is, for the record."""
    from sparkv.cache.attention import ONE_QUERY
    from sparkv.runtime import decodeattn

    for i in chosen:
        setattr(decoder_layers[i].self_attn, ONE_QUERY, decodeattn.attend)
    return f"numba kernel from {decodeattn.MIN_ROWS} keys"


def _low_mlps(decoder_layers: Any, chosen: list[int], dtype: torch.dtype) -> list[int]:
    """Marks the MLPs of layers ``chosen`` whose three projections are bias-free bf16
    :class:`Bf16Linear` layers to keep their activations in ``dtype``
    (:data:`~sparkv.runtime.fastops.MLP_DTYPE`); returns those layers (an MLP of another shape
    computes as ``mixed`` does)."""
    from sparkv.runtime.fastops import MLP_DTYPE

    marked = []
    for i in chosen:
        mlp = getattr(decoder_layers[i], "mlp", None)
        projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if all(isinstance(p, Bf16Linear) and p.bias is None for p in projs):
            setattr(mlp, MLP_DTYPE, dtype)
            marked.append(i)
    return marked


__all__ = ["CONFIGS", "CPU_BF16_ORDER", "ComputeConfig", "ComputeError", "apply_compute",
           "auto_compute", "check_device", "compute_of", "get_compute", "plain_compute",
           "resolve_compute", "resolve_dtype"]
