"""What running the answer tokens of K asks as one forward pass gains (issue 45: the device
service's compute worker runs the answer tokens waiting together as one pass,
``sparkv device serve --ask-decode-batch``): SmolLM2, K contexts of ``--tokens`` tokens each,
their next tokens (a) one pass each, one after the other, (b) one pass of K rows
(:func:`sparkv.runtime.batchdecode.decode_together`), interleaved, ``--reps`` times; each
context's memory takes one token per pass, as decoding does.

Wall time per round (ms, the median of ``--reps``), and the ratio. On a CPU one decode pass is
bound by reading the weights: K rows cost about one.

    python bench/batch_decode.py --k 1,2,4,8 --tokens 1024 --threads 2 --out bench/results/batch_decode.json

``--dtype`` takes a compute configuration (``int4-kernel``: torch's packed int4 matmul reads a
quarter of float32's weight bytes; decode is where that can pay).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from sparkv.cache import SparkvCache
from sparkv.runtime import load_model, sample_context_ids
from sparkv.runtime.batchdecode import DecodeItem, decode_together
from sparkv.runtime.generate import context_memory, reference_prefill
from sparkv.runtime.threads import use_threads


def _round(lm, caches: list[SparkvCache], pos: int, together: bool) -> float:
    """One token for each cache at ``pos``; the wall seconds."""
    items = [DecodeItem(c, 5, pos) for c in caches]
    t0 = time.perf_counter()
    if together:
        decode_together(lm, items)
    else:
        for item in items:
            decode_together(lm, [item])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", default="1,2,4,8", help="contexts per round, comma-separated")
    ap.add_argument("--tokens", type=int, default=1024, help="each context's tokens")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32",
                    help="the model's compute configuration (docs/dtypes.md: float32, int4-kernel, ...)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_threads(args.threads)
    lm = load_model(dtype=args.dtype)
    ks = [int(k) for k in args.k.split(",")]
    n = args.tokens
    base = sample_context_ids(lm, n + max(ks))
    kvs = [reference_prefill(lm, base[i:i + n]) for i in range(max(ks))]
    rows = []
    for k in ks:
        caches = [SparkvCache(context_memory(lm, kv, n)) for kv in kvs[:k]]
        one, together = [], []
        for rep in range(args.reps):   # the memories grow by one token a pass, both variants
            one.append(_round(lm, caches, n + 2 * rep, together=False))
            together.append(_round(lm, caches, n + 2 * rep + 1, together=True))
        row = {"k": k, "one_by_one_ms": 1e3 * statistics.median(one),
               "together_ms": 1e3 * statistics.median(together)}
        row["ratio"] = row["one_by_one_ms"] / row["together_ms"]
        rows.append(row)
        print(f"K={k}: one by one {row['one_by_one_ms']:.1f} ms, together "
              f"{row['together_ms']:.1f} ms, {row['ratio']:.2f}x", flush=True)
    out = {"benchmark": "batch_decode", "model": lm.name, "dtype": args.dtype, "tokens": n,
           "threads": args.threads,
           "reps": args.reps, "loadavg": os.getloadavg(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
