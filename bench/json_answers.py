"""JSON answers (docs/asks.md, "JSON answers"): what a form costs a token and what it does to the
bundled SmolLM2's answers, over the bundled QA sets' questions, four ways in one run:

* ``text``: the question alone, any text (the QA tables' answer);
* ``asked``: the question plus an instruction to answer in JSON (``{"answer": ...}``), any text:
  what an app gets without a form;
* ``object``: the same prompt, the answer a JSON object (``json_object``);
* ``schema``: the same prompt, the answer JSON of ``{"answer": string}`` (``json_schema``).

    python bench/json_answers.py [--per-set 6] [--tokens 64] [--out bench/results/json_answers_cpu.json]

For each: the share of answers that are JSON (parse), that follow the schema, that ended by
themselves before the token cap; the keyword hit rate (the QA sets' rule; the ``answer`` field
of a JSON answer that has one, else the whole text) with the paired difference against ``text``
and its bootstrap interval; the decode time per token and the chooser's share of it. The modes'
order alternates per question. Wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

INSTRUCTION = ' Answer in JSON, as {"answer": "..."}.'
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"type": "string", "maxLength": 300}}}
MODES = ("text", "asked", "object", "schema")
SETS = ("story", "meeting", "manual", "code")


def _form(mode: str) -> Any:
    from sparkv.runtime.jsonform import JsonForm

    return {"object": JsonForm.any_object(),
            "schema": JsonForm.from_schema(SCHEMA, "answer")}.get(mode)


def _parsed(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _judged(item: Any, text: str, ended: bool) -> dict[str, Any]:
    value = _parsed(text)
    said = value["answer"] if isinstance(value, dict) and isinstance(value.get("answer"),
                                                                      str) else text
    return {"text": text, "json": value is not None, "ended": ended,
            "schema": (isinstance(value, dict) and list(value) == ["answer"]
                       and isinstance(value["answer"], str)),
            "hit": item.keyword_hit(said)}


class ChooserClock:
    """Time spent choosing tokens (the chooser's calls, wrapped for the run)."""

    def __init__(self) -> None:
        from sparkv.runtime.sampling import TokenChooser

        self.s, self.calls, self._orig = 0.0, 0, TokenChooser.__call__
        clock = self

        def timed(chooser: Any, logits: Any) -> int:
            t0 = time.perf_counter()
            try:
                return clock._orig(chooser, logits)
            finally:
                clock.s += time.perf_counter() - t0
                clock.calls += 1

        TokenChooser.__call__ = timed           # type: ignore[method-assign]

    def take(self) -> tuple[float, int]:
        out = (self.s, self.calls)
        self.s, self.calls = 0.0, 0
        return out


def _answer(lm: Any, kv: Any, n: int, item: Any, mode: str, tokens: int,
            clock: ChooserClock) -> dict[str, Any]:
    from sparkv.edge import question_suffix
    from sparkv.runtime.generate import greedy_generate
    from sparkv.runtime.sampling import Sampling

    question = item.question + ("" if mode == "text" else INSTRUCTION)
    q = question_suffix(lm, question, True)
    clock.take()
    res = greedy_generate(lm, kv, n, q, tokens, sampling=Sampling(form=_form(mode)))
    chooser_s, calls = clock.take()
    ended = len(res.tokens) < tokens or res.tokens[-1] in lm.eos_ids
    out = _judged(item, res.text, ended)
    decode_s = res.total_s - res.first_token_s
    out.update(tokens=len(res.tokens), chooser_us_per_token=chooser_s / max(1, calls) * 1e6,
               decode_ms_per_token=decode_s / max(1, len(res.tokens) - 1) * 1e3)
    return out


def _summary(rows: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    return summary_of(rows, base, json=lambda r: r["json"], schema=lambda r: r["schema"])


def summary_of(rows: list[dict[str, Any]], base: list[dict[str, Any]],
               **shares: Any) -> dict[str, Any]:
    """A mode's summary: each of ``shares`` (name -> whether a row counts), the share that
    ended by itself, the hit rate and its paired difference against ``base``, the median
    decode and chooser times."""
    from sparkv.bench.verdict import bootstrap_mean_interval

    diffs = [float(r["hit"]) - float(b["hit"]) for r, b in zip(rows, base)]
    n = len(rows)
    return {"questions": n, **{k: sum(bool(f(r)) for r in rows) / n for k, f in shares.items()},
            "ended": sum(r["ended"] for r in rows) / n,
            "hit": sum(r["hit"] for r in rows) / n,
            "hit_minus_text": sum(diffs) / n,
            "hit_minus_text_interval": bootstrap_mean_interval(diffs),
            "decode_ms_per_token": statistics.median(r["decode_ms_per_token"] for r in rows),
            "chooser_us_per_token": statistics.median(r["chooser_us_per_token"] for r in rows)}


def answer_all(per_set: int, modes: tuple[str, ...], answer: Any
               ) -> tuple[Any, dict[str, list[dict[str, Any]]]]:
    """Every mode's answer to ``per_set`` questions of each QA set, each over its own context
    (prefilled dense once), the modes' order alternating per question: ``(the model, each
    mode's rows)``; ``answer(lm, kv, context_len, item, mode, clock)`` gives one row."""
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
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    work = []
    for name in SETS:
        qa = load_qa_set(pathlib.Path("sparkv/data") / f"qa_{name}.json")
        for sid, items in qa.by_slice().items():
            work.append((qa.text(sid), items[:per_set]))
    bar = tqdm(total=sum(len(items) for _, items in work), desc="questions")
    for text, items in work:
        ctx = chat_context(lm, lm.encode_text(text))
        with torch.inference_mode():
            kv = reference_prefill(lm, ctx)
        for i, item in enumerate(items):
            for mode in (modes if (len(rows[modes[0]]) + i) % 2 == 0 else reversed(modes)):
                rows[mode].append({"id": item.id, **answer(lm, kv, len(ctx), item, mode, clock)})
            bar.update(1)
    bar.close()
    return lm, rows


def run_modes(args: argparse.Namespace, modes: tuple[str, ...], answer: Any, summarize: Any,
              show: Any, **extra: Any) -> int:
    """Answers every question every mode (:func:`answer_all`; ``answer(lm, kv, n, item, mode,
    tokens, clock)``), summarizes each mode against the first (``summarize(rows, base)``),
    prints it (``show(summary, rows, args)``) and writes ``args.out`` (``extra`` beside)."""
    from sparkv.cli import passive_openmp_waits
    passive_openmp_waits()

    lm, rows = answer_all(args.per_set, modes, lambda lm, kv, n, item, mode, clock: answer(
        lm, kv, n, item, mode, args.tokens, clock))
    summary = {m: summarize(rows[m], rows[modes[0]]) for m in modes}
    show(summary, rows, args)
    out = {"model": lm.name, "answer_tokens": args.tokens, **extra, "summary": summary,
           "answers": rows}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-set", type=int, default=6, help="questions per QA set")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="bench/results/json_answers_cpu.json")
    return run_modes(p.parse_args(), MODES, _answer, _summary, _print,
                     instruction=INSTRUCTION, schema=SCHEMA)


def print_table(summary: dict[str, Any], rows: dict[str, list[dict[str, Any]]],
                args: argparse.Namespace, shares: list[tuple[str, str]]) -> None:
    """Each mode's ``shares`` (``(header, key)``), hit rate and its difference against the first
    mode, decode and chooser times; then each mode's first answer."""
    n = next(iter(summary.values()))["questions"]
    print(f"{n} questions ({args.per_set} per set of {', '.join(SETS)}), at most {args.tokens} "
          "answer tokens, greedy")
    print(f"{'mode':<9} " + " ".join(f"{h:>7}" for h, _ in shares)
          + f" {'hit':>6} {'hit-text [90% interval]':>26} {'ms/token':>9} {'chooser us':>11}")
    for m, s in summary.items():
        lo, hi = s["hit_minus_text_interval"]
        print(f"{m:<9} " + " ".join(f"{s[k]:>7.2f}" for _, k in shares)
              + f" {s['hit']:>6.2f} {s['hit_minus_text']:>+9.2f} [{lo:+.2f}, {hi:+.2f}]{'':>5} "
              f"{s['decode_ms_per_token']:>9.1f} {s['chooser_us_per_token']:>11.0f}")
    for m in summary:
        print(f"  {m}: {rows[m][0]['text'][:120]!r}")


def _print(summary: dict[str, Any], rows: dict[str, list[dict[str, Any]]],
           args: argparse.Namespace) -> None:
    print_table(summary, rows, args, [("JSON", "json"), ("schema", "schema"), ("ended", "ended")])


if __name__ == "__main__":
    raise SystemExit(main())
