"""A/B of the device service's host-RAM tier (docs/device-service.md, "On a GPU"): one context
swapped out and switched back in, with and without the tier, alternated; the medians of the
switch and its load (the first pair dropped: warm-up).

    python bench/host_tier_ab.py [--tokens 2048] [--pairs 7] [--out F.json]
    bash bench/slow_flash.sh 200 python bench/host_tier_ab.py      # on a 200 MB/s flash

Wall clock on whatever machine runs it (2 torch threads).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
from typing import Any

import torch

FIELDS = ("switch_ms", "total_ms", "wait_io_ms", "fill_ms", "io_ms", "read_chunks",
          "host_chunks", "bytes_read", "recomputed")


def one_switch(svc: Any, cid: str) -> dict[str, float]:
    """Swaps the context out, then one call switches it back in: the switch and its load."""
    svc.swap_out(cid)
    r = svc.call(cid, "Say one word.", max_new_tokens=1)
    L = r.load
    return {"switch_ms": r.switch_s * 1e3, "total_ms": L.total_s * 1e3,
            "wait_io_ms": L.wait_io_s * 1e3, "fill_ms": L.fill_s * 1e3, "io_ms": L.io_s * 1e3,
            "read_chunks": L.read_chunks, "host_chunks": L.host_chunks,
            "bytes_read": L.bytes_read, "recomputed": L.recomputed_chunks}


def run(tokens: int, pairs: int) -> dict[str, list[dict[str, float]]]:
    """``pairs`` switches of each service (no tier, a 256 MiB tier), alternated."""
    from sparkv.device import ContextService
    from sparkv.runtime import load_model
    from sparkv.runtime.generate import sample_context_ids

    lm = load_model(progress=False)
    doc = sample_context_ids(lm, tokens)
    root = pathlib.Path(tempfile.mkdtemp(prefix="host-tier-ab-"))
    svcs = {h: ContextService(lm, 512 << 20, root / f"h{h}", journal=False, host_tier_bytes=h)
            for h in (0, 256 << 20)}
    ids = {h: s.new_context(system_ids=doc) for h, s in svcs.items()}
    out: dict[str, list[dict[str, float]]] = {"flash": [], "host": []}
    for _ in range(pairs):
        for h, s in svcs.items():
            out["host" if h else "flash"].append(one_switch(s, ids[h]))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="the context's tokens")
    p.add_argument("--pairs", type=int, default=7, help="switches of each, alternated")
    p.add_argument("--out", default=None, help="write every switch's figures here (JSON)")
    args = p.parse_args()
    torch.set_num_threads(2)
    out = run(args.tokens, args.pairs)
    for name, rows in out.items():
        med = {k: round(statistics.median(r[k] for r in rows[1:]), 2) for k in FIELDS}
        print(name, med)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
