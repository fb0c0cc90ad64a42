"""``sparkv bench ttft``: end-to-end TTFT of every strategy, real server, real model, emulated link.

For each context size a real ``sparkv serve`` process on loopback encodes the bundled sample text;
then, for each link (constant rates and fluctuating traces) and each strategy, the edge client
answers the same question ``--runs`` times through :class:`~sparkv.edge.shaper.LinkShaper` (a
token bucket following the link, restarted at t=0 for every request). Everything on the TTFT path
is measured: manifest download, planning, streaming + decoding + local compute (overlapped),
question prefill and the first token. ``local`` does not touch the network, so it is measured once
per size and reused for every link; with ``--local per-link`` it is measured beside every link's
strategies instead (paired: each link's ratios against its own local, for a machine whose speed
drifts over a long sweep).

With ``--link netns`` (root only; skipped with the reason elsewhere) the same points run over a
real shaped path instead: the server in a network namespace behind a veth pair, ``tc`` following
the trace (docs/netns.md), results in ``ttft_netns.json``.

Per point: median, min and max TTFT over the runs; greedy agreement over the first 32 tokens and
first-token KL against the dense full-prefill reference; the simulator's prediction for the plan
that ran (same controller, same link); an energy estimate (below). Targets (the issue): at the
crossover bandwidth (where local and stream-only are closest) sparkv <= 0.75x the better of the two
and <= 0.8x Strong Hybrid; nowhere worse than 1.05x the best baseline.

With ``--traces adversarial:N`` the links are N seeded adversarial traces
(:func:`sparkv.scheduler.trace.adversarial_trace`: fades of 0.5-3 s down to 0.5-3 Mbit/s at random
times, the very start included, recoveries to 20-300 Mbit/s, bursty Wi-Fi) and the report is the
distribution of sparkv's TTFT over the best baseline's per trace (median, 95th percentile, worst;
targets 1.05x at the 95th percentile and 1.15x at worst), with the per-trace table in the JSON
(``ttft_adversarial.json``).

Energy (an ESTIMATE from a documented power model, not a measurement):
``E = P_compute * compute_busy + P_decode * decode_busy + P_radio * link_active + P_idle * TTFT``
with configurable watts (defaults: a phone-class SoC, 3.0 W compute, 1.5 W decode, 1.2 W radio,
0.3 W idle).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkv.bench.common import MODEL_HELP, add_output_args, format_table, write_result
from sparkv.bench.longctx import LONG_CONTEXT_MODES, growth_lines, growth_report, plot_growth
from sparkv.cliflags import PRESS_METAVAR
from sparkv.cliflags import add_device_args

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

STRATEGY_ORDER = ("local", "stream", "hybrid", "sparkv")
QUESTION = "What does this text say about warranty? Answer in one sentence."


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("ttft", help="end-to-end TTFT of every strategy over emulated links")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--sizes", default="2048,4096,8192",
                   help="context sizes in tokens, comma-separated (past the model's window: "
                        "see --long-context)")
    p.add_argument("--long-context", choices=LONG_CONTEXT_MODES, default="auto",
                   help="auto: when a size exceeds the model's window, every size runs on the "
                        "model with its RoPE extended (rope-extended:N, timing only past the "
                        "window; labelled in the table, JSON and plots); rope: always that "
                        "model; random: random weights of the same shape, extended; off: never "
                        "(docs/benchmarks.md)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="T the server encodes with (smaller T: finer plans, larger manifests)")
    p.add_argument("--levels", default="raw,q8,q5", help="levels the server encodes")
    p.add_argument("--mbps", default=None,
                   help="constant links (Mbit/s; default 5,20,50,100,500; '' for none: the "
                        "--trace links only)")
    p.add_argument("--trace", action="append", default=None,
                   help="trace CSV or bundled name (repeatable; default: wifi, lte, deep_fade; "
                        "none or an empty name: constant links only)")
    p.add_argument("--traces", default=None,
                   help="adversarial:N[:SEED] - N seeded adversarial traces instead of the "
                        "default links (constant links only if --mbps is given explicitly)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="emulated round trip (ms)")
    p.add_argument("--strategies", default=",".join(STRATEGY_ORDER),
                   help="strategies to answer with, comma-separated")
    p.add_argument("--prelude", choices=("auto", "off"), default="auto",
                   help="off: sparkv waits for the manifest and the plan before computing, as "
                        "the baselines do (the start-up overlap's ablation)")
    p.add_argument("--runs", type=int, default=3, help="questions per size, link and strategy")
    p.add_argument("--local", choices=("once", "per-link"), default="once",
                   help="once: local prefill (which never touches the link) measured once per "
                        "size; per-link: measured beside every link's strategies, in their "
                        "rotation, and each link's ratios taken against its own local (paired: "
                        "on a machine whose speed drifts during a long sweep)")
    p.add_argument("--link-prior", choices=("fresh", "learned"), default="fresh",
                   help="fresh: every ask plans with no link rate learned (the plan's default "
                        "until its first samples); learned: the session keeps the rate its "
                        "loads measured on this link, as an app asking again does (forgotten "
                        "when the link changes)")
    p.add_argument("--max-new-tokens", type=int, default=32,
                   help="answer tokens compared with the dense reference (agreement)")
    add_device_args(p)
    p.add_argument("--backend", default="auto",
                   help="attention of every strategy's local layer steps, the baselines' as "
                        "sparkv's: auto (what sparkv resolves for the model), dense, "
                        "block_sparse, ...")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--link", choices=("shaper", "netns"), default="shaper",
                   help="shaper: server on loopback, link emulated in the client (ttft.json); "
                        "netns: server in a network namespace, tc shapes a real veth path "
                        "(root only; ttft_netns.json)")
    p.add_argument("--watts-compute", type=float, default=3.0,
                   help="power while computing, W (the energy estimate's model)")
    p.add_argument("--watts-decode", type=float, default=1.5, help="power while decoding frames, W")
    p.add_argument("--watts-radio", type=float, default=1.2,
                   help="power while the link is active, W")
    p.add_argument("--watts-idle", type=float, default=0.3, help="power at idle, W")
    p.add_argument("--press", default=None, metavar=PRESS_METAVAR,
                   help="compressed contexts (docs/presses.md, 'On the server'): every size is "
                        "also encoded with this question-agnostic press (e.g. adakv:0.5); "
                        "stream, hybrid and sparkv run on both, plus pass-key accuracy with and "
                        "without it (bench/results/ttft_press.json; default links 10,20,40)")
    p.add_argument("--press-trials", type=int, default=4,
                   help="pass-key tasks per size with --press")
    add_output_args(p, "ttft", json_help="write bench/results/ttft.json and its plots "
                                         "(ttft_netns.json with --link netns, "
                                         "ttft_adversarial.json with --traces, ttft_press.json "
                                         "with --press)")
    p.set_defaults(func=run)


def _csv(text: str, cast: Any = float) -> list[Any]:
    return [cast(x) for x in text.split(",") if x.strip()]


def _links(args: argparse.Namespace) -> list[tuple[Any, Any]]:
    """``(label, Trace)`` for every link: numbers for constant links, names for traces."""
    from sparkv.scheduler.trace import Trace, adversarial_traces

    if args.traces:
        kind, _, rest = args.traces.partition(":")
        if kind != "adversarial" or not rest:
            raise SystemExit(f"--traces: expected adversarial:N[:SEED], got {args.traces!r}")
        count, _, seed = rest.partition(":")
        out: list[tuple[Any, Any]] = [(m, Trace.constant(m)) for m in _csv(args.mbps or "")]
        out += [(tr.name, tr) for tr in adversarial_traces(int(count), int(seed or 0))]
        return out
    out = [(m, Trace.constant(m))
           for m in _csv("5,20,50,100,500" if args.mbps is None else args.mbps)]
    for t in (args.trace or ["wifi", "lte", "deep-fade"]):
        if t in ("none", ""):
            continue
        if t in ("wifi", "lte", "deep-fade"):
            out.append((t, Trace.sample(t)))
        else:
            out.append((Path(t).stem, Trace.from_csv(t)))
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.press:
        return run_press(args)
    sizes = _csv(args.sizes, int)
    strategies = [s for s in _csv(args.strategies, str)]
    links = _links(args)
    lm = _sweep_model(args, sizes)
    fair = fair_baselines(lm, args.backend)
    name = "ttft" if args.link == "shaper" else "ttft_netns"
    if args.traces:
        name += "_adversarial"
    if args.link == "netns":
        from sparkv.edge.netns import netns_available

        ok, why = netns_available()
        if not ok:
            print(f"skipping the real shaped path: {why}")
            return 0
        strategies = [s for s in strategies if s != "local"]   # local never touches the link
    print(f"model: {lm.label}; every strategy computes in {fair['compute']} (parameters "
          f"{fair['dtype']}) with the {fair['backend']} attention backend", flush=True)
    runs_raw, timelines = _measure_all(args, lm, sizes, strategies, links, fair)
    points = _aggregate(runs_raw, links, lm.native_positions)
    targets = _targets(points, sizes, links)
    if args.traces:
        targets["adversarial"] = _distribution(points, sizes, links)
    else:
        targets["growth"] = growth_report(points, sizes, [lab for lab, _ in links])
    _print(points, targets, lm.label)
    config = result_config(args, lm, fair)
    if args.json or args.out:
        out = write_result(name, {"points": points, "targets": targets, "runs": runs_raw,
                                  "timelines": timelines}, config, args.out)
        if args.link == "shaper":
            _plots(points, timelines, targets, out.with_suffix(""), lm.label)
        print(f"wrote {out}")
    return 0


def result_config(args: argparse.Namespace, lm: LoadedModel,
                  fair: dict[str, Any]) -> dict[str, Any]:
    """The JSON's ``config``: the flags, plus the model as results label it (``model_label``;
    ``long_context``: what extending its RoPE did, null for the model as trained), and what
    every strategy computed with (``fair_baselines``)."""
    import torch

    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(torch_threads=torch.get_num_threads(), question=QUESTION,
                  model_label=lm.label, model_fingerprint=lm.fingerprint,
                  native_positions=lm.native_positions,
                  long_context=lm.extra.get("long_context"), fair_baselines=fair)
    config["energy_model"] = ("E = P_compute*compute_busy + P_decode*decode_busy + "
                              "P_radio*link_active + P_idle*TTFT (an estimate)")
    return config


def _sweep_model(args: argparse.Namespace, sizes: list[int]) -> Any:
    """The model every size of the sweep runs: ``--model``, or its RoPE-extended twin under
    ``--long-context`` (:func:`sparkv.bench.longctx.long_context_model`); ``args.model``
    becomes its spec, so that the server encodes with the same model."""
    from sparkv.bench.longctx import LongContextError, long_context_model
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime.heap import settle

    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    try:
        spec = long_context_model(args.model, lm.native_positions, sizes, args.long_context)
    except LongContextError as e:
        raise SystemExit(f"sparkv bench ttft: {e}") from None
    if spec != args.model:
        args.model = spec
        lm = load_model_in_dtype(spec, dtype=args.dtype, device=args.device)
    settle()             # the sweep's model for good: out of full collections (runtime.heap)
    return lm


def fair_baselines(lm: LoadedModel, backend: str = "auto") -> dict[str, Any]:
    """What every strategy computes with, the baselines as sparkv (the paper's fair baselines):
    the model's compute configuration (``compute``: ``mixed-attn``, ``float32``...; ``dtype``:
    its parameters' dtype) and one attention backend, ``auto`` resolved as sparkv resolves it
    for the model (:func:`sparkv.edge.planning.default_backend`). ``option`` is what each ask passes
    (``AskOptions.backend``), ``backend`` the class's name it builds."""
    from sparkv.edge.planning import default_backend
    from sparkv.runtime.attention import get_backend

    option = (default_backend(lm.base_fingerprint, compute=lm.compute) if backend == "auto"
              else backend)
    return {"dtype": str(lm.dtype).replace("torch.", ""), "compute": lm.compute.name,
            "backend": get_backend(option).name,
            "option": option, "requested": backend,
            "applies_to": list(STRATEGY_ORDER) + ["server prefill (its --dtype)"]}


class _Loopback:
    """The server on loopback; links emulated in the client (LinkShaper)."""

    def __init__(self, args: argparse.Namespace, tmp: str) -> None:
        import torch

        from sparkv.server.process import ServerProcess, write_config

        self.args = args
        config = None
        if args.model:       # the server encodes with the model the edge runs
            config = f"{tmp}/server.yaml"
            write_config(config, None, allow_anonymous=True, models={"bench": str(args.model)},
                         default_model="bench")
        self.server = ServerProcess(config, f"file://{tmp}/store", log_path=f"{tmp}/server.log",
                                    torch_threads=max(1, torch.get_num_threads()),
                                    extra_args=["--device", str(args.device), "--dtype",
                                                str(args.dtype)]).start()
        self.url = self.server.url

    def shaper(self, trace: Any) -> Any:
        from sparkv.edge.shaper import LinkShaper

        if trace is None:
            return LinkShaper.unlimited()
        return LinkShaper(trace, rtt_s=self.args.rtt_ms / 1e3)

    def done(self) -> None:
        pass

    def close(self) -> None:
        self.server.stop()


class _Netns:
    """The server in a network namespace behind a veth pair; tc shapes the link (docs/netns.md).
    The client does not shape (an unlimited LinkShaper); the kernel here has no netem, so the RTT
    is the veth's own (microseconds) unless netem exists."""

    def __init__(self, args: argparse.Namespace, tmp: str) -> None:
        from sparkv.bench.common import NetnsServer

        self.args = args
        # the server encodes with the edge's model, on its device and in its dtype (a GPU's
        # 32K context on the server's one CPU thread would take minutes)
        self.server = NetnsServer(tmp, args.model, extra_args=["--device", str(args.device),
                                                               "--dtype", str(args.dtype)])
        self.link, self.url = self.server.link, self.server.url

    def shaper(self, trace: Any) -> Any:
        from sparkv.edge.shaper import LinkShaper

        if trace is None:
            self.link.set_rate(1000.0)
        else:
            self.link.start_trace(trace, interval_s=0.05)
        return LinkShaper.unlimited()

    def done(self) -> None:
        self.link.stop_trace()
        self.link.set_rate(1000.0)

    def close(self) -> None:
        self.server.close()


def _measure_all(args: argparse.Namespace, lm: LoadedModel, sizes: list[int], strategies: list[str],
                 links: list[tuple[Any, Any]], fair: dict[str, Any]
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from sparkv.edge.options import AskOptions
    from sparkv.edge.plots import timeline_of
    from sparkv.edge.prompts import question_suffix
    from sparkv.runtime.generate import (first_token_kl, greedy_agreement, greedy_generate,
                                         reference_prefill)

    runs_raw: list[dict[str, Any]] = []
    timelines: dict[str, Any] = {}
    paired = getattr(args, "local", "once") == "per-link"
    per_size = args.runs * ((1 if "local" in strategies and not paired else 0)
                            + len(links) * len([s for s in strategies
                                                if s != "local" or paired]))
    n_total = len(sizes) * per_size
    done = 0
    t_bench = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-ttft-") as tmp:
        path = (_Netns if args.link == "netns" else _Loopback)(args, tmp)
        try:
            for n in sizes:
                session, context = _sample_session(lm, path, n)
                client = session.client
                t0 = time.perf_counter()
                cid = client.create_context(token_ids=context, chunk_tokens=args.chunk_tokens,
                                            levels=_csv(args.levels, str))
                print(f"[{n} tokens] context {cid[:8]} encoded in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                suffix = question_suffix(lm, QUESTION)
                ref_kv = reference_prefill(lm, context)
                ref = greedy_generate(lm, ref_kv, len(context), suffix, args.max_new_tokens,
                                      stop_at_eos=False)
                del ref_kv
                # warm-up, unshaped: calibrates the client's compute scale and loads kernels,
                # codec tables, the HTTP stack and the planners, so that no strategy pays
                # first-use costs that the others do not
                for strat in ("local", *[s for s in strategies if s != "local"]):
                    session.ask(cid, QUESTION, AskOptions(strategy=strat, max_new_tokens=2,
                                                          use_cache=False, prelude=_prelude(args),
                                                          backend=fair["option"]))
                for link_label, trace in ([] if paired else [(None, None)]) + links:
                    session.priors.bandwidth_Bps = None       # nothing learned of this link
                    for r, strat in _interleaved(strategies, link_label is None, args.runs,
                                                 with_local=paired):
                        opts = AskOptions(strategy=strat, use_cache=False, prelude=_prelude(args),
                                          max_new_tokens=args.max_new_tokens, stop_at_eos=False,
                                          backend=fair["option"])
                        if args.link_prior == "fresh":
                            session.priors.bandwidth_Bps = None   # every run probes afresh
                        client.shaper = path.shaper(trace)
                        # no strategy pays for the bench's garbage: a full collection
                        # between runs, none during one (the timelines this loop keeps made
                        # a gen-2 collection of ~0.35 s land inside whichever ask crossed
                        # the threshold: adversarial-18, every run)
                        gc.collect()
                        gc.disable()
                        server_cpu = process_cpu_s(_server_pid(path))
                        tax = session.priors.receive_tax        # what the session believed
                        try:
                            res = session.ask(cid, QUESTION, opts)
                        finally:
                            gc.enable()
                            path.done()
                        row = _row(args, n, link_label, strat, r, res, ref, trace, tax)
                        row["server_cpu_s"] = _cpu_since(_server_pid(path), server_cpu)
                        row.update(_computed_with(res, fair))
                        row["agreement"] = greedy_agreement(ref.tokens, res.tokens)
                        row["first_token_kl"] = first_token_kl(ref.first_logits,
                                                               res.first_logits)
                        runs_raw.append(row)
                        done += 1
                        if r == 0:
                            timelines[f"{n}/{link_label}/{strat}"] = timeline_of(res)
                        print(f"  [{done}/{n_total} {time.perf_counter() - t_bench:6.0f}s] "
                              f"{n} tok  {str(link_label or 'any'):>9}  {strat:>6}  run {r}: "
                              f"TTFT {row['ttft_s']:6.2f} s (sim {row['sim_ttft_s']:6.2f})  "
                              f"agree {row['agreement']:.2f}  MB {row['mb']:.1f}  "
                              f"{row['streamed']}/{row['computed']}"
                              + (f"  FALLBACK {row['fallback']}" if row["fallback"] else ""),
                              flush=True)
                session.close()
        finally:
            path.close()
    return runs_raw, timelines


def _interleaved(strategies: list[str], local: bool, runs: int,
                 with_local: bool = False) -> list[tuple[int, str]]:
    """``(run, strategy)`` in the order they are asked: run by run, each run every strategy of
    the link (``local`` alone without one; ``with_local``: ``local`` among a link's too), the
    order rotated each run. Side by side under a load that drifts (another process, the
    machine's clock): every strategy's runs spread over the same minutes, and none always
    follows the same one."""
    strats = [s for s in strategies if (s == "local") == local or (with_local and not local)]
    out = []
    for r in range(runs):
        k = r % max(1, len(strats))
        out += [(r, s) for s in strats[k:] + strats[:k]]
    return out


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, from ``/proc`` (``None`` where
    there is none, or the process is gone)."""
    import os

    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _server_pid(path: Any) -> int:
    """The pid of a path's (``_Loopback``'s or ``_Netns``'s) running server process."""
    assert path.server.proc is not None
    return int(path.server.proc.pid)


def _cpu_since(pid: int, before: float | None) -> float | None:
    """What the benchmark's server used since ``before`` (``None``: not measured): on one
    machine it shares the device's cores, which a device whose server is remote does not."""
    now = process_cpu_s(pid)
    return None if now is None or before is None else max(0.0, now - before)


def _computed_with(res: Any, fair: dict[str, Any]) -> dict[str, str]:
    """The row's ``dtype`` (of the KV the load filled) and ``backend`` (its asks' option, built
    by name): what this strategy computed with."""
    kv = getattr(getattr(res, "load", None), "kv", None)
    dtype = str(kv.dtype).replace("torch.", "") if kv is not None else fair["dtype"]
    return {"dtype": dtype, "backend": fair["backend"]}


def _prelude(args: argparse.Namespace) -> bool | None:
    """``AskOptions.prelude``: ``None`` (the strategy's default) or off for every strategy."""
    return False if getattr(args, "prelude", "auto") == "off" else None


def simulated_load_s(res: Any, strategy: str, controller: Any, trace: Any, inst: Any,
                     sim_inst: Any = None) -> float:
    """The simulator's TTFT (s, from the load's start) of the load ``res`` ran, under
    ``trace`` and the ``controller`` configuration: the plan it ended with, run from the start
    (a handover comes within milliseconds); a load that re-planned at the measured link rate
    (``breakdown.replan``) runs from the plan it started by, its controller handed the
    strategy's planner, so the simulated link's samples decide the re-plan again.
    ``sim_inst``: the instance the simulated device runs (default ``inst``, the one the
    controller plans with)."""
    from sparkv.edge.planning import replanner
    from sparkv.scheduler.controller import Controller
    from sparkv.scheduler.simulator import simulate

    replanned = bool((res.breakdown.replan or {}).get("taken")) and res.started_by is not None
    plan = res.started_by if replanned else res.plan
    ctl = Controller(plan, inst, controller, planner=replanner(strategy) if replanned else None)
    return simulate(plan, sim_inst if sim_inst is not None else inst, trace,
                    controller=ctl).ttft_s


def _row(args: argparse.Namespace, n: int, link: Any, strat: str, r: int, res: Any, ref: Any,
         trace: Any, receive_tax: float) -> dict[str, Any]:
    """One run's row. ``sim_ttft_s``: the simulator's TTFT for the load that ran
    (:func:`simulated_load_s`) on the instance it was planned on, under the same link and
    controller; ``sim_taxed_ttft_s``: the same with the receive tax the session believed before
    the ask (plans leave it out unless ``AskOptions.plan_receive_tax``: the cost model's reading
    of the device's real speed)."""
    from sparkv.edge.planning import STRATEGIES
    from sparkv.scheduler.trace import Trace

    bd = res.breakdown
    sim_ttft = sim_taxed = float("nan")
    if res.plan is not None and res.instance is not None:
        # the load's own controller configuration (spans and their order included)
        ctl = res.controller if res.controller is not None else STRATEGIES[strat][1]()
        sim_trace = trace if trace is not None else Trace.constant(1e4)
        inst = res.instance.replace(rtt_s=args.rtt_ms / 1e3)
        sim_ttft = bd.manifest_s + bd.planning_s + simulated_load_s(res, strat, ctl, sim_trace,
                                                                    inst)
        sim_taxed = sim_ttft
        if receive_tax > inst.receive_tax:
            # the steps pay the tax; the controller decides as the load's did (on the plan's
            # instance, which left it out)
            sim_taxed = bd.manifest_s + bd.planning_s + simulated_load_s(
                res, strat, ctl, sim_trace, inst, inst.replace(receive_tax=receive_tax))
    bound = float("nan")
    if (trace is not None and len(trace.mbps) == 1 and res.instance is not None
            and strat != "local"):
        from sparkv.scheduler.bounds import lp_dep_bound
        from sparkv.scheduler.instance import MBPS

        # the LP lower bound (layer dependencies, no token dependencies, perfect overlap) for
        # this instance at the link's true rate: no plan can beat it under the cost model
        bound = bd.manifest_s + bd.planning_s + lp_dep_bound(
            res.instance.with_bandwidth(trace.mbps[0] * MBPS))
    energy = (args.watts_compute * bd.local_compute_s + args.watts_decode * bd.decoding_s
              + args.watts_radio * bd.streaming_s + args.watts_idle * bd.ttft_s)
    return {"tokens": n, "link": link if link is not None else "any", "strategy": strat, "run": r,
            "ttft_s": bd.ttft_s, "sim_ttft_s": sim_ttft, "sim_taxed_ttft_s": sim_taxed,
            "receive_tax_prior": receive_tax, "lp_bound_s": bound,
            "manifest_s": bd.manifest_s,
            "planning_s": bd.planning_s, "loading_s": bd.loading_s,
            "link_s": bd.streaming_s, "compute_s": bd.local_compute_s,
            "decode_s": bd.decoding_s, "question_s": bd.question_prefill_s,
            "mb": bd.bytes_streamed / 1e6, "wasted_mb": bd.bytes_wasted / 1e6,
            "streamed": bd.chunks_streamed, "computed": bd.chunks_computed,
            "migrations": bd.migrations, "levels": bd.levels, "fallback": bd.fallback,
            "energy_j_estimate": energy,
            "plan": ((res.plan.info or {}).get("portfolio", {}).get("chosen")
                     if res.plan is not None else None),
            "prelude_steps": getattr(bd, "prelude_steps", 0),
            "replan": getattr(bd, "replan", None),
            # what this load measured streaming cost its steps (docs/edge.md, "Priors")
            "stream_tax_ms": res.load.stream_tax_s * 1e3 if res.load is not None else None,
            "receive_tax": res.load.receive_tax if res.load is not None else None,
            "compute_us_per_token_layer": compute_rate_us(res)}


def compute_rate_us(res: Any) -> float | None:
    """Microseconds of the load's compute busy time per token-layer it computed (its steps'
    tokens summed): beside a link it shows what the streaming cost the compute, against
    ``local``'s at the same size (the H200's run 3: up to 4x, the launches starved by the
    receiving threads' Python: docs/gpu.md). The prelude's steps, which the breakdown's compute
    time counts, count at a full chunk each. ``None`` when nothing was computed."""
    load, inst, bd = res.load, res.instance, res.breakdown
    if load is None or inst is None or not bd.local_compute_s:
        return None
    g = inst.geometry
    tokens = sum(b - a for a, b in (g.token_range(s.t) for s in load.steps))
    tokens += int(getattr(bd, "prelude_steps", 0) or 0) * g.chunk_tokens
    return bd.local_compute_s * 1e6 / tokens if tokens else None


def _aggregate(runs: list[dict[str, Any]], links: list[tuple[Any, Any]],
               native_positions: int = 0) -> list[dict[str, Any]]:
    """Medians per (tokens, link, strategy); ``local`` (link-independent) copied to every link.
    Every point at a constant link carries that link's LP bound (``lp_bound_s``, the median
    over every strategy's instance there) and its TTFT over it; ``in_window``: the size is
    within the model's native window (quality means something only there)."""
    groups: dict[tuple[int, Any, str], list[dict[str, Any]]] = {}
    bounds: dict[tuple[int, Any], list[float]] = {}
    for r in runs:
        groups.setdefault((r["tokens"], r["link"], r["strategy"]), []).append(r)
        bounds.setdefault((r["tokens"], r["link"]), []).append(r.get("lp_bound_s", float("nan")))
    points = []
    sizes = sorted({r["tokens"] for r in runs})
    for n in sizes:
        for label, _ in links:
            for strat in STRATEGY_ORDER:
                rs = groups.get((n, label, strat)) or (groups.get((n, "any", strat))
                                                        if strat == "local" else None)
                if not rs:
                    continue
                tt = [x["ttft_s"] for x in rs]
                sims = [x["sim_ttft_s"] for x in rs if x["sim_ttft_s"] == x["sim_ttft_s"]]
                taxed = _nanmedian([x.get("sim_taxed_ttft_s", float("nan")) for x in rs])
                bound = _nanmedian(bounds.get((n, label), []))
                points.append({
                    "tokens": n, "link": label, "strategy": strat, "runs": len(rs),
                    "ttft_median_s": statistics.median(tt), "ttft_min_s": min(tt),
                    "ttft_max_s": max(tt),
                    "sim_ttft_median_s": statistics.median(sims) if sims else None,
                    "sim_error": (statistics.median(tt) / statistics.median(sims) - 1.0
                                  if sims else None),
                    "sim_taxed_error": statistics.median(tt) / taxed - 1.0 if taxed else None,
                    "lp_bound_median_s": _nanmedian([x.get("lp_bound_s", float("nan"))
                                                     for x in rs]),
                    "lp_bound_s": bound,
                    "vs_lp_bound": statistics.median(tt) / bound if bound else None,
                    "in_window": not native_positions or n <= native_positions,
                    "dtype": rs[0].get("dtype"), "backend": rs[0].get("backend"),
                    "agreement_median": statistics.median(x["agreement"] for x in rs),
                    "first_token_kl_median": statistics.median(x["first_token_kl"] for x in rs),
                    "mb_median": statistics.median(x["mb"] for x in rs),
                    "migrations_median": statistics.median(x["migrations"] for x in rs),
                    "energy_j_estimate_median": statistics.median(x["energy_j_estimate"]
                                                                  for x in rs),
                    "fallbacks": sum(1 for x in rs if x["fallback"]),
                    "compute_us_per_token_layer": _nanmedian(
                        [x.get("compute_us_per_token_layer") or float("nan") for x in rs]),
                })
    _compute_vs_local(points)
    return points


def _compute_vs_local(points: list[dict[str, Any]]) -> None:
    """Each point's ``compute_vs_local``: its compute time per token-layer over ``local``'s at
    the same size and link (``None`` where either computed nothing)."""
    local = {(p["tokens"], p["link"]): p["compute_us_per_token_layer"] for p in points
             if p["strategy"] == "local"}
    for p in points:
        mine, base = p["compute_us_per_token_layer"], local.get((p["tokens"], p["link"]))
        p["compute_vs_local"] = mine / base if mine and base else None


def _nanmedian(xs: list[float]) -> float | None:
    ok = [x for x in xs if x == x]
    return statistics.median(ok) if ok else None


def _targets(points: list[dict[str, Any]], sizes: list[int],
             links: list[tuple[Any, Any]]) -> dict[str, Any]:
    by = {(p["tokens"], p["link"], p["strategy"]): p["ttft_median_s"] for p in points}
    out: dict[str, Any] = {"per_size": []}
    worst = 0.0
    for n in sizes:
        numeric = [lab for lab, _ in links if isinstance(lab, (int, float))]
        best_gap, cross = None, None
        for lab in numeric:
            a, b = by.get((n, lab, "local")), by.get((n, lab, "stream"))
            if a and b:
                gap = abs(a / b - 1.0) if a >= b else abs(b / a - 1.0)
                if best_gap is None or gap < best_gap:
                    best_gap, cross = gap, lab
        entry: dict[str, Any] = {"tokens": n, "crossover_mbps": cross}
        if cross is not None and (n, cross, "sparkv") in by:
            sp = by[(n, cross, "sparkv")]
            entry["sparkv_vs_better_of_local_stream"] = sp / min(by[(n, cross, "local")],
                                                                 by[(n, cross, "stream")])
            if (n, cross, "hybrid") in by:
                entry["sparkv_vs_hybrid"] = sp / by[(n, cross, "hybrid")]
            bounds = [p["lp_bound_median_s"] for p in points if p["tokens"] == n
                      and p["link"] == cross and p["strategy"] == "sparkv"]
            if bounds and bounds[0]:
                entry["lp_bound_s"] = bounds[0]
                entry["sparkv_vs_lp_bound"] = sp / bounds[0]
                if (n, cross, "hybrid") in by:
                    entry["hybrid_vs_lp_bound"] = by[(n, cross, "hybrid")] / bounds[0]
        ratios = {}
        for lab, _ in links:
            base = [by[(n, lab, s)] for s in ("local", "stream", "hybrid") if (n, lab, s) in by]
            if base and (n, lab, "sparkv") in by:
                ratios[str(lab)] = by[(n, lab, "sparkv")] / min(base)
                worst = max(worst, ratios[str(lab)])
        entry["sparkv_vs_best_baseline"] = ratios
        out["per_size"].append(entry)
    out["worst_sparkv_vs_best_baseline"] = worst
    out["cost_model"] = _cost_model_accuracy(points)
    out["targets"] = {"crossover_vs_better": 0.75, "crossover_vs_hybrid": 0.8,
                      "never_worse_than": 1.05}
    return out


def _distribution(points: list[dict[str, Any]], sizes: list[int],
                  links: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Per size: sparkv's median TTFT over the best baseline's, per trace, and its distribution
    (median, 95th percentile, worst)."""
    by = {(p["tokens"], p["link"], p["strategy"]): p["ttft_median_s"] for p in points}
    out: dict[str, Any] = {"per_size": [], "targets": {"p95": 1.05, "worst": 1.15}}
    for n in sizes:
        rows = []
        for label, _ in links:
            base = {s: by[(n, label, s)] for s in ("local", "stream", "hybrid")
                    if (n, label, s) in by}
            if not base or (n, label, "sparkv") not in by:
                continue
            best = min(base, key=lambda s: base[s])
            sp = by[(n, label, "sparkv")]
            rows.append({"trace": str(label), "sparkv_s": sp, "best": best,
                         "best_s": base[best], "ratio": sp / base[best], **{
                             f"{s}_s": v for s, v in base.items()}})
        ratios = sorted(r["ratio"] for r in rows)
        if not ratios:
            continue
        p95 = ratios[min(len(ratios) - 1, int(round(0.95 * (len(ratios) - 1))))]
        out["per_size"].append({"tokens": n, "traces": len(rows),
                                "median": statistics.median(ratios), "p95": p95,
                                "worst": ratios[-1], "rows": rows})
    return out


def _cost_model_accuracy(points: list[dict[str, Any]]) -> dict[str, Any]:
    """How well the simulator, given the plan that ran, the same link and controller, predicted
    the measured TTFT: median absolute relative error per strategy (the figure the tests used to
    assert on; a benchmark reports it instead)."""
    out: dict[str, Any] = {}
    for key, name in (("sim_error", ""), ("sim_taxed_error", "taxed_")):
        per: dict[str, list[float]] = {}
        for p in points:
            if p.get(key) is not None and p[key] == p[key]:
                per.setdefault(p["strategy"], []).append(abs(float(p[key])))
        for s, v in sorted(per.items()):
            out.setdefault(s, {"points": len(v)}).update(
                {f"{name}median_abs_error": statistics.median(v),
                 f"{name}max_abs_error": max(v)})
    return out


def _print(points: list[dict[str, Any]], targets: dict[str, Any], label: str = "") -> None:
    rows = [[p["tokens"], p["link"], p["strategy"], p["ttft_median_s"], p["ttft_min_s"],
             p["ttft_max_s"], p.get("lp_bound_s"), p["sim_ttft_median_s"], p["agreement_median"],
             p["mb_median"], p["energy_j_estimate_median"]] for p in points]
    print()
    if label:
        print(f"model: {label}")
    print(format_table(["tokens", "link", "strategy", "TTFT_med", "min", "max", "LP bound", "sim",
                        "agree", "MB", "J(est)"], rows))
    print()
    for e in targets["per_size"]:
        print(f"{e['tokens']} tokens: crossover {e['crossover_mbps']} Mbit/s; sparkv / better of "
              f"local,stream = {e.get('sparkv_vs_better_of_local_stream', float('nan')):.2f} "
              f"(target <= 0.75); sparkv / hybrid = {e.get('sparkv_vs_hybrid', float('nan')):.2f}"
              f" (target <= 0.8); sparkv / LP bound = "
              f"{e.get('sparkv_vs_lp_bound', float('nan')):.2f}"
              f", hybrid / LP bound = {e.get('hybrid_vs_lp_bound', float('nan')):.2f}")
    print(f"worst sparkv / best baseline over the sweep: "
          f"{targets['worst_sparkv_vs_best_baseline']:.2f} (target <= 1.05)")
    adv = targets.get("adversarial")
    if adv:
        for e in adv["per_size"]:
            worst = max(e["rows"], key=lambda r: r["ratio"])
            print(f"{e['tokens']} tokens, {e['traces']} adversarial traces: sparkv / best baseline "
                  f"median {e['median']:.3f}, p95 {e['p95']:.3f} (target 1.05), worst "
                  f"{e['worst']:.3f} (target 1.15) on {worst['trace']}")
    for line in growth_lines(targets.get("growth") or {"per_link": []}):
        print(line)
    beside = [f"{p['tokens']}/{p['link']}/{p['strategy']} {p['compute_vs_local']:.2f}x"
              for p in points if p["strategy"] != "local" and p.get("compute_vs_local")]
    if beside:
        print("compute per token-layer against local's: " + ", ".join(beside))
    cm = targets.get("cost_model") or {}
    if cm:
        print("cost model (measured vs simulated TTFT, same plan/link/controller), median |error|: "
              + ", ".join(f"{s} {v['median_abs_error']:.1%}" for s, v in cm.items()
                          if "median_abs_error" in v))
        print("  with the receive tax the session believed (the plans leave it out): "
              + ", ".join(f"{s} {v['taxed_median_abs_error']:.1%}" for s, v in cm.items()
                          if "taxed_median_abs_error" in v))


def _plots(points: list[dict[str, Any]], timelines: dict[str, Any], targets: dict[str, Any],
           stem: Path, label: str = "") -> None:
    from sparkv.edge.plots import plot_ttft_vs_bandwidth

    if targets.get("adversarial"):
        _plot_adversarial(targets["adversarial"], Path(f"{stem}.png"))
        return
    plot_ttft_vs_bandwidth(points, f"{stem}.png",
                           title=f"TTFT vs constant link (median, min-max over runs)\n{label}")
    _plot_timeline(timelines, targets, Path(f"{stem}_timeline.png"))
    if targets.get("growth"):
        plot_growth(points, targets["growth"], Path(f"{stem}_growth.png"), label)


def _plot_adversarial(adv: dict[str, Any], path: Path) -> None:
    """Per size, the sorted ratios sparkv / best baseline over the traces (a CDF), and each
    strategy's TTFT per trace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = adv["per_size"]
    fig, axes = plt.subplots(1, 1 + len(sizes), figsize=(5 + 5 * len(sizes), 4))
    ax = axes[0]
    for e in sizes:
        r = sorted(x["ratio"] for x in e["rows"])
        ax.plot(r, [(i + 1) / len(r) for i in range(len(r))], drawstyle="steps-post",
                label=f"{e['tokens']} tokens")
    for x, ls in ((1.05, "--"), (1.15, ":")):
        ax.axvline(x, color="grey", ls=ls, lw=1)
    ax.set_xlabel("sparkv TTFT / best baseline's, per trace")
    ax.set_ylabel("fraction of traces")
    ax.set_title("adversarial traces (targets: 1.05 at p95, 1.15 worst)")
    ax.legend()
    for ax, e in zip(axes[1:], sizes):
        rows = sorted(e["rows"], key=lambda x: x["best_s"])
        xs = range(len(rows))
        for strat in ("local", "stream", "hybrid", "sparkv"):
            ys = [r.get(f"{strat}_s") for r in rows]
            if any(y is not None for y in ys):
                ax.plot(xs, ys, marker=".", lw=0.8, label=strat)
        ax.set_yscale("log")
        ax.set_xlabel("trace (sorted by the best baseline's TTFT)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{e['tokens']} tokens")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_timeline(timelines: dict[str, Any], targets: dict[str, Any], path: Path) -> None:
    """Both paths of each strategy at the largest size's crossover bandwidth."""
    from sparkv.edge.plots import plot_timelines

    sizes = [e for e in targets["per_size"] if e.get("crossover_mbps") is not None]
    if not sizes:
        return
    n, cross = sizes[-1]["tokens"], sizes[-1]["crossover_mbps"]
    runs = [(s, timelines[k]) for s, k in
            ((s, f"{n}/{cross}/{s}" if s != "local" or f"{n}/{cross}/local" in timelines
              else f"{n}/None/local") for s in STRATEGY_ORDER) if k in timelines]
    plot_timelines(runs, path, title=f"{n} tokens at the crossover link ({cross} Mbit/s): "
                                     "both paths")


# ------------------------------------------------------------------------------------------------
# --press: compressed contexts end to end
# ------------------------------------------------------------------------------------------------
PRESS_STRATEGIES = ("stream", "hybrid", "sparkv")


def run_press(args: argparse.Namespace) -> int:
    """``--press SPEC``: per size, the uncompressed context and its compressed variant on one
    server; local once (uncompressed), then stream / hybrid / sparkv on both over each constant
    link; pass-key accuracy with and without the press. Target (issue 14): at the crossover
    (the uncompressed context's local vs stream), sparkv with the press <= 0.7x Strong Hybrid
    without it, at pass-key parity with full KV."""
    import torch

    from sparkv.presses import PressError, canonical_spec
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime.heap import settle

    try:
        spec = canonical_spec(args.press)
    except PressError as e:
        raise SystemExit(f"--press: {e}") from None
    if args.link != "shaper" or args.traces:
        raise SystemExit("--press runs on the loopback shaper with constant links only")
    sizes = _csv(args.sizes, int)
    mbps = _csv(args.mbps or "10,20,40")
    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    settle()
    t0 = time.perf_counter()
    rows, passkey = _measure_press(args, lm, spec, sizes, mbps)
    points = _press_points(rows)
    targets = _press_targets(points, passkey, sizes, mbps)
    print()
    print(format_table(["tokens", "Mbit/s", "context", "strategy", "TTFT_med", "min", "max",
                        "MB", "streamed", "computed"],
                       [[p["tokens"], p["link"], p["context"], p["strategy"], p["ttft_median_s"],
                         p["ttft_min_s"], p["ttft_max_s"], p["mb_median"], p["streamed_median"],
                         p["computed_median"]] for p in points]))
    print()
    print(format_table(["tokens", "context", "trials", "pass-key accuracy"],
                       [[r["tokens"], r["context"], r["n"], r["accuracy"]] for r in passkey]))
    print()
    for r in targets["per_size"]:
        print(f"{r['tokens']} tokens, crossover {r['crossover_mbps']} Mbit/s: sparkv+press / "
              f"hybrid = {r.get('sparkv_press_vs_hybrid', float('nan')):.2f} (target <= 0.7); "
              f"hybrid+press / hybrid = {r.get('hybrid_press_vs_hybrid', float('nan')):.2f}; "
              f"sparkv / hybrid = {r.get('sparkv_vs_hybrid', float('nan')):.2f}; pass key "
              f"{r.get('passkey_press')} vs full {r.get('passkey_full')} "
              f"({'parity' if r.get('passkey_parity') else 'BELOW full KV'})")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update({"press": spec, "mbps": mbps, "torch_threads": torch.get_num_threads(),
                   "question": QUESTION, "wall_s": time.perf_counter() - t0,
                   "note": "2-core CPU shared with other jobs (loaded): absolute seconds are "
                           "pessimistic; ratios are measured within one run"})
    if args.json or args.out:
        out = write_result("ttft_press", {"points": points, "passkey": passkey,
                                          "targets": targets, "runs": rows}, config, args.out)
        print(f"wrote {out}")
    return 0


def _measure_press(args: argparse.Namespace, lm: LoadedModel, spec: str, sizes: list[int],
                   mbps: list[float]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from sparkv.logs import progress_bar

    from sparkv.bench.tasks import task_suite
    from sparkv.edge.options import AskOptions
    from sparkv.edge.prompts import chat_context
    from sparkv.edge.session import EdgeSession
    from sparkv.scheduler.trace import Trace

    rows: list[dict[str, Any]] = []
    passkey: list[dict[str, Any]] = []
    levels = _csv(args.levels, str)
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-ttft-press-") as tmp:
        path = _Loopback(args, tmp)
        try:
            for n in sizes:
                session, context = _sample_session(lm, path, n)
                client = session.client
                t0 = time.perf_counter()
                full = client.create_context(token_ids=context, chunk_tokens=args.chunk_tokens,
                                             levels=levels)
                pressed = client.pressed_context(full, spec)
                kept = client.manifest(pressed).press
                print(f"[{n} tokens] contexts {full[:8]} and {pressed[:8]} ({spec}, kept "
                      f"{kept.kept_fraction if kept else float('nan'):.3f}) encoded in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
                cids = {"full": full, "press": pressed}
                for cid in cids.values():      # warm-up (see _measure_all)
                    for strat in ("local", *PRESS_STRATEGIES):
                        session.ask(cid, QUESTION, AskOptions(strategy=strat, max_new_tokens=2,
                                                              use_cache=False))
                work = [(None, "full", "local")] + [(m, c, s) for m in mbps for c in cids
                                                     for s in PRESS_STRATEGIES]
                for m, variant, strat in progress_bar(work, desc=f"ttft --press {n} tok"):
                    trace = Trace.constant(m) if m is not None else None
                    for r in range(args.runs):
                        session.priors.bandwidth_Bps = None
                        client.shaper = path.shaper(trace)
                        tax = session.priors.receive_tax
                        res = session.ask(cids[variant], QUESTION,
                                          AskOptions(strategy=strat, use_cache=False,
                                                     max_new_tokens=args.max_new_tokens,
                                                     stop_at_eos=False))
                        row = _row(args, n, m, strat, r, res, None, trace, tax)
                        row["context"] = variant
                        rows.append(row)
                session.close()
                # pass key with and without the press (sparkv, unshaped link)
                tasks = task_suite(("passkey",), (n,), args.press_trials,
                                   lambda s: len(lm.encode_text(s)))
                session = EdgeSession.connect(path.url, model=lm, shaper=path.shaper(None))
                hits = {"full": 0, "press": 0}
                for task in progress_bar(tasks, desc=f"pass key {n} tok"):
                    ids = chat_context(lm, lm.encode_text(task.document))
                    full = session.client.create_context(token_ids=ids,
                                                         chunk_tokens=args.chunk_tokens,
                                                         levels=levels)
                    for variant, cid in (("full", full),
                                         ("press", session.client.pressed_context(full, spec))):
                        res = session.ask(cid, task.question,
                                          AskOptions(strategy="sparkv", max_new_tokens=16))
                        ok = task.correct(res.text)
                        hits[variant] += int(ok)
                        rows.append({"tokens": n, "task": task.to_dict(), "context": variant,
                                     "answer": res.text, "correct": ok, "kind": "passkey"})
                for variant, h in hits.items():
                    passkey.append({"tokens": n, "context": variant, "n": len(tasks),
                                    "accuracy": h / max(1, len(tasks))})
                session.close()
        finally:
            path.close()
    return rows, passkey


def _press_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[int, Any, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("kind") == "passkey":
            continue
        groups.setdefault((r["tokens"], r["link"], r["context"], r["strategy"]), []).append(r)
    out = []
    for (n, link, variant, strat), rs in sorted(groups.items(), key=lambda x: (
            x[0][0], -1 if x[0][1] == "any" else x[0][1], x[0][2], x[0][3])):
        tt = [x["ttft_s"] for x in rs]
        out.append({"tokens": n, "link": link, "context": variant, "strategy": strat,
                    "runs": len(rs), "ttft_median_s": statistics.median(tt),
                    "ttft_min_s": min(tt), "ttft_max_s": max(tt),
                    "mb_median": statistics.median(x["mb"] for x in rs),
                    "streamed_median": statistics.median(x["streamed"] for x in rs),
                    "computed_median": statistics.median(x["computed"] for x in rs),
                    "fallbacks": sum(1 for x in rs if x["fallback"])})
    return out


def _press_targets(points: list[dict[str, Any]], passkey: list[dict[str, Any]],
                   sizes: list[int], mbps: list[float]) -> dict[str, Any]:
    by = {(p["tokens"], p["link"], p["context"], p["strategy"]): p["ttft_median_s"]
          for p in points}
    acc = {(r["tokens"], r["context"]): r["accuracy"] for r in passkey}
    out: dict[str, Any] = {"per_size": [], "targets": {"sparkv_press_vs_hybrid": 0.7,
                                                       "passkey": "press >= full"}}
    for n in sizes:
        local = by.get((n, "any", "full", "local"))
        cross, best = None, None
        for m in mbps:
            st = by.get((n, m, "full", "stream"))
            if local and st:
                gap = max(local, st) / min(local, st) - 1.0
                if best is None or gap < best:
                    best, cross = gap, m
        e: dict[str, Any] = {"tokens": n, "crossover_mbps": cross}
        hy = by.get((n, cross, "full", "hybrid"))
        if cross is not None and hy:
            for key, ctx, strat in (("sparkv_press_vs_hybrid", "press", "sparkv"),
                                    ("hybrid_press_vs_hybrid", "press", "hybrid"),
                                    ("sparkv_vs_hybrid", "full", "sparkv"),
                                    ("stream_press_vs_hybrid", "press", "stream")):
                if (n, cross, ctx, strat) in by:
                    e[key] = by[(n, cross, ctx, strat)] / hy
            if (n, cross, "press", "hybrid") in by and (n, cross, "press", "sparkv") in by:
                e["sparkv_press_vs_hybrid_press"] = (by[(n, cross, "press", "sparkv")]
                                                     / by[(n, cross, "press", "hybrid")])
        e["per_link_sparkv_press_vs_hybrid"] = {
            str(m): by[(n, m, "press", "sparkv")] / by[(n, m, "full", "hybrid")]
            for m in mbps if (n, m, "press", "sparkv") in by and (n, m, "full", "hybrid") in by}
        e["passkey_full"], e["passkey_press"] = acc.get((n, "full")), acc.get((n, "press"))
        e["passkey_parity"] = (None if e["passkey_full"] is None or e["passkey_press"] is None
                               else e["passkey_press"] >= e["passkey_full"])
        ratio = e.get("sparkv_press_vs_hybrid")
        e["met"] = None if ratio is None else bool(ratio <= 0.7 and e["passkey_parity"])
        out["per_size"].append(e)
    return out


def _sample_session(lm: LoadedModel, path: Any, n: int) -> tuple[Any, list[int]]:
    """An edge session on the bench's server (through its link) and the ``n``-token sample
    context as a chat context: the chat turn's head included, 40 tokens left for the question
    and the answer (a context of the model's whole window must leave them room)."""
    from sparkv.edge.prompts import chat_context
    from sparkv.edge.session import EdgeSession
    from sparkv.runtime import sample_context_ids

    head = len(chat_context(lm, []))
    context = chat_context(lm, sample_context_ids(lm, n - 40 - head))
    return EdgeSession.connect(path.url, model=lm, shaper=path.shaper(None)), context
