"""Helpers every benchmark uses: the result JSON envelope, a plain-text table, the machine facts."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from sparkv.tables import format_table

__all__ = ["RESULTS_DIR_ENV", "results_dir", "machine_info", "write_result", "format_table"]

RESULTS_DIR_ENV = "SPARKV_BENCH_DIR"


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
    except ImportError:  # pragma: no cover
        pass
    return info


def write_result(name: str, payload: dict[str, Any], config: dict[str, Any] | None = None,
                 path: str | os.PathLike[str] | None = None) -> Path:
    """Writes ``{"benchmark", "created_unix", "machine", "config", "results"...}`` as JSON.

    The file is ``bench/results/<name>.json`` unless ``path`` is given. Written atomically.
    """
    doc = {
        "benchmark": name,
        "created_unix": time.time(),
        "machine": machine_info(),
        "config": config or {},
        **payload,
    }
    out = Path(path) if path else results_dir() / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, out)
    return out


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "_asdict"):
        return obj._asdict()
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return str(obj)


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
