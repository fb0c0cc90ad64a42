"""The chunk stream's receive path: the lean HTTP/1.1 client (sparkv.edge.wire) against httpx,
paired in one process (docs/edge.md, "The receive path").

1. The link thread's CPU per received chunk (``time.thread_time`` over the link thread's life):
   strategy ``stream`` (the link alone, nothing computed beside it) at ``--cpu-mbps``, each path
   in turn.
2. sparkv's TTFT against local prefill with each path: each path and local in turn per link,
   the order reversed every other link (SmolLM2 2K, T=512, raw/q8/q5, a fresh prior each ask).

    python bench/receive_path.py --links 100mbps,200mbps,wifi,lte,50mbps,20mbps --rounds 3 \\
        --out bench/results/receive_path_s72.json
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics as st
import time
from typing import Any

from sparkv.cli import passive_openmp_waits

passive_openmp_waits()          # before torch loads, as the sparkv command does

from sparkv.edge import http_source, link  # noqa: E402
from sparkv.edge.commands import read_trace  # noqa: E402
from sparkv.edge.session import EdgeSession  # noqa: E402
from sparkv.bench.served import fresh_ask, served_context  # noqa: E402
from sparkv.predictor.dtypes import load_model_in_dtype  # noqa: E402
from sparkv.runtime.heap import settle  # noqa: E402
from sparkv.scheduler.trace import Trace  # noqa: E402

PATH = {"httpx": False}            # the path the next chunk source takes
LINK_CPU: list[float] = []         # each link thread's CPU seconds


def count_link_cpu() -> None:
    """Each link thread's CPU seconds (``time.thread_time`` over its life) into
    :data:`LINK_CPU`."""
    main = link.Link._main

    def link_main(self: link.Link) -> None:
        t0 = time.thread_time()
        try:
            return main(self)
        finally:
            LINK_CPU.append(time.thread_time() - t0)

    setattr(link.Link, "_main", link_main)


def _patch() -> None:
    init = http_source.HttpChunkSource.__init__

    def source_init(self: http_source.HttpChunkSource, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        self.proxied = PATH["httpx"]

    setattr(http_source.HttpChunkSource, "__init__", source_init)   # the path under test
    count_link_cpu()


def _trace(name: str) -> Trace:
    return Trace.constant(float(name[:-4])) if name.endswith("mbps") else read_trace(name)


def link_cpu(s: EdgeSession, cid: str, mbps: float, rounds: int) -> dict:
    per: dict[str, list[float]] = collections.defaultdict(list)
    for k in range(rounds):
        for name in (("wire", "httpx") if k % 2 == 0 else ("httpx", "wire")):
            PATH["httpx"] = name == "httpx"
            r = fresh_ask(s, cid, "stream", Trace.constant(mbps))
            per[name].append(LINK_CPU[-1] / r.breakdown.chunks_streamed * 1e3)
            print(f"link cpu {name:5s} {per[name][-1]:.3f} ms/chunk "
                  f"({r.breakdown.chunks_streamed} chunks)", flush=True)
    return {name: {"ms_per_chunk": v, "median": st.median(v)} for name, v in per.items()}


def ttft_pairs(s: EdgeSession, cid: str, links: list[str], rounds: int) -> tuple[list, dict]:
    rows, res = [], collections.defaultdict(list)
    names, k = ["wire", "httpx", "local"], 0
    for rnd in range(rounds):
        for ln in links:
            k += 1
            for name in (names if k % 2 else names[::-1]):
                PATH["httpx"] = name == "httpx"
                strategy = "local" if name == "local" else "sparkv"
                b = fresh_ask(s, cid, strategy, _trace(ln)).breakdown
                res[(ln, name)].append(b.ttft_s)
                rows.append(dict(link=ln, round=rnd, variant=name, ttft_s=b.ttft_s,
                                 loading_s=b.loading_s, chunks_streamed=b.chunks_streamed))
                print(f"{ln:9s} {name:6s} ttft {b.ttft_s:.3f} streamed {b.chunks_streamed}",
                      flush=True)
    per_link = {ln: {nm: st.median([a / b for a, b in zip(res[(ln, nm)], res[(ln, "local")])])
                     for nm in ("wire", "httpx")} for ln in links}
    all_r = {nm: [a / b for ln in links for a, b in zip(res[(ln, nm)], res[(ln, "local")])]
             for nm in ("wire", "httpx")}
    summary = {nm: {"median": st.median(v), "max": max(v), "mean": st.mean(v)}
               for nm, v in all_r.items()}
    return rows, {"per_link": per_link, "summary": summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--links", default="100mbps,200mbps,wifi,lte,50mbps,20mbps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu-mbps", type=float, default=100.0)
    ap.add_argument("--cpu-rounds", type=int, default=6)
    ap.add_argument("--out", default="bench/results/receive_path.json")
    args = ap.parse_args()
    _patch()
    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    settle()
    with served_context(lm, warm=("local", "sparkv", "stream", "hybrid")) as (s, cid):
        cpu = link_cpu(s, cid, args.cpu_mbps, args.cpu_rounds)
        rows, ttft = ttft_pairs(s, cid, args.links.split(","), args.rounds)
    out = {"link_cpu": {"mbps": args.cpu_mbps, **cpu}, "ttft": ttft, "rows": rows}
    print(json.dumps({"link_cpu_median_ms": {k: v["median"] for k, v in cpu.items()},
                      **ttft}, indent=1))
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
