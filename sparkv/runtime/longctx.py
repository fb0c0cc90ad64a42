"""The long-context timing mode: a model whose RoPE is extended past its trained window.

SmolLM2-135M was trained on 8192 positions; timing sparkv at 16K needs a model that accepts 16K.
``load_model("rope-extended:16384")`` loads the bundled SmolLM2 with its rotary embedding scaled
by YaRN (factor ``16384 / 8192 = 2``, ``original_max_position_embeddings = 8192``) and
``max_position_embeddings = 16384``; ``rope-extended:POSITIONS:BASE`` does the same to any other
model spec (a checkpoint path, ``random:smollm2-135m`` for random weights of the same shape).

The shape, and so the cost of every layer step, is the base model's: the mode is for timing. Its
answers past the base's window are not a quality result (quality is judged only within the
native window, on the base model); the loaded model says so in :func:`describe` and its name
(``rope-extended:16384:smollm2-135m-instruct``), which every result that names the model carries.
YaRN is static (the same frequencies for every forward, whatever its length), so layer steps of
any span reproduce the full prefill; dynamic NTK scaling would not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LONG_PREFIX = "rope-extended:"
ROPE_METHOD = "yarn"


@dataclass(frozen=True)
class LongContextSpec:
    """``rope-extended:POSITIONS[:BASE]``: ``positions`` the extended window (tokens),
    ``base`` the base model's spec (``None``: the bundled SmolLM2)."""

    positions: int
    base: str | None = None

    @classmethod
    def parse(cls, spec: str) -> "LongContextSpec":
        """Raises ``ValueError`` (saying what to pass) for a malformed spec."""
        if not is_long_spec(spec):
            raise ValueError(f"{spec!r} is not a long-context spec ({LONG_PREFIX}POSITIONS[:BASE])")
        body = spec[len(LONG_PREFIX):]
        positions, _, base = body.partition(":")
        try:
            n = int(positions)
        except ValueError:
            raise ValueError(f"{LONG_PREFIX}POSITIONS[:BASE]: POSITIONS must be an integer, got "
                             f"{positions!r}") from None
        if n <= 0:
            raise ValueError(f"{LONG_PREFIX}POSITIONS[:BASE]: POSITIONS must be positive, got {n}")
        if is_long_spec(base):
            raise ValueError(f"{spec!r}: the base of a long-context spec cannot be one itself")
        return cls(n, base or None)

    def name(self, base_name: str) -> str:
        """The loaded model's name: the spec with its base spelled out."""
        return f"{LONG_PREFIX}{self.positions}:{base_name}"


def is_long_spec(name: object) -> bool:
    return isinstance(name, str) and name.lower().startswith(LONG_PREFIX)


def long_context_spec(positions: int, base: str | None = None) -> str:
    """The model spec of ``base`` (``None``: the bundled SmolLM2) extended to ``positions``."""
    return f"{LONG_PREFIX}{positions}" + (f":{base}" if base else "")


def extend_rope(config: Any, positions: int) -> dict[str, Any]:
    """Scales ``config``'s RoPE by YaRN so that ``positions`` positions are valid (in place,
    before the model is built from it); returns what was done (``long_context`` of the model's
    ``extra``). Raises ``ValueError`` unless ``positions`` exceeds the native window or when the
    base's RoPE is already scaled."""
    native = int(getattr(config, "max_position_embeddings", 0) or 0)
    if native <= 0:
        raise ValueError("the base model declares no max_position_embeddings: nothing to extend")
    if positions <= native:
        raise ValueError(f"{LONG_PREFIX}{positions}: the base model already accepts {native} "
                         "positions; pass more than that, or the base model itself")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"the base model's RoPE is already scaled ({kind!r}): not extended again")
    factor = positions / native
    rope.update(rope_type=ROPE_METHOD, factor=factor, original_max_position_embeddings=native)
    rope.setdefault("rope_theta", float(getattr(config, "rope_theta", 10000.0) or 10000.0))
    config.rope_parameters = rope
    config.max_position_embeddings = positions
    return {"mode": "rope-extended", "method": ROPE_METHOD, "factor": factor,
            "native_positions": native, "positions": positions,
            "attention_factor": 0.1 * math.log(factor) + 1.0,
            "quality": f"judged only within the native {native} positions (on the base model)"}


def describe(name: str, long_context: dict[str, Any] | None, random_weights: bool) -> str:
    """The model's label in tables, JSON and plots: its name, plus what makes it timing-only."""
    notes = []
    if long_context:
        notes.append(f"RoPE extended {long_context['native_positions']} -> "
                     f"{long_context['positions']} positions ({long_context['method']} "
                     f"x{long_context['factor']:g}): timing mode, quality only within "
                     f"{long_context['native_positions']}")
    if random_weights:
        notes.append("random weights: timing only")
    return name + (f" [{'; '.join(notes)}]" if notes else "")
