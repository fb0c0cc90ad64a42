"""``sparkv bench prefill``: local prefill, every way sparkv can run it, against the model's own.

Variants (``--variants``, comma-separated; ``+fused`` runs the stepper layer by layer over the
whole context instead of one token chunk at a time, :meth:`LayerStepper.complete`; ``+engine``
runs the edge engine's all-local load of the context as the ``local`` strategy does, with the
controller it gets on this device (spans of a layer's token chunks on every device since
session 64, :class:`~sparkv.scheduler.rules.CommitSpans`; ``SPARKV_FUSED_SPANS=0`` runs it step by
step); ``+spans`` / ``+steps`` force either; ``+eager`` runs the stepper step by step without the CUDA graphs a GPU's steps
replay by default, :mod:`sparkv.runtime.graphs`):

* ``full``: transformers' own forward over the whole context (``use_cache``, last logits only):
  the baseline the stepper answers to;
* ``dense``: the layer stepper with :class:`DenseAttention` (on CUDA a chunk after a prefix runs
  as prefix + own keys merged by LSE); ``dense_mask``: the same with SDPA and a boolean mask (the
  path before the split, kept as a baseline);
* ``block_sparse``, ``flex_dense``, ``flex_sparse``, ``auto``: the stepper with that backend.

For each context length and variant: the median wall time over ``--repeats`` runs (after a warm-up
run on CUDA, where kernels compile and load on first use), its ratio to ``full`` and to ``dense``,
the fraction of causal blocks skipped, and the answer against the first of ``full``/``dense``
(max abs first-token logit difference, greedy agreement, first-token KL). Also a per-step cost
table ``(t, l, backend) -> ms`` for the predictor. ``--model random:llama-3.2-3b`` times a real
shape with random weights (labelled so in the JSON; its answers are noise). See
docs/benchmarks.md and docs/gpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sparkv.bench.common import add_run_args, format_table, results_dir, write_result
from sparkv.cliflags import add_device_args

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

QUESTION = "\n\nQuestion: In one sentence, what is this document about?\nAnswer:"
BACKENDS = ("dense", "dense_mask", "block_sparse", "flex_dense", "flex_sparse", "auto")


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("prefill", help="local prefill: stepper backends vs the full forward")
    p.add_argument("--sizes", default="1024,2048,4096,8192",
                   help="comma-separated context lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=1024, help="T, tokens per chunk")
    p.add_argument("--variants", default="dense,block_sparse",
                   help="comma-separated: full, " + ", ".join(BACKENDS)
                        + "; NAME+fused runs the stepper layer by layer; NAME+engine the edge "
                          "engine's local load (spans on a GPU), NAME+spans / NAME+steps with "
                          "its spans forced on / off, NAME+eager step by step without CUDA "
                          "graphs")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per point (median)")
    p.add_argument("--profile", default=None, metavar="VARIANT",
                   help="also profile one run of VARIANT at the largest size (torch.profiler): "
                        "kernel time by kernel, against the wall time")
    p.add_argument("--cdf", type=float, default=None, help="override the cdf threshold")
    p.add_argument("--estimator", default=None, choices=["qpool", "meansim"],
                   help="block-sparse attention's block estimator (default: the backend's, qpool)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="tokens generated after the question (the agreement with the reference)")
    add_device_args(p)
    add_run_args(p, "prefill",
                 threads_help="torch threads (default: torch's; 1 is fairer on a shared machine)",
                 model_help="local checkpoint, or random:SHAPE for a real shape with random "
                            "weights (default: bundled SmolLM2)")
    p.set_defaults(func=run)


@dataclass
class PrefillVariant:
    name: str            # as given: dense, auto+fused, full, dense+engine, ...
    backend: str         # full or a backend name
    fused: bool
    engine: bool | None = None   # run by the edge engine: None no; True/False spans forced
    by_engine: bool = False
    graphs: bool | None = None   # the stepper's CUDA graphs: None the device's default


def parse_variants(text: str) -> list[PrefillVariant]:
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        base, _, flag = spec.partition("+")
        if base not in ("full", *BACKENDS) or flag not in ("", *ENGINE_FLAGS, "fused", "eager") \
                or (base == "full" and flag):
            raise SystemExit(f"--variants: unknown variant {spec!r} (full, {', '.join(BACKENDS)}"
                             ", each optionally +fused, +engine, +spans, +steps or +eager)")
        out.append(PrefillVariant(spec, base, flag == "fused", ENGINE_FLAGS.get(flag),
                                  flag in ENGINE_FLAGS, False if flag == "eager" else None))
    return out


#: ``+flag`` -> the engine's spans: the device's default (None), forced on, forced off
ENGINE_FLAGS: dict[str, bool | None] = {"engine": None, "spans": True, "steps": False}


def _backend(name: str, cfg: Any) -> Any:
    from sparkv.runtime import DenseAttention, get_backend

    if name == "dense_mask":
        return DenseAttention(split=False)
    return get_backend(name, cfg)


def _sync(lm: LoadedModel) -> None:
    import torch

    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def _run_once(lm: LoadedModel, ids: list[int], v: PrefillVariant, chunk: int, backend: Any
              ) -> tuple[float, Any, list[Any]]:
    """One prefill: ``(seconds, per-layer KV, step results)``."""
    import torch

    from sparkv.runtime import LayerStepper
    from sparkv.runtime.kvcache import from_dynamic_cache
    from sparkv.runtime.hfcache import output_cache

    _sync(lm)
    start = time.perf_counter()
    if v.backend == "full":
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=lm.device)
            out = lm.model(input_ids=x, use_cache=True, logits_to_keep=1)
        _sync(lm)
        return time.perf_counter() - start, from_dynamic_cache(output_cache(out)), []
    stepper = LayerStepper(lm, ids, chunk, backend, graphs=v.graphs)
    results = _engine_load(stepper, v.engine) if v.by_engine else stepper.complete(fused=v.fused)
    _sync(lm)
    return time.perf_counter() - start, stepper.kv.layer_kv(), results


def _engine_load(stepper: Any, spans: bool | None) -> list[Any]:
    """The edge engine's all-local load of ``stepper``'s context (a local plan, no link), with
    the controller of this device (``spans`` None) or spans forced on or off; no step results
    (the engine reports timings, not attention statistics)."""
    from sparkv.edge.engine import Engine
    from sparkv.runtime.device import fused_spans
    from sparkv.scheduler.controller import ControllerConfig
    from sparkv.scheduler.instance import Instance
    from sparkv.scheduler.planners import get_planner

    geo = stepper.geometry
    inst = Instance.from_mappings(geo, {c: {"raw": 1} for c in geo.chunk_ids()},
                                  {s: 1e-3 for s in geo.step_ids()}, 1.0, name="prefill")
    on = fused_spans(stepper.lm.device) if spans is None else spans
    Engine(stepper, get_planner("local").plan(inst), inst,
           ControllerConfig.static().with_spans(on), source=None).run()
    return []


def _measure(lm: LoadedModel, ids: list[int], v: PrefillVariant, args: argparse.Namespace, cfg: Any
             ) -> tuple[list[float], Any, list[Any]]:
    backend = None if v.backend == "full" else _backend(v.backend, cfg)
    if lm.device.type == "cuda":                 # compile / load kernels at this shape first
        _run_once(lm, ids, v, args.chunk_tokens, backend)
    walls: list[float] = []
    for _ in range(max(1, args.repeats)):
        wall, kv, results = _run_once(lm, ids, v, args.chunk_tokens, backend)
        walls.append(wall)
    return walls, kv, results


def _density(results: list[Any]) -> float:
    active = sum(float(r.stats.active_blocks.float().mean()) for r in results if r.stats)
    causal = sum(r.stats.causal_blocks for r in results if r.stats)
    return active / causal if causal else 1.0


def _question(lm: LoadedModel) -> list[int]:
    if lm.tokenizer is None:
        return list(range(1, 17))
    return lm.encode_text(QUESTION)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from sparkv.logs import progress_bar

    from sparkv.runtime import (LayerStepper, SparsityConfig, first_token_kl, greedy_agreement,
                                greedy_generate, sample_context_ids)
    from sparkv.predictor.dtypes import load_model_in_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    variants = parse_variants(args.variants)
    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    question = _question(lm)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    cfg = None  # no override: block_sparse/auto use the model's calibrated thresholds if stored
    if args.cdf is not None or args.estimator:
        cfg = SparsityConfig()
        if args.cdf is not None:
            cfg.cdf_threshold = args.cdf
        if args.estimator:
            cfg.estimator = args.estimator
    if lm.device.type != "cuda":   # warm-up: first calls pay one-off allocation costs
        for v in variants:
            if v.backend != "full":
                LayerStepper(lm, sample_context_ids(lm, 2 * args.chunk_tokens), args.chunk_tokens,
                             _backend(v.backend, cfg)).complete(v.fused)
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    bar = progress_bar(total=len(sizes) * len(variants), desc="prefill bench", unit="run")
    for n in sizes:
        ids = sample_context_ids(lm, n)
        ref = None
        for v in variants:
            try:
                walls, kv, results = _measure(lm, ids, v, args, cfg)
            except Exception as exc:  # noqa: BLE001 - a variant that fails (a kernel that
                # does not compile, memory) is reported, and the others still run
                print(f"prefill bench: {v.name} at {n} tokens failed: {exc!r}"[:800])
                rows.append({"tokens": n, "variant": v.name, "error": repr(exc)[:800]})
                bar.update(1)
                continue
            gen = greedy_generate(lm, kv, n, question, args.max_new_tokens, stop_at_eos=False)
            del kv
            row = {"tokens": n, "variant": v.name, "wall_s": statistics.median(walls),
                   "walls_s": walls, "density": None if v.by_engine else _density(results),
                   "answer": gen.text}
            tqdm.write(f"  {n} tokens  {v.name:>14}: {row['wall_s']:.4f} s "
                       f"(runs {', '.join(f'{w:.4f}' for w in walls)})")
            if ref is None and v.backend in ("full", "dense"):
                ref = (v.name, gen)
            if ref is not None:
                row.update(reference=ref[0],
                           max_abs_logit_diff=float((ref[1].first_logits - gen.first_logits)
                                                    .abs().max()),
                           greedy_agreement=greedy_agreement(ref[1].tokens, gen.tokens),
                           first_token_kl=first_token_kl(ref[1].first_logits, gen.first_logits))
            rows.append(row)
            if not v.fused and not v.by_engine:
                steps.extend(_step_rows(n, v.name, results))
            if lm.device.type == "cuda":
                torch.cuda.empty_cache()
            bar.update(1)
    bar.close()
    _add_ratios(rows)
    print(_table(rows))
    profile = _profile(lm, sample_context_ids(lm, sizes[-1]), args, cfg) if args.profile else None
    config = {"model": lm.name, "random_weights": lm.name.startswith("random:"),
              "device": str(lm.device), "dtype": str(lm.dtype).replace("torch.", ""),
              "gpu": torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else None,
              "chunk_tokens": args.chunk_tokens, "sparsity": vars(cfg or SparsityConfig()),
              "sparse_thresholds": _thresholds_file(lm) if cfg is None else None,
              "torch_threads": torch.get_num_threads(), "new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "variants": [v.name for v in variants],
              "lse_kernel": _lse_kernel_name(lm)}
    target = {"sparse_speedup_at_8k_cpu": 1.5, "greedy_agreement": 0.9,
              "stepper_dense_vs_full_gpu_at_most": 1.05}
    if args.json or args.out:
        path = write_result("prefill", {"results": rows, "summary": _summary(rows),
                                        "profile": profile, "step_costs": steps,
                                        "targets": target}, config, args.out)
        _plot(rows, path.with_suffix(".png"), lm.name, str(lm.device))
        print(f"wrote {path}")
    return 0


def _profile(lm: LoadedModel, ids: list[int], args: argparse.Namespace, cfg: Any) -> dict[str, Any]:
    """One profiled run of ``args.profile``: wall time, summed kernel time (the GPU's busy time,
    at most; on the CPU the operators' self CPU time), and the kernels (operators) that took
    most of it (:func:`~sparkv.bench.profiling.profile_kernels`)."""
    from sparkv.bench.profiling import kernel_table, profile_kernels

    v = parse_variants(args.profile)[0]
    backend = None if v.backend == "full" else _backend(v.backend, cfg)
    prof = profile_kernels(lambda: _run_once(lm, ids, v, args.chunk_tokens, backend), lm.device)
    out = {"variant": v.name, "tokens": len(ids), **prof}
    print(f"profile of {v.name} at {len(ids)} tokens: wall {prof['wall_s']:.3f} s, kernels busy "
          f"{prof['kernel_busy_s']:.3f} s ({prof['kernel_launches']} launches)")
    print(format_table(["kernel", "calls", "ms"], kernel_table(prof)))
    return out


def _thresholds_file(lm: LoadedModel) -> str | None:
    """The model's calibrated block-sparse thresholds file, when one is stored."""
    from sparkv.runtime.thresholds import load_thresholds, thresholds_path

    found = load_thresholds(str(lm.fingerprint))
    return str(thresholds_path(found.fingerprint)) if found is not None else None


def _lse_kernel_name(lm: LoadedModel) -> str | None:
    """Which LSE kernel the dense split runs on this device (None: the masked path)."""
    from sparkv.runtime.split import lse_kernel

    chosen = lse_kernel(lm.device, lm.dtype)
    return chosen[0] if chosen else None


def _step_rows(n: int, name: str, results: list[Any]) -> list[dict[str, Any]]:
    return [{"tokens": n, "t": r.step.t, "l": r.step.l, "backend": name, "ms": r.seconds * 1e3,
             "active_blocks": (float(r.stats.active_blocks.float().mean()) if r.stats else 0.0),
             "causal_blocks": r.stats.causal_blocks if r.stats else 0} for r in results]


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    by = {(r["tokens"], r["variant"]): r["wall_s"] for r in rows if "wall_s" in r}
    for r in rows:
        for base in ("full", "dense"):
            if (r["tokens"], base) in by and "wall_s" in r:
                r[f"x_{base}"] = r["wall_s"] / by[(r["tokens"], base)]


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The legacy dense-vs-block-sparse speedup per size, when both ran."""
    by = {(r["tokens"], r["variant"]): r for r in rows if "wall_s" in r}
    out = {}
    for n in sorted({r["tokens"] for r in rows}):
        d, s = by.get((n, "dense")), by.get((n, "block_sparse"))
        if d and s:
            out[str(n)] = {"dense_s": d["wall_s"], "sparse_s": s["wall_s"],
                           "speedup": d["wall_s"] / s["wall_s"],
                           "blocks_skipped": 1.0 - s["density"]}
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    headers = ["tokens", "variant", "wall_s", "x full", "x dense", "skipped", "max|dlogit|",
               "greedy", "KL"]
    dash = "-"
    table = [[r["tokens"], r["variant"], r.get("wall_s", "FAILED"), r.get("x_full", dash),
              r.get("x_dense", dash),
              dash if r.get("density") is None else 1.0 - r["density"],
              r.get("max_abs_logit_diff", dash), r.get("greedy_agreement", dash),
              r.get("first_token_kl", dash)] for r in rows]
    return format_table(headers, table)


def _plot(rows: list[dict[str, Any]], path: Any, model: str, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["variant"] for r in rows):
        pts = [r for r in rows if r["variant"] == name and "wall_s" in r]
        ax.plot([r["tokens"] for r in pts], [r["wall_s"] for r in pts], "o-", label=name)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("local prefill wall time (s)")
    ax.set_title(f"{model} prefill on {device}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["register", "run", "results_dir", "parse_variants"]
