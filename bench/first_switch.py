"""A restarted device service's first context switch against its later ones (docs/device-service.md,
"A restarted service's first switch").

A ``sparkv device serve`` (100 MB budget) makes ``--contexts`` contexts of the bundled text and
stops; a fresh one on the same flash dir reopens them from its journal and calls each once
(``grow`` off), one after the other: every switch loads a context from flash. Per call: its
``switch_s`` and ``first_token_s``, and the restarted service's start time.

    python bench/first_switch.py --out bench/results/first_switch_s81.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkv.cli import passive_openmp_waits

passive_openmp_waits()          # before torch loads, as the sparkv command does

from sparkv.device.client import DeviceProcess  # noqa: E402
from sparkv.runtime.generate import sample_text  # noqa: E402


def _made(home: Path, count: int) -> list[str]:
    dev = DeviceProcess(home, 100, torch_threads=2).start()
    try:
        with dev.client() as c:
            text = sample_text()
            return [c.new_context(text[i * 3000:(i + 1) * 3000]) for i in range(count)]
    finally:
        dev.stop()


def _calls(home: Path, ids: list[str]) -> tuple[float, list[dict[str, Any]]]:
    t0 = time.perf_counter()
    dev = DeviceProcess(home, 100, torch_threads=2).start()
    start_s = time.perf_counter() - t0
    print(f"restarted service up in {start_s:.2f} s", flush=True)
    rows = []
    try:
        with dev.client() as c:
            for i, cid in enumerate(ids):
                st = c.call(cid, "What is it about?", max_new_tokens=4, grow=False).stats
                rows.append({"call": i, "switch_s": st["switch_s"],
                             "first_token_s": st["first_token_s"]})
                print(f"call {i}: switch {st['switch_s']:.3f} s, first token "
                      f"{st['first_token_s']:.3f} s", flush=True)
    finally:
        dev.stop()
    return start_s, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--out", default="bench/results/first_switch.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="sparkv-first-switch-") as tmp:
        home = Path(tmp) / "dev"
        ids = _made(home, args.contexts)
        start_s, rows = _calls(home, ids)
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "service_start_s": start_s, "calls": rows}, f, indent=1)


if __name__ == "__main__":
    main()
