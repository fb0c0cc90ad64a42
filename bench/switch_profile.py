"""Where a context switch's time goes (issue 43): ``sparkv bench contexts``' workload (the same
contexts, budget and trace), one system, with cProfile enabled only while the service switches
a context in (``keeper.switch_in``: reclaim + load), and each switch's own breakdown (reclaim,
the loader's fill, pure flash reads, the readers' busy window, waits, recomputation, the
process's minor page faults: memory touched for the first time, every thread's).

    PYTHONPATH=. .venv/bin/python bench/switch_profile.py --contexts 8 --fraction 0.25 \
        --calls 12 --pattern random --system llms [--top 30] [--out F.json]

Wall clock on whatever machine runs it (the load average is recorded).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from sparkv.bench.contexts import (DIALOGUE, Prototypes, budget_for, make_contexts, make_service,
                                   make_trace, parse_token_range)
from sparkv.runtime.model import load_model


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    lm = load_model()
    contexts = make_contexts(lm, args.contexts, parse_token_range(args.context_tokens), args.seed)
    budget = budget_for(lm, contexts, args.calls / args.contexts, 8, args.fraction)
    trace = make_trace(contexts, args.calls, args.pattern, args.seed + 1)
    work = Path(tempfile.mkdtemp(prefix="switch-profile-"))
    out: dict[str, Any] = {"settings": vars(args), "budget_bytes": budget["budget_bytes"],
                           "load_average_start": os.getloadavg(), "systems": {}}
    try:
        protos = Prototypes(lm, work)
        for system in args.system.split(","):
            out["systems"][system] = one_system(lm, system, contexts, trace, budget, protos,
                                                work, args.top)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_average_end"] = os.getloadavg()
    return out


def one_system(lm: Any, system: str, contexts: list[dict[str, Any]], trace: Any,
               budget: dict[str, int], protos: Prototypes, work: Path, top: int) -> dict[str, Any]:
    swap = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=work))
    svc = make_service(lm, system, budget["budget_bytes"], swap, None)
    prof = cProfile.Profile()
    rows: list[dict[str, Any]] = []
    inner = svc.keeper.switch_in

    def switch_in(ctx: Any, spare: int, remote: Any = None) -> Any:
        t0 = time.perf_counter()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        prof.enable()
        try:
            sw = inner(ctx, spare, remote)
        finally:
            prof.disable()
        s = sw.stats
        rows.append({"switch_ms": (time.perf_counter() - t0) * 1e3,
                     "reclaim_ms": sw.reclaim_s * 1e3,
                     "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0,
                     **({k: (v * 1e3 if k.endswith("_s") else v)
                         for k, v in s.to_dict().items() if k != "notes"} if s else {})})
        return sw

    svc.keeper.switch_in = switch_in
    ids = []
    for c in contexts:
        tokens, layers, density = protos.get(c)
        ids.append(svc.import_context(tokens, layers, density=density))
    rows.clear()
    prof = cProfile.Profile()
    turn = [0] * len(contexts)
    for _, i in trace:
        svc.call(ids[i], DIALOGUE[turn[i] % len(DIALOGUE)], max_new_tokens=8)
        turn[i] += 1
    peak = svc.stats()["peak_bytes"]
    del svc
    shutil.rmtree(swap, ignore_errors=True)
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    mean = {k: statistics.fmean(r.get(k, 0) for r in rows) for k in keys}
    return {"mean": mean, "switches": rows, "peak_bytes": peak, "profile": text.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, default=8)
    p.add_argument("--fraction", type=float, default=0.25)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--pattern", default="random")
    p.add_argument("--system", default="llms")
    p.add_argument("--context-tokens", default="1024-4096")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    res = run(args)
    for system, r in res["systems"].items():
        print(f"== {system}: mean per switch (ms / counts)")
        print(json.dumps({k: round(v, 2) for k, v in r["mean"].items()}, indent=None))
        print(r["profile"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
