"""A compute call's fixed cost on this machine (sparkv.scheduler.instance.SMOLLM2_135M_CPU_SPANS):
every attention layer of a 2K context (four 512-token chunks) computed as one span, as four
single steps, and as two spans of each split, on fresh steppers, alternating per round; the
mean over layers 2..28 of each layer's median.

    python bench/call_cost.py [--rounds 3] [--out bench/results/call_cost_s71.json]

The bundled SmolLM2 in ``--dtype auto``, torch's threads as set (2 on the 2-core CPU); wall
clock of the stepper's calls on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from sparkv.layout import StepId

SPLITS = ((0, 4), (0, 1, 4), (0, 2, 4), (0, 3, 4))


def _layer_ms(stepper: Any, cuts: tuple[int, ...], layer: int) -> float:
    total = 0.0
    for a, b in zip(cuts, cuts[1:]):
        t = time.perf_counter()
        if b - a == 1:
            stepper.run_step(StepId(a, layer))
        else:
            stepper.run_span(a, b, layer)
        total += time.perf_counter() - t
    return total * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime import LayerStepper, sample_context_ids

    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    ids = sample_context_ids(lm, 2048)
    cases = {"one span": (0, 4), "four single steps": (0, 1, 2, 3, 4),
             **{f"two spans {c}": c for c in SPLITS[1:]}}
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for name, cuts in cases.items():
            st = LayerStepper(lm, ids, 512)
            L = st.geometry.num_layers
            for layer in range(L - 1):
                times.setdefault((name, layer), []).append(_layer_ms(st, cuts, layer))
    rows = {name: statistics.mean(statistics.median(times[(name, l)]) for l in range(2, L - 1))
            for name in cases}
    span, single = rows["one span"], rows["four single steps"]
    out = {"benchmark": "call_cost", "rounds": args.rounds, "ms_per_layer": rows,
           "call_s_from_singles": (single - span) / 3 / 1e3,
           "call_s_from_two_spans": statistics.mean(rows[k] for k in rows if k.startswith("two"))
           / 1e3 - span / 1e3}
    for k, v in rows.items():
        print(f"{k:24s} {v:7.2f} ms per layer")
    print(f"a call's fixed cost: {out['call_s_from_singles'] * 1e3:.2f} ms (singles), "
          f"{out['call_s_from_two_spans'] * 1e3:.2f} ms (two spans)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
