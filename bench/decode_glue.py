"""What the work around an answer token's matmuls costs, with and without two of its shortcuts:
the decoder layer calling its children's forwards directly
(:func:`sparkv.runtime.fastops._decoder_forward`) and q/k RoPE in one numba call
(:mod:`sparkv.runtime.ropekernel`). SmolLM2, one context of ``--tokens`` tokens, answer tokens
one pass each; the four variants (neither, each alone, both) alternate in blocks of
``--block`` tokens in one process (the order reversed every other round), so that a slow spell
of a shared machine falls on all of them. Per variant, the median of its blocks' ms a token.

    python bench/decode_glue.py --dtype int4 --rounds 16 \
        --out bench/results/decode_glue_int4_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

from sparkv.cache import SparkvCache
from sparkv.runtime import load_model, ropekernel, sample_context_ids
from sparkv.runtime.batchdecode import DecodeItem, decode_together
from sparkv.runtime.generate import context_memory, reference_prefill
from sparkv.runtime.threads import use_threads

#: variant -> (the fast decoder layer, the RoPE kernel)
VARIANTS = {"neither": (False, False), "layer": (True, False), "rope": (False, True),
            "both": (True, True)}


def _switch(layer_cls: type, own: Callable[..., Any], fast: Callable[..., Any],
            matches: Callable[[], bool], variant: str) -> None:
    lean, rope = VARIANTS[variant]
    layer_cls.forward = fast if lean else own                       # type: ignore[attr-defined]
    ropekernel.matches_torch = matches if rope else (lambda: False)  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", help="the compute configuration")
    ap.add_argument("--tokens", type=int, default=1024, help="the context's tokens")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--block", type=int, default=4, help="answer tokens a block")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_threads(args.threads)
    lm = load_model(dtype=args.dtype)
    n = args.tokens
    ids = sample_context_ids(lm, n)
    memory = context_memory(lm, reference_prefill(lm, ids), n)
    cache = SparkvCache(memory)
    layer_cls = type(lm.decoder.layers[0])
    own, fast, matches = layer_cls.__mro__[1].forward, layer_cls.forward, ropekernel.matches_torch
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for rnd in range(args.rounds + 1):                   # round 0 warms every variant
            order = list(VARIANTS) if rnd % 2 else list(VARIANTS)[::-1]
            pos = n
            for variant in order:
                _switch(layer_cls, own, fast, matches, variant)
                t0 = time.perf_counter()
                for _ in range(args.block):
                    decode_together(lm, [DecodeItem(cache, 5, pos)])
                    pos += 1
                if rnd:
                    times[variant].append(1e3 * (time.perf_counter() - t0) / args.block)
            memory.truncate()
    finally:
        _switch(layer_cls, own, fast, matches, "both")
    med = {v: statistics.median(t) for v, t in times.items()}
    for v in VARIANTS:
        print(f"{v:8s} {med[v]:7.1f} ms a token  ({med['neither'] / med[v]:.3f}x neither)")
    out = {"benchmark": "decode_glue", "model": lm.name, "dtype": args.dtype, "tokens": n,
           "threads": args.threads, "rounds": args.rounds, "block": args.block,
           "loadavg": os.getloadavg(), "median_ms": med, "ms": times}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
