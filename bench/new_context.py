"""What a new context costs the device service (``ContextService.new_context``): its system
prompt's prefill over the working memory (LLMS's densities recorded), its chunks folded at
their levels into pages, and its write-ahead to flash.

    python bench/new_context.py [--rounds 5] [--tokens 2048]
                                [--out bench/results/new_context_cpu.json]

One ``ContextService`` in process with SmolLM2 (the bundled model), the bundled story's first
``--tokens`` tokens as the system prompt (its own ids), made ``--rounds`` times after a warm-up
context; per round the seconds, and the median. The C heap kept as the service's process keeps
it (``keep_freed_memory``) and the heap frozen, 2 torch threads. Run it on two checkouts to
compare (a ``git worktree`` of the commit before, ``PYTHONPATH`` at it). No paper figure (LLMS
reports switch times, not how long a context takes to make).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402


def main() -> int:
    from sparkv.device import ContextService
    from sparkv.runtime.heap import freeze_heap, keep_freed_memory

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=2048, help="the story's first tokens")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(2)
    lm, _, ids = story_model(a.tokens)
    times = []
    with tempfile.TemporaryDirectory() as d:
        svc = ContextService(lm, 1 << 31, d)
        svc.new_context(system_ids=ids[:200])                       # warm
        keep_freed_memory()
        freeze_heap()
        for r in range(a.rounds):
            t = time.perf_counter()
            svc.new_context(system_ids=ids)
            times.append(time.perf_counter() - t)
            print(f"round {r + 1}/{a.rounds}: {times[-1]:.3f} s", flush=True)
        svc.close()
    med = statistics.median(times)
    print(f"a new {len(ids)}-token context: median {med:.3f} s "
          f"(min {min(times):.3f}, max {max(times):.3f})")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "context_tokens": len(ids), "seconds": [round(x, 4) for x in times],
             "median_s": round(med, 4)}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
