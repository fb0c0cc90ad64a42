"""A read turn's opener and a late joiner with a longer answer (docs/device-service.md, "Calls
that read one working memory"): one ``ContextService`` in process with SmolLM2 and a kept
context of the bundled story's first tokens; call A (``--short`` tokens) opens a read turn, call
B (``--long`` tokens) comes once A's first token is out and joins it. Per round: when each call
returned, from A's start. Run it on two checkouts to compare (before the hand-off, A returned
only when B had left).

    python bench/read_handoff.py [--rounds 3] [--short 16] [--long 96] [--tokens 1024]
                                 [--out bench/results/read_handoff_cpu.json]

SmolLM2 (the bundled model), greedy, every answer run to its length (``stop_at_eos`` off), 2
torch threads; wall clock on whatever machine runs it. No paper figure (LLMS runs its calls one
after another).
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402


def one_round(svc: Any, cid: str, short: int, long: int) -> dict[str, float]:
    from sparkv.runtime import sampling

    t0 = time.perf_counter()
    out: dict[str, float] = {}
    first = threading.Event()

    def a() -> None:
        with sampling.reporting_to(lambda *_: first.set(), None):
            svc.call(cid, "What happens in the story?", max_new_tokens=short, grow=False,
                     stop_at_eos=False)
        out["a_s"] = time.perf_counter() - t0

    def b() -> None:
        res = svc.call(cid, "Tell the story again in your own words.", max_new_tokens=long,
                       grow=False, stop_at_eos=False)
        out["b_s"] = time.perf_counter() - t0
        out["b_joined"] = float(res.joined)

    ta = threading.Thread(target=a)
    ta.start()
    assert first.wait(600)
    tb = threading.Thread(target=b)
    tb.start()
    ta.join()
    tb.join()
    with svc.locked(cid):               # the read turn's end is done
        out["lock_free_s"] = time.perf_counter() - t0
    return out


def main() -> int:
    from sparkv.device import ContextService

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--short", type=int, default=16, help="A's answer tokens")
    p.add_argument("--long", type=int, default=96, help="B's answer tokens")
    p.add_argument("--tokens", type=int, default=1024, help="the context's tokens")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, _, ids = story_model(a.tokens)
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        svc = ContextService(lm, 1 << 30, d)
        cid = svc.new_context(system_ids=ids)
        svc.call(cid, "Hi.", max_new_tokens=2, grow=False)          # warm
        for r in range(a.rounds):
            rounds.append(one_round(svc, cid, a.short, a.long))
            print(f"round {r + 1}: A returned {rounds[-1]['a_s']:.2f} s, B "
                  f"{rounds[-1]['b_s']:.2f} s (joined: {bool(rounds[-1]['b_joined'])})",
                  flush=True)
        handoffs = svc.stats().get("read_handoffs")
        svc.close()
    med = {k: round(statistics.median(r[k] for r in rounds), 3) for k in ("a_s", "b_s")}
    print(f"median: A {med['a_s']:.2f} s, B {med['b_s']:.2f} s; read_handoffs {handoffs}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "rounds": rounds, "median": med, "read_handoffs": handoffs},
            indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
