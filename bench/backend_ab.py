"""A/B of the local prefill's attention backends in one compute configuration
(docs/dtypes.md, "On a CPU with bf16 hardware"): the layer stepper's whole prefill with
``dense`` and with ``block_sparse`` (the CPU's ``auto``), alternated round by round in one
process; the best round of each and their ratio.

    python bench/backend_ab.py --dtype mixed-attn --sizes 4096,8192 [--rounds 2] [--out F.json]

Wall clock on whatever machine runs it (2 torch threads, T=1024, SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

BACKENDS = ("dense", "block_sparse")


def prefill_seconds(lm: object, ids: list[int], backend: str) -> float:
    """One local prefill of ``ids`` by the layer stepper (T=1024) with ``backend``."""
    from sparkv.runtime import LayerStepper, get_backend

    start = time.perf_counter()
    LayerStepper(lm, ids, 1024, get_backend(backend)).complete()
    return time.perf_counter() - start


def run(dtype: str, sizes: list[int], rounds: int) -> list[dict[str, object]]:
    """Per size, every round's seconds per backend and the best-round ratio."""
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime.generate import sample_context_ids

    lm = load_model_in_dtype(None, dtype=dtype, device="cpu", progress=False)
    rows: list[dict[str, object]] = []
    for size in sizes:
        ids = sample_context_ids(lm, size)
        runs: dict[str, list[float]] = {b: [] for b in BACKENDS}
        for _ in range(rounds):
            for backend in BACKENDS:
                runs[backend].append(prefill_seconds(lm, ids, backend))
        ratio = min(runs["block_sparse"]) / min(runs["dense"])
        rows.append({"tokens": size, "dtype": lm.compute.name, "seconds": runs,
                     "block_sparse_over_dense": ratio})
        print(f"{lm.compute.name} {size} tokens: dense {min(runs['dense']):.2f} s, block-sparse "
              f"{min(runs['block_sparse']):.2f} s, block-sparse / dense {ratio:.2f}", flush=True)
    return rows


def main() -> int:
    from sparkv.bench.common import machine_info

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", help="compute configuration (docs/dtypes.md)")
    p.add_argument("--sizes", default="4096,8192", help="context tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="prefills of each backend, alternated")
    p.add_argument("--out", default=None, help="write the rounds here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows = run(args.dtype, [int(s) for s in args.sizes.split(",")], args.rounds)
    if args.out:
        doc = {"benchmark": "backend_ab", "machine": machine_info(), "rows": rows}
        pathlib.Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
