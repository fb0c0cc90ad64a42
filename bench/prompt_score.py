"""What scoring a prompt costs (sparkv.runtime.promptscore: OpenAI's echo with logprobs): the
question's pass over a context's KV with and without the prompt scored, the bundled SmolLM2,
alternated in one process (paired by round: this VM is noisy), per prompt length. A scored
pass adds the output head over the prompt's positions (576 x 49,152 multiply-adds a token)
and the log-softmax; the table gives the ratio and the added milliseconds per prompt token.

    PYTHONPATH=$PWD python bench/prompt_score.py [--context 1024] [--rounds 5]
                                                 [--out bench/results/prompt_score.json]
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from sparkv.runtime import load_model, promptscore
from sparkv.runtime.generate import greedy_generate, sample_text
from sparkv.runtime.hfcache import output_cache
from sparkv.runtime.kvcache import from_dynamic_cache
from sparkv.runtime.promptscore import PromptScorer, scoring

PROMPTS = (16, 64, 256, 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024, help="the context's tokens")
    p.add_argument("--rounds", type=int, default=5, help="pairs a prompt length")
    p.add_argument("--out", default=None, help="write the rows here (JSON)")
    a = p.parse_args()
    CONTEXT, ROUNDS = a.context, a.rounds
    lm = load_model()
    promptscore.install(lm.model)
    ids = lm.encode_text(sample_text())
    assert len(ids) >= CONTEXT + max(PROMPTS), "the sample is shorter than the bench"
    context = ids[:CONTEXT]
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([context]), use_cache=True)
    kv = from_dynamic_cache(output_cache(out))
    rows = []
    for n in PROMPTS:
        prompt = ids[CONTEXT:CONTEXT + n]

        def run(scored: bool) -> float:
            scorer = PromptScorer(tuple(prompt), 1) if scored else None
            t0 = time.perf_counter()
            with scoring(scorer):
                greedy_generate(lm, kv, CONTEXT, prompt, max_new_tokens=1)
            return time.perf_counter() - t0
        run(True), run(False)                                  # warm
        pairs = []
        for _ in range(ROUNDS):
            plain, scored = run(False), run(True)
            pairs.append((plain, scored))
        ratio = statistics.median(s / p_ for p_, s in pairs)
        plain_ms = statistics.median(p_ for p_, _ in pairs) * 1e3
        scored_ms = statistics.median(s for _, s in pairs) * 1e3
        rows.append({"prompt_tokens": n, "plain_ms": round(plain_ms, 1),
                     "scored_ms": round(scored_ms, 1), "ratio": round(ratio, 3),
                     "added_ms_per_token": round((scored_ms - plain_ms) / n, 3)})
        print(f"prompt {n:5d}: pass {plain_ms:8.1f} ms, scored {scored_ms:8.1f} ms, "
              f"{ratio:.2f}x (paired median), +{(scored_ms - plain_ms) / n:.2f} ms a token",
              flush=True)
    if not a.out:
        return
    out_path = Path(a.out)
    out_path.write_text(json.dumps({
        "model": lm.name, "dtype": str(lm.dtype), "context_tokens": CONTEXT, "rounds": ROUNDS,
        "threads": torch.get_num_threads(), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
