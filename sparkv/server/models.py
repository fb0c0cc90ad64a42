"""The models a server (or the offline encoder) may encode with, loaded lazily and kept.

Configured as ``models: {name: path-or-null}`` (``null``: the bundled SmolLM2). A context records the
model's fingerprint and its tokenizer's identity, so ids never collide across models.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparkv.server.errors import ApiError

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel


@dataclass
class ModelEntry:
    """A loaded model and what the server needs to know about it.

    Attributes:
        name: the configured name (what clients send).
        lm: the :class:`~sparkv.runtime.LoadedModel`.
        tokenizer_id: a short hash of the tokenizer's vocabulary (``"none"`` without one).
        vocab_size: token ids must be below it.
        max_tokens: the longest context accepted (model positions and the server's limit).
    """

    name: str
    lm: LoadedModel
    tokenizer_id: str
    vocab_size: int
    max_tokens: int

    @property
    def fingerprint(self) -> str:
        return str(self.lm.fingerprint)

    @classmethod
    def from_loaded(cls, name: str, lm: LoadedModel, max_context_tokens: int) -> "ModelEntry":
        tok = lm.tokenizer
        if tok is None:
            tok_id = "none"
        else:
            vocab = sorted(tok.get_vocab().items())
            tok_id = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
        positions = lm.max_positions or max_context_tokens
        return cls(name, lm, tok_id, int(lm.config.vocab_size), min(positions, max_context_tokens))


@dataclass(frozen=True)
class ModelFacts:
    """What a request for one model must respect (the OpenAPI document states them)."""

    vocab_size: int
    """Token ids are below it."""
    kv_heads: int
    """``heads_per_group`` divides it (or is 0)."""
    max_tokens: int
    """The longest context (the model's positions and the server's limit)."""


def _config_facts(path: str | None, max_context_tokens: int) -> ModelFacts | None:
    """:class:`ModelFacts` from a checkpoint's ``config.json`` without loading the model
    (``None``: the bundled model not converted yet, a ``random:`` or ``rope-extended:`` spec,
    an unreadable config)."""
    from sparkv.runtime.model import DEFAULT_MODEL, converted_dir

    if path is None or str(path).lower() in (DEFAULT_MODEL, "smollm2"):
        config = converted_dir() / "config.json"
    elif ":" in str(path):
        return None
    else:
        config = Path(path).expanduser() / "config.json"
    try:
        doc = json.loads(config.read_text())
        heads = int(doc.get("num_key_value_heads") or doc["num_attention_heads"])
        positions = int(doc.get("max_position_embeddings") or 0) or max_context_tokens
        return ModelFacts(int(doc["vocab_size"]), heads, min(positions, max_context_tokens))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class ModelRegistry:
    """Configured models by name; ``get`` loads on first use (thread-safe, once per name)."""

    def __init__(self, models: dict[str, str | None], max_context_tokens: int,
                 device: str = "cpu", dtype: str = "float32") -> None:
        self.device, self.dtype = device, dtype
        self._paths = dict(models)
        self._max = max_context_tokens
        self._loaded: dict[str, ModelEntry] = {}
        self._locks = {name: threading.Lock() for name in models}

    def names(self) -> list[str]:
        return list(self._paths)

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def facts(self, name: str) -> ModelFacts | None:
        """The limits of model ``name`` from the loaded model, else from its checkpoint's
        ``config.json`` (never loads it); ``None`` when neither can be read."""
        entry = self._loaded.get(name)
        if entry is None:
            return _config_facts(self._paths[name], self._max)
        cfg = entry.lm.config
        heads = int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
        return ModelFacts(entry.vocab_size, heads, entry.max_tokens)

    def add(self, entry: ModelEntry) -> None:
        """Registers an already loaded model (tests, the offline encoder)."""
        self._paths.setdefault(entry.name, None)
        self._locks.setdefault(entry.name, threading.Lock())
        self._loaded[entry.name] = entry

    def get(self, name: str) -> ModelEntry:
        """The loaded model called ``name``.

        Raises:
            ApiError: 400 ``unknown_model`` for a name not configured; 503 ``model_unavailable``
                when a configured model fails to load (the message says why).
        """
        if name not in self._paths:
            raise ApiError(400, "unknown_model",
                           f"unknown model {name!r}; this server has: {', '.join(self._paths)}",
                           models=list(self._paths))
        entry = self._loaded.get(name)
        if entry is not None:
            return entry
        with self._locks[name]:
            entry = self._loaded.get(name)
            if entry is None:
                from sparkv.predictor.dtypes import load_model_in_dtype
                from sparkv.runtime import ModelError

                try:
                    lm = load_model_in_dtype(self._paths[name], dtype=self.dtype,
                                             device=self.device,
                                    progress=True)
                except ModelError as exc:
                    raise ApiError(503, "model_unavailable",
                                   f"model {name!r} cannot be loaded: {exc}") from exc
                entry = ModelEntry.from_loaded(name, lm, self._max)
                self._loaded[name] = entry
        return entry
