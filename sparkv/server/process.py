"""Running sparkv's servers as processes: a ``sparkv serve`` subprocess on a free loopback port
(:class:`ServerProcess`), a throwaway Debian ``redis-server`` (:class:`RedisProcess`), and a
config file with fresh API keys (:func:`write_config`). The demo, the benchmarks and the tests
start real servers with these.
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

from sparkv.launch import Proc, launch
from sparkv.server.config import hash_api_key, new_api_key
from sparkv.server.errors import ServerError

HOST = "127.0.0.1"


class ServerProcessError(ServerError):
    """A server (or redis-server) process did not start or exited."""


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
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{HOST}:{self.port}"

    def start(self, timeout: float = 120.0) -> "ServerProcess":
        cmd = [sys.executable, "-m", "sparkv.cli", "serve", "--host", HOST, "--port",
               str(self.port), "--store", self.store, "--threads",
               str(self.torch_threads), *self.extra_args]
        if self.config:
            cmd += ["--config", self.config]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.torch_threads),
               "PYTHONUNBUFFERED": "1", **self.env}
        self._log = open(self.log_path, "ab")
        self.proc = launch(cmd, env=env, log=self._log)
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerProcessError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(f"{self.url}/healthz", timeout=2.0, verify=False)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ServerProcessError(f"server not ready after {timeout} s:\n{self.log()}")

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


def terminate(proc: "Proc | None", grace_s: float = 10.0) -> None:
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
        from sparkv.extras import require

        redis = require("redis", feature="the Redis store and queue")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                redis.Redis(host=HOST, port=self.port, socket_connect_timeout=1).ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None:
                    raise ServerProcessError("redis-server exited") from None
                time.sleep(0.05)
        raise ServerProcessError("redis-server did not start")

    def stop(self) -> None:
        terminate(self.proc)
