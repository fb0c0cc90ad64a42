"""What keeping a streamed background response's events on the flash costs (docs/asks.md,
"Streamed background responses"): ``--logs`` logs of ``--events`` events each, of the size
and shape of a token's ``response.output_text.delta``, written through
:class:`~sparkv.asks.resplog.EventLogs` with their files (:mod:`sparkv.asks.resplogfiles`) and
without (the service's memory only), on this machine's disk in ``--dir``; then the time a new
process takes to read them back past the page cache, as a restarted service does (median of 5),
half of them logs the service stopped before they ended (their failure added); and what ending a
log costs the event loop, and how long until its sync (in the syncing thread) put it on the disk.

    python bench/response_events.py [--out bench/results/response_events_cpu.json]

Wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from sparkv.asks.resplog import EventLogs
from sparkv.asks.resplogfiles import EventFiles

RUNS = 5


def _event(k: int) -> bytes:
    data = {"type": "response.output_text.delta", "sequence_number": k,
            "item_id": "msg_" + "0" * 48, "output_index": 0, "content_index": 0,
            "delta": " word", "logprobs": []}
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n".encode()


def _rid(k: int) -> str:
    return f"resp_{k:032x}"


def write(logs: EventLogs, n_logs: int, n_events: int) -> float:
    """Seconds per event added (half the logs left running, as at a service's stop)."""
    events = [_event(k) for k in range(n_events)]

    async def go() -> float:
        t0 = time.perf_counter()
        for j in range(n_logs):
            log = logs.open("app:bench", _rid(j))
            for e in events:
                log.add(e)
            if j % 2 == 0:
                logs.end(_rid(j))
        took = time.perf_counter() - t0
        logs.close()
        return took
    return asyncio.run(go()) / (n_logs * n_events)


def ending(files: EventFiles, n_logs: int, n_events: int) -> tuple[list[float], list[float]]:
    """Per log: the seconds the event loop spends ending it (its end mark written, its sync
    handed to the syncing thread), and the seconds until that sync ended (file and, the first
    time, folder: a finished response's events on the disk)."""
    events = [_event(k) for k in range(n_events)]
    on_loop, synced = [], []

    async def go() -> None:
        logs = EventLogs(finished=1000, finished_bytes=10**9, files=files)
        for j in range(n_logs):
            log = logs.open("app:bench", _rid(j))
            for e in events:
                log.add(e)
            t0 = time.perf_counter()
            logs.end(_rid(j))
            on_loop.append(time.perf_counter() - t0)
            files.syncs.wait()
            synced.append(time.perf_counter() - t0)
        logs.close()
    asyncio.run(go())
    return on_loop, synced


#: a restarted service's reading of the logs, in a new process (its imports not counted)
_READ_BACK = """
import sys, time
from sparkv.asks.respfiles import STOPPED
from sparkv.asks.resplog import EventLogs
from sparkv.asks.resplogfiles import EventFiles
t0 = time.perf_counter()
logs = EventLogs(finished=1000, finished_bytes=10**9, files=EventFiles(sys.argv[1]))
n = logs.load(lambda app, rid: {"id": rid, "status": "failed", "error": STOPPED})
print(time.perf_counter() - t0, n)
"""


def read_back(folder: pathlib.Path) -> tuple[float, int]:
    out = subprocess.run([sys.executable, "-c", _READ_BACK, str(folder)], capture_output=True,
                         text=True, check=True).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--logs", type=int, default=32)
    ap.add_argument("--events", type=int, default=300)
    ap.add_argument("--dir", type=pathlib.Path, default=None,
                    help="where the files are written (default: a new folder in the working "
                         "directory's disk, removed after)")
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    folder = args.dir or pathlib.Path(tempfile.mkdtemp(prefix=".events-bench-", dir="."))
    try:
        memory = min(write(EventLogs(finished=1000, finished_bytes=10**9), args.logs,
                           args.events) for _ in range(RUNS))
        filed = []
        for _ in range(RUNS):
            shutil.rmtree(folder / "events", ignore_errors=True)
            filed.append(write(EventLogs(finished=1000, finished_bytes=10**9,
                                         files=EventFiles(folder / "events")),
                               args.logs, args.events))
        files_bytes = sum(p.stat().st_size for p in (folder / "events").iterdir())
        first = read_back(folder / "events")        # the stopped logs get their failure
        took, loaded = zip(*(read_back(folder / "events") for _ in range(RUNS)))
        on_loop, synced = ending(EventFiles(folder / "ended"), args.logs, args.events)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    out: dict[str, Any] = {
        "logs": args.logs, "events": args.events, "event_bytes": len(_event(0)),
        "add_us_memory": memory * 1e6, "add_us_file": min(filed) * 1e6,
        "add_us_file_median": statistics.median(filed) * 1e6, "files_bytes": files_bytes,
        "first_read_back_s": first[0], "read_back_s": statistics.median(took),
        "read_back": loaded[0], "stopped_rewritten": args.logs // 2,
        "end_us_on_loop": statistics.median(on_loop) * 1e6,
        "end_synced_ms": statistics.median(synced) * 1e3,
        "end_synced_ms_max": max(synced) * 1e3}
    print(f"an event ({out['event_bytes']} B) added: {out['add_us_memory']:.1f} us in memory, "
          f"{out['add_us_file']:.1f} us with its file (median {out['add_us_file_median']:.1f})")
    print(f"{loaded[0]} logs ({files_bytes:,} B) read back by a new process in "
          f"{out['read_back_s'] * 1e3:.0f} ms (median of {RUNS}); the first time, with "
          f"{args.logs // 2} stopped logs' failures added and written again, "
          f"{first[0] * 1e3:.0f} ms")
    print(f"a log ended: {out['end_us_on_loop']:.0f} us on the event loop; its events on the "
          f"disk {out['end_synced_ms']:.1f} ms later (median of {args.logs}; at most "
          f"{out['end_synced_ms_max']:.1f} ms, the first with its folder)")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
