"""Harness for running real servers in tests and benchmarks: a ``sparkv serve`` subprocess on a
free loopback port, a throwaway ``redis-server``, a config file with fresh keys, and a tiny random
Llama checkpoint for tests where the model's quality does not matter.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sparkv.server.config import hash_api_key, new_api_key

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def write_config(path: str | os.PathLike[str], tenants: list[str] | None = None,
                 **settings: Any) -> dict[str, str]:
    """Writes a server config with one fresh key per tenant; returns ``{tenant: key}``."""
    keys = {t: new_api_key() for t in (tenants or [])}
    doc = {"tenants": {t: {"keys": [hash_api_key(k)]} for t, k in keys.items()}, **settings}
    Path(path).write_text(yaml.safe_dump(doc, sort_keys=False))
    return keys


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


class ServerProcess:
    """``python -m sparkv.cli serve`` on a free loopback port, logging to ``log_path``."""

    def __init__(self, config: str | os.PathLike[str] | None, store: str, *,
                 log_path: str | os.PathLike[str], port: int | None = None,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 torch_threads: int = 1, scheme: str = "http") -> None:
        self.config = str(config) if config else None
        self.store = store
        self.port = port or free_port()
        self.log_path = Path(log_path)
        self.extra_args = extra_args or []
        self.env = env or {}
        self.torch_threads = torch_threads
        self.scheme = scheme
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        cmd = [sys.executable, "-m", "sparkv.cli", "serve", "--host", HOST, "--port",
               str(self.port), "--store", self.store, "--torch-threads",
               str(self.torch_threads), *self.extra_args]
        if self.config:
            cmd += ["--config", self.config]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.torch_threads),
               "PYTHONUNBUFFERED": "1", **self.env}
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/healthz", timeout=2.0, verify=False)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers run (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        terminate(self.proc)
        self._close_log()

    def _close_log(self) -> None:
        log = getattr(self, "_log", None)
        if log is not None and not log.closed:
            log.close()

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def terminate(proc: "subprocess.Popen[bytes] | None", grace_s: float = 10.0) -> None:
    """SIGTERM a running process, then SIGKILL it if it has not exited after ``grace_s``."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)


def redis_server_available() -> bool:
    return shutil.which("redis-server") is not None


class RedisProcess:
    """Debian's ``redis-server`` on a free loopback port, in-memory (no persistence)."""

    def __init__(self, workdir: str | os.PathLike[str]) -> None:
        self.port = free_port()
        self.workdir = Path(workdir)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def start(self, timeout: float = 20.0) -> "RedisProcess":
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", HOST, "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "yes", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                redis.Redis(host=HOST, port=self.port, socket_connect_timeout=1).ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None:
                    raise RuntimeError("redis-server exited") from None
                time.sleep(0.05)
        raise TimeoutError("redis-server did not start")

    def stop(self) -> None:
        terminate(self.proc)


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

def parse_frame_stream(body: bytes) -> list[bytes]:
    """Splits a stream response (``u32 LE length | frame`` records) into frames."""
    import struct

    out, pos = [], 0
    while pos < len(body):
        if pos + 4 > len(body):
            raise ValueError("truncated length prefix")
        (n,) = struct.unpack_from("<I", body, pos)
        pos += 4
        if pos + n > len(body):
            raise ValueError("truncated frame")
        out.append(body[pos:pos + n])
        pos += n
    return out
