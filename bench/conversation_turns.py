"""A/B of the context service's turn cache (docs/device-service.md, "A conversation's turns,
kept"): one conversation about a bundled story, every ask sending the whole conversation so far
(as an OpenAI chat app does), answered over the kept context with and without the KV of its
earlier turns kept; the two services alternate, a fresh conversation each round.

    python bench/conversation_turns.py [--turns 8] [--rounds 3] [--max-new 48]
                                       [--out bench/results/conversation_turns_cpu.json]

Per turn: the prompt's tokens after the context, the tokens reused, the median time to the
first token of each (its switch, the turn's prefill, the first token), their ratio, and whether
both gave the same tokens. SmolLM2 (the bundled model), wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
from typing import Any

import torch

CACHE_BYTES = 64 << 20


def conversation(svc: Any, sid: str, lm: Any, questions: list[str], max_new: int
                 ) -> list[dict[str, Any]]:
    """Asks ``questions`` in turn, each ask the whole conversation so far."""
    from sparkv.runtime.turns import ChatTurn, Conversation, suffix_ids

    history: list[Any] = []
    out = []
    for q in questions:
        conv = Conversation.of(q, history)
        ids = suffix_ids(lm, conv)
        r = svc.call(sid, prompt_ids=ids, max_new_tokens=max_new, grow=False)
        out.append({"prompt_tokens": len(ids), "reused": r.turn_tokens_reused,
                    "ttft_ms": r.first_token_s * 1e3, "tokens": r.tokens, "text": r.text})
        history = [*conv.turns, ChatTurn("assistant", r.text)]
    return out


def run(turns: int, rounds: int, max_new: int) -> dict[str, Any]:
    """``rounds`` conversations of ``turns`` asks on each service (no turn cache, 64 MiB),
    alternated (the order swapped every round)."""
    from sparkv.bench.qa import DATA_DIR, load_qa_set
    from sparkv.device import ContextService
    from sparkv.runtime import load_model
    from sparkv.runtime.generate import prompt_parts, reference_prefill

    lm = load_model(progress=False)
    qa = load_qa_set(DATA_DIR / "qa_story.json")
    items = qa.items[:turns]
    head, _ = prompt_parts(lm, lm.encode_text(qa.text(items[0].slice)), "x")
    kv = reference_prefill(lm, head)
    root = pathlib.Path(tempfile.mkdtemp(prefix="turns-ab-"))
    svcs = {c: ContextService(lm, 1 << 30, root / f"c{c}", journal=False, turn_cache_bytes=c)
            for c in (0, CACHE_BYTES)}
    sids = {c: s.import_context(head, [(k.clone(), v.clone()) for k, v in kv])
            for c, s in svcs.items()}
    runs: dict[str, list[list[dict[str, Any]]]] = {"recomputed": [], "kept": []}
    for r in range(rounds):
        for c in (sorted(svcs) if r % 2 == 0 else sorted(svcs, reverse=True)):
            svcs[c].tails.forget(sids[c])
            conv = conversation(svcs[c], sids[c], lm, [i.question for i in items], max_new)
            runs["kept" if c else "recomputed"].append(conv)
        print(f"round {r + 1}/{rounds} done", flush=True)
    cache = svcs[CACHE_BYTES].stats()["turn_cache"]
    for s in svcs.values():
        s.close()
    return {"context_tokens": len(head), "items": [i.id for i in items], "runs": runs,
            "turn_cache": cache,
            "hits": [[i.keyword_hit(t["text"]) for i, t in zip(items, conv)]
                     for conv in runs["kept"][:1] + runs["recomputed"][:1]]}


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per turn: the prompt's tokens, those reused, each side's median TTFT, their ratio, and
    whether every round of both gave the same tokens."""
    rows = []
    for t in range(len(res["items"])):
        kept = [conv[t] for conv in res["runs"]["kept"]]
        rec = [conv[t] for conv in res["runs"]["recomputed"]]
        k_ms = statistics.median(x["ttft_ms"] for x in kept)
        r_ms = statistics.median(x["ttft_ms"] for x in rec)
        rows.append({"turn": t + 1, "prompt_tokens": rec[0]["prompt_tokens"],
                     "reused": kept[0]["reused"], "recomputed_ms": round(r_ms, 1),
                     "kept_ms": round(k_ms, 1), "ratio": round(k_ms / r_ms, 3),
                     "same_tokens": len({tuple(x["tokens"]) for x in kept + rec}) == 1})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8, help="asks in the conversation")
    p.add_argument("--rounds", type=int, default=3, help="conversations on each service")
    p.add_argument("--max-new", type=int, default=48, help="each answer's most tokens")
    p.add_argument("--out", default=None, help="write every ask's figures here (JSON)")
    a = p.parse_args()
    torch.set_num_threads(2)
    res = run(a.turns, a.rounds, a.max_new)
    rows = summary(res)
    print(f"context {res['context_tokens']} tokens; turn cache {res['turn_cache']}")
    print(f"{'turn':>4} {'prompt':>6} {'reused':>6} {'recomputed ms':>13} {'kept ms':>8} "
          f"{'ratio':>6}  same tokens")
    for r in rows:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['reused']:>6} "
              f"{r['recomputed_ms']:>13.1f} {r['kept_ms']:>8.1f} {r['ratio']:>6.3f}  "
              f"{r['same_tokens']}")
    if a.out:
        out = {"bench": "conversation_turns", "rows": rows, **res}
        pathlib.Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
