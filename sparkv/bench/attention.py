"""``sparkv bench attention``: one layer's attention on a GPU, dense vs the block-sparse kernel.

Two shapes per head geometry and key length (random bf16 data, CUDA only):

* ``square``: causal attention of every query over its prefix (a whole context's layer at
  once, offset 0), the shape the block-sparse target is stated for: at 32K tokens and 25% of
  blocks, flex_attention over the kept blocks, mask prediction included, at least 2x faster
  than dense flash attention;
* ``chunk``: one ``--chunk``-query chunk at the end of the keys (a layer step after a prefix),
  the shape ``auto`` decides on: its break-even densities become this GPU's attention profile
  (``--save-profile``, read by :class:`~sparkv.runtime.autoattn.AutoAttention`).

Per point: dense ms (SDPA causal, or the prefix + own-keys LSE split after a prefix), the mask
prediction ms (the default ``qpool`` estimator and ``meansim``), and per top-k density the real
share of blocks kept, the kernel alone, kernel + prediction, and the speedup over dense.
Milliseconds are medians of ``--repeats`` synchronized runs after a warm-up. See docs/gpu.md.
"""

from __future__ import annotations

import argparse
from typing import Any

from sparkv.bench.common import add_output_args, format_table, results_dir, write_result


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("attention", help="GPU: one layer's dense vs block-sparse attention")
    p.add_argument("--heads", default="24/8/128,9/3/64",
                   help="comma-separated Hq/Hkv/head_dim (Llama-3.2-3B, SmolLM2)")
    p.add_argument("--lengths", default="8192,16384,32768", help="key lengths")
    p.add_argument("--densities", default="0.1,0.25,0.5,0.75", help="top-k shares of blocks")
    p.add_argument("--chunk", type=int, default=4096, help="queries per chunk (chunk shape)")
    p.add_argument("--shapes", default="square,chunk", help="square, chunk or both")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    p.add_argument("--device", default="cuda", help="a CUDA device")
    p.add_argument("--profile-predict", action="store_true",
                   help="also profile the mask prediction (eager and the compiled pipeline) at "
                        "the longest length, square, first head geometry: where its time goes")
    p.add_argument("--save-profile", action="store_true",
                   help="save the chunk rows of the first head geometry as this GPU's profile")
    add_output_args(p, "attention")
    p.set_defaults(func=run)


def _heads(text: str) -> list[tuple[int, int, int]]:
    out = []
    for spec in (s for s in text.split(",") if s.strip()):
        try:
            hq, hkv, d = (int(x) for x in spec.split("/"))
        except ValueError:
            raise SystemExit(f"--heads: expected Hq/Hkv/head_dim, got {spec!r}") from None
        out.append((hq, hkv, d))
    return out


def _meansim_ms(device: Any, hq: int, hkv: int, d: int, keys: int, queries: int,
                repeats: int) -> float:
    import torch

    from sparkv.runtime import BlockSparseAttention, SparsityConfig
    from sparkv.runtime.autoattn import median_time_s

    q = torch.randn(1, hq, queries, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, keys, d, device=device, dtype=torch.bfloat16)
    pred = BlockSparseAttention(SparsityConfig(estimator="meansim"))
    return 1e3 * median_time_s(lambda: pred.predict_mask(q, k, keys - queries), device, repeats)


def run(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from sparkv.logs import progress_bar

    from sparkv.runtime.autoattn import measure_point, profile_from, save_profile
    from sparkv.runtime.device import DeviceUnavailable, resolve_device

    try:
        device = resolve_device(args.device)
    except DeviceUnavailable as exc:
        print(f"sparkv: error: {exc}")
        return 2
    if device.type != "cuda":
        print("sparkv: error: bench attention measures a CUDA device (the CPU's rule is "
              "block_sparse's own: bench prefill)")
        return 2
    heads = _heads(args.heads)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    densities = tuple(float(x) for x in args.densities.split(",") if x)
    shapes = [s for s in args.shapes.split(",") if s in ("square", "chunk")]
    rows: list[dict[str, Any]] = []
    bar = progress_bar(total=len(heads) * len(lengths) * len(shapes), desc="attention bench")
    for hq, hkv, d in heads:
        for n in lengths:
            for shape in shapes:
                queries = n if shape == "square" else min(args.chunk, n)
                row = measure_point(device, (hq, hkv), d, n, queries, densities, args.repeats,
                                    static=shape == "square" and n == max(lengths))
                row["shape"] = shape
                row["predict_meansim_ms"] = _meansim_ms(device, hq, hkv, d, n, queries,
                                                        args.repeats)
                rows.append(row)
                tqdm.write(f"  {row['heads']} {shape} {n}: dense {row['dense_ms']:.3f} ms, "
                           f"predict {row['predict_ms']:.3f} ms (pipeline "
                           f"{row['pipeline_ms']:.3f}), sparse total "
                           + ", ".join(f"{s['topk']:.2f}->{s['total_ms']:.3f}"
                                       f" (kernel {s['kernel_ms']:.3f}, static "
                                       f"{s.get('kernel_static_ms', float('nan')):.3f})"
                                       for s in row["sparse"]))
                torch.cuda.empty_cache()
                bar.update(1)
    bar.close()
    print(_table(rows))
    predict_profile = (predict_profiles(device, heads[0], max(lengths))
                       if args.profile_predict else None)
    target = _target(rows)
    print(f"target (square, 32K, 25% of blocks, prediction included, >= 2x dense): {target}")
    name = torch.cuda.get_device_name(device)
    profile = None
    chunk_rows = [r for r in rows if r["shape"] == "chunk" and r["heads"] == "%d/%d/%d" % heads[0]]
    if chunk_rows:
        profile = profile_from(chunk_rows, name)
        print(f"profile: min_sparse_keys {profile.min_sparse_keys}, breakeven {profile.breakeven}")
        if args.save_profile:
            print(f"saved {save_profile(profile)}")
    if args.json or args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        config["gpu"] = name
        path = write_result("attention", {"results": rows, "target": target,
                                          "profile": vars(profile) if profile else None,
                                          "predict_profile": predict_profile},
                            config, args.out)
        print(f"wrote {path}")
    return 0


def predict_profiles(device: Any, heads: tuple[int, int, int], keys: int) -> dict[str, Any]:
    """The mask prediction of a square call (``keys`` queries over ``keys`` keys, random bf16)
    under the profiler, eager (``predict_mask``) and as ``flex_sparse`` runs it (the pipeline:
    compiled on CUDA), each :func:`~sparkv.bench.profiling.profile_kernels`; printed as tables.
    """
    import torch

    from sparkv.bench.profiling import kernel_table, profile_kernels
    from sparkv.runtime import BlockSparseAttention
    from sparkv.runtime.flex import FlexAttention

    hq, hkv, d = heads
    gen = torch.Generator(device=device).manual_seed(keys)
    q = torch.randn(1, hq, keys, d, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, hkv, keys, d, device=device, dtype=torch.bfloat16, generator=gen)
    eager, pipeline = BlockSparseAttention(), FlexAttention(sparse=True)
    profs = {"eager": profile_kernels(lambda: eager.predict_mask(q, k, 0), device),
             "pipeline": profile_kernels(lambda: pipeline.predict(q, k, 0), device)}
    out: dict[str, Any] = {"heads": "%d/%d/%d" % heads, "keys": keys, **profs}
    for name, prof in profs.items():
        print(f"mask prediction ({name}) at {keys} keys, {out['heads']}: wall "
              f"{1e3 * prof['wall_s']:.2f} ms, kernels busy {1e3 * prof['kernel_busy_s']:.2f} ms "
              f"({prof['kernel_launches']} launches)")
        print(format_table(["kernel", "calls", "ms"], kernel_table(prof)))
    return out


def _target(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"needed_speedup": 2.0}
    for r in rows:
        if r["shape"] == "square" and r["keys"] == 32768:
            for s in r["sparse"]:
                if abs(s["topk"] - 0.25) < 1e-9:
                    out[r["heads"]] = {"dense_ms": r["dense_ms"], "total_ms": s["total_ms"],
                                       "kernel_ms": s["kernel_ms"], "predict_ms": r["predict_ms"],
                                       "pipeline_ms": r.get("pipeline_ms"),
                                       "kernel_static_ms": s.get("kernel_static_ms"),
                                       "density": s["density"], "speedup": s["speedup"],
                                       "met": s["speedup"] >= 2.0}
    return out


def _table(rows: list[dict[str, Any]]) -> str:
    headers = ["heads", "shape", "keys", "queries", "dense_ms", "pred_ms", "pipeline_ms",
               "pred_ms meansim", "topk", "density", "kernel_ms", "total_ms", "speedup"]
    table = []
    for r in rows:
        for s in r["sparse"]:
            table.append([r["heads"], r["shape"], r["keys"], r["queries"], r["dense_ms"],
                          r["predict_ms"], r.get("pipeline_ms", "-"), r["predict_meansim_ms"],
                          s["topk"], s["density"],
                          s["kernel_ms"], s["total_ms"], s["speedup"]])
    return format_table(headers, table)


__all__ = ["register", "run", "results_dir"]
