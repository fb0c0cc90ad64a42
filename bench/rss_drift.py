"""Does the device service's RSS come back after asks that free everything? (issue 45)

A real ``sparkv serve`` with four 1,024-token contexts of the bundled text, a real ``sparkv device
serve`` (4 slots, one 80 Mbit/s link, SmolLM2); batches of asks one after another (SparKV x1 three
times, SparKV x4 three times, local x4 twice, SparKV x1 three times); the service's ``VmRSS``
2 s after each batch, and its peak during it. ``python bench/rss_drift.py [--out PATH]``
(default bench/results/rss_drift.json).
"""
import argparse
import json
import tempfile
import time
from pathlib import Path

from sparkv.bench.concurrency import _batch, _contexts
from sparkv.device.client import DeviceProcess
from sparkv.server.process import ServerProcess, write_config

PLAN = [("sparkv", 1)] * 3 + [("sparkv", 4)] * 3 + [("local", 4)] * 2 + [("sparkv", 1)] * 3


def rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) // 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/rss_drift.json")
    out = p.parse_args().out
    args = argparse.Namespace(tokens=1024, levels="raw,q8,q5", chunk_tokens=256, model=None,
                              shared=False, max_new_tokens=8)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_config(f"{tmp}/s.yaml", None, allow_anonymous=True)
        srv = ServerProcess(f"{tmp}/s.yaml", f"file://{tmp}/store",
                            log_path=f"{tmp}/s.log").start()
        try:
            cids = _contexts(srv.url, 4, args)
            dev = DeviceProcess(Path(tmp) / "dev", 1024, torch_threads=2,
                                extra_args=["--ask-slots", "4", "--ask-queue", "4",
                                            "--link-mbps", "80"]).start()
            start = rss_mb(dev.proc.pid)
            print("service started:", start, "MB", flush=True)
            for i, (strategy, n) in enumerate(PLAN):
                b = _batch(dev, srv.url, cids, strategy, n, args)
                time.sleep(2)
                rows.append({"batch": i, "strategy": strategy, "n": n,
                             "peak_mb": b["rss_peak_bytes"] >> 20, "after_mb": rss_mb(dev.proc.pid)})
                print(f"[{i + 1}/{len(PLAN)}] {strategy} x{n}: peak {rows[-1]['peak_mb']} MB, "
                      f"after {rows[-1]['after_mb']} MB", flush=True)
            dev.stop()
        finally:
            srv.stop()
    Path(out).write_text(json.dumps({"start_mb": start, "batches": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
