"""Test-only helpers: a tiny random Llama checkpoint (with SmolLM2's tokenizer), a started tiny
server, and a stop that fails on a traceback in the server's log."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from sparkv.server.process import ServerProcess, write_config


def tiny_checkpoint(path: str | os.PathLike[str], tokenizer_from: str | None = None,
                    layers: int = 2, seed: int = 0) -> Path:
    """Saves a small random Llama (GQA: 4 query heads, 2 KV heads, head_dim 16) to ``path``.

    With ``tokenizer_from`` (a checkpoint directory) its tokenizer is copied and the vocabulary
    sized to match, so the tiny model accepts text.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    vocab = 256
    tok = None
    if tokenizer_from:
        tok = AutoTokenizer.from_pretrained(tokenizer_from)
        vocab = len(tok)
    torch.manual_seed(seed)
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    if tok is not None:
        tok.save_pretrained(path)
    return path


_TINY: dict[str, Path] = {}


def shared_tiny_checkpoint() -> Path:
    """A tiny random Llama with SmolLM2's tokenizer, built once per process in a temp dir."""
    if "path" not in _TINY:
        import atexit
        import tempfile

        from sparkv.runtime.model import default_checkpoint

        tmp = Path(tempfile.mkdtemp(prefix="sparkv-tiny-"))
        atexit.register(shutil.rmtree, tmp, True)
        _TINY["path"] = tiny_checkpoint(tmp / "tiny", tokenizer_from=str(default_checkpoint()))
    return _TINY["path"]



def start_tiny_server(tmp: Path, tenants: tuple[str, ...] = ("alice", "bob"),
                      **settings: Any) -> ServerProcess:
    """A started server on a file store under ``tmp`` with the tiny model (``"tiny"``, levels raw
    and q5, T = 32, 64 KiB bodies unless ``settings`` say otherwise) and one key per tenant.

    The process gets ``keys`` (tenant -> key), ``config_path`` and ``store_dir`` attributes.
    """
    config = {"models": {"tiny": str(shared_tiny_checkpoint())}, "default_model": "tiny",
              "default_levels": ["raw", "q5"], "default_chunk_tokens": 32,
              "max_body_bytes": 65536, **settings}
    keys = write_config(tmp / "server.yaml", list(tenants), **config)
    server = ServerProcess(tmp / "server.yaml", f"file://{tmp}/store",
                           log_path=tmp / "server.log").start()
    server.keys = keys  # type: ignore[attr-defined]
    server.config_path = tmp / "server.yaml"  # type: ignore[attr-defined]
    server.store_dir = tmp / "store"  # type: ignore[attr-defined]
    return server


def stop_checked(server: ServerProcess) -> None:
    """Stops ``server`` and fails if its log holds a traceback."""
    server.stop()
    log = server.log()
    assert "Traceback" not in log, log
