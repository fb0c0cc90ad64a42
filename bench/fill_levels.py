"""The fill of a working memory from a wholly resident paged context, per level (issue 43's
switch; the dequantization kernel of sparkv/device/dequant.py): SmolLM2-135M's geometry,
4,096 tokens in chunks of 256, every chunk paged at one level, ``fill_layers`` into a float32
working memory, one thread. Also the pages' row gather alone (``read_paged``), which the fill
pays before dequantizing; one decode step's attention over the pages where they lie (every
layer's :class:`~sparkv.cache.qattend.PagedAttention`, one query per head: DynaKV's and a
resident call's path); and the pages' bytes. Median of ``--repeats``.

    python bench/fill_levels.py [--levels int8,k8v4,int4,int2] [--repeats 7] [--out F.json]

Wall clock on whatever machine runs it; compare trees run one after the other on one machine
(``PYTHONPATH`` = the tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch


def context(level: str, tokens: int = 4096, chunk: int = 256):
    from sparkv.cache import ContextKV
    from sparkv.device.keeper import adopted_chunks
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime import load_model

    lm = load_model()
    g = ChunkGeometry.from_config(lm.config, tokens, chunk, 0)
    src = ContextKV(g, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    for l in range(g.num_layers):  # noqa: E741
        k = torch.randn(1, g.num_kv_heads, tokens, g.head_dim, generator=gen)
        v = torch.randn_like(k)
        for t in range(g.num_token_chunks):
            a, b = g.token_range(t)
            src.put_step_output(t, l, k[:, :, a:b], v[:, :, a:b])
    C = ContextKV(g, torch.float32, "cpu", paged=True)
    for payloads in adopted_chunks(src, g, [level] * g.num_token_chunks, torch.float32):
        C.put_payloads(payloads)
    return g, C


def measure(level: str, repeats: int) -> dict[str, float]:
    from sparkv.cache import ContextKV
    from sparkv.device.loader import fill_layers

    g, C = context(level)
    L, G = g.num_layers, g.num_groups
    tt, ll, gg = (a.reshape(-1) for a in np.meshgrid(np.arange(g.num_token_chunks),
                                                     np.arange(L), np.arange(G), indexing="ij"))
    atts = [C.resident_attention(l) for l in range(L)]  # noqa: E741
    hq = g.num_kv_heads * 3                 # SmolLM2-135M: 9 query heads over 3 KV heads
    q, qpos = torch.randn(1, hq, 1, g.head_dim), torch.tensor([g.num_tokens])
    fills, gathers, attends = [], [], []
    for _ in range(repeats):
        W = ContextKV(g, torch.float32, "cpu", spare_tokens=0)
        t0 = time.perf_counter()
        fill_layers(C, W, range(L))
        fills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        C.read_paged(tt, ll, gg)
        gathers.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for att in atts:
            att.attend(q, qpos, None)
        attends.append(time.perf_counter() - t0)
    return {"fill_ms": 1e3 * statistics.median(fills),
            "gather_ms": 1e3 * statistics.median(gathers),
            "attend_ms": 1e3 * statistics.median(attends), "kv_bytes": int(C.nbytes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--levels", default="int8,k8v4,int4,int2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    from sparkv.cache.qattend import warm_up

    warm_up()
    rows = []
    for level in args.levels.split(","):
        r = {"level": level, **measure(level, args.repeats)}
        rows.append(r)
        print(f"{level:>5}: fill {r['fill_ms']:7.1f} ms   gather alone {r['gather_ms']:6.1f} ms"
              f"   decode attention {r['attend_ms']:6.2f} ms   pages {r['kv_bytes'] / 2**20:6.1f} "
              "MiB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "fill_levels", "tree": os.environ.get("PYTHONPATH", ""),
                       "loadavg": os.getloadavg(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
