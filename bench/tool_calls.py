"""Tool calls (docs/asks.md, "Tool calls"): what the tool forms cost a token and what the bundled
SmolLM2 makes of tools, over the bundled QA sets' questions, five ways in one run:

* ``text``: the question alone, any text (the QA tables' answer);
* ``prompted``: the tools' instructions (one tool, ``record_answer(answer: string)``) before the
  question, any text: what an app gets from a model told of tools without a form;
* ``auto``: the same prompt, the form ``tool_choice`` ``auto`` gives (prose or whole calls);
* ``required``: the same prompt, one call or more (``required``, parallel calls allowed);
* ``one``: the same, one call (``parallel_tool_calls`` false).

    python bench/tool_calls.py [--per-set 6] [--tokens 96] [--out bench/results/tool_calls_cpu.json]

For each: the share of answers that are whole calls (read back by ``ToolSet.read``), that ended
by themselves before the token cap; the keyword hit rate (the QA sets' rule, on the first call's
``answer`` argument when there is one, else on the whole text) with the paired difference
against ``text`` and its bootstrap interval; the decode time per token and the chooser's time per
token. The modes' order alternates per question. Wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from typing import Any

from json_answers import SETS, ChooserClock

TOOL = {"name": "record_answer", "description": "Records the answer to the question",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["answer"],
                       "properties": {"answer": {"type": "string", "maxLength": 300}}}}
MODES = ("text", "prompted", "auto", "required", "one")
#: each mode's tool choice and whether several calls may come (``None``: no form)
CHOICE = {"prompted": ("auto", True), "auto": ("auto", True), "required": ("required", True),
          "one": ("required", False)}


def _tools(mode: str) -> Any:
    from sparkv.runtime.toolform import Tool, ToolSet

    choice, parallel = CHOICE.get(mode, ("none", True))
    return ToolSet([Tool(**TOOL, strict=True)], choice, parallel)


def _asked(lm: Any, item: Any, mode: str) -> list[int]:
    from sparkv.edge import question_suffix
    from sparkv.runtime.turns import ChatTurn, Conversation

    if mode == "text":
        return question_suffix(lm, item.question, True)
    conv = Conversation((ChatTurn("system", _tools(mode).instructions()),
                         ChatTurn("user", item.question)))
    return question_suffix(lm, conv, True)


def _answer(lm: Any, kv: Any, n: int, item: Any, mode: str, tokens: int,
            clock: ChooserClock) -> dict[str, Any]:
    from sparkv.runtime.generate import greedy_generate
    from sparkv.runtime.sampling import Sampling

    tools = _tools(mode)
    form = tools.form() if mode not in ("text", "prompted") else None
    clock.take()
    res = greedy_generate(lm, kv, n, _asked(lm, item, mode), tokens, sampling=Sampling(form=form))
    chooser_s, calls_made = clock.take()
    calls = _tools("auto").read(res.text)            # what an app reads back, in any mode
    first = json.loads(calls[0].arguments) if calls else {}
    said = first.get("answer") if isinstance(first.get("answer"), str) else res.text
    decode_s = res.total_s - res.first_token_s
    return {"text": res.text, "calls": len(calls),
            "ended": len(res.tokens) < tokens or res.tokens[-1] in lm.eos_ids,
            "hit": item.keyword_hit(said), "tokens": len(res.tokens),
            "chooser_us_per_token": chooser_s / max(1, calls_made) * 1e6,
            "decode_ms_per_token": decode_s / max(1, len(res.tokens) - 1) * 1e3}


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    from sparkv.bench.verdict import bootstrap_mean_interval

    diffs = [float(r["hit"]) - float(b["hit"]) for r, b in zip(rows, base)]
    n = len(rows)
    return {"questions": n, "calls": sum(r["calls"] > 0 for r in rows) / n,
            "one_call": sum(r["calls"] == 1 for r in rows) / n,
            "ended": sum(r["ended"] for r in rows) / n,
            "hit": sum(r["hit"] for r in rows) / n,
            "hit_minus_text": sum(diffs) / n,
            "hit_minus_text_interval": bootstrap_mean_interval(diffs),
            "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in rows),
            "chooser_us_per_token": statistics.median(r["chooser_us_per_token"] for r in rows)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-set", type=int, default=6, help="questions per QA set")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--out", default="bench/results/tool_calls_cpu.json")
    args = p.parse_args()
    from sparkv.cli import passive_openmp_waits
    passive_openmp_waits()
    import torch
    from tqdm import tqdm

    from sparkv.bench.qa import load_qa_set
    from sparkv.edge import chat_context
    from sparkv.runtime.generate import reference_prefill
    from sparkv.runtime.guided import vocabulary
    from sparkv.runtime.model import load_model

    lm = load_model(progress=False)
    vocabulary(lm)                              # made once, outside the timings
    clock = ChooserClock()
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    work = []
    for name in SETS:
        qa = load_qa_set(pathlib.Path("sparkv/data") / f"qa_{name}.json")
        for sid, items in qa.by_slice().items():
            work.append((qa.text(sid), items[:args.per_set]))
    bar = tqdm(total=sum(len(items) for _, items in work), desc="questions")
    for text, items in work:
        ctx = chat_context(lm, lm.encode_text(text))
        with torch.inference_mode():
            kv = reference_prefill(lm, ctx)
        for i, item in enumerate(items):
            for mode in (MODES if (len(rows["text"]) + i) % 2 == 0 else reversed(MODES)):
                rows[mode].append({"id": item.id, **_answer(lm, kv, len(ctx), item, mode,
                                                            args.tokens, clock)})
            bar.update(1)
    bar.close()
    summary = {m: _summary(rows[m], rows["text"]) for m in MODES}
    _print(summary, rows, args)
    out = {"model": lm.name, "answer_tokens": args.tokens, "tool": TOOL, "summary": summary,
           "answers": rows}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


def _print(summary: dict[str, Any], rows: dict[str, list[dict[str, Any]]],
           args: argparse.Namespace) -> None:
    n = summary["text"]["questions"]
    print(f"{n} questions ({args.per_set} per set of {', '.join(SETS)}), at most {args.tokens} "
          "answer tokens, greedy")
    print(f"{'mode':<9} {'calls':>6} {'1 call':>7} {'ended':>6} {'hit':>6} "
          f"{'hit-text [90% interval]':>26} {'ms/token':>9} {'chooser us':>11}")
    for m, s in summary.items():
        lo, hi = s["hit_minus_text_interval"]
        print(f"{m:<9} {s['calls']:>6.2f} {s['one_call']:>7.2f} {s['ended']:>6.2f} "
              f"{s['hit']:>6.2f} {s['hit_minus_text']:>+9.2f} [{lo:+.2f}, {hi:+.2f}]{'':>5} "
              f"{s['decode_ms_per_token']:>9.1f} {s['chooser_us_per_token']:>11.0f}")
    for m in MODES:
        print(f"  {m}: {rows[m][0]['text'][:120]!r}")


if __name__ == "__main__":
    raise SystemExit(main())
