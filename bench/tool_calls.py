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
    return {"text": res.text, "calls": len(calls),
            "ended": len(res.tokens) < tokens or res.tokens[-1] in lm.eos_ids,
            "hit": item.keyword_hit(said), "tokens": len(res.tokens),
            "chooser_us_per_token": chooser_s / max(1, calls_made) * 1e6,
            "decode_ms_per_token": decode_s / max(1, len(res.tokens) - 1) * 1e3}


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    return summary_of(rows, base, calls=lambda r: r["calls"] > 0,
                      one_call=lambda r: r["calls"] == 1)


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


if __name__ == "__main__":
    raise SystemExit(main())
