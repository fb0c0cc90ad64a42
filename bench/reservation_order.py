"""A big call among small ones on the context service: first come, first served against the old
retry order (docs/device-service.md, "Calls at once").

The bundled SmolLM2 (float32) on one :class:`~sparkv.device.ContextService` with a tight KV
budget: ``--small-apps`` threads each call their own 4-token context without a pause (a turn
of ``--small-tokens`` answer tokens each), while one big app calls its 60-token context
``--big-calls`` times, ``--gap-s`` apart. The big call's switch-in does not fit beside the
small calls' turns; each small one's does. With ``retry`` (the order before the line), a small
call arriving while the big one waits takes the memory first; with ``fcfs`` it waits behind it.
Reported per order: the big call's latency (median, max) and the small calls completed per
second. Both orders run in each of ``--rounds`` paired rounds, alternating which goes first.

    python bench/reservation_order.py [--budget-mb 9] [--rounds 2] [--max-s 60]
        [--out bench/results/reservation_order_cpu.json]

No paper figure: LLMS (llms.md) runs its calls one after another; this is the many-apps
service's fairness, the order of vLLM's FCFS scheduler.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

from tqdm import tqdm

TURN = "What is the capital of France?"


def _session(lm: Any, doc: list[int], order: str, args: argparse.Namespace) -> dict[str, Any]:
    from sparkv.device import ContextService
    from sparkv.device.flashio import IOProfile

    fast = IOProfile(read_Bps=1e13, per_file_s=0.0, threads=4, source="bench")
    with tempfile.TemporaryDirectory() as tmp:
        svc = ContextService(lm, int(args.budget_mb * (1 << 20)), pathlib.Path(tmp),
                             io_profile=fast, compression="fp", reservation_order=order)
        big = svc.new_context(system_ids=doc[60:120])
        smalls = [svc.new_context(system_ids=doc[i:i + 4]) for i in range(args.small_apps)]
        stop = threading.Event()
        done = [0] * args.small_apps

        t0 = time.perf_counter()

        def small_app(i: int) -> None:   # until the big app is done, or --max-s has passed
            while not stop.is_set() and time.perf_counter() - t0 < args.max_s:
                svc.call(smalls[i], TURN, max_new_tokens=args.small_tokens, grow=False)
                done[i] += 1

        apps = [threading.Thread(target=small_app, args=(i,)) for i in range(args.small_apps)]
        for th in apps:
            th.start()
        latencies = []
        try:
            for _ in range(args.big_calls):
                time.sleep(args.gap_s)
                t = time.perf_counter()
                svc.call(big, TURN, max_new_tokens=4, grow=False)
                latencies.append(time.perf_counter() - t)
        finally:
            stop.set()
            for th in apps:
                th.join()
        wall = time.perf_counter() - t0
        waits = svc.stats()["turn_waits"]
    return {"order": order, "big_latency_s": latencies, "capped": wall >= args.max_s,
            "small_calls": sum(done),
            "small_calls_per_s": sum(done) / wall, "turn_waits": waits}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-mb", type=float, default=9.0)
    p.add_argument("--small-apps", type=int, default=2)
    p.add_argument("--small-tokens", type=int, default=8)
    p.add_argument("--big-calls", type=int, default=3)
    p.add_argument("--max-s", type=float, default=60.0,
                   help="the small apps stop after this long (a starved big call then goes on: "
                        "its latency is a lower bound, the session marked capped)")
    p.add_argument("--gap-s", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args()
    from sparkv.runtime import load_model
    from sparkv.runtime.generate import sample_context_ids

    lm = load_model(dtype="float32")
    doc = sample_context_ids(lm, 120)
    runs: dict[str, list[dict[str, Any]]] = {"fcfs": [], "retry": []}
    for r in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for order in (("fcfs", "retry") if r % 2 == 0 else ("retry", "fcfs")):
            runs[order].append(_session(lm, doc, order, args))
    rows = []
    for order, sessions in runs.items():
        lat = [x for s in sessions for x in s["big_latency_s"]]
        rows.append({"order": order, "big_median_s": statistics.median(lat),
                     "big_max_s": max(lat),
                     "small_calls_per_s": statistics.median(s["small_calls_per_s"]
                                                            for s in sessions),
                     "turn_waits": sum(s["turn_waits"] for s in sessions),
                     "sessions_capped": sum(s["capped"] for s in sessions)})
    print(f"a big call among {args.small_apps} apps of small calls, {args.budget_mb} MB budget, "
          f"{args.rounds} paired rounds of {args.big_calls} big calls:")
    for row in rows:
        print(f"  {row['order']:>5}: big call {row['big_median_s']:.2f} s median, "
              f"{row['big_max_s']:.2f} s max; small calls {row['small_calls_per_s']:.2f}/s; "
              f"{row['turn_waits']} waits for a turn"
              + (f"; {row['sessions_capped']} session(s) hit --max-s (a lower bound)"
                 if row["sessions_capped"] else ""))
    result = {"config": vars(args), "rows": rows, "runs": runs}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
