"""The cost model's online correction checked at a size it never saw (issue 44, Deliver 3).

An edge session on a server on loopback learns its compute scale from local asks about a small
context (``--train`` tokens), then asks about a larger one (``--test`` tokens) locally. For that
ask the local prefill's predicted time (the measured-steps model's ``t_comp`` of every step,
times the learned scale) is set against the load's measured compute time, and so is the
prediction without the correction (scale 1). Writes ``bench/results/online_correction.json``.

    python bench/online_correction.py --train 2048 --test 8192 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

QUESTION = "What is the main topic of this document?"


def _ask_local(session, cid: str) -> dict:
    from sparkv.edge.options import AskOptions

    before = session.priors.compute_scale
    res = session.ask(cid, QUESTION, AskOptions(strategy="local", max_new_tokens=1,
                                                use_cache=False))
    inst, load = res.instance, res.load
    predicted = float(inst.t_comp.sum())            # already times the scale it planned with
    measured = sum(e - s for s, e in load.steps.values())
    return {"tokens": int(inst.geometry.num_tokens), "scale_used": before,
            "predicted_s": predicted, "uncorrected_s": predicted / before,
            "measured_s": measured, "load_ratio": load.compute_ratio,
            "error": predicted / measured - 1.0, "uncorrected_error":
                predicted / before / measured - 1.0, "scale_after": session.priors.compute_scale}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--train", type=int, default=2048)
    p.add_argument("--test", type=int, default=8192)
    p.add_argument("--train-asks", type=int, default=3)
    p.add_argument("--test-asks", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="bench/results/online_correction.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from sparkv.bench import ttft as T

    ns = argparse.Namespace(model=None, dtype="auto", device="cpu", rtt_ms=20.0,
                            long_context="off")
    lm = T._sweep_model(ns, [args.test])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = T._Loopback(ns, tmp)
        try:
            from sparkv.edge.prompts import chat_context
            from sparkv.runtime import sample_context_ids

            session, small = T._sample_session(lm, path, args.train)
            large = chat_context(lm, sample_context_ids(lm, args.test - 40))
            cids = {n: session.client.create_context(token_ids=ctx, chunk_tokens=512,
                                                     levels=["raw"])
                    for n, ctx in ((args.train, small), (args.test, large))}
            for phase, n, k in (("train", args.train, args.train_asks),
                                ("test", args.test, args.test_asks)):
                for i in range(k):
                    row = {"phase": phase, **_ask_local(session, cids[n])}
                    rows.append(row)
                    print(json.dumps({a: round(b, 4) if isinstance(b, float) else b
                                      for a, b in row.items()}), flush=True)
            session.close()
        finally:
            path.close()
    test = [r for r in rows if r["phase"] == "test"]
    summary = {"median_abs_error_corrected": statistics.median(abs(r["error"]) for r in test),
               "median_abs_error_uncorrected":
                   statistics.median(abs(r["uncorrected_error"]) for r in test)}
    print(summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows, "summary": summary,
                               "when": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
