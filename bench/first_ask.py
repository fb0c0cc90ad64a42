"""A fresh device service's first asks against its later ones (docs/asks.md, "A fresh service's
first ask").

A real ``sparkv serve`` on loopback encodes ``--asks`` distinct 2K slices of the bundled text; a
fresh ``sparkv device serve`` (one emulated link of ``--link-mbps``) answers one ask about each,
one after the other (``keep`` off: every ask loads its context). Per ask: ``first_token_s`` (from
its submission, what an app waits), the edge's ``ttft_s`` (from the session's clock) and their
difference (what the ask paid outside the session's clock), and the service's start time.

    python bench/first_ask.py --asks 4 --out bench/results/first_ask_s81.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkv.cli import passive_openmp_waits

passive_openmp_waits()          # before torch loads, as the sparkv command does

from sparkv.bench.concurrency import QUESTION, _contexts  # noqa: E402
from sparkv.device.client import DeviceProcess  # noqa: E402
from sparkv.server.process import ServerProcess, write_config  # noqa: E402


def _asks(dev: Any, url: str, cids: list[str], strategy: str) -> list[dict[str, Any]]:
    rows = []
    for i, cid in enumerate(cids):
        with dev.client() as c:
            done = c.ask(cid, QUESTION, server=url, strategy=strategy, max_new_tokens=4,
                         stop_at_eos=False, keep=False).model_dump()
        ttft = done["stats"]["ttft_s"]
        rows.append({"ask": i, "first_token_s": done["first_token_s"], "ttft_s": ttft,
                     "outside_s": done["first_token_s"] - ttft,
                     "chunks_streamed": done["stats"].get("chunks_streamed")})
        print(f"ask {i}: first token {done['first_token_s']:.2f} s, session TTFT {ttft:.2f} s, "
              f"outside its clock {done['first_token_s'] - ttft:.2f} s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--asks", type=int, default=4)
    ap.add_argument("--strategy", default="sparkv")
    ap.add_argument("--link-mbps", type=float, default=50.0)
    ap.add_argument("--out", default="bench/results/first_ask.json")
    args = ap.parse_args()
    ctx_args = argparse.Namespace(model=None, tokens=2048, levels="raw,q8,q5", chunk_tokens=512)
    with tempfile.TemporaryDirectory(prefix="sparkv-first-ask-") as tmp:
        yaml = f"{tmp}/server.yaml"
        write_config(yaml, None, allow_anonymous=True)
        server = ServerProcess(yaml, f"file://{tmp}/store", log_path=f"{tmp}/server.log").start()
        try:
            cids = _contexts(server.url, args.asks, ctx_args)
            t0 = time.perf_counter()
            dev = DeviceProcess(Path(tmp) / "dev", 512, torch_threads=2,
                                extra_args=["--link-mbps", str(args.link_mbps),
                                            "--link-rtt-ms", "20"]).start()
            start_s = time.perf_counter() - t0
            print(f"service started in {start_s:.1f} s", flush=True)
            try:
                rows = _asks(dev, server.url, cids, args.strategy)
            finally:
                dev.stop()
        finally:
            server.stop()
    later = sorted(r["first_token_s"] for r in rows[1:])
    summary = {"service_start_s": start_s, "first_ask_first_token_s": rows[0]["first_token_s"],
               "later_median_first_token_s": later[len(later) // 2] if later else None,
               "first_ask_outside_s": rows[0]["outside_s"]}
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "summary": summary, "asks": rows}, f, indent=1)


if __name__ == "__main__":
    main()
