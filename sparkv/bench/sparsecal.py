"""``sparkv bench calibrate-sparse``: block-sparse thresholds per layer (and head) for a model.

Prefills calibration prompts (the sample text at each ``--sizes`` length) with dense attention and
measures every candidate ``(cdf, sim)`` threshold pair on each layer's real ``q, k, v``
(:mod:`sparkv.runtime.sparsecal`); keeps per layer the settings that skip the most blocks while
each call's relative L1 error of the attention output stays within ``--eps``, then verifies them
as the runtime runs them. Prints one row per layer; ``--save`` stores them for the model
(``<cache dir>/sparse/thresholds-<fingerprint>.json``), where ``block_sparse`` and ``auto`` pick
them up. See docs/runtime.md.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

from sparkv.bench.common import add_run_args, format_table, write_result
from sparkv.cliflags import add_device_args


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("calibrate-sparse",
                       help="calibrate block-sparse thresholds per layer against an error bound")
    p.add_argument("--sizes", default="4096,8192", help="calibration prompt lengths in tokens")
    p.add_argument("--eps", type=float, default=0.05,
                   help="bound on each call's relative L1 error of the attention output")
    p.add_argument("--cdfs", default=None, help="candidate cdf thresholds (comma-separated)")
    p.add_argument("--sims", default=None,
                   help="candidate self-similarity thresholds (comma-separated)")
    p.add_argument("--per-head", default="auto", choices=["auto", "always", "never"],
                   help="per-head cdf thresholds: where they keep fewer blocks (auto), always, "
                        "or one per layer")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="T, tokens per chunk")
    p.add_argument("--estimator", default="qpool", choices=["qpool", "meansim"],
                   help="block-sparse attention's block estimator")
    p.add_argument("--save", action="store_true",
                   help="store the thresholds for this model (block_sparse and auto use them)")
    add_device_args(p)
    add_run_args(p, "calibrate_sparse", threads_help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def _floats(text: str | None, default: tuple[float, ...], flag: str) -> tuple[float, ...]:
    if text is None:
        return default
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0.0 < x <= 1.0 for x in values):
        raise SystemExit(f"{flag}: values must be in (0, 1], got {text!r}")
    return values


def run(args: argparse.Namespace) -> int:
    import torch

    from sparkv.runtime import SparsityConfig, load_model, sample_context_ids
    from sparkv.runtime.sparsecal import (DEFAULT_CDFS, DEFAULT_SIMS, calibrate_thresholds,
                                          summary)
    from sparkv.runtime.thresholds import save_thresholds

    if args.eps <= 0:
        raise SystemExit("--eps must be positive")
    cdfs = _floats(args.cdfs, DEFAULT_CDFS, "--cdfs")
    sims = _floats(args.sims, DEFAULT_SIMS, "--sims")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    cfg = SparsityConfig(estimator=args.estimator)
    start = time.perf_counter()
    th = calibrate_thresholds(lm, [sample_context_ids(lm, n) for n in sizes], args.eps,
                              args.chunk_tokens, cdfs, sims, args.per_head, cfg)
    wall = time.perf_counter() - start
    rows = summary(th)
    print(format_table(["layer", "cdf min", "cdf max", "per head", "sim", "error", "density"],
                       [[r["layer"], r["cdf_min"], r["cdf_max"], r["per_head"], r["sim"],
                         r["error"], r["density"]] for r in rows]))
    print(f"calibrated {len(rows)} layers in {wall:.1f} s (eps {args.eps}, prompts {sizes})")
    if args.save:
        print(f"saved {save_thresholds(th)}")
    if args.json or args.out:
        config = {"model": lm.name, "fingerprint": lm.fingerprint, "dtype": str(lm.dtype),
                  "device": str(lm.device), "sizes": sizes, "eps": args.eps, "cdfs": cdfs,
                  "sims": sims, "per_head": args.per_head, "estimator": args.estimator,
                  "chunk_tokens": args.chunk_tokens, "wall_s": wall}
        payload: dict[str, Any] = {"results": rows, "thresholds": asdict(th)}
        print(f"wrote {write_result('calibrate_sparse', payload, config, args.out)}")
    return 0
