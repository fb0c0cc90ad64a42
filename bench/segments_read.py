"""Micro-benchmark of the device service's swap layouts (issue 29): reading a 4K-token int8
context's token chunks back from flash, O_DIRECT,

  (a) as one file per token chunk (VLLM-S / VLLM-SQ's layout), 4 reader threads;
  (b) as one segment file of aligned records (LLMS's layout), in runs of adjacent records of at
      most ``--run-mib`` MiB, 4 reader threads;

first the reads alone (MB/s of record bytes, against the flash profile's ``read_MBps``), then the
loader's whole read path (read, checksum, unpack, swap into the context's memory, dequantize into
the working memory: ``sparkv.device.loader.load``). SmolLM2-135M's geometry (30 layers, 3 KV heads
of 64 dims, one KV group) with random values; the chunks are written once, then read ``--repeat``
times each (the order of the layouts alternates). The numbers are wall clock on whatever machine
runs it: say whether it was loaded.

    PYTHONPATH=. .venv/bin/python bench/segments_read.py [--tokens 4096] [--dir DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from sparkv.cache import ChunkPayload, ContextKV, Source
from sparkv.cache.payload import contiguous_positions
from sparkv.device.flashio import plan_runs
from sparkv.device.loader import LoadOptions, LoadRequest, load, token_chunk_ids
from sparkv.device.registry import DeviceContext
from sparkv.device.swap import SwapStore
from sparkv.layout import ChunkGeometry

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def make_context(root: Path, tokens: int, contiguous: bool) -> tuple[SwapStore, DeviceContext]:
    """A context of ``tokens`` tokens at int8, written to flash in one batch and swapped out."""
    g = ChunkGeometry(tokens, 16, LAYERS, KV_HEADS, HEAD_DIM, KV_HEADS)
    swap = SwapStore(root, contiguous=contiguous)
    ctx = DeviceContext("bench", list(range(tokens)), None, swap.tier("bench"))
    C = ContextKV(g, torch.float32, "cpu", paged=True)
    gen = torch.Generator().manual_seed(0)
    for t in range(g.num_token_chunks):
        n = g.chunk_len(t)
        for cid in token_chunk_ids(g, t):
            k, v = (torch.randn(KV_HEADS * n, HEAD_DIM, generator=gen) for _ in range(2))
            p = ChunkPayload(cid, "fp", [n] * KV_HEADS, contiguous_positions([n] * KV_HEADS,
                                                                             t * 16), k, v,
                             torch.float32)
            C.put_payload(p.at_level("int8"), Source.COMPUTED)
    ctx.memory = C
    ctx.modified.update(range(g.num_token_chunks))
    swap.write_ahead(ctx)
    swap.put_away(ctx, range(g.num_token_chunks))
    return swap, ctx


def refs_of(ctx: DeviceContext) -> dict[int, Any]:
    C = ctx.memory
    assert C is not None
    return {t: C.state(token_chunk_ids(C.geometry, t)[0]).flash
            for t in range(C.geometry.num_token_chunks)}


def _read_len(tier: Any, run: Any) -> int:
    """One run read as the loader reads it (a view of the read's buffer); its length."""
    with tier.read_view(run.path, run.offset, run.nbytes) as data:
        return len(data)


def read_only(ctx: DeviceContext, threads: int, run_bytes: int) -> tuple[float, int, int]:
    """Seconds to read every record (runs of adjacent ones), the reads and the record bytes."""
    tier = ctx.tier
    refs = refs_of(ctx)
    runs = plan_runs(refs, tier.align, run_bytes)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        got = list(ex.map(lambda r: _read_len(tier, r), runs))
    dt = time.perf_counter() - t0
    assert got == [r.nbytes for r in runs]
    return dt, len(runs), sum(r.nbytes for r in refs.values())


def full_load(ctx: DeviceContext, threads: int) -> tuple[float, int]:
    """Seconds of the loader's read path (every chunk read into ``C`` and ``W``), its reads;
    the chunks swapped out again after (:func:`swap_out`, not timed)."""
    dt, reads = load_all(ctx, threads)
    swap_out(ctx)
    return dt, reads


def load_all(ctx: DeviceContext, threads: int) -> tuple[float, int]:
    """:func:`full_load`'s timed part: every chunk read into ``C`` and a new ``W``."""
    C = ctx.memory
    assert C is not None
    W = ContextKV(C.geometry, torch.float32, "cpu")
    lm = types.SimpleNamespace(device=torch.device("cpu"))
    t0 = time.perf_counter()
    stats = load(lm, ctx.tokens, C, W, ctx.tier,
                 LoadRequest(read=range(C.geometry.num_token_chunks)),
                 LoadOptions(pipeline=False, io_threads=threads))
    dt = time.perf_counter() - t0
    assert stats.faults == 0 and stats.read_chunks == C.geometry.num_token_chunks
    return dt, stats.reads


def swap_out(ctx: DeviceContext) -> None:
    """Every chunk of ``ctx`` swapped out again, nothing written: one ``drop_many`` (a ``drop``
    per chunk took ~2.4 s for 7,680 chunks, each one releasing and compacting pages)."""
    C = ctx.memory
    assert C is not None
    C.drop_many([c for t in range(C.geometry.num_token_chunks)
                 for c in token_chunk_ids(C.geometry, t)])


def flash_read_MBps() -> float | None:
    try:
        from sparkv.cache import flash_profile_path, load_flash_profile
        from sparkv.runtime.model import cache_dir

        prof = load_flash_profile(flash_profile_path(cache_dir()))
        return float(prof["read_MBps"]) if prof else None
    except Exception:  # noqa: BLE001 - no profile: no comparison
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--run-mib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the flash files go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sparkv-segments-", dir=a.dir))
    run_bytes = int(a.run_mib * (1 << 20))
    try:
        layouts = {"chunk_files": make_context(root / "files", a.tokens, False)[1],
                   "segments": make_context(root / "segs", a.tokens, True)[1]}
        res: dict[str, dict[str, Any]] = {k: {"read_s": [], "load_s": []} for k in layouts}
        for i in range(a.repeat):
            order = list(layouts) if i % 2 == 0 else list(reversed(layouts))
            for name in order:
                dt, reads, nbytes = read_only(layouts[name], a.threads, run_bytes)
                res[name].update(reads=reads, bytes=nbytes, direct_io=layouts[name].tier.direct)
                res[name]["read_s"].append(dt)
            for name in order:
                dt, reads = full_load(layouts[name], a.threads)
                res[name]["load_s"].append(dt)
                res[name]["load_reads"] = reads
        flash = flash_read_MBps()
        for name, r in res.items():
            for key in ("read_s", "load_s"):
                r[key.replace("_s", "_MBps")] = r["bytes"] / statistics.median(r[key]) / 1e6
            r["read_vs_flash_profile"] = r["read_MBps"] / flash if flash else None
            read_ms = statistics.median(r["read_s"]) * 1e3
            load_ms = statistics.median(r["load_s"]) * 1e3
            print(f"{name:12s} reads {r['reads']:4d}  {r['bytes'] / 1e6:6.1f} MB  read "
                  f"{r['read_MBps']:7.1f} MB/s ({read_ms:6.1f} ms)  loader {r['load_MBps']:7.1f}"
                  f" MB/s ({load_ms:6.1f} ms)  direct_io={r['direct_io']}")
        print(f"flash profile read_MBps: {flash}")
        if a.out:
            Path(a.out).write_text(json.dumps({"tokens": a.tokens, "threads": a.threads,
                                               "run_bytes": run_bytes, "flash_read_MBps": flash,
                                               "layouts": res}, indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
