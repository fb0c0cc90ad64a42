"""What sampling costs an answer (docs/asks.md, "Sampling"): the chooser alone over the bundled
SmolLM2's real logits (greedy, temperature, top-p, top-k, penalties and a bias), and whole answers over the bundled
story's KV, greedy against sampled, alternated in one run.

    python bench/sampling.py [--rounds 3] [--tokens 64] [--out bench/results/sampling_cpu.json]

Wall clock on whatever machine runs it. The answers' decode time per token is the answer's time
after its first token over the tokens after the first.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

RULES = {"greedy": {}, "t0.7": {"temperature": 0.7},
         "t0.7 top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
         "t0.7 top_k 50": {"temperature": 0.7, "top_k": 50},
         "greedy penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.5,
                              "logit_bias": {0: -100.0}}}
QUESTION = "Tell me what happens in the story, in detail."


def chooser_us(logits: Any, rule: dict[str, Any], n: int = 2000) -> float:
    """Microseconds per token to choose from ``logits``."""
    from sparkv.runtime.sampling import Sampling, TokenChooser

    choose = TokenChooser(Sampling(**rule, seed=1) if rule else None)
    for _ in range(50):
        choose(logits)
    t0 = time.perf_counter()
    for _ in range(n):
        choose(logits)
    return (time.perf_counter() - t0) / n * 1e6


def answer(lm: Any, kv: Any, n: int, q: list[int], tokens: int, rule: dict[str, Any]
           ) -> dict[str, Any]:
    from sparkv.runtime.generate import greedy_generate
    from sparkv.runtime.sampling import Sampling

    res = greedy_generate(lm, kv, n, q, tokens, stop_at_eos=False,
                          sampling=Sampling(**rule) if rule else None)
    return {"decode_ms_per_token": (res.total_s - res.first_token_s) / (len(res.tokens) - 1) * 1e3,
            "first_token_s": res.first_token_s, "seed": res.seed, "text": res.text}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="bench/results/sampling_cpu.json")
    args = p.parse_args()
    from sparkv.cli import passive_openmp_waits
    passive_openmp_waits()
    import torch

    from sparkv.edge import chat_context, question_suffix
    from sparkv.runtime.generate import greedy_generate, reference_prefill, sample_context_ids
    from sparkv.runtime.model import load_model

    lm = load_model(progress=False)
    ctx = chat_context(lm, sample_context_ids(lm, 1500))
    q = question_suffix(lm, QUESTION, True)
    with torch.inference_mode():
        kv = reference_prefill(lm, ctx)
    logits = greedy_generate(lm, kv, len(ctx), q, 1, stop_at_eos=False).first_logits
    chooser = {name: chooser_us(logits, rule) for name, rule in RULES.items()}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in RULES}
    for r in range(args.rounds):
        for name, rule in (RULES.items() if r % 2 == 0 else reversed(RULES.items())):
            runs[name].append(answer(lm, kv, len(ctx), q, args.tokens, rule))
    med = {name: statistics.median(x["decode_ms_per_token"] for x in rs)
           for name, rs in runs.items()}
    print(f"context {len(ctx)} tokens, question {len(q)}, {args.tokens} answer tokens, "
          f"vocabulary {logits.numel()}, {args.rounds} rounds alternated")
    print(f"{'rule':<17} {'chooser us/token':>17} {'decode ms/token':>16} {'x greedy':>9}")
    for name in RULES:
        print(f"{name:<17} {chooser[name]:>17.1f} {med[name]:>16.1f} "
              f"{med[name] / med['greedy']:>9.3f}")
    for name in RULES:
        print(f"  {name}: {runs[name][0]['text'][:90]!r}")
    out = {"context_tokens": len(ctx), "question_tokens": len(q), "answer_tokens": args.tokens,
           "vocab": logits.numel(), "rounds": args.rounds, "chooser_us_per_token": chooser,
           "decode_ms_per_token_median": med,
           "decode_x_greedy": {k: v / med["greedy"] for k, v in med.items()},
           "runs": runs}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
