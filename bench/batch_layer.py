"""What batching the same layer of two contexts gains (issue 45: the compute worker batches "the
same layer of two contexts"): SmolLM2, chunk ``t`` of two contexts through all layers, layer by
layer, (a) one step after the other (``LayerStepper.run_step``, the service's behaviour with
``--ask-batch off``), (b) both steps as one call (``run_steps_together``: one set of GEMMs over
the concatenated rows, the attention per context), and, for comparison, (c) one context's chunks
``t`` and ``t+1`` as one span (``run_span``: the same rows, one attention).

Time per layer (ms, median of ``--reps``, the three variants interleaved): the process's CPU
time with one torch thread by default (a loaded shared machine stretches wall time, not CPU
time); ``--clock wall`` for wall time.

    python bench/batch_layer.py --chunks 32,64,128,256 --threads 1 --out bench/results/batch_layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from sparkv.layout import StepId
from sparkv.runtime import LayerStepper, load_model, sample_context_ids
from sparkv.runtime.stepper import run_steps_together


def _prepared(lm, ids: list[int], T: int, t: int) -> LayerStepper:
    """A stepper whose chunks before ``t`` are computed."""
    st = LayerStepper(lm, ids, T)
    for tt in range(t):
        st.run_column(tt, 0, lm.config.num_hidden_layers)
    return st


def _reset(st: LayerStepper, t: int) -> None:
    """Forgets that chunk ``t``'s steps ran (its K/V stay: a computed chunk is not rewritten)."""
    st._done = {s for s in st._done if s.t != t}
    st._hidden = {k: v for k, v in st._hidden.items() if k.t != t}


def measure(lm, T: int, t: int, reps: int, clock) -> dict[str, float]:
    L = lm.config.num_hidden_layers
    ids = sample_context_ids(lm, T * (t + 2))
    a, b, c = _prepared(lm, ids, T, t), _prepared(lm, ids[::-1], T, t), _prepared(lm, ids, T, t)
    variants = {
        "one_by_one": lambda: [st.run_step(StepId(t, l)) for l in range(L) for st in (a, b)],
        "together": lambda: [run_steps_together([(a, StepId(t, l)), (b, StepId(t, l))])
                             for l in range(L)],
        "span_of_2": lambda: [c.run_span(t, t + 2, l) for l in range(L)],
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(reps):
        for name, run in variants.items():
            for st in (a, b, c):
                _reset(st, t)
                _reset(st, t + 1)
            t0 = clock()
            run()
            times[name].append(clock() - t0)
    ms = {k: statistics.median(v) * 1e3 / L for k, v in times.items()}
    return {"chunk_tokens": T, "t": t, **{f"{k}_ms_per_layer": v for k, v in ms.items()},
            "together_speedup": ms["one_by_one"] / ms["together"],
            "span_speedup": ms["one_by_one"] / ms["span_of_2"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="32,64,128,256", help="chunk sizes T, comma-separated")
    p.add_argument("--ts", default="0,3", help="chunk indices t, comma-separated")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    lm = load_model(progress=False)
    rows = []
    load_before = os.getloadavg()
    for T in (int(x) for x in args.chunks.split(",")):
        for t in (int(x) for x in args.ts.split(",")):
            r = measure(lm, T, t, args.reps, clock)
            rows.append(r)
            print(f"T={T:4d} t={t}: 2 steps one by one {r['one_by_one_ms_per_layer']:.2f} ms/layer, "
                  f"together {r['together_ms_per_layer']:.2f} ({r['together_speedup']:.2f}x), "
                  f"run_span of 2 chunks {r['span_of_2_ms_per_layer']:.2f} "
                  f"({r['span_speedup']:.2f}x)", flush=True)
    if args.out:
        config = {**vars(args), "model": lm.name,
                  "loadavg_before_after": [list(load_before), list(os.getloadavg())]}
        Path(args.out).write_text(json.dumps({"results": rows, "config": config}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
