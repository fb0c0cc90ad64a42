"""``sparkv bench concurrency --naive``: the device service against the naive alternative, N
separate ``sparkv ask`` processes (each loads its own model), over ONE real shaped link.

Emulated links cannot be shared between processes (N ``--mbps`` shapers would give N times the
bandwidth), so both sides use the kernel's: the server runs in a network namespace behind a veth
pair whose downlink tc shapes to ``--link-mbps`` (:class:`~sparkv.edge.netns.ShapedLink`, root
only, docs/netns.md). The device service runs with no emulated link (its asks share the veth),
and each naive process runs ``sparkv ask`` with neither ``--mbps`` nor ``--trace`` (the veth
shapes it). The kernel here may lack netem: then the link's RTT is the veth's own.

Per (strategy, N), beside the service's point: the naive batch's makespan (the N processes
started at once to the last exit: each process's start and model load included, which is the
naive cost), the TTFT p50/p95/max each process reports (``stats.ttft_s``, from its ask's start,
its model already loaded) and the peak of the processes' summed ``VmRSS``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sparkv.bench.common import NetnsServer, format_table, percentile, write_result

#: the port the server listens on inside its namespace (the namespace has nothing else)
NETNS_PORT = 18080
#: a rate high enough not to shape the contexts' creation (Mbit/s)
SETUP_MBPS = 1000.0


class RssSum:
    """The peak of the summed ``VmRSS`` of several processes while the block runs (a process that
    has exited counts 0)."""

    def __init__(self, pids: list[int], every_s: float = 0.05) -> None:
        self.pids, self.every_s, self.peak = pids, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def rss(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, sum(self.rss(p) for p in self.pids))
            self._stop.wait(self.every_s)

    def __enter__(self) -> "RssSum":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def ask_argv(url: str, cid: str, question: str, strategy: str, args: argparse.Namespace
             ) -> list[str]:
    """One naive app: ``sparkv ask`` on an unshaped emulated link (the veth shapes it)."""
    argv = [sys.executable, "-m", "sparkv.cli", "ask", question, "--server", url, "--context",
            cid, "--strategy", strategy, "--max-new-tokens", str(args.max_new_tokens), "--json",
            "--no-cache"]
    return argv + (["--model", str(args.model)] if args.model else [])


def naive_batch(url: str, cids: list[str], question: str, strategy: str, n: int,
                args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    """N ``sparkv ask`` processes started at once; their parsed outputs (or the failure's last
    line), the makespan and the peak of their summed RSS."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads or 2), "PYTHONUNBUFFERED": "1"}
    logs = [open(f"{tmp}/naive-{strategy}-{n}-{i}.err", "wb") for i in range(n)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(ask_argv(url, cids[0 if args.shared else i], question, strategy,
                                       args), stdout=subprocess.PIPE, stderr=logs[i], env=env)
             for i in range(n)]
    with RssSum([p.pid for p in procs]) as rss:
        stdouts = [p.communicate(timeout=900)[0] for p in procs]
        makespan = time.perf_counter() - t0
    outs: list[dict[str, Any] | str] = []
    for i, (p, raw) in enumerate(zip(procs, stdouts)):
        logs[i].close()
        try:
            outs.append(json.loads(raw) if p.returncode == 0 else _last_line(logs[i].name))
        except json.JSONDecodeError:
            outs.append(f"bad JSON on stdout: {raw[-200:]!r}")
    return {"outs": outs, "makespan_s": makespan, "rss_peak_bytes": rss.peak}


def _last_line(path: str) -> str:
    lines = Path(path).read_text(errors="replace").strip().splitlines()
    return lines[-1] if lines else "exited without output"


def naive_point(strategy: str, n: int, batch: dict[str, Any]) -> dict[str, Any]:
    """The naive batch's summary: TTFT from each process's own ``stats.ttft_s``."""
    done = [o for o in batch["outs"] if isinstance(o, dict)]
    ttft = [float(d["stats"]["ttft_s"]) for d in done]
    return {"strategy": strategy, "n": n, "failed": [o for o in batch["outs"]
                                                     if not isinstance(o, dict)],
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "ttft_max_s": max(ttft, default=0.0), "ttft_s": ttft,
            "makespan_s": batch["makespan_s"],
            "mb_per_ask": sum(d["stats"].get("bytes_streamed", 0) for d in done)
            / 1e6 / max(1, len(done)),
            "rss_peak_mb": batch["rss_peak_bytes"] / 2**20}


def compare(service: dict[str, Any], naive: dict[str, Any]) -> dict[str, Any]:
    """The naive batch over the service's, for one (strategy, N): > 1 is the service ahead."""
    def over(key: str) -> float | None:
        return naive[key] / service[key] if service[key] > 0 else None

    return {"strategy": service["strategy"], "n": service["n"],
            "naive_over_service_makespan": over("makespan_s"),
            "naive_over_service_ttft_p50": over("ttft_p50_s"),
            "naive_over_service_rss": over("rss_peak_mb")}


@dataclass(frozen=True)
class ServiceSide:
    """What ``sparkv bench concurrency`` gives the comparison (no import back into it):
    ``contexts(url, count, args)`` creates the contexts, ``point(dev, url, cids, strategy, n)``
    runs and summarizes one batch through the service, ``question`` is every ask's."""

    contexts: Callable[[str, int, argparse.Namespace], list[str]]
    point: Callable[[Any, str, list[str], str, int], dict[str, Any]]
    question: str


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def run_naive(args: argparse.Namespace, side: ServiceSide) -> int:
    """Every strategy and N: the service's batch, then the naive processes', over one veth."""
    from sparkv.device.client import DeviceProcess
    from sparkv.edge.netns import netns_available

    ok, why = netns_available()
    if not ok:
        raise SystemExit(f"--naive needs a real shaped link (docs/netns.md): {why}")
    if args.link_trace:
        raise SystemExit("--naive shapes one constant veth: give --link-mbps, not --link-trace")
    ns = sorted(int(x) for x in _csv(args.n))
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-naive-") as tmp:
        server = NetnsServer(tmp, args.model, port=NETNS_PORT, setup_mbps=SETUP_MBPS)
        dev = None
        try:
            cids = side.contexts(server.url, 1 if args.shared else ns[-1], args)
            server.link.set_rate(args.link_mbps)
            dev = DeviceProcess(Path(tmp) / "dev", args.budget_mb, model=args.model,
                                torch_threads=args.threads or 2,
                                extra_args=["--ask-slots", str(ns[-1]), "--ask-queue",
                                            str(ns[-1]), "--ask-link-plan",
                                            _csv(args.link_plans)[0], "--ask-batch",
                                            args.ask_batch]).start()
            for strategy in _csv(args.strategies):
                side.point(dev, server.url, cids, strategy, 1)          # warm-up
                for n in ns:
                    svc = side.point(dev, server.url, cids, strategy, n)
                    nav = naive_point(strategy, n, naive_batch(server.url, cids, side.question,
                                                               strategy, n, args, tmp))
                    rows.append({"service": svc, "naive": nav, **compare(svc, nav)})
                    print(f"{strategy} N={n}: makespan service {svc['makespan_s']:.2f} s, "
                          f"naive {nav['makespan_s']:.2f} s", flush=True)
        finally:
            if dev is not None:
                dev.stop()
            server.close()
    _report(rows, args, load_before)
    return 0


def _report(rows: list[dict[str, Any]], args: argparse.Namespace,
            load_before: tuple[float, float, float]) -> None:
    table = []
    for r in rows:
        for side in ("service", "naive"):
            p = r[side]
            table.append([side, p["strategy"], p["n"], f"{p['makespan_s']:.2f}",
                          f"{p['ttft_p50_s']:.2f}", f"{p['ttft_p95_s']:.2f}",
                          f"{p['rss_peak_mb']:.0f}", len(p["failed"])])
    print(format_table(["side", "strategy", "N", "makespan s", "TTFT p50 s", "p95 s",
                        "peak RSS MB", "failed"], table))
    if args.json or args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        config["loadavg_before_after"] = [list(load_before), list(os.getloadavg())]
        config["link"] = ("one tc-shaped veth (server in a network namespace); the service and "
                          "the naive processes emulate no link of their own")
        out = write_result("concurrency_naive", {"results": rows,
                                                 "targets": {"naive_over_service_makespan_at_4":
                                                             1.3}}, config, path=args.out)
        print(f"wrote {out}")
