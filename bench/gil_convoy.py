"""Why a busy Python thread stalls a host-bound compute thread (docs/gpu.md, "H200 run 3"): a
thread issuing tiny torch ops, each of which gives up the GIL (as a GPU's kernel launches do),
alone and beside a thread running pure Python (as the planner, the frame receiver and the
controller do), at several GIL switch intervals. Beside it, each op waits for the busy thread
to hand the GIL back, up to the switch interval (5 ms by default).

    python bench/gil_convoy.py [--seconds 1] [--out bench/results/gil_convoy_cpu.json]

CPU only: the ops stand in for launches (a few microseconds each, like a launch's host cost).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import threading
import time
from typing import Any

import torch


def _ops_per_s(seconds: float) -> float:
    x = torch.zeros(16)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x.add_(1.0)
        n += 1
    return n / (time.perf_counter() - t0)


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        total = 0
        for i in range(10_000):
            total += i


def _point(interval_s: float, seconds: float) -> dict[str, Any]:
    sys.setswitchinterval(interval_s)
    alone = _ops_per_s(seconds / 2)
    stop = threading.Event()
    busy = threading.Thread(target=_busy, args=(stop,), daemon=True)
    busy.start()
    try:
        beside = _ops_per_s(seconds)
    finally:
        stop.set()
        busy.join()
    return {"switch_interval_ms": interval_s * 1e3, "ops_per_s_alone": alone,
            "ops_per_s_beside_busy_python": beside, "ratio": beside / alone,
            "us_per_op_beside": 1e6 / beside}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    try:
        points = [_point(s, args.seconds) for s in (0.005, 0.001, 0.0005, 0.0001)]
    finally:
        sys.setswitchinterval(default)
    print("switch ms   ops/s alone   ops/s beside busy Python   ratio   us/op beside")
    for r in points:
        print(f"{r['switch_interval_ms']:9.1f}  {r['ops_per_s_alone']:12,.0f}  "
              f"{r['ops_per_s_beside_busy_python']:25,.0f}  {r['ratio']:6.3f}  "
              f"{r['us_per_op_beside']:12.1f}")
    if args.out:
        doc = {"benchmark": "gil_convoy", "torch": torch.__version__,
               "python": sys.version.split()[0], "points": points}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
