"""``sparkv bench layer-precision``: each decoder layer's sensitivity to bf16 matmuls, and the
layers ``mixed-layers`` may compute in bf16 (:mod:`sparkv.runtime.layerprec`, docs/dtypes.md).

Runs the model's full forward over calibration text in float32 and once per layer with only that
layer's linear layers in bf16 (``mixed``), prints per layer the mean KL against float32 and the
share of positions whose argmax it keeps, selects the least sensitive layers within
``--budget-kl`` and measures the selection. The calibration text is Python's own reference
documentation (``pydoc_data.topics``): held out from every QA set of the quality table, so the
selection is not fitted to the text it is judged on. ``--save`` stores it for the model.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

from sparkv.bench.common import add_run_args, format_table, write_result


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("layer-precision",
                       help="per-layer sensitivity to bf16 matmuls; the mixed-layers selection")
    p.add_argument("--tokens", type=int, default=1536, help="calibration tokens")
    p.add_argument("--budget-kl", type=float, default=None,
                   help="summed per-layer KL (nats per position) the selection may spend "
                        "(default: sparkv.runtime.layerprec.DEFAULT_BUDGET_KL)")
    p.add_argument("--save", action="store_true",
                   help="store the selection for this model (mixed-layers uses it)")
    add_run_args(p, "layer_precision", threads_help="torch threads (default: torch's)")
    p.set_defaults(func=run)


def calibration_ids(lm: object, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids of Python's reference documentation (``pydoc_data.topics``, in
    key order), repeated if short."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = lm.encode_text(text[: num_tokens * 8])  # type: ignore[attr-defined]
    while len(ids) < num_tokens:
        ids = ids + ids
    return ids[:num_tokens]


def run(args: argparse.Namespace) -> int:
    import torch

    from sparkv.runtime import load_model
    from sparkv.runtime.layerprec import (DEFAULT_BUDGET_KL, measure_layer_precision,
                                          save_precision)

    if args.threads:
        torch.set_num_threads(args.threads)
    budget = DEFAULT_BUDGET_KL if args.budget_kl is None else args.budget_kl
    if budget < 0:
        raise SystemExit("--budget-kl must be at least 0")
    lm = load_model(args.model, dtype="float32", device="cpu")
    ids = calibration_ids(lm, args.tokens)
    start = time.perf_counter()
    rec = measure_layer_precision(
        lm, ids, budget,
        progress=lambda i, kl, a: print(f"  layer {i:2d}: KL {kl:.3e}, argmax kept {a:.4f}",
                                        flush=True))
    rec.meta.update(text="pydoc_data.topics", seconds=time.perf_counter() - start)
    print(format_table(["layer", "KL", "argmax kept", "bf16"],
                       [[i, kl, a, "yes" if i in rec.bf16 else ""]
                        for i, (kl, a) in enumerate(zip(rec.layer_kl, rec.layer_agreement))]))
    print(f"selection: {len(rec.bf16)} of {len(rec.layer_kl)} layers in bf16 (budget "
          f"{budget:g}): KL {rec.selection_kl:.3e}, argmax kept {rec.selection_agreement:.4f}")
    if args.save:
        print(f"saved {save_precision(rec)}")
    if args.json or args.out:
        path = write_result("layer_precision", {"results": [asdict(rec)]},
                            {"model": lm.name, "tokens": args.tokens, "budget_kl": budget,
                             "torch_threads": torch.get_num_threads()}, args.out)
        print(f"wrote {path}")
    return 0


__all__ = ["calibration_ids", "register", "run"]
