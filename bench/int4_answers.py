"""What the ``int4`` configuration's answer tokens cost and give (sparkv/runtime/q41kernel.py: a
pass of a few rows multiplies with SmolLM2's Q4_1 blocks in one numba call): SmolLM2 in
float32 and in ``int4`` (the same weights), the bundled story's first ``--tokens`` tokens as
the context (prefilled once, in float32: ``int4``'s prefill is float32's bit for bit), each of
the story's first ``--questions`` questions answered greedily (``--answer`` tokens, no stop at
the end of a sentence) by both, interleaved.

    python bench/int4_answers.py [--tokens 1024] [--questions 8] [--answer 24]
                                 [--out bench/results/int4_answers_cpu.json]

Per model the median milliseconds a decoded token (after the first), the answers whose tokens
are float32's token for token, the tokens equal before the first difference, and the largest
difference of the first token's logits. 2 torch threads, wall clock on whatever machine runs
it. No paper figure (none of the papers quantizes the model's weights); docs/dtypes.md's decode
table is the comparison (``int4-kernel``, ``int4-decode``).
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402


def _answer(lm: Any, kv: Any, n: int, question: list[int], tokens: int) -> Any:
    from sparkv.runtime.generate import greedy_generate

    return greedy_generate(lm, [(k.clone(), v.clone()) for k, v in kv], n, question,
                           max_new_tokens=tokens, stop_at_eos=False)


def main() -> int:
    from sparkv.runtime import LoadedModel
    from sparkv.runtime.compute import apply_compute
    from sparkv.runtime.generate import reference_prefill
    from sparkv.runtime.q41kernel import warm_up

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--questions", type=int, default=8)
    p.add_argument("--answer", type=int, default=24)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, qa, ids = story_model(a.tokens)
    int4 = LoadedModel.from_model(copy.deepcopy(lm.model), lm.tokenizer, lm.name)
    apply_compute(int4, "int4")
    warm_up()
    n = len(ids)
    kv = reference_prefill(lm, ids)
    models = {"float32": lm, "int4": int4}
    rows = []
    for i, item in enumerate(qa.items[:a.questions]):
        question = lm.encode_text(item.question)
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        got = {name: _answer(models[name], kv, n, question, a.answer) for name in order}
        f, q = got["float32"], got["int4"]
        same = next((j for j, (x, y) in enumerate(zip(f.tokens, q.tokens)) if x != y),
                    len(f.tokens))
        rows.append({"question": item.question, "same_tokens": same,
                     "identical": f.tokens == q.tokens,
                     "first_logits_max_diff": float((f.first_logits - q.first_logits).abs()
                                                    .max()),
                     **{f"{name}_ms_per_token": 1e3 * (r.total_s - r.first_token_s)
                        / max(len(r.tokens) - 1, 1) for name, r in got.items()}})
        print(f"{i + 1}/{a.questions}: identical {rows[-1]['identical']} (same {same}), "
              f"float32 {rows[-1]['float32_ms_per_token']:.1f} ms, "
              f"int4 {rows[-1]['int4_ms_per_token']:.1f} ms a token", flush=True)
    med = {name: round(statistics.median(r[f"{name}_ms_per_token"] for r in rows), 2)
           for name in models}
    identical = sum(r["identical"] for r in rows)
    print(f"\n{n}-token context, {len(rows)} questions, {a.answer}-token answers\n"
          "| model | ms a decoded token (median) | answers = float32's |\n|---|---|---|\n"
          f"| float32 | {med['float32']:.1f} | - |\n"
          f"| int4 | {med['int4']:.1f} | {identical} of {len(rows)} |\n"
          f"int4 / float32 a token: {med['int4'] / med['float32']:.2f}x; first token's logits "
          f"differ by at most {max(r['first_logits_max_diff'] for r in rows):.2e}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "context_tokens": n, "rows": rows, "median_ms": med,
             "identical_answers": identical}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
