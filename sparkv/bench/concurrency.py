"""``sparkv bench concurrency``: N simultaneous asks through one device service (docs/asks.md),
over one shaped link (docs/benchmarks.md, "concurrency").

A real ``sparkv serve`` on loopback encodes ``max(--n)`` distinct slices of the bundled text
(``--tokens`` each; with ``--shared`` every ask is about the first one); a real ``sparkv device
serve`` (``--ask-slots`` = ``max(--n)``, one link: ``--link-mbps`` or ``--link-trace``) answers.
For each strategy and each N, N clients submit one ask each at once (``keep`` off: every ask
loads its context) and wait for its ``done`` event. Per (strategy, N):

* TTFT p50 / p95 / max: each ask's ``first_token_s`` (from its submission to its first token,
  its wait for the cores and the link included);
* the batch's makespan (the first submission to the last ``done``);
* the answer's time after its first token (``total_s - first_token_s``: the later tokens' pace,
  what the ``first-tokens`` core order trades for first tokens), p50 and max;
* bytes and energy per request (the energy an ESTIMATE from the model of ``sparkv bench ttft``:
  ``E = P_compute * compute_busy + P_decode * decode_busy + P_radio * link_active + P_idle *
  TTFT``, from each ask's own ``stats``);
* the service's peak RSS during the batch (``VmRSS`` of its process, sampled every 50 ms).

One warm-up ask per strategy runs first (not counted). The service's one link follows
``--link-trace`` from its first byte on, so with a trace each batch sees another part of it (the
strategies are paired only over a constant link), unless ``--trace-per-batch`` starts a fresh
service for each (strategy, N) batch (its warm-up a ``local`` ask, which sends no byte): then
every batch sees the trace from its start, and the strategies are paired under it too. Ratios at the largest N: SparKV's p50
over Strong Hybrid's and local's; for every N >= 2, SparKV's p50 over N times its p50 at N = 1
(the issue's targets: 1.3x, 5x, <= 0.75). With ``--json`` or ``--out``, a PNG beside the JSON:
TTFT against N per strategy (the paper's Fig. 15).

``--link-plans even,oldest`` runs every strategy under each of the service's link plans
(``--ask-link-plan``, docs/asks.md), one service after the other over the same contexts: each
point records its ``link_plan``, and the ratios are per plan (before and after in one run).

``--naive`` compares the service with N separate ``sparkv ask`` processes over one real shaped
link instead (:mod:`sparkv.bench.naive`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from sparkv.asks.cores import DECODE_BATCH, GRANT_ORDERS
from sparkv.asks.orders import DEFAULT_ORDER
from sparkv.asks.linkplan import LINK_PLANS
from sparkv.bench.common import add_run_args, format_table, percentile, write_result

STRATEGY_ORDER = ("local", "stream", "hybrid", "sparkv")
QUESTION = "What does this text say about warranty? Answer in one sentence."
#: each ask's busy times the JSON keeps (``busy_s``: where an ask's seconds went)
BUSY_KEYS = ("local_compute_s", "decoding_s", "streaming_s")
#: how often the service's RSS is sampled during a batch (s)
RSS_EVERY_S = 0.05


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("concurrency", help="N simultaneous asks through one device service "
                                           "over one shaped link")
    p.add_argument("--n", default="1,2,4", help="simultaneous asks, comma-separated")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of each context")
    p.add_argument("--shared", action="store_true",
                   help="every ask is about one context (default: a distinct one each)")
    p.add_argument("--strategies", default=",".join(STRATEGY_ORDER),
                   help="strategies, comma-separated")
    link = p.add_mutually_exclusive_group()
    link.add_argument("--link-mbps", type=float, default=20.0,
                      help="the one constant link every ask shares (Mbit/s)")
    link.add_argument("--link-trace", default=None,
                      help="the one link follows this trace instead (CSV or wifi, lte, ...)")
    p.add_argument("--link-rtt-ms", type=float, default=20.0, help="the link's round trip (ms)")
    p.add_argument("--trace-per-batch", action="store_true",
                   help="with --link-trace: a fresh service per (strategy, N), its warm-up a local "
                        "ask, so every batch sees the trace from its start (paired strategies)")
    p.add_argument("--core-order", choices=GRANT_ORDERS, default=DEFAULT_ORDER,
                   help="the service's --ask-core-order (docs/asks.md)")
    p.add_argument("--ask-batch", choices=("on", "off"), default="off",
                   help="the service's --ask-batch (docs/asks.md)")
    p.add_argument("--decode-batch", type=int, default=DECODE_BATCH,
                   help="the service's --ask-decode-batch (docs/asks.md; 1: each answer token "
                        "its own pass)")
    p.add_argument("--dtype", default="auto",
                   help="the service's --dtype, its compute configuration (docs/dtypes.md; "
                        "e.g. int4-decode: answer tokens through the int4 kernel)")
    p.add_argument("--link-plans", default="oldest",
                   help="the service's --ask-link-plan, comma-separated: one service per plan, "
                        "every strategy under each (e.g. even,oldest: before and after)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="T the server encodes with")
    p.add_argument("--levels", default="raw,q8,q5", help="levels the server encodes")
    p.add_argument("--max-new-tokens", type=int, default=8, help="answer tokens per ask")
    p.add_argument("--budget-mb", type=int, default=1024, help="the service's memory budget")
    p.add_argument("--watts-compute", type=float, default=3.0, help="energy model: computing, W")
    p.add_argument("--watts-decode", type=float, default=1.5, help="energy model: decoding, W")
    p.add_argument("--watts-radio", type=float, default=1.2, help="energy model: link active, W")
    p.add_argument("--watts-idle", type=float, default=0.3, help="energy model: idle, W")
    p.add_argument("--naive", action="store_true",
                   help="instead, each strategy and N through the service and as N separate "
                        "`sparkv ask` processes (each loads its own model), both over one "
                        "tc-shaped veth at --link-mbps (root only; concurrency_naive.json)")
    add_run_args(p, "concurrency", threads=2, threads_help="the service's torch threads")
    p.set_defaults(func=run)


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _contexts(url: str, count: int, args: argparse.Namespace) -> list[str]:
    """``count`` contexts of ``--tokens`` tokens each: distinct slices of the bundled text."""
    from transformers import AutoTokenizer

    from sparkv.edge.client import EdgeClient
    from sparkv.runtime.generate import sample_text
    from sparkv.runtime.model import default_checkpoint

    tok = AutoTokenizer.from_pretrained(str(args.model or default_checkpoint(progress=False)))
    ids = tok(sample_text(), add_special_tokens=False)["input_ids"]
    while len(ids) < count * args.tokens:
        ids = ids + ids
    with EdgeClient(url, None, timeout_s=900) as client:
        return [client.create_context(token_ids=ids[i * args.tokens:(i + 1) * args.tokens],
                                      levels=_csv(args.levels), chunk_tokens=args.chunk_tokens)
                for i in range(count)]


class _RssPeak:
    """The peak ``VmRSS`` of a process while the block runs (sampled every
    :data:`RSS_EVERY_S`)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(RSS_EVERY_S)

    def __enter__(self) -> "_RssPeak":
        self.peak = self._rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _batch(dev: Any, url: str, cids: list[str], strategy: str, n: int,
           args: argparse.Namespace) -> dict[str, Any]:
    """N asks at once; their outcomes and the batch's makespan and peak RSS."""
    outs: list[dict[str, Any] | BaseException | None] = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        with dev.client() as c:
            start.wait()
            try:
                outs[i] = c.ask(cids[0 if args.shared else i], QUESTION, server=url,
                                strategy=strategy, max_new_tokens=args.max_new_tokens,
                                stop_at_eos=False, keep=False).model_dump()
            except Exception as e:  # noqa: BLE001 - a failed ask is reported, the batch goes on
                outs[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    units_before = _units(dev)
    with _RssPeak(dev.proc.pid) as rss:
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        makespan = time.perf_counter() - t0
    units = {k: v - units_before[k] for k, v in _units(dev).items()}
    return {"outs": outs, "makespan_s": makespan, "rss_peak_bytes": rss.peak, **units}


def _units(dev: Any) -> dict[str, int]:
    """The service's compute units so far, and those run in another ask's call."""
    with dev.client() as c:
        cores = c.ask_stats()["cores"]
    return {"units": int(cores["units"]), "batched_units": int(cores["batched_units"])}


def _energy(bd: dict[str, Any], args: argparse.Namespace) -> float:
    return (args.watts_compute * bd.get("local_compute_s", 0.0)
            + args.watts_decode * bd.get("decoding_s", 0.0)
            + args.watts_radio * bd.get("streaming_s", 0.0)
            + args.watts_idle * bd.get("ttft_s", 0.0))


def _point(strategy: str, n: int, batch: dict[str, Any], args: argparse.Namespace
           ) -> dict[str, Any]:
    done = [o for o in batch["outs"] if isinstance(o, dict)]
    failed = [f"{type(o).__name__}: {o}" for o in batch["outs"] if not isinstance(o, dict)]
    ttft = [float(d["first_token_s"]) for d in done]
    answer = [float(d["total_s"]) - float(d["first_token_s"]) for d in done if "total_s" in d]
    return {"strategy": strategy, "n": n, "asks": n, "failed": failed,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "ttft_max_s": max(ttft, default=0.0), "ttft_s": ttft,
            "makespan_s": batch["makespan_s"],
            "answer_p50_s": percentile(answer, 50), "answer_max_s": max(answer, default=0.0),
            "answer_s": answer,
            "mb_per_ask": sum(d["stats"]["bytes_streamed"] for d in done) / 1e6 / max(1, len(done)),
            "energy_j_per_ask": sum(_energy(d["stats"], args) for d in done) / max(1, len(done)),
            "queued_s": [float(d["queued_s"]) for d in done],
            "streamed": [d["stats"]["chunks_streamed"] for d in done],
            "computed": [d["stats"]["chunks_computed"] for d in done],
            "fallback": [d["stats"]["fallback"] for d in done],
            # each ask's re-plan at the measured link rate (``None``: none judged; ``taken``)
            "replan": [d["stats"].get("replan") for d in done],
            "busy_s": [{k: round(float(d["stats"].get(k, 0.0)), 3) for k in BUSY_KEYS}
                       for d in done],
            "rss_peak_mb": batch["rss_peak_bytes"] / 2**20,
            "units": batch.get("units"), "batched_units": batch.get("batched_units")}


def _ratios(points: list[dict[str, Any]]) -> dict[str, Any]:
    """SparKV against Strong Hybrid and local at the largest N; SparKV at N against N times its
    single-ask TTFT; the service's peak RSS during SparKV's largest batch over its single ask."""
    p50 = {(p["strategy"], p["n"]): p["ttft_p50_s"] for p in points}
    ns = sorted({p["n"] for p in points})
    top = ns[-1]
    out: dict[str, Any] = {"n": top}
    for base in ("hybrid", "local", "stream"):
        if ("sparkv", top) in p50 and (base, top) in p50 and p50[("sparkv", top)] > 0:
            out[f"{base}_over_sparkv_p50"] = p50[(base, top)] / p50[("sparkv", top)]
    one = p50.get(("sparkv", 1))
    if one:
        out["sparkv_p50_over_n_times_single"] = {n: p50[("sparkv", n)] / (n * one)
                                                 for n in ns if n >= 2 and ("sparkv", n) in p50}
    rss = {p["n"]: p["rss_peak_mb"] for p in points if p["strategy"] == "sparkv"}
    if 1 in rss and rss[1] > 0:
        out["rss_top_over_rss_1"] = rss[top] / rss[1]
    return out


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """TTFT p50 against N per strategy (the p95 as a band's top), as the paper's Fig. 15."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    plans = set(p.get("link_plan") for p in points)
    for key in dict.fromkeys((p["strategy"], p.get("link_plan")) for p in points):
        mine = sorted((p for p in points if (p["strategy"], p.get("link_plan")) == key),
                      key=lambda p: p["n"])
        ns = [p["n"] for p in mine]
        label = key[0] if len(plans) == 1 else f"{key[0]} ({key[1]} link plan)"
        line, = ax.plot(ns, [p["ttft_p50_s"] for p in mine], marker="o", label=label)
        ax.fill_between(ns, [p["ttft_p50_s"] for p in mine], [p["ttft_p95_s"] for p in mine],
                        color=line.get_color(), alpha=0.15)
    ax.set_xlabel("simultaneous asks (N)")
    ax.set_ylabel("TTFT p50 (s; band: to p95)")
    ax.set_xticks(sorted({p["n"] for p in points}))
    ax.set_title("asks through one device service, one link")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plans(args: argparse.Namespace) -> list[str]:
    plans = _csv(args.link_plans)
    bad = [x for x in plans if x not in LINK_PLANS]
    if bad or not plans:
        raise SystemExit(f"--link-plans: no plan {bad} (of {', '.join(LINK_PLANS)})")
    return plans


def run(args: argparse.Namespace) -> int:
    from sparkv.device.client import DeviceProcess
    from sparkv.server.process import ServerProcess, write_config

    plans = _plans(args)
    if args.naive:
        from sparkv.bench.naive import ServiceSide, run_naive

        def service_point(dev: Any, url: str, cids: list[str], strategy: str, n: int
                          ) -> dict[str, Any]:
            return _point(strategy, n, _batch(dev, url, cids, strategy, n, args), args)

        return run_naive(args, ServiceSide(_contexts, service_point, QUESTION))
    ns = sorted(int(x) for x in _csv(args.n))
    load_before = os.getloadavg()
    strategies = _csv(args.strategies)
    link = (["--link-trace", args.link_trace] if args.link_trace
            else ["--link-mbps", str(args.link_mbps)])
    fresh = bool(args.link_trace) and args.trace_per_batch
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-concurrency-") as tmp:
        server_yaml = f"{tmp}/server.yaml"
        models = {"models": {"bench": str(args.model)}, "default_model": "bench"} if args.model else {}
        write_config(server_yaml, None, allow_anonymous=True, **models)
        server = ServerProcess(server_yaml, f"file://{tmp}/store", log_path=f"{tmp}/server.log").start()
        dev = None
        points: list[dict[str, Any]] = []
        try:
            cids = _contexts(server.url, 1 if args.shared else ns[-1], args)
            for plan in plans:
                def service(tag: str) -> Any:
                    return DeviceProcess(Path(tmp) / f"dev-{plan}-{tag}", args.budget_mb,
                                         model=args.model, torch_threads=args.threads or 2,
                                         extra_args=["--ask-slots", str(ns[-1]), "--ask-queue",
                                                     str(ns[-1]), *link, "--link-rtt-ms",
                                                     str(args.link_rtt_ms), "--ask-core-order",
                                                     args.core_order, "--ask-link-plan",
                                                     plan, "--ask-batch",
                                                     args.ask_batch, "--ask-decode-batch",
                                                     str(args.decode_batch), "--dtype",
                                                     args.dtype]).start()

                dev = None if fresh else service("all")
                for strategy in strategies:
                    if dev is not None:
                        _batch(dev, server.url, cids, strategy, 1, args)      # warm-up
                    for n in ns:
                        if fresh:      # a service whose trace starts at this batch's first byte
                            dev = service(f"{strategy}-{n}")
                            _batch(dev, server.url, cids, "local", 1, args)   # warm-up, no link
                        point = _point(strategy, n, _batch(dev, server.url, cids, strategy,
                                                           n, args), args)
                        points.append({**point, "link_plan": plan})
                        print(f"[{plan}] {strategy} N={n}: TTFT p50 {point['ttft_p50_s']:.2f} "
                              f"s, makespan {point['makespan_s']:.2f} s", flush=True)
                        if fresh and dev is not None:
                            dev.stop()
                            dev = None
                if dev is not None:
                    dev.stop()
                    dev = None
        finally:
            if dev is not None:
                dev.stop()
            server.stop()
    ratios = {plan: _ratios([p for p in points if p["link_plan"] == plan]) for plan in plans}
    if len(plans) == 1:
        ratios = ratios[plans[0]]
    print(format_table(
        ["plan", "strategy", "N", "TTFT p50 s", "p95 s", "max s", "makespan s", "answer p50 s",
         "max s", "MB/ask", "J/ask (est.)", "RSS MB", "failed"],
        [[p["link_plan"], p["strategy"], p["n"], f"{p['ttft_p50_s']:.2f}", f"{p['ttft_p95_s']:.2f}",
          f"{p['ttft_max_s']:.2f}", f"{p['makespan_s']:.2f}", f"{p['answer_p50_s']:.2f}",
          f"{p['answer_max_s']:.2f}", f"{p['mb_per_ask']:.2f}",
          f"{p['energy_j_per_ask']:.2f}", f"{p['rss_peak_mb']:.0f}", len(p["failed"])]
         for p in points]))
    print("ratios:", ratios)
    if args.json or args.out:
        config = {k: v for k, v in vars(args).items() if k not in ("func",)}
        config["loadavg_before_after"] = [list(load_before), list(os.getloadavg())]
        config["energy_model"] = ("E = P_compute*compute_busy + P_decode*decode_busy + "
                                  "P_radio*link_active + P_idle*TTFT (an estimate)")
        out = write_result("concurrency", {"results": points, "ratios": ratios,
                                           "targets": {"hybrid_over_sparkv_p50_at_8": 1.3,
                                                       "local_over_sparkv_p50_at_8": 5.0,
                                                       "sparkv_p50_over_n_times_single": 0.75,
                                                       "rss_8_over_rss_1": 1.3}},
                           config, path=args.out)
        plot(points, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0
