"""Random-weight models of real shapes, for timing only: ``--model random:SHAPE[:SEED]``.

Only SmolLM2 ships here, so timing a bigger model (a GPU edge runs Llama-3.2-3B-class models) uses
the real architecture with random weights. Results made with one are labelled with the model name
``random:SHAPE`` (its answers are noise; its speed is the real shape's).

* The weights are initialised on the target device from a seeded generator, so two processes on
  the same machine (a server and an edge) build the same model and the same KV.
* The tokenizer: ``$SPARKV_TOKENIZER`` (a directory with a Hugging Face tokenizer), else the bundled
  SmolLM2's when the shape shares its vocabulary and it is already converted, else none (token ids
  only; :func:`~sparkv.runtime.generate.sample_context_ids` then draws seeded ids).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

RANDOM_PREFIX = "random:"

# the real models' published shapes (config.json of each), without weights
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                         vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, intermediate_size=8192,
                         vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=False, rms_norm_eps=1e-5),
}


def is_random_spec(name: object) -> bool:
    return isinstance(name, str) and name.lower().startswith(RANDOM_PREFIX)


def parse_random_spec(spec: str) -> tuple[str, int]:
    """``random:SHAPE[:SEED]`` -> ``(shape, seed)``; raises ``ValueError`` naming the shapes."""
    body = spec[len(RANDOM_PREFIX):]
    shape, _, seed = body.partition(":")
    shape = shape.lower()
    if shape not in SHAPES:
        raise ValueError(f"unknown random model shape {shape!r}; choose one of "
                         f"{', '.join(SHAPES)} (random:SHAPE[:SEED])")
    try:
        return shape, int(seed or 0)
    except ValueError:
        raise ValueError(f"random model seed must be an integer, got {seed!r}") from None


def random_config(shape: str) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHAPES[shape], bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _tokenizer(shape: str, smollm2_dir: str | os.PathLike[str] | None) -> Any:
    from transformers import AutoTokenizer

    path = os.environ.get("SPARKV_TOKENIZER")
    if not path and shape == "smollm2-135m" and smollm2_dir is not None:
        found = os.path.isfile(os.path.join(smollm2_dir, "tokenizer_config.json"))
        path = str(smollm2_dir) if found else None
    if not path:
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def build_random_model(spec: str, device: torch.device, dtype: torch.dtype,
                       smollm2_dir: str | os.PathLike[str] | None = None,
                       configure: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for ``random:SHAPE[:SEED]`` on ``device`` in ``dtype`` (seeded);
    ``smollm2_dir``: the converted SmolLM2 checkpoint, whose tokenizer its shape borrows;
    ``configure``: changes the config in place before the model is built (the long-context
    mode extends its RoPE: :mod:`sparkv.runtime.longctx`)."""
    from transformers import LlamaForCausalLM

    shape, seed = parse_random_spec(spec)
    cfg = random_config(shape)
    if configure is not None:
        configure(cfg)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        model = LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return model.eval(), _tokenizer(shape, smollm2_dir)
