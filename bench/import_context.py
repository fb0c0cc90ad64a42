"""What adopting a loaded context costs the context service (``ContextService.import_context``,
docs/device-service.md), and what its first call then waits for: an ask keeps its loaded cache
this way, at its first answer token when other asks wait for it (``--ask-early-keep``), so the
loader's second token waits for it; the next ask about it (a follow-up) switches it in. One
model in process, SmolLM2; the bundled story's first ``--tokens`` tokens prefilled once; then,
``--rounds`` times, alternating in each round:

* ``kept`` (the default service): the import also fills a working memory from the chunks it
  put in pages and keeps it (``keep_working``), so the first call switches in without a load;
* ``unkept`` (``keep_working=False``, what every import did before): the first call fills its
  working memory from the chunks.

Each is imported, asked one short question (``grow=False``, up to ``--answer-tokens``: its
switch and its first token) and deleted; the heap frozen first, as the service's process does.

    python bench/import_context.py [--rounds 7] [--tokens 2048] [--answer-tokens 32]
                                   [--out bench/results/import_context_cpu.json]

Per variant and round: the whole import (the chunks converted to their levels and put in
pages, the kept working memory's fill, the journal record, the write-ahead to flash) and its
parts, the first call's switch and first token. Medians, and the kept/unkept ratios paired by
round. 2 torch threads; wall clock on whatever machine runs it. No paper figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402


def timed_into(into: dict[str, dict[str, list[float]]], now: list[str], name: str,
               fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, its seconds appended to ``into[now[0]][name]`` (the variant running now)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[now[0]].setdefault(name, []).append(time.perf_counter() - t)
    return run


QUESTION = " Who is the story about?"
VARIANTS = {"kept": {}, "unkept": {"keep_working": False}}


def one_round(svc: Any, ids: list[int], layers: Any, q: list[int], answer: int
              ) -> dict[str, float]:
    """One import, its first call (``answer`` tokens at most) and the delete: their seconds."""
    t = time.perf_counter()
    cid = svc.import_context(ids, layers)
    import_s = time.perf_counter() - t
    res = svc.call(cid, prompt_ids=q, max_new_tokens=answer, grow=False)
    svc.delete(cid)
    return {"import_s": import_s, "switch_s": res.switch_s, "first_token_s": res.first_token_s,
            "import_and_first_token_s": import_s + res.first_token_s}


def main() -> int:
    from sparkv.device import ContextService, chunked
    from sparkv.runtime.generate import reference_prefill
    from sparkv.runtime.heap import freeze_heap

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=32,
                   help="the first call's answer tokens at most (what it reserves)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, _, ids = story_model(a.tokens)
    layers = list(reference_prefill(lm, ids))
    q = lm.tokenizer.encode(QUESTION)
    parts: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    now: list[str] = ["kept"]
    keeper = chunked.ChunkKeeper
    for name in ("adopt", "_keep_adopted", "write_ahead"):
        setattr(keeper, name, timed_into(parts, now, f"{name.strip('_')}_s",
                                         getattr(keeper, name)))
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        svcs = {v: ContextService(lm, 1 << 31, f"{d}/{v}", **kw) for v, kw in VARIANTS.items()}
        for v, svc in svcs.items():
            now[0] = v
            one_round(svc, ids, layers, q, a.answer_tokens)                                  # warm
        for part in parts.values():
            part.clear()
        freeze_heap()
        for r in range(a.rounds):
            for v in (VARIANTS if r % 2 == 0 else reversed(list(VARIANTS))):
                now[0] = v
                runs[v].append(one_round(svcs[v], ids, layers, q, a.answer_tokens))
            print(f"round {r + 1}/{a.rounds}: " + ", ".join(
                f"{v} import {runs[v][-1]['import_s']:.3f} s, switch "
                f"{runs[v][-1]['switch_s']:.3f} s" for v in VARIANTS), flush=True)
        for svc in svcs.values():
            svc.close()
    med = {v: {**{k: round(statistics.median(x[k] for x in runs[v]), 4) for k in runs[v][0]},
               **{k: round(statistics.median(x), 4) for k, x in parts[v].items()}}
           for v in VARIANTS}
    ratio = {k: round(statistics.median(x[k] / y[k] for x, y in zip(runs["kept"],
                                                                       runs["unkept"])), 3)
             for k in runs["kept"][0]}
    print(f"{len(ids)} tokens, medians of {a.rounds} rounds (kept / unkept paired by round):")
    for k in runs["kept"][0]:
        print(f"  {k:26s} kept {med['kept'][k]:.3f} s  unkept {med['unkept'][k]:.3f} s  "
              f"ratio {ratio[k]:.2f}")
    print("  kept's import parts: " + ", ".join(
        f"{k} {v:.3f} s" for k, v in med["kept"].items() if k not in runs["kept"][0]))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "tokens": len(ids), "question": QUESTION, "runs": runs,
             "parts": parts, "median": med, "kept_over_unkept": ratio}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
