"""Where the flash load of a context's records goes, on one thread: bench/segments_read.py's
context (SmolLM2-135M's geometry at int8, one segment), its runs read and filled one after the
other by the calling thread (``FileReads._read_run``, what each reader thread does) under cProfile,
against the same runs' reads alone.

    PYTHONPATH=$PWD python bench/load_profile.py [TOKENS]
    SORT=cumulative TOP=40 PYTHONPATH=$PWD python bench/load_profile.py 4096   # another cut
"""
import cProfile
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import segments_read as sr  # noqa: E402

from sparkv.cache import ContextKV  # noqa: E402
from sparkv.device.loader import FileReads, pages_to_read  # noqa: E402

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
torch.set_num_threads(1)
root = Path(tempfile.mkdtemp(prefix="loadprofile-"))
try:
    _, ctx = sr.make_context(root, tokens, True)
    C = ctx.memory
    refs = sr.refs_of(ctx)
    W = ContextKV(C.geometry, torch.float32, "cpu")
    reads = FileReads(C, W, ctx.tier, refs, threads=1)
    t0 = time.perf_counter()
    for run in reads.runs:
        with ctx.tier.read_view(run.path, run.offset, run.nbytes):
            pass
    read_s = time.perf_counter() - t0
    reads._read_run(reads.runs[0])           # numba compiled / loaded from its cache
    C.drop_many(list(C.geometry.chunk_ids()))
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    C.reserve_pages(pages_to_read(C, refs))     # what a load does first (Load.run)
    for run in reads.runs:
        reads._read_run(run)
    prof.disable()
    load_s = time.perf_counter() - t0
    print(f"{len(reads.runs)} runs, reads alone {read_s * 1e3:.0f} ms, read + check + swap in + "
          f"fill on one thread {load_s * 1e3:.0f} ms ({load_s / read_s:.1f}x), failed "
          f"{len(reads.failed)}")
    stats = pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime"))
    stats.print_stats(int(os.environ.get("TOP", "15")))
finally:
    shutil.rmtree(root, ignore_errors=True)
