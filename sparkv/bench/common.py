"""Helpers every benchmark uses: the result JSON envelope, a plain-text table, the machine facts.

Where results go: a benchmark writes nothing under ``bench/results/`` unless asked (``--json``:
``bench/results/NAME.json``; ``--out PATH``: there instead). A ``--quick`` run writes
``NAME_quick.json`` (and its PNGs beside it), and refuses to overwrite a file that holds a full
run's result, whatever path it is given (:func:`result_path`). Scratch files (flash tiers,
stores) go to the system's temp dir.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Sequence

from sparkv.errors import SparkvError
from sparkv.tables import format_table

__all__ = ["RESULTS_DIR_ENV", "OUT_HELP", "QUICK_SUFFIX", "results_dir", "result_path",
           "machine_info", "write_result", "format_table", "add_output_args", "add_run_args",
           "percentile", "wait_job", "NetnsServer"]

RESULTS_DIR_ENV = "SPARKV_BENCH_DIR"

#: ``--out``'s help
OUT_HELP = "write the JSON here instead: nothing under bench/results is touched"
#: what a ``--quick`` run's default file name adds to the benchmark's name
QUICK_SUFFIX = "_quick"
#: ``--model``'s help
MODEL_HELP = "local checkpoint (default: bundled SmolLM2)"


def add_output_args(p: Any, name: str, *, json_help: str | None = None,
                    out_help: str = OUT_HELP, quick: bool = False) -> None:
    """``--json`` (write ``bench/results/<name>.json``) and ``--out PATH`` (write it there
    instead), for a benchmark that writes its JSON when either is given:
    ``write_result(name, ..., path=args.out)`` under ``if args.json or args.out``. ``quick``:
    the benchmark has ``--quick`` (the help names the ``_quick`` file)."""
    also = f" ({name}{QUICK_SUFFIX}.json with --quick)" if quick else ""
    p.add_argument("--json", action="store_true",
                   help=json_help or f"write bench/results/{name}.json{also}")
    p.add_argument("--out", default=None, metavar="PATH", help=out_help)


def add_run_args(p: Any, name: str, *, threads: int | None = None,
                 threads_help: str = "torch threads (default: torch's)",
                 model_help: str = MODEL_HELP, json_help: str | None = None,
                 out_help: str = OUT_HELP, quick: bool = False) -> None:
    """``--threads N`` (default ``threads``), ``--model PATH`` (default: the bundled model), then
    :func:`add_output_args`: the flags of a benchmark that runs the model."""
    p.add_argument("--threads", type=int, default=threads, help=threads_help)
    p.add_argument("--model", default=None, help=model_help)
    add_output_args(p, name, json_help=json_help, out_help=out_help, quick=quick)


def results_dir() -> Path:
    """``$SPARKV_BENCH_DIR`` or ``bench/results`` under the current directory."""
    path = Path(os.environ.get(RESULTS_DIR_ENV, "bench/results"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.is_available()
        info["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except ImportError:  # pragma: no cover
        pass
    from sparkv.runtime.device import cpu_bf16_flags

    info["cpu_bf16"] = cpu_bf16_flags()   # bf16 in hardware: what `--dtype auto` reads
    return info


def result_path(name: str, path: str | os.PathLike[str] | None = None, *,
                quick: bool = False) -> Path:
    """Where :func:`write_result` writes: ``path``, else ``<results dir>/<name>.json``
    (``<name>_quick.json`` for a ``quick`` run). Raises :class:`SparkvError` when a ``quick``
    run would overwrite a file that does not hold a quick run's result (a full run's, or not a
    result at all): call it before a long run to fail at once."""
    out = Path(path) if path else results_dir() / f"{name}{QUICK_SUFFIX if quick else ''}.json"
    if quick and out.exists() and not _holds_quick_run(out):
        raise SparkvError(f"{out} holds a full run's result: a --quick run does not overwrite "
                          "it (give another --out)")
    return out


def _holds_quick_run(path: Path) -> bool:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("quick") is True


def write_result(name: str, payload: dict[str, Any], config: dict[str, Any] | None = None,
                 path: str | os.PathLike[str] | None = None, *, quick: bool = False) -> Path:
    """Writes ``{"benchmark", "created_unix", "quick", "machine", "config", "results"...}`` as
    JSON, atomically, at :func:`result_path` ``(name, path, quick=quick)`` (which refuses to let
    a quick run overwrite a full one)."""
    out = result_path(name, path, quick=quick)
    doc = {
        "benchmark": name,
        "created_unix": time.time(),
        "quick": bool(quick),
        "machine": machine_info(),
        "config": config or {},
        **payload,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(_str_keys(doc), indent=2, default=_jsonable) + "\n")
    os.replace(tmp, out)
    return out


def _str_keys(obj: Any) -> Any:
    """``obj`` with every mapping key JSON can hold: a tuple key ``("backend", 8192)`` becomes
    ``"backend@8192"`` (the CLI's spelling of ``--group-trials``), others ``str(key)``."""
    if isinstance(obj, dict):
        return {(k if isinstance(k, (str, int, float, bool)) or k is None else
                 "@".join(map(str, k)) if isinstance(k, tuple) else str(k)): _str_keys(v)
                for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_str_keys(v) for v in obj]
    return obj


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "_asdict"):
        return obj._asdict()
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return str(obj)


def percentile(xs: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs``: the nearest-rank sample, 0.0 when empty."""
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))]


def wait_job(client: Any, job_id: str, timeout: float = 900.0, what: str = "job"
             ) -> dict[str, Any]:
    """Polls ``GET /v1/jobs/{job_id}`` (``client``: an ``httpx.Client`` on the server) every
    0.1 s until the job is neither queued nor running; returns its record. Raises
    ``TimeoutError`` (``"<what> <id> did not finish ..."``) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise TimeoutError(f"{what} {job_id} did not finish in {timeout} s")


def run_event_loop(main: Any) -> Any:
    """Runs the coroutine ``main`` to completion on uvloop when it is installed (the load
    generators' loop), else on asyncio's default loop."""
    import asyncio

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    return asyncio.run(main)


class NetnsServer:
    """``sparkv serve`` inside a :class:`~sparkv.edge.netns.ShapedLink`'s namespace (docs/netns.md),
    its link at ``setup_mbps`` until the caller shapes it; ``model``: the model the server encodes
    with (``None``: its default); ``extra_args``: more of ``sparkv serve``'s options (the edge's
    ``--device`` and ``--dtype``). :class:`SparkvError` when it does not answer /healthz in 2
    min."""

    def __init__(self, tmp: str, model: str | None = None, *, port: int = 18080,
                 setup_mbps: float = 1000.0, extra_args: Sequence[str] = ()) -> None:
        import subprocess
        import sys

        import httpx

        from sparkv.edge.netns import ShapedLink
        from sparkv.server.process import write_config

        self.link = ShapedLink()
        cfg = f"{tmp}/server.yaml"
        models = {"models": {"bench": str(model)}, "default_model": "bench"} if model else {}
        write_config(cfg, None, allow_anonymous=True, **models)
        self.log = open(f"{tmp}/server.log", "ab")
        self.proc = self.link.popen(
            [sys.executable, "-m", "sparkv.cli", "serve", "--host", self.link.ns_ip, "--port",
             str(port), "--store", f"file://{tmp}/store", "--threads", "1", "--config", cfg,
             *extra_args],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://{self.link.ns_ip}:{port}"
        self.link.set_rate(setup_mbps)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SparkvError(f"the server in the namespace did not start (see {tmp})")
            time.sleep(0.3)

    def close(self) -> None:
        from sparkv.server.process import terminate

        try:
            terminate(self.proc)
        finally:
            self.log.close()
            self.link.close()


class PeakRss:
    """This process's peak resident memory over a block, in bytes (Linux: the kernel's
    high-water mark, ``VmHWM``, reset on entry through ``/proc/self/clear_refs``; ``None``
    elsewhere). On entry the collector runs and the C heap's free pages go back to the system
    (:func:`~sparkv.runtime.heap.trim_heap`), so what an earlier run freed is not counted::

        with PeakRss() as peak:
            run()
        row["rss_peak_bytes"] = peak.bytes
    """

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._reset = False

    def __enter__(self) -> "PeakRss":
        import gc

        from sparkv.runtime.heap import trim_heap

        gc.collect()
        trim_heap()
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self._reset = True
        except OSError:
            self._reset = False
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._reset:
            return
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.bytes = int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            self.bytes = None
