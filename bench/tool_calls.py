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
by themselves before the token cap; where a stream of the answer shows its first call (the
answer tokens when it is named and when it is whole, against the answer's end, until which a
stream showed nothing before calls streamed); the keyword hit rate (the QA sets' rule, on the
first call's ``answer`` argument when there is one, else on the whole text) with the paired
difference against ``text`` and its bootstrap interval; the decode time per token and the
chooser's time per token. The modes' order alternates per question. Wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from json_answers import ChooserClock, print_table, run_modes, summary_of

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
    calls = [c for c in _tools("auto").read(res.text) if c.complete]  # what an app can use
    first = json.loads(calls[0].arguments) if calls else {}
    said = first.get("answer") if isinstance(first.get("answer"), str) else res.text
    decode_s = res.total_s - res.first_token_s
    named, whole = _call_tokens(lm, res.tokens)
    return {"text": res.text, "calls": len(calls), "named_at": named, "whole_at": whole,
            "ended": len(res.tokens) < tokens or res.tokens[-1] in lm.eos_ids,
            "hit": item.keyword_hit(said), "tokens": len(res.tokens),
            "chooser_us_per_token": chooser_s / max(1, calls_made) * 1e6,
            "decode_ms_per_token": decode_s / max(1, len(res.tokens) - 1) * 1e3}


def _call_tokens(lm: Any, tokens: list[int]) -> tuple[int | None, int | None]:
    """The tokens a stream of the answer had shown when its first call was named, and when it
    was whole (``None``: never): its text read as it came (:mod:`sparkv.runtime.toolstream`),
    as the service's streams read it."""
    reader, text = _tools("required").reader(), ""
    named = whole = None
    for k in range(len(tokens)):
        now = lm.decode_tokens(tokens[:k + 1])
        if not now.startswith(text):              # a character not whole yet
            continue
        for p in reader.feed(now[len(text):]):
            if p.place == 0 and p.name is not None:
                named = k + 1
            if p.place == 0 and p.done:
                whole = k + 1
        text = now
    return named, whole


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    out = summary_of(rows, base, calls=lambda r: r["calls"] > 0,
                     one_call=lambda r: r["calls"] == 1)
    called = [r for r in rows if r["whole_at"] is not None]
    if called:                                  # where a stream shows the first call
        out["streamed"] = {k: statistics.median(r[k] for r in called)
                           for k in ("named_at", "whole_at", "tokens")}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-set", type=int, default=6, help="questions per QA set")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--out", default="bench/results/tool_calls_cpu.json")
    return run_modes(p.parse_args(), MODES, _answer, _summary, _print, tool=TOOL)


def _print(summary: dict[str, Any], rows: dict[str, list[dict[str, Any]]],
           args: argparse.Namespace) -> None:
    print_table(summary, rows, args, [("calls", "calls"), ("1 call", "one_call"),
                                      ("ended", "ended")])
    print("streamed, the answers with a whole call (medians, in answer tokens): the first "
          "call named / whole / the answer's end (all a stream showed before)")
    for m, s in summary.items():
        if "streamed" in s:
            st = s["streamed"]
            print(f"  {m:<9} {st['named_at']:>5.0f} {st['whole_at']:>5.0f} {st['tokens']:>5.0f}")


if __name__ == "__main__":
    raise SystemExit(main())
