"""What adopting a loaded context costs the context service (``ContextService.import_context``,
docs/device-service.md): an ask keeps its loaded cache this way, at its first answer token when
other asks wait for it (``--ask-early-keep``), so the loader's second token waits for it. One
``ContextService`` in process with SmolLM2; the bundled story's first ``--tokens`` tokens
prefilled once; then imported and deleted ``--rounds`` times (the heap frozen first, as the
service's process does, so no full collection of the model's objects lands in a round).

    python bench/import_context.py [--rounds 7] [--tokens 2048]
                                   [--out bench/results/import_context_cpu.json]

Per round the whole import (the chunks converted to their levels and put in pages, the journal
record, the write-ahead to flash) and its parts. Run it on two checkouts to compare. 2 torch
threads; wall clock on whatever machine runs it. No paper figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from story_model import story_model  # noqa: E402


def timed(into: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into.setdefault(name, []).append(time.perf_counter() - t)
    return run


def main() -> int:
    from sparkv.device import ContextService, chunked
    from sparkv.runtime.generate import reference_prefill
    from sparkv.runtime.heap import freeze_heap

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    lm, _, ids = story_model(a.tokens)
    layers = list(reference_prefill(lm, ids))
    parts: dict[str, list[float]] = {}
    keeper = chunked.ChunkKeeper
    keeper.adopt = timed(parts, "adopt_s", keeper.adopt)                   # type: ignore
    keeper.write_ahead = timed(parts, "write_ahead_s", keeper.write_ahead)  # type: ignore
    with tempfile.TemporaryDirectory() as d:
        svc = ContextService(lm, 1 << 31, d)
        svc.delete(svc.import_context(ids, layers))                         # warm
        parts.clear()
        freeze_heap()
        total = []
        for r in range(a.rounds):
            t = time.perf_counter()
            cid = svc.import_context(ids, layers)
            total.append(time.perf_counter() - t)
            svc.delete(cid)
            print(f"round {r + 1}/{a.rounds}: {total[-1]:.3f} s", flush=True)
        svc.close()
    med = {"import_s": round(statistics.median(total), 4),
           **{k: round(statistics.median(v), 4) for k, v in parts.items()}}
    print(f"{len(ids)} tokens, median of {a.rounds}: " + ", ".join(
        f"{k} {v:.3f} s" for k, v in med.items()))
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps(
            {"args": vars(a), "tokens": len(ids), "rounds": total, "parts": parts,
             "median": med}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
