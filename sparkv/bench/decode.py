"""``sparkv bench decode``: decoding over the KV memory (docs/kv-memory.md).

For each context length (SmolLM2, the bundled sample text) the context is prefilled once, then
``--new-tokens`` tokens are decoded greedily over:

* ``dynamic``: transformers' ``DynamicCache`` (concatenates every layer at every token);
* ``memory``: :class:`~sparkv.cache.SparkvCache` over a dense fp :class:`~sparkv.cache.ContextKV`
  (appends in place);
* ``ragged50`` / ``ragged20``: every layer pruned per KV head to 50% / 20% of the context on
  average, with uneven head budgets (0.5x, 1x, 1.5x the average: the Ada-KV shape), keeping the
  first 4 tokens, the last 32 and evenly spread others (what is kept does not change the speed);
* ``int8`` / ``int4``: every chunk resident at that level, dequantized on read at every step.

Reported per run: decode tokens/s (median of ``--repeats``), the KV bytes held at the end and the
peak during decoding (the memory's own account plus any tail; for ``dynamic``, the bytes of its
tensors), and the ratio of each to the fp memory. Also the flash tier's read and write bandwidth
here, with and without the page cache. Targets: ``memory`` at least as fast as ``dynamic`` at
every length; ``ragged20`` peak KV bytes at most 0.25x the full memory's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from sparkv.bench.common import format_table, results_dir, write_result
from sparkv.runtime.device import add_device_args

CONFIGS = ("dynamic", "memory", "ragged50", "ragged20", "int8", "int4")


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("decode", help="decode speed and KV bytes over the KV memory "
                                      "(vs DynamicCache, ragged, quantized), flash bandwidth")
    p.add_argument("--sizes", default="2048,4096,8192", help="context lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--flash-mb", type=int, default=64, help="bytes moved by the flash measurement")
    p.add_argument("--flash-dir", default=None, help="directory of the flash tier (default: a "
                                                     "temp dir under bench/results)")
    add_device_args(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
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


def _decode(lm: Any, cache: Any, n: int, first: int, steps: int, memory: Any = None
            ) -> tuple[float, int]:
    """Greedy steps after one token; returns (tokens/s, peak bytes held)."""
    import torch

    token = first
    peak = 0
    with torch.inference_mode():
        t0 = time.perf_counter()
        for i in range(steps):
            out = lm.model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                           position_ids=torch.tensor([[n + i]]), use_cache=True)
            token = int(out.logits[0, -1].argmax())
            if memory is not None:
                peak = max(peak, memory.nbytes + cache.extra_nbytes())
        dt = time.perf_counter() - t0
    if memory is None:
        peak = sum(t.numel() * t.element_size() for layer in cache.layers
                   for t in (layer.keys, layer.values))
    return steps / dt, peak


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    from sparkv.cache import FlashTier, SparkvCache, flash_profile_path, save_flash_profile
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime import load_model, reference_prefill, sample_context_ids
    from sparkv.runtime.kvcache import memory_from_layers
    from sparkv.runtime.model import cache_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    configs = [c for c in args.configs.split(",") if c]
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(sizes) * len(configs) * args.repeats, desc="decode bench", unit="run")
    for n in sizes:
        ids = sample_context_ids(lm, n)
        with torch.inference_mode():
            layers = reference_prefill(lm, ids)
        geo = ChunkGeometry.from_config(lm.config, n, args.chunk_tokens)
        first = int(ids[-1])
        full_bytes = None
        for cfg in configs:
            speeds, peaks, ends = [], [], []
            for r in range(args.repeats):
                memory = None
                if cfg == "dynamic":
                    cache = DynamicCache()
                    for i, (k, v) in enumerate(layers):
                        cache.update(k.clone(), v.clone(), i)
                else:
                    memory = memory_from_layers(layers, geo, spare_tokens=args.new_tokens)
                    if cfg.startswith("ragged"):
                        frac = int(cfg[len("ragged"):]) / 100
                        for l in range(geo.num_layers):  # noqa: E741
                            memory.prune_layer(l, _keep(n, frac, geo.num_kv_heads, l),
                                               spare_tokens=args.new_tokens)
                    elif cfg in ("int8", "int4"):
                        for cid in geo.chunk_ids():
                            memory.set_level(cid, cfg)
                    cache = SparkvCache(memory)
                speed, peak = _decode(lm, cache, n, first, args.new_tokens, memory)
                end = memory.nbytes if memory is not None else peak
                speeds.append(speed)
                peaks.append(peak)
                ends.append(end)
                bar.update(1)
            row = {"tokens": n, "config": cfg, "tokens_per_s": statistics.median(speeds),
                   "tokens_per_s_all": speeds, "peak_kv_bytes": max(peaks),
                   "end_kv_bytes": max(ends)}
            if cfg == "memory":
                full_bytes = row["peak_kv_bytes"]
            rows.append(row)
        base = {r["config"]: r for r in rows if r["tokens"] == n}
        for r in rows:
            if r["tokens"] == n:
                if "dynamic" in base:
                    r["speed_vs_dynamic"] = r["tokens_per_s"] / base["dynamic"]["tokens_per_s"]
                if full_bytes:
                    r["peak_vs_full_memory"] = r["peak_kv_bytes"] / full_bytes
        del layers
    bar.close()
    flash_root = args.flash_dir or tempfile.mkdtemp(prefix="flash-", dir=results_dir())
    tier = FlashTier(flash_root)
    flash = tier.measure(total_bytes=args.flash_mb << 20)
    try:
        import shutil
        if not args.flash_dir:
            shutil.rmtree(flash_root, ignore_errors=True)
    except OSError:
        pass
    profile = save_flash_profile(flash_profile_path(cache_dir()), flash, flash_root)

    print(format_table(["tokens", "config", "tok/s", "vs dynamic", "peak MB", "vs full", "end MB"],
                       [[r["tokens"], r["config"], r["tokens_per_s"],
                         r.get("speed_vs_dynamic", float("nan")), r["peak_kv_bytes"] / 1e6,
                         r.get("peak_vs_full_memory", float("nan")), r["end_kv_bytes"] / 1e6]
                        for r in rows]))
    print(f"\nflash tier ({'O_DIRECT' if flash['direct_io'] else 'posix_fadvise'}): write "
          f"{flash['write_MBps']:.0f} MB/s, read {flash['read_MBps']:.0f} MB/s, read through the "
          f"page cache {flash['read_page_cache_MBps']:.0f} MB/s (saved to {profile})")
    mem_vs_dyn = [r["speed_vs_dynamic"] for r in rows if r["config"] == "memory"
                  and "speed_vs_dynamic" in r]
    r20 = [r["peak_vs_full_memory"] for r in rows if r["config"] == "ragged20"
           and "peak_vs_full_memory" in r]
    targets = {"memory_vs_dynamic_min": min(mem_vs_dyn) if mem_vs_dyn else None,
               "memory_vs_dynamic_target": 1.0,
               "ragged20_peak_vs_full_max": max(r20) if r20 else None,
               "ragged20_peak_target": 0.25}
    print(f"targets: memory / dynamic speed >= 1.0 at every length: "
          f"{targets['memory_vs_dynamic_min']}; ragged20 peak <= 0.25x full: "
          f"{targets['ragged20_peak_vs_full_max']}")
    if args.json or args.out:
        path = write_result("decode", {"rows": rows, "flash": flash, "targets": targets},
                            config=vars(args) | {"func": None}, path=args.out)
        print(f"wrote {path}")
    return 0
