"""One context's encode job on one thread and on several (``encode_threads``, docs/server.md):
the bundled SmolLM2 prefills a context once, then the job's frames are coded and stored into a
file store, alternating the thread counts over ``--rounds`` paired rounds (each round a fresh
store). Reported: the coding phase's wall time (the job minus its prefill) per thread count and
the ratio against one thread, with the stored frames checked identical.

    python bench/encode_threads.py [--tokens 2048] [--chunk-tokens 256,1024] [--threads 1,2]
        [--rounds 3] [--out bench/results/encode_threads_cpu.json]

Frames of more values per tensor scale better: the codec's numba kernels release the GIL, its
Python between them does not. SmolLM2 at T=256 codes 3 x 256 x 64 values per tensor; the GPU
check's 1B shape at T=512 codes 8 x 512 x 64, close to SmolLM2 at T=1024 (3 x 1024 x 64).

The server has no paper figure to answer to: SparKV's paper (sparkv.md) encodes offline. The
point is the GPU check's 46 s server-side encode of a 32K context (docs/gpu.md), which a
16-core host codes in parallel.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

from tqdm import tqdm


def _job(entry: Any, spec: Any, cid: str, root: str, threads: int) -> tuple[float, float, dict]:
    from sparkv.server.encoder import encode_context
    from sparkv.server.stores import open_store

    store = open_store(f"file://{root}")
    t0 = time.perf_counter()
    _, stats = encode_context(entry, spec, cid, store.chunks, threads=threads)
    wall = time.perf_counter() - t0
    frames = {k: store.chunks.get(spec.tenant, cid, k) for k in store.chunks.keys(spec.tenant, cid)}
    return wall - stats.prefill_s, stats.codec_s, frames


def _point(entry: Any, ids: tuple[int, ...], chunk_tokens: int, args: argparse.Namespace,
           counts: list[int]) -> dict[str, Any]:
    """Paired rounds of one chunk size: every thread count once per round, alternating."""
    from sparkv.server.encoder import ContextSpec, derive_context_id

    spec = ContextSpec("bench", "smollm2", ids, chunk_tokens, tuple(args.levels.split(",")), 0,
                       False, None)
    cid = derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)
    walls: dict[int, list[float]] = {n: [] for n in counts}
    codec: dict[int, list[float]] = {n: [] for n in counts}
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        for r in tqdm(range(args.rounds), desc=f"T={chunk_tokens}", file=sys.stderr):
            for n in (counts if r % 2 == 0 else counts[::-1]):
                wall, codec_s, frames = _job(entry, spec, cid, f"{tmp}/r{r}t{n}", n)
                reference = reference or frames
                if frames != reference:
                    raise SystemExit(f"{n} threads stored different frames")
                walls[n].append(wall)
                codec[n].append(codec_s)
    one = statistics.median(walls[counts[0]])
    rows = [{"threads": n, "coding_wall_s": statistics.median(walls[n]),
             "codec_thread_s": statistics.median(codec[n]),
             "speedup_vs_first": one / statistics.median(walls[n]), "walls_s": walls[n]}
            for n in counts]
    return {"chunk_tokens": chunk_tokens, "frames": len(reference or {}), "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk-tokens", default="256,1024")
    p.add_argument("--levels", default="q8,q6,q5,q4,raw")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args()
    from sparkv.runtime import load_model
    from sparkv.runtime.generate import sample_text
    from sparkv.server.models import ModelEntry

    lm = load_model()
    entry = ModelEntry.from_loaded("smollm2", lm, 1 << 20)
    base = lm.tokenizer.encode(sample_text(), add_special_tokens=False)
    ids = tuple((base * (args.tokens // len(base) + 1))[:args.tokens])
    counts = [int(x) for x in args.threads.split(",")]
    points = [_point(entry, ids, int(t), args, counts)
              for t in args.chunk_tokens.split(",")]
    print(f"{args.tokens} tokens ({args.levels}), {os.cpu_count()} cores, median of "
          f"{args.rounds} paired rounds:")
    for point in points:
        for row in point["rows"]:
            print(f"  T={point['chunk_tokens']} ({point['frames']} frames), {row['threads']} "
                  f"threads: coding {row['coding_wall_s']:.2f} s "
                  f"({point['frames'] / row['coding_wall_s']:.0f} frames/s), "
                  f"{row['speedup_vs_first']:.2f}x {counts[0]} thread(s)")
    result = {"tokens": args.tokens, "levels": args.levels, "cores": os.cpu_count(),
              "rounds": args.rounds, "points": points}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
