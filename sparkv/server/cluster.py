"""Driving ``deploy/cluster.sh`` from Python (the cluster tests and ``sparkv bench cluster``):
:class:`LocalCluster` starts N API replicas, M workers, redis-server and nginx on loopback, reads
their pids and ports, and kills or stops them. See docs/cluster.md."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from sparkv.server.errors import ServerError

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "cluster.sh"


class ClusterError(ServerError):
    """The cluster did not start (or cluster.sh is missing)."""


def nginx_path() -> str | None:
    """nginx's executable (Debian puts it in /usr/sbin, often not on a user's PATH)."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def cluster_available() -> str | None:
    """``None`` when a local cluster can run here, else why not."""
    if not SCRIPT.is_file():
        return f"{SCRIPT} is missing (a source checkout is needed)"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    if nginx_path() is None:
        return "nginx is not installed (apt-get install nginx-light)"
    return None


class LocalCluster:
    """``deploy/cluster.sh`` in ``directory`` (see that script for what it starts).

    Args:
        config: the server config file (tenants, models, job settings).
        api_replicas / workers: how many of each.
        torch_threads: PyTorch threads per process.
        nginx_workers: nginx worker processes (``auto``: one per core).
        redis_aof: persist Redis (append-only file in the directory), so a cluster started
            again in the same directory keeps its contexts.
    """

    def __init__(self, directory: str | os.PathLike[str], config: str | os.PathLike[str], *,
                 api_replicas: int = 2, workers: int = 1, torch_threads: int = 1,
                 nginx_workers: str = "auto", redis_aof: bool = False) -> None:
        if api_replicas < 1 or workers < 0:
            raise ValueError("a cluster needs at least 1 API replica and 0 or more workers")
        self.dir = Path(directory)
        self.config = Path(config)
        self.api_replicas = api_replicas
        self.workers = workers
        self.torch_threads = torch_threads
        self.nginx_workers = nginx_workers
        self.redis_aof = redis_aof
        self.env: dict[str, str] = {}

    def _run(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SPARKV_CLUSTER_DIR": str(self.dir),
               "SPARKV_API_REPLICAS": str(self.api_replicas),
               "SPARKV_WORKERS": str(self.workers), "SPARKV_CLUSTER_PORT": "0",
               "SPARKV_CONFIG": str(self.config), "SPARKV_TORCH_THREADS": str(self.torch_threads),
               "SPARKV_NGINX_WORKERS": self.nginx_workers,
               "SPARKV_REDIS_AOF": "yes" if self.redis_aof else "no",
               "PATH": os.environ.get("PATH", "") + ":/usr/sbin:/sbin"}
        return subprocess.run(["bash", str(SCRIPT), command], env=env, capture_output=True,
                              text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def start(self, timeout: float = 300.0) -> "LocalCluster":
        why = cluster_available()
        if why:
            raise ClusterError(why)
        r = self._run("start", timeout)
        if r.returncode != 0:
            raise ClusterError(f"cluster.sh start failed ({r.returncode}):\n{r.stdout}\n"
                               f"{r.stderr}\n{self.logs()}")
        self.env = {}
        for line in (self.dir / "cluster.env").read_text().splitlines():
            k, _, v = line.partition("=")
            self.env[k] = v.strip('"')
        return self

    def stop(self) -> None:
        self._run("stop", 120)

    def status(self) -> str:
        return self._run("status", 30).stdout

    @property
    def url(self) -> str:
        return self.env["SPARKV_URL"]

    @property
    def redis_url(self) -> str:
        return self.env["SPARKV_REDIS_URL"]

    @property
    def api_ports(self) -> list[int]:
        return [int(p) for p in self.env.get("SPARKV_API_PORTS", "").split()]

    def pid(self, name: str) -> int | None:
        """The pid of ``api-I``, ``worker-I`` or ``redis`` (``None``: no pid file)."""
        f = self.dir / "run" / f"{name}.pid"
        try:
            return int(f.read_text().strip())
        except (OSError, ValueError):
            return None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Sends ``sig`` (default SIGKILL: a crash) to one process; returns its pid."""
        pid = self.pid(name)
        if pid is None:
            raise ClusterError(f"no process {name}")
        os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            if _reap(pid):
                break
            time.sleep(0.02)
        return pid

    def logs(self, tail: int = 30) -> str:
        out = []
        for f in sorted((self.dir / "logs").glob("*.log")):
            try:
                lines = f.read_text(errors="replace").splitlines()[-tail:]
            except OSError:
                continue
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _reap(pid: int) -> bool:
    """Reaps ``pid`` if it is our zombie child (it is not: cluster.sh started it)."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False
