"""What a fork's attention over its dense prefix costs a decoded token (sparkv/cache/qattend.py,
``PrefixAttention``): SmolLM2 over a fork (``ForkCache``) of a kept context of the bundled
story's first tokens, a question and an answer, two ways interleaved round by round in one
process:

* ``kernel``: a few queries per head (a decoded token) take the numba kernel (one call per
  layer: K and V read once for the head's queries, the weights' column sums made inside);
* ``torch``: every pass takes the batched torch ops (``KERNEL_QUERIES = 0``: what ran before).

    python bench/fork_decode.py [--rounds 7] [--tokens 2048] [--answer 32] [--no-record]
                                [--out bench/results/fork_decode_cpu.json]
    python bench/fork_decode.py --layer [--out bench/results/fork_decode_layer_cpu.json]

The calls run under the device service's density recording (its column sink set: what a fork's
call pays in the service) unless ``--no-record``. Per way the median first token (the question's
pass: many queries, the torch ops both ways), the median seconds per decoded token after it, the
answer's seconds, and whether both ways gave the same tokens. ``--layer``: one layer's attention
alone, random K and V of SmolLM2's shape (3 KV heads, 9 query heads, D 64; labelled random),
float32 and bfloat16 prefixes of 1,024 to 8,192 rows and a 1-token tail, 1 to 4 queries, the
kernel's and the torch ops' median microseconds (the sink set, as under the recording).
Greedy, 2 torch threads, wall clock on whatever machine runs it. No paper figure (LLMS and
SparKV do not time the decode attention over a shared prefix).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402

WAYS = ("kernel", "torch")


def one_answer(lm: Any, mem: Any, n: int, question: list[int], answer: int, way: str,
               record: bool) -> dict[str, Any]:
    """A question and an ``answer``-token answer over a new fork of ``mem``."""
    from sparkv.cache.fork import ForkCache
    from sparkv.cache.qattend import PrefixAttention
    from sparkv.device.density import DensityRecorder, recording
    from sparkv.runtime.generate import generate_over

    kept = PrefixAttention.KERNEL_QUERIES
    PrefixAttention.KERNEL_QUERIES = kept if way == "kernel" else 0
    rec = DensityRecorder(n + len(question) + answer + 1) if record else None
    try:
        t0 = time.perf_counter()
        with recording(rec):
            res = generate_over(lm, ForkCache(mem), n, question, answer, stop_at_eos=False)
        total = time.perf_counter() - t0
    finally:
        PrefixAttention.KERNEL_QUERIES = kept
    per = (res.total_s - res.first_token_s) / max(len(res.tokens) - 1, 1)
    return {"first_token_s": res.first_token_s, "per_token_s": per, "total_s": total,
            "tokens": res.tokens}


def layer_table(repeat: int = 300) -> list[dict[str, Any]]:
    """One layer's attention, kernel against torch ops, over random prefixes (module doc)."""
    import torch

    from sparkv.cache import colmass
    from sparkv.cache.qattend import PrefixAttention, warm_up

    torch.set_num_threads(2)
    warm_up()
    previous = colmass.set_sink(lambda sums, rows: None)
    rows = []
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for prefix in (1024, 2048, 4096, 8192):
                arena = [torch.randn(3, prefix + 256, 64).to(dtype) for _ in range(2)]
                att = PrefixAttention(arena[0][:, :prefix], arena[1][:, :prefix])
                tail = (torch.randn(3, 1, 64), torch.randn(3, 1, 64), torch.tensor([prefix]))
                for nq in (1, 2, 4):
                    q = torch.randn(1, 9, nq, 64).to(dtype)
                    q_pos = torch.full((nq,), prefix)
                    us = {w: _median_us(lambda: f(q, q_pos, 0.125, tail), repeat)
                          for w, f in (("kernel", att._attend_kernel),
                                       ("torch", att._attend_torch))}
                    rows.append({"dtype": str(dtype).split(".")[-1], "prefix": prefix,
                                 "queries": nq, **us, "ratio": round(us["kernel"] / us["torch"],
                                                                     3)})
                    print(f"| {rows[-1]['dtype']} | {prefix} | {nq} | {us['kernel']:.0f} us | "
                          f"{us['torch']:.0f} us | {rows[-1]['ratio']:.2f}x |", flush=True)
    finally:
        colmass.set_sink(previous)
    return rows


def _median_us(call: Any, repeat: int) -> float:
    """The median microseconds of ``call()`` over ``repeat`` calls (after 20 unmeasured)."""
    for _ in range(20):
        call()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def main() -> int:
    from sparkv.cache.qattend import warm_up
    from sparkv.device.density import install_hooks
    from sparkv.runtime.generate import context_memory, reference_prefill
    from sparkv.runtime.heap import freeze_heap, keep_freed_memory

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=2048, help="the context's tokens")
    p.add_argument("--answer", type=int, default=32, help="tokens per answer")
    p.add_argument("--no-record", action="store_true", help="no density recording")
    p.add_argument("--layer", action="store_true", help="one layer's attention alone")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.layer:
        print("one layer, random K and V of SmolLM2's shape, medians\n| dtype | prefix | "
              "queries | kernel | torch ops | ratio |\n|---|---|---|---|---|---|")
        layer = layer_table()
        if a.out:
            pathlib.Path(a.out).write_text(json.dumps(
                {"args": vars(a), "random_weights": True, "rows": layer}, indent=1) + "\n")
            print(f"wrote {a.out}")
        return 0
    lm, qa, ids = story_model(a.tokens)
    install_hooks(lm.model)
    warm_up()
    n = len(ids)
    mem = context_memory(lm, reference_prefill(lm, ids), n)
    question = lm.encode_text(qa.items[0].question)
    for way in WAYS:
        one_answer(lm, mem, n, question, 4, way, not a.no_record)        # warm
    keep_freed_memory()
    freeze_heap()
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(a.rounds):
        order = WAYS[r % 2:] + WAYS[:r % 2]
        rounds.append({w: one_answer(lm, mem, n, question, a.answer, w, not a.no_record)
                       for w in order})
        print(f"round {r + 1}/{a.rounds}: " + ", ".join(
            f"{w} {rounds[-1][w]['first_token_s']:.3f} s + {rounds[-1][w]['per_token_s']:.4f} "
            f"s/token" for w in WAYS), flush=True)
    keys = ("first_token_s", "per_token_s", "total_s")
    table = {w: {k: round(statistics.median(r[w][k] for r in rounds), 4) for k in keys}
             for w in WAYS}
    same = all(r["kernel"]["tokens"] == r["torch"]["tokens"] for r in rounds)
    ratio = table["kernel"]["per_token_s"] / table["torch"]["per_token_s"]
    print(f"\n{n}-token context, a {len(question)}-token question, {a.answer}-token answers, "
          f"recording {'off' if a.no_record else 'on'}, medians of {a.rounds}\n"
          "| way | first token | per decoded token | answer |\n|---|---|---|---|")
    for w, row in table.items():
        print(f"| {w} | {row['first_token_s']:.3f} s | {row['per_token_s'] * 1e3:.1f} ms | "
              f"{row['total_s']:.3f} s |")
    print(f"a decoded token, kernel / torch: {ratio:.2f}x; the same tokens: {same}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "context_tokens": n, "question_tokens": len(question),
             "rounds": [{w: {k: r[w][k] for k in keys} for w in WAYS} for r in rounds],
             "median": table, "per_token_ratio": round(ratio, 3), "same_tokens": same},
            indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
