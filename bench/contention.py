"""What a background thread's CPU costs the layer steps on this machine: every attention layer
of a 2K context (four 512-token spans) on the main thread, torch's threads as set, while a
second thread wakes up every ``period`` and works ``work`` (GIL-free work: SHA-256 of 64 KiB
blocks, as the link's socket reads and the decoder's numba kernels release the GIL), at the
normal priority or under ``SCHED_IDLE``. The median of five runs each (docs/edge.md, "Decoding
in turn").

    python bench/contention.py [--out bench/results/contention_s71.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import threading
import time
from typing import Any

#: (period s, work s) of the background thread; None: no background thread
LOADS: tuple[tuple[float | None, float | None], ...] = (
    (None, None), (0.005, 0.0002), (0.001, 0.0001), (0.0005, 0.00005), (0.005, 0.002))
_BUF = os.urandom(1 << 16)


def _background(stop: threading.Event, period: float, work: float, idle: bool) -> None:
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    while not stop.is_set():
        time.sleep(period)
        t = time.perf_counter()
        while time.perf_counter() - t < work:
            hashlib.sha256(_BUF).digest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime import LayerStepper, sample_context_ids

    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    ids = sample_context_ids(lm, 2048)

    def layers() -> float:
        st = LayerStepper(lm, ids, 512)
        t = time.perf_counter()
        for layer in range(st.geometry.num_layers - 1):
            st.run_span(0, 4, layer)
        return time.perf_counter() - t

    layers(), layers()
    rows: list[dict[str, Any]] = []
    for idle in (False, True):
        for period, work in LOADS:
            if period is None and idle:
                continue
            stop = threading.Event()
            th = None
            share = 0.0
            if period is not None and work is not None:
                th = threading.Thread(target=_background, args=(stop, period, work, idle),
                                      daemon=True)
                th.start()
                share = work / (period + work)
            ms = statistics.median(layers() for _ in range(5)) * 1e3
            stop.set()
            if th is not None:
                th.join()
            rows.append({"period_s": period, "work_s": work, "sched_idle": idle,
                         "background_core_share": share, "layers_ms": ms})
            print(f"{'SCHED_IDLE' if idle else 'normal':10s} background {share:5.1%} of a core: "
                  f"{ms:6.0f} ms", flush=True)
    base = rows[0]["layers_ms"]
    for r in rows:
        r["slowdown"] = r["layers_ms"] / base
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "contention", "threads": int(os.environ.get("OMP_NUM_THREADS",
                                                                                 "0") or 0),
                       "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
