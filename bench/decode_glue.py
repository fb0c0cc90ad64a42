"""What the work around an answer token's matmuls costs, with and without three of its
shortcuts: the decoder layer calling its children's forwards directly
(:func:`sparkv.runtime.fastops._decoder_forward`), q/k RoPE in one numba call
(:mod:`sparkv.runtime.ropekernel`) and the lean wrapper around the few-rows weight kernels
(:func:`sparkv.runtime.rowkernels.run_rows`; the variants without it run the wrapper it
replaced, :func:`_plain_run_rows`). SmolLM2, one context of ``--tokens`` tokens, answer tokens
one pass each; the five variants (none, each alone, all) alternate in blocks of
``--block`` tokens in one process (the order reversed every other round), so that a slow spell
of a shared machine falls on all of them. Per variant, the median of its blocks' ms a token, and
the median over rounds of none's block time over the variant's (paired: the steadier ratio).

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

import numba as nb
import numpy as np
import torch

from sparkv.cache import SparkvCache
from sparkv.runtime import load_model, q41kernel, q80, ropekernel, rowkernels, sample_context_ids
from sparkv.runtime.batchdecode import DecodeItem, decode_together
from sparkv.runtime.generate import context_memory, reference_prefill
from sparkv.runtime.threads import use_threads

#: variant -> (the fast decoder layer, the RoPE kernel, the lean kernel wrapper)
VARIANTS = {"none": (False, False, False), "layer": (True, False, False),
            "rope": (False, True, False), "rows": (False, False, True), "all": (True, True, True)}


def _plain_run_rows(x: torch.Tensor, arrays: tuple[Any, ...], out_features: int,
                    kernel_for: Callable[[int], Callable[..., None]]) -> torch.Tensor:
    """The kernel wrapper before the lean one: numba asked for its thread count every call,
    the output shaped by torch's ``view``."""
    xs = (x if x.is_contiguous() else x.contiguous()).numpy().reshape(-1, x.shape[-1])
    y = np.empty((xs.shape[0], out_features), dtype=np.float32)
    threads = max(1, min(torch.get_num_threads(), rowkernels._NUMBA_THREADS))
    if nb.get_num_threads() != threads:
        nb.set_num_threads(threads)
    for a in range(0, xs.shape[0], rowkernels.MAX_ROWS):
        b = min(a + rowkernels.MAX_ROWS, xs.shape[0])
        kernel_for(b - a)(xs[a:b], *arrays, y[a:b])
    return torch.from_numpy(y).view(*x.shape[:-1], out_features)


def _switch(layer_cls: type, own: Callable[..., Any], fast: Callable[..., Any],
            matches: Callable[[], bool], variant: str) -> None:
    lean, rope, rows = VARIANTS[variant]
    layer_cls.forward = fast if lean else own                       # type: ignore[attr-defined]
    ropekernel.matches_torch = matches if rope else (lambda: False)  # type: ignore[assignment]
    wrapper = rowkernels.run_rows if rows else _plain_run_rows
    q41kernel.run_rows = q80.run_rows = wrapper


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
        _switch(layer_cls, own, fast, matches, "all")
    med = {v: statistics.median(t) for v, t in times.items()}
    # per round, none's block over the variant's (the round's blocks ran back to back)
    paired = {v: statistics.median(a / b for a, b in zip(times["none"], t))
              for v, t in times.items()}
    for v in VARIANTS:
        print(f"{v:8s} {med[v]:7.1f} ms a token  ({med['none'] / med[v]:.3f}x none; "
              f"paired by round {paired[v]:.3f}x)")
    out = {"benchmark": "decode_glue", "model": lm.name, "dtype": args.dtype, "tokens": n,
           "threads": args.threads, "rounds": args.rounds, "block": args.block,
           "loadavg": os.getloadavg(), "median_ms": med, "paired_speedup": paired,
           "ms": times}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
