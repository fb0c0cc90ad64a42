"""An answer token's attention: SDPA against the one-query kernel (:mod:`sparkv.runtime.
decodeattn`, ``int4``'s), at several context lengths, in one process.

Per length: SmolLM2 in ``--dtype`` (default ``int4``), one context of that many tokens in the KV
memory (a dense arena), answer tokens one pass each. The two variants (the kernel on every
layer's attention, or taken off) alternate in blocks of ``--block`` tokens (the order reversed
every other round), so that a slow spell of a shared machine falls on both; per variant the
median of its blocks' ms a token, and the median over rounds of SDPA's block time over the
kernel's (paired: the steadier ratio). Beside it, one layer's attention call alone (the arena's
K/V of layer 0, SmolLM2's 9 query heads over 3 KV heads), and what the kernel changes in the
answers: the first answer token's logits (largest difference from SDPA's) and the greedy answer
of ``--answer`` tokens (identical or not).

    python bench/one_query.py --tokens 2048,4096,8192 --rounds 12 \\
        --out bench/results/one_query_int4_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sparkv.cache import SparkvCache
from sparkv.cache.attention import ONE_QUERY
from sparkv.runtime import decodeattn, load_model, sample_context_ids
from sparkv.runtime.batchdecode import DecodeItem, decode_together
from sparkv.runtime.generate import context_memory, greedy_generate, reference_prefill
from sparkv.runtime.threads import use_threads

VARIANTS = ("sdpa", "kernel")


def _use(lm: Any, variant: str) -> None:
    for layer in lm.decoder.layers:
        if variant == "kernel":
            setattr(layer.self_attn, ONE_QUERY, decodeattn.attend)
        elif hasattr(layer.self_attn, ONE_QUERY):
            delattr(layer.self_attn, ONE_QUERY)


def _median_us(fn: Any, reps: int = 60) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def _one_call(memory: Any, n: int) -> dict[str, float]:
    """Layer 0's attention call alone over the arena's first ``n`` rows: SDPA, the kernel."""
    k, v = memory.layers[0].prefix(n)
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, 3 * int(k.shape[1]), 1, int(k.shape[3]), generator=g)
    sdpa = _median_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    kernel = _median_us(lambda: decodeattn.attend(q, k, v, None))
    out = decodeattn.attend(q, k, v, None)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    diff = float((out - ref).abs().max()) if out is not None else float("nan")
    return {"sdpa_us": sdpa, "kernel_us": kernel, "speedup": sdpa / kernel, "max_diff": diff}


def _answers(lm: Any, memory: Any, n: int, tokens: int) -> dict[str, Any]:
    """The first answer token's logits and a greedy answer, SDPA's and the kernel's."""
    question = torch.tensor(lm.tokenizer.encode(" What is this about?"))
    got: dict[str, Any] = {}
    for variant in VARIANTS:
        _use(lm, variant)
        cache = SparkvCache(memory)
        logits = decode_together(lm, [DecodeItem(cache, int(question[0]), n)])[0]
        memory.truncate()
        answer = greedy_generate(lm, memory, n, question.tolist(), tokens, stop_at_eos=False)
        memory.truncate()
        got[variant] = (logits.float(), answer.tokens)
    diff = float((got["sdpa"][0] - got["kernel"][0]).abs().max())
    return {"first_logits_max_diff": diff, "greedy_identical": got["sdpa"][1] == got["kernel"][1],
            "greedy_tokens": tokens}


def _timed(lm: Any, memory: Any, n: int, rounds: int, block: int) -> dict[str, Any]:
    cache = SparkvCache(memory)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for rnd in range(rounds + 1):                            # round 0 warms both
        pos = n
        for variant in (VARIANTS if rnd % 2 else VARIANTS[::-1]):
            _use(lm, variant)
            t0 = time.perf_counter()
            for _ in range(block):
                decode_together(lm, [DecodeItem(cache, 5, pos)])
                pos += 1
            if rnd:
                times[variant].append(1e3 * (time.perf_counter() - t0) / block)
        memory.truncate()
    med = {v: statistics.median(t) for v, t in times.items()}
    paired = statistics.median(a / b for a, b in zip(times["sdpa"], times["kernel"]))
    return {"median_ms": med, "paired_speedup": paired, "ms": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="int4", help="the compute configuration")
    ap.add_argument("--tokens", default="2048,4096,8192", help="context lengths")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=4, help="answer tokens a block")
    ap.add_argument("--answer", type=int, default=24, help="greedy answer tokens compared")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-rows", type=int, default=decodeattn.MIN_ROWS,
                    help="fewest keys the kernel takes (to place the threshold)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_threads(args.threads)
    decodeattn.MIN_ROWS = args.min_rows
    lm = load_model(dtype=args.dtype)
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        print(f"{n} tokens: prefilling the context ...", flush=True)
        memory = context_memory(lm, reference_prefill(lm, sample_context_ids(lm, n)), n)
        row = {"tokens": n, "call": _one_call(memory, n),
               **_answers(lm, memory, n, args.answer),
               **_timed(lm, memory, n, args.rounds, args.block)}
        rows.append(row)
        c, m = row["call"], row["median_ms"]
        print(f"{n:6d} tokens  one call: SDPA {c['sdpa_us']:7.0f} us, kernel "
              f"{c['kernel_us']:7.0f} us ({c['speedup']:.2f}x, max diff {c['max_diff']:.1e})  "
              f"answer token: SDPA {m['sdpa']:6.1f} ms, kernel {m['kernel']:6.1f} ms "
              f"(paired {row['paired_speedup']:.3f}x)  first logits within "
              f"{row['first_logits_max_diff']:.1e}, greedy "
              f"{'identical' if row['greedy_identical'] else 'DIFFERENT'}", flush=True)
    _use(lm, "kernel" if lm.extra.get("compute_info", {}).get("one_query") else "sdpa")
    out = {"benchmark": "one_query", "model": lm.name, "dtype": args.dtype,
           "threads": args.threads, "rounds": args.rounds, "block": args.block,
           "min_rows": decodeattn.MIN_ROWS, "loadavg": os.getloadavg(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
