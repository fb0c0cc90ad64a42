"""``sparkv bench prefill``: dense vs block-sparse chunked local prefill of SmolLM2.

For each context length: wall time of the whole layer-step prefill with each backend, the speedup,
the fraction of causal blocks skipped, and the answer quality of the sparse cache against the dense
one (max abs first-token logit difference, greedy agreement over 32 tokens, first-token KL). Also a
per-step cost table ``(t, l, backend) -> ms`` for the predictor. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from sparkv.bench.common import format_table, results_dir, write_result
from sparkv.runtime.device import add_device_args

QUESTION = "\n\nQuestion: In one sentence, what is this document about?\nAnswer:"


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("prefill", help="dense vs block-sparse local prefill (time, quality)")
    p.add_argument("--sizes", default="1024,2048,4096,8192",
                   help="comma-separated context lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="T, tokens per chunk")
    p.add_argument("--cdf", type=float, default=None, help="override the cdf threshold")
    p.add_argument("--estimator", default=None, choices=["qpool", "meansim"])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--model", default=None, help="local checkpoint (default: bundled SmolLM2)")
    add_device_args(p)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's; 1 is fairer on a shared machine)")
    p.add_argument("--json", action="store_true", help="write bench/results/prefill.json")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/prefill.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from sparkv.runtime import (BlockSparseAttention, DenseAttention, LayerStepper, SparsityConfig,
                                first_token_kl, greedy_agreement, greedy_generate, load_model,
                                sample_context_ids)

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    question = lm.encode_text(QUESTION)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    cfg = SparsityConfig()
    if args.cdf is not None:
        cfg.cdf_threshold = args.cdf
    if args.estimator:
        cfg.estimator = args.estimator
    backends = {"dense": DenseAttention(), "block_sparse": BlockSparseAttention(cfg)}
    for backend in backends.values():  # warm-up: first calls pay one-off allocation costs
        LayerStepper(lm, sample_context_ids(lm, 2 * args.chunk_tokens), args.chunk_tokens,
                     backend).complete()
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    bar = tqdm(total=len(sizes) * len(backends), desc="prefill bench", unit="run")
    for n in sizes:
        ids = sample_context_ids(lm, n)
        outcome: dict[str, Any] = {}
        for name, backend in backends.items():
            stepper = LayerStepper(lm, ids, args.chunk_tokens, backend)
            start = time.perf_counter()
            results = stepper.complete()
            wall = time.perf_counter() - start
            kv = stepper.kv.layer_kv()
            gen = greedy_generate(lm, kv, n, question, args.new_tokens, stop_at_eos=False)
            active = sum(float(r.stats.active_blocks.float().mean()) for r in results if r.stats)
            causal = sum(r.stats.causal_blocks for r in results if r.stats)
            outcome[name] = {"wall_s": wall, "gen": gen, "density": active / max(causal, 1)}
            for r in results:
                steps.append({"tokens": n, "t": r.step.t, "l": r.step.l, "backend": name,
                              "ms": r.seconds * 1e3,
                              "active_blocks": (float(r.stats.active_blocks.float().mean())
                                                if r.stats else 0.0),
                              "causal_blocks": r.stats.causal_blocks if r.stats else 0})
            bar.update(1)
        d, s = outcome["dense"], outcome["block_sparse"]
        rows.append({
            "tokens": n,
            "dense_s": d["wall_s"],
            "sparse_s": s["wall_s"],
            "speedup": d["wall_s"] / s["wall_s"],
            "blocks_skipped": 1.0 - s["density"],
            "max_abs_logit_diff": float((d["gen"].first_logits - s["gen"].first_logits).abs().max()),
            "greedy_agreement": greedy_agreement(d["gen"].tokens, s["gen"].tokens),
            "first_token_kl": first_token_kl(d["gen"].first_logits, s["gen"].first_logits),
            "dense_answer": d["gen"].text,
            "sparse_answer": s["gen"].text,
        })
    bar.close()
    headers = ["tokens", "dense_s", "sparse_s", "speedup", "skipped", "max|dlogit|", "greedy",
               "KL"]
    table = [[r["tokens"], r["dense_s"], r["sparse_s"], r["speedup"], r["blocks_skipped"],
              r["max_abs_logit_diff"], r["greedy_agreement"], r["first_token_kl"]] for r in rows]
    print(format_table(headers, table))
    config = {"model": lm.name, "chunk_tokens": args.chunk_tokens, "sparsity": vars(cfg),
              "torch_threads": torch.get_num_threads(), "new_tokens": args.new_tokens}
    target = {"speedup_at_8k": 1.5, "greedy_agreement": 0.9}
    if args.json or args.out:
        path = write_result("prefill", {"results": rows, "step_costs": steps, "targets": target},
                            config, args.out)
        _plot(rows, path.with_suffix(".png"))
        print(f"wrote {path}")
    return 0


def _plot(rows: list[dict[str, Any]], path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["tokens"] for r in rows]
    ax.plot(n, [r["dense_s"] for r in rows], "o-", label="dense (SDPA)")
    ax.plot(n, [r["sparse_s"] for r in rows], "s-", label="block-sparse")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("local prefill wall time (s)")
    ax.set_title("SmolLM2-135M chunked prefill on this CPU")
    for r in rows:
        ax.annotate(f"{r['speedup']:.2f}x", (r["tokens"], r["sparse_s"]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["register", "run", "results_dir"]
