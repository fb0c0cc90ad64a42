"""What a fork's density recording costs its passes, without the service (sparkv/device/density.py):
SmolLM2 over a fork (``ForkCache``) of a kept context of the bundled story's first tokens, one
question's pass (its first token), three ways, interleaved round by round in one process:

* ``take``: the recording as the service runs it (the fork's attention hands its weights to the
  column sink, ``sparkv/cache/colmass.py``; the hook keeps their column sums);
* ``defer``: the recording with ``DensityRecorder.TAKE_WEIGHTS`` off (the hook keeps the
  queries, the recording's end multiplies them by the keys again);
* ``off``: no recording.

    python bench/density_pass.py [--rounds 15] [--tokens 2048] [--answer 1]
                                 [--out bench/results/density_pass_cpu.json]

Per way the median seconds of the pass(es) (``pass_s``: to the last token) and of the pass with
the recording's end (``with_end_s``: the flush included). Greedy, 2 torch threads, wall clock on
whatever machine runs it. No paper figure (LLMS does not report what measuring its densities
costs).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402

WAYS = ("take", "defer", "off")


def one_pass(lm: Any, mem: Any, n: int, question: list[int], answer: int,
             way: str) -> dict[str, float]:
    """One question's pass (and ``answer - 1`` decoded tokens) over a new fork of ``mem``."""
    from sparkv.cache.fork import ForkCache
    from sparkv.device.density import DensityRecorder, recording
    from sparkv.runtime.generate import generate_over

    DensityRecorder.TAKE_WEIGHTS = way == "take"
    rec = None if way == "off" else DensityRecorder(n + len(question) + answer + 1)
    t0 = time.perf_counter()
    with recording(rec):
        generate_over(lm, ForkCache(mem), n, question, answer, stop_at_eos=False)
        t1 = time.perf_counter()
    return {"pass_s": t1 - t0, "with_end_s": time.perf_counter() - t0}


def main() -> int:
    from sparkv.device.density import DensityRecorder, install_hooks
    from sparkv.runtime.generate import context_memory, reference_prefill
    from sparkv.runtime.heap import freeze_heap, keep_freed_memory

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tokens", type=int, default=2048, help="the context's tokens")
    p.add_argument("--answer", type=int, default=1, help="tokens per pass (1: the question's)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, qa, ids = story_model(a.tokens)
    install_hooks(lm.model)
    n = len(ids)
    mem = context_memory(lm, reference_prefill(lm, ids), n)
    question = lm.encode_text(qa.items[0].question)
    take = DensityRecorder.TAKE_WEIGHTS
    one_pass(lm, mem, n, question, a.answer, "take")                  # warm
    keep_freed_memory()
    freeze_heap()
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for r in range(a.rounds):
            order = WAYS[r % 3:] + WAYS[:r % 3]
            rounds.append({w: one_pass(lm, mem, n, question, a.answer, w) for w in order})
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(
                f"{w} {rounds[-1][w]['pass_s']:.3f}/{rounds[-1][w]['with_end_s']:.3f} s"
                for w in WAYS), flush=True)
    finally:
        DensityRecorder.TAKE_WEIGHTS = take
    table = {w: {k: round(statistics.median(r[w][k] for r in rounds), 4)
                 for k in ("pass_s", "with_end_s")} for w in WAYS}
    print(f"\n{n}-token context, a {len(question)}-token question, {a.answer} token(s), "
          f"medians of {a.rounds}\n| way | pass | with the recording's end |\n|---|---|---|")
    for w, row in table.items():
        print(f"| {w} | {row['pass_s']:.3f} s | {row['with_end_s']:.3f} s |")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "context_tokens": n, "question_tokens": len(question),
             "rounds": rounds, "median": table}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
