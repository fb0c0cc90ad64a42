"""A/B of the device service's host-RAM tier (docs/device-service.md, "On a GPU"): one context
swapped out and switched back in, with and without the tier, alternated 7 times; the medians of
the switch and its load (the first pair dropped).

    python bench/host_tier_ab.py TOKENS [OUT.json]
"""
import json
import pathlib
import statistics
import sys
import tempfile

import torch
from sparkv.runtime import load_model
from sparkv.runtime.generate import sample_context_ids
from sparkv.device import ContextService
torch.set_num_threads(2)
lm = load_model(progress=False)
doc = sample_context_ids(lm, int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
d = pathlib.Path(tempfile.mkdtemp())
svcs = {h: ContextService(lm, 512 << 20, d / f"h{h}", journal=False, host_tier_bytes=h)
        for h in (0, 256 << 20)}
ids = {h: s.new_context(system_ids=doc) for h, s in svcs.items()}
out = {h: [] for h in svcs}
for i in range(7):
    for h, s in svcs.items():
        s.swap_out(ids[h])
        r = s.call(ids[h], "Say one word.", max_new_tokens=1)
        L = r.load
        out[h].append({"switch_ms": r.switch_s * 1e3, "total_ms": L.total_s * 1e3,
                       "wait_io_ms": L.wait_io_s * 1e3, "fill_ms": L.fill_s * 1e3,
                       "io_ms": L.io_s * 1e3, "read_chunks": L.read_chunks,
                       "host_chunks": L.host_chunks, "bytes_read": L.bytes_read,
                       "recomputed": L.recomputed_chunks})
for h, rows in out.items():
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]}
    print("host" if h else "flash", {k: round(v, 2) for k, v in med.items()})
json.dump(out, open(sys.argv[2], "w")) if len(sys.argv) > 2 else None
