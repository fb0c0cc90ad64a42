"""``sparkv bench decode``: decoding over the KV memory (docs/kv-memory.md).

For each context length (SmolLM2, the bundled sample text) the context is prefilled once, then
``--max-new-tokens`` tokens are decoded greedily over:

* ``dynamic``: transformers' ``DynamicCache`` (concatenates every layer at every token);
* ``memory``: :class:`~sparkv.cache.SparkvCache` over a dense fp :class:`~sparkv.cache.ContextKV`
  (appends in place);
* ``ragged50`` / ``ragged20``: every layer pruned per KV head to 50% / 20% of the context on
  average, with uneven head budgets (0.5x, 1x, 1.5x the average: the Ada-KV shape), keeping the
  first 4 tokens, the last 32 and evenly spread others (what is kept does not change the speed);
* ``int8`` / ``int4``: every chunk resident at that level in pages, attended in place by the paged
  kernel (sparkv/cache/qattend.py: one call per layer, no dequantization of the context).

The configs of one length decode in lockstep (token ``i`` of each config, then token ``i + 1`` of
each), so on a shared machine they see the same load; the load average at the start and the end is
printed and recorded. Reported per config: decode tokens/s (median of ``--repeats``), the KV bytes held at the
end and the peak during decoding (the memory's own account plus any tail; for ``dynamic``, the
bytes of its tensors), the speed ratio to ``dynamic`` and to the fp memory (``memory``): the
median of the ratios of the runs side by side, and the peak bytes' ratio to the fp memory's. Also
the flash tier's read and write bandwidth here, with and without the page cache. Targets:
``memory`` at least as fast as ``dynamic`` at every length; ``ragged20`` peak KV bytes at most
0.25x the full memory's; ``int8`` at least 1.0x and ``int4`` at least 0.95x ``memory``'s tokens/s
at every length (issue 43), with peak KV bytes at most 0.30x / 0.18x (issue 29). ``--quick``: 2K
and 8K, ``memory,int8,int4``, 16 tokens, one run each, a 16 MB flash measurement
(``decode_quick.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import TYPE_CHECKING, Any

from sparkv.bench.common import add_run_args, format_table, write_result
from sparkv.cliflags import add_device_args

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

CONFIGS = ("dynamic", "memory", "ragged50", "ragged20", "int8", "int4")


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("decode", help="decode speed and KV bytes over the KV memory "
                                      "(vs DynamicCache, ragged, quantized), flash bandwidth")
    p.add_argument("--sizes", default="2048,4096,8192", help="context lengths in tokens")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens decoded per run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help="caches to compare: dynamic (transformers' DynamicCache), memory (the "
                        "KV memory), ragged50/ragged20 (pruned to 50%%/20%%), int8, int4")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="T of the KV memory's chunks (the server's default T)")
    p.add_argument("--flash-mb", type=int, default=64,
                   help="MB (10^6 bytes) the flash measurement writes and reads, in 1 MiB files")
    p.add_argument("--flash-dir", default=None,
                   help="directory of the flash tier (default: a new dir in the system's temp "
                        "dir, removed after; if that is a tmpfs, the \"flash\" is RAM)")
    p.add_argument("--quick", action="store_true",
                   help="2K and 8K tokens, memory,int8,int4, 16 tokens, 1 run, 16 MB of flash")
    add_device_args(p)
    add_run_args(p, "decode", quick=True)
    p.set_defaults(func=run)


def _keep(n: int, frac: float, heads: int, seed: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    weights = [0.5, 1.0, 1.5] if heads == 3 else [1.0] * heads
    scale = heads / sum(weights)
    for h in range(heads):
        budget = max(40, min(n, int(round(frac * n * weights[h] * scale))))
        fixed = torch.cat([torch.arange(min(4, n)), torch.arange(max(0, n - 32), n)]).unique()
        rest = torch.tensor([i for i in range(n) if i not in set(fixed.tolist())])
        pick = rest[torch.randperm(rest.numel(), generator=g)[:max(0, budget - fixed.numel())]]
        out.append(torch.cat([fixed, pick]).unique())
    return out


def _decode(lm: LoadedModel, caches: dict[str, tuple[Any, Any]], n: int, first: int, steps: int
            ) -> dict[str, tuple[float, int]]:
    """Greedy steps after one token over every cache **in lockstep** (step ``i`` of each config,
    then step ``i + 1`` of each: the configs see the same load); per config ``(tokens/s, peak
    bytes held)``. ``caches``: config -> ``(cache, memory or None)``."""
    import torch

    from sparkv.runtime.hfcache import model_call

    token = {cfg: first for cfg in caches}
    busy = {cfg: 0.0 for cfg in caches}
    peak = {cfg: 0 for cfg in caches}
    with torch.inference_mode():
        for i in range(steps):
            for cfg, (cache, memory) in caches.items():
                t0 = time.perf_counter()
                out = model_call(lm.model, input_ids=torch.tensor([[token[cfg]]]), cache=cache,
                                 position_ids=torch.tensor([[n + i]]), use_cache=True)
                token[cfg] = int(out.logits[0, -1].argmax())
                busy[cfg] += time.perf_counter() - t0
                if memory is not None:
                    peak[cfg] = max(peak[cfg], memory.nbytes + cache.extra_nbytes())
    for cfg, (cache, memory) in caches.items():
        if memory is None:
            peak[cfg] = sum(t.numel() * t.element_size() for layer in cache.layers
                            for t in (layer.keys, layer.values))
    return {cfg: (steps / busy[cfg], peak[cfg]) for cfg in caches}


def run(args: argparse.Namespace) -> int:
    import torch
    from sparkv.logs import progress_bar

    from sparkv.runtime import load_model
    from sparkv.runtime.heap import settle

    if args.quick:
        args.sizes, args.configs, args.max_new_tokens = "2048,8192", "memory,int8,int4", 16
        args.repeats, args.flash_mb = 1, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    settle()             # the model for good: out of full collections (sparkv.runtime.heap)
    from sparkv.cache.qattend import warm_up

    warm_up()   # compile the quantized kernel before any timing
    sizes = [int(s) for s in args.sizes.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    rows: list[dict[str, Any]] = []
    load = {"start": os.getloadavg()}
    bar = progress_bar(total=len(sizes) * len(configs) * args.repeats, desc="decode bench", unit="run")
    for n in sizes:
        _measure_size(lm, n, configs, args, rows, bar)
    bar.close()
    load["end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min): start {load['start']}, end {load['end']} on "
          f"{os.cpu_count()} CPUs")
    flash, profile = _measure_flash(args.flash_dir, args.flash_mb)
    targets = _report(rows, flash, profile)
    if args.json or args.out:
        path = write_result("decode", {"rows": rows, "flash": flash, "targets": targets,
                                       "load_average": load},
                            config=vars(args) | {"func": None}, path=args.out, quick=args.quick)
        print(f"wrote {path}")
    return 0


def _measure_size(lm: LoadedModel, n: int, configs: list[str], args: argparse.Namespace,
                  rows: list[dict[str, Any]], bar: Any) -> None:
    """Prefills an ``n``-token context, then decodes over every config ``--repeats`` times, the
    configs in lockstep (:func:`_decode`); appends one row per config to ``rows`` with its
    ratios to ``dynamic`` and ``memory``: the median over repeats of the ratios of the runs side
    by side."""
    import torch

    from sparkv.layout import ChunkGeometry
    from sparkv.runtime import reference_prefill, sample_context_ids

    ids = sample_context_ids(lm, n)
    with torch.inference_mode():
        layers = reference_prefill(lm, ids)
    geo = ChunkGeometry.from_config(lm.config, n, args.chunk_tokens)
    runs: dict[str, list[tuple[float, int, int]]] = {cfg: [] for cfg in configs}
    for _ in range(args.repeats):
        caches = {cfg: _cache_for(cfg, layers, geo, args.max_new_tokens) for cfg in configs}
        for cfg, (speed, peak) in _decode(lm, caches, n, int(ids[-1]), args.max_new_tokens).items():
            memory = caches[cfg][1]
            runs[cfg].append((speed, peak, memory.nbytes if memory is not None else peak))
        bar.update(len(configs))
        del caches
    for cfg in configs:
        speeds = [r[0] for r in runs[cfg]]
        row: dict[str, Any] = {
            "tokens": n, "config": cfg, "tokens_per_s": statistics.median(speeds),
            "tokens_per_s_all": speeds, "peak_kv_bytes": max(r[1] for r in runs[cfg]),
            "end_kv_bytes": max(r[2] for r in runs[cfg])}
        for base, key in (("dynamic", "speed_vs_dynamic"), ("memory", "speed_vs_memory")):
            if base in runs:
                row[key] = statistics.median(a[0] / b[0] for a, b in zip(runs[cfg], runs[base]))
        if "memory" in runs:
            row["peak_vs_full_memory"] = row["peak_kv_bytes"] / max(r[1] for r in runs["memory"])
        rows.append(row)


def _cache_for(cfg: str, layers: list, geo: Any, spare_tokens: int) -> tuple[Any, Any]:
    """``(cache, memory)``: a ``DynamicCache`` of the prefilled ``layers`` (memory None) for
    ``dynamic``, else a :class:`~sparkv.cache.SparkvCache` over a memory pruned (``raggedNN``) or
    quantized (``int8``/``int4``) as ``cfg`` says."""
    from transformers import DynamicCache

    from sparkv.cache import SparkvCache
    from sparkv.runtime.kvcache import memory_from_layers

    if cfg == "dynamic":
        cache = DynamicCache()
        for i, (k, v) in enumerate(layers):
            cache.update(k.clone(), v.clone(), i)
        return cache, None
    memory = memory_from_layers(layers, geo, spare_tokens=spare_tokens)
    if cfg.startswith("ragged"):
        frac = int(cfg[len("ragged"):]) / 100
        for l in range(geo.num_layers):  # noqa: E741
            memory.prune_layer(l, _keep(geo.num_tokens, frac, geo.num_kv_heads, l),
                               spare_tokens=spare_tokens)
    elif cfg in ("int8", "int4"):
        for cid in geo.chunk_ids():
            memory.set_level(cid, cfg)
    return SparkvCache(memory), memory


def _measure_flash(flash_dir: str | None, flash_mb: int) -> tuple[dict[str, Any], Any]:
    """The flash tier's bandwidth in ``flash_dir`` (default: a new dir in the system's temp dir,
    removed after), saved as this machine's flash profile: ``(measurement, profile path)``."""
    import shutil
    import tempfile

    from sparkv.cache import FlashTier, flash_profile_path, save_flash_profile
    from sparkv.runtime.model import cache_dir

    flash_root = flash_dir or tempfile.mkdtemp(prefix="sparkv-flash-")
    tier = FlashTier(flash_root)
    flash = tier.measure(total_bytes=int(flash_mb * 1e6))   # in 1 MiB files
    try:
        if not flash_dir:
            shutil.rmtree(flash_root, ignore_errors=True)
    except OSError:
        pass
    profile = save_flash_profile(flash_profile_path(cache_dir()), flash, flash_root)
    return flash, profile


def _report(rows: list[dict[str, Any]], flash: dict[str, Any], profile: Any) -> dict[str, Any]:
    """Prints the table, the flash bandwidth and the targets; returns the targets."""
    print(format_table(["tokens", "config", "tok/s", "vs dynamic", "vs memory", "peak MB",
                        "vs full", "end MB"],
                       [[r["tokens"], r["config"], r["tokens_per_s"],
                         r.get("speed_vs_dynamic", float("nan")),
                         r.get("speed_vs_memory", float("nan")), r["peak_kv_bytes"] / 1e6,
                         r.get("peak_vs_full_memory", float("nan")), r["end_kv_bytes"] / 1e6]
                        for r in rows]))
    print(f"\nflash tier ({'O_DIRECT' if flash['direct_io'] else 'posix_fadvise'}): write "
          f"{flash['write_MBps']:.0f} MB/s, read {flash['read_MBps']:.0f} MB/s, read through the "
          f"page cache {flash['read_page_cache_MBps']:.0f} MB/s (saved to {profile})")
    targets = _targets(rows)
    print("targets: " + "; ".join(f"{k} {v}" for k, v in targets.items()))
    return targets


def _worst(rows: list[dict[str, Any]], config: str, key: str, fn: Any) -> float | None:
    vals = [r[key] for r in rows if r["config"] == config and key in r]
    return fn(vals) if vals else None


def _targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured worst case beside each target."""
    return {"memory_vs_dynamic_min": _worst(rows, "memory", "speed_vs_dynamic", min),
            "memory_vs_dynamic_target": 1.0,
            "ragged20_peak_vs_full_max": _worst(rows, "ragged20", "peak_vs_full_memory", max),
            "ragged20_peak_target": 0.25,
            "int8_vs_memory_min": _worst(rows, "int8", "speed_vs_memory", min),
            "int8_vs_memory_target": 1.0,
            "int4_vs_memory_min": _worst(rows, "int4", "speed_vs_memory", min),
            "int4_vs_memory_target": 0.95,
            "int8_peak_vs_full_max": _worst(rows, "int8", "peak_vs_full_memory", max),
            "int8_peak_target": 0.30,
            "int4_peak_vs_full_max": _worst(rows, "int4", "peak_vs_full_memory", max),
            "int4_peak_target": 0.18}
