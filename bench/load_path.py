"""The load path of a context of SmolLM2's geometry at int8 (bench/segments_read.py's context),
in the source tree on PYTHONPATH (so that a checkout before a change runs it too): the reads alone,
the loader's flash path (read, check, swap into pages, fill the working memory), the resident
fill (fill_layers), each the median of REPEAT, then a cProfile of one flash load (the calling
thread only: the readers' threads are not in it; the swap-out after it left out).

    PYTHONPATH=$PWD python bench/load_path.py TOKENS REPEAT OUT.json
"""
import cProfile
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
sys.path.insert(0, os.environ["PYTHONPATH"] + "/bench")
import segments_read as sr
from sparkv.cache import ContextKV
from sparkv.device.flashio import RUN_BYTES
from sparkv.device.loader import fill_layers, LoadOptions, LoadRequest, load, token_chunk_ids

tokens = int(sys.argv[1]); repeat = int(sys.argv[2]); out = sys.argv[3]
torch.set_num_threads(1)
root = Path(tempfile.mkdtemp(prefix="loadprof-"))
res = {"tokens": tokens, "load_start": os.getloadavg()}
try:
    t0 = time.perf_counter(); swap, ctx = sr.make_context(root, tokens, True); res["setup_s"] = time.perf_counter() - t0
    C = ctx.memory; g = C.geometry
    reads, loads, fills = [], [], []
    for i in range(repeat):
        dt, nreads, nbytes = sr.read_only(ctx, 4, RUN_BYTES); reads.append(dt)
        dt, _ = sr.full_load(ctx, 4); loads.append(dt)
    # resident fill: everything resident at int8
    W = ContextKV(g, torch.float32, "cpu")
    lm = types.SimpleNamespace(device=torch.device("cpu"))
    load(lm, ctx.tokens, C, W, ctx.tier, LoadRequest(read=range(g.num_token_chunks)), LoadOptions(pipeline=False))
    for i in range(repeat):
        W = ContextKV(g, torch.float32, "cpu")
        t0 = time.perf_counter(); fill_layers(C, W, range(g.num_layers)); fills.append(time.perf_counter() - t0)
    C.drop_many([c for t in range(g.num_token_chunks) for c in token_chunk_ids(g, t)])
    prof = cProfile.Profile(); prof.enable(); dt, _ = sr.load_all(ctx, 4); prof.disable()
    sr.swap_out(ctx)
    s = io.StringIO(); st = pstats.Stats(prof, stream=s); st.sort_stats("tottime").print_stats(18)
    res.update(read_ms=statistics.median(reads) * 1e3, flash_load_ms=statistics.median(loads) * 1e3,
               resident_fill_ms=statistics.median(fills) * 1e3, bytes=nbytes, reads=nreads,
               reads_all=reads, loads_all=loads, fills_all=fills, profile=s.getvalue(),
               load_end=os.getloadavg())
    res["load_over_read"] = res["flash_load_ms"] / res["read_ms"]
finally:
    shutil.rmtree(root, ignore_errors=True)
Path(out).write_text(json.dumps(res, indent=1))
print({k: v for k, v in res.items() if k != "profile"}); print(res["profile"])
