"""One ask beside a CPU load that switches on and off (issue 45's target: sparkv at most 1.10x the
best of local, stream and hybrid under the same load pattern, median of paired runs).

A real ``sparkv serve`` on loopback, SmolLM2, one context; the link emulated at a constant rate.
A neighbour of one busy process per core runs ``--period-s`` on, ``--period-s`` off, for the whole
run. Each round asks once per strategy, the order rotated each round (paired: a round's asks see
the same pattern); a fresh session per ask (no frame cache, no learned speed carried over).

    python bench/onoff_load.py --tokens 1024 --mbps 20 --rounds 5 --out bench/results/onoff_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ["local", "stream", "hybrid", "sparkv"]
QUESTION = "What is this text about?"
# a neighbour: busy for `period` seconds, idle for `period`, on the same clock for every core
HOG = """
import sys, time
period = float(sys.argv[1]); t0 = float(sys.argv[2])
while True:
    if int((time.time() - t0) // period) % 2 == 0:
        end = t0 + (int((time.time() - t0) // period) + 1) * period
        while time.time() < end:
            pass
    else:
        time.sleep(0.05)
"""


def _neighbours(period_s: float) -> list[subprocess.Popen]:
    t0 = time.time()
    return [subprocess.Popen([sys.executable, "-c", HOG, str(period_s), str(t0)])
            for _ in range(os.cpu_count() or 1)]


def _ask(url: str, lm, cid: str, strategy: str, mbps: float, new_tokens: int) -> dict:
    from sparkv.edge import EdgeSession, LinkShaper

    with EdgeSession.connect(url, model=lm, shaper=LinkShaper.constant(mbps, 20.0)) as s:
        res = s.ask(cid, QUESTION, strategy=strategy, max_new_tokens=new_tokens)
    bd = res.breakdown
    return {"strategy": strategy, "ttft_s": bd.ttft_s, "streamed": bd.chunks_streamed,
            "computed": bd.chunks_computed, "mb": bd.bytes_streamed / 1e6, "tokens": res.tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024, help="context tokens")
    p.add_argument("--mbps", type=float, default=20.0, help="the link's constant rate")
    p.add_argument("--rounds", type=int, default=5, help="paired rounds")
    p.add_argument("--period-s", type=float, default=2.0, help="the neighbour's on and off time")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--out", default="bench/results/onoff_load.json")
    args = p.parse_args()

    import torch

    from sparkv.edge import EdgeSession, chat_context
    from sparkv.runtime import load_model, sample_context_ids
    from sparkv.server.process import ServerProcess

    torch.set_num_threads(os.cpu_count() or 1)
    lm = load_model()
    ctx = chat_context(lm, sample_context_ids(lm, args.tokens))
    with tempfile.TemporaryDirectory() as d:
        srv = ServerProcess(None, f"file://{d}/store", log_path=Path(d) / "server.log").start()
        hogs: list[subprocess.Popen] = []
        try:
            with EdgeSession.connect(srv.url, model=lm) as s:
                cid = s.client.create_context(token_ids=ctx, levels=["raw", "q8", "q5"],
                                              chunk_tokens=256)
            hogs = _neighbours(args.period_s)
            rows = []
            for r in range(args.rounds):
                order = STRATEGIES[r % 4:] + STRATEGIES[:r % 4]
                for strategy in order:
                    row = _ask(srv.url, lm, cid, strategy, args.mbps, args.max_new_tokens)
                    row["round"] = r
                    rows.append(row)
                    print(f"round {r} {strategy:>6}: TTFT {row['ttft_s']:.2f} s, "
                          f"{row['streamed']} streamed / {row['computed']} computed", flush=True)
        finally:
            for h in hogs:
                h.kill()
            srv.stop()
    med = {s: statistics.median(x["ttft_s"] for x in rows if x["strategy"] == s)
           for s in STRATEGIES}
    best = min(("local", "stream", "hybrid"), key=lambda s: med[s])
    ratio = med["sparkv"] / med[best]
    print("median TTFT: " + ", ".join(f"{s} {med[s]:.2f} s" for s in STRATEGIES))
    print(f"sparkv / best of the others ({best}): {ratio:.2f}x (target <= 1.10x)")
    doc = {"benchmark": "onoff_load", "config": vars(args), "rows": rows, "median_ttft_s": med,
           "best_other": best, "sparkv_over_best": ratio, "target": 1.10,
           "load_average_after": os.getloadavg()}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
