"""``sparkv bench scheduler``: the paper's Table II at our scale, every planner across bandwidths, and
the runtime controller under real-looking traces.

Three parts, all on synthetic SmolLM2-135M / 2-core-CPU instances (docs/scheduler.md, "Benchmark"):

1. **table2**: greedy vs the exact MILP (CBC) for contexts of 2K..20K tokens at one bandwidth:
   scheduling time, TTFT (every plan judged by the same estimator: the simulator at the instance's
   bandwidth, no noise), the MILP's status / gap, and each TTFT over the LP lower bound. The MILP
   runs until the first size it cannot solve to optimality within its time limit; the single-stage
   MILP (K=1, no stream-enables-compute) is reported beside it.
2. **sweep**: every planner side by side from 5 to 500 Mbit/s (the MILP at the smaller context).
3. **traces**: plans made at a trace's median rate, executed under the wifi / lte / deep-fade
   traces with compute noise, without (static) and with the runtime controller.

Prints the tables; with ``--json`` writes ``bench/results/scheduler.json`` (see docs/scheduler.md
for the schema; ``scheduler_quick.json`` with ``--quick``) and ``scheduler.png`` beside it, with
``--out PATH`` there instead.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from sparkv.bench.common import add_output_args, format_table, result_path, write_result

DEFAULT_SIZES_K = (2, 4, 6, 8, 12, 16, 20)
QUICK_SIZES_K = (2, 4)
DEFAULT_MBPS = (5, 10, 20, 50, 100, 200, 500)
QUICK_MBPS = (5, 50, 500)
TRACES = ("wifi", "lte", "deep-fade")


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("scheduler", help="greedy vs MILP (Table II), planners vs bandwidth, "
                                         "controller under traces")
    add_output_args(p, "scheduler", quick=True,
                    json_help="write bench/results/scheduler.json and scheduler.png "
                              "(scheduler_quick.* with --quick; scheduler_adversarial.json with "
                              "--adversarial)")
    p.add_argument("--quick", action="store_true", help="small sizes and short limits (< 1 min)")
    p.add_argument("--sizes", default=None,
                   help="Table II context sizes in K tokens, comma-separated "
                        f"(default {','.join(map(str, DEFAULT_SIZES_K))})")
    p.add_argument("--table-mbps", type=float, default=25.0,
                   help="bandwidth of the Table II instances, Mbit/s (default 25)")
    p.add_argument("--mbps", default=None, help="sweep bandwidths, Mbit/s, comma-separated "
                                                "(default 5,10,20,50,100,200,500)")
    p.add_argument("--sweep-tokens", type=int, default=None,
                   help="context of the sweep without the MILP (default 16384; quick 4096)")
    p.add_argument("--milp-sweep-tokens", type=int, default=None,
                   help="context of the sweep with the MILP (default 4096; quick 2048)")
    p.add_argument("--milp-stages", type=int, default=2, help="MILP stages K (default 2)")
    p.add_argument("--milp-time-limit-s", type=float, default=None,
                   help="CBC time limit per solve, s (default 120; quick 20)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the compute noise and the traces' instances")
    p.add_argument("--adversarial", type=int, default=0, metavar="N",
                   help="instead: every strategy on N seeded adversarial traces, simulated "
                        "(manifest download, plan at the measured prior, controller), 2K and 4K "
                        "tokens; writes scheduler_adversarial.json")
    p.add_argument("--fade-start", type=int, default=20, metavar="N",
                   help="with --adversarial: also N seeded traces that start in a deep fade "
                        "(0.5-3 Mbit/s for 1.5-2.5 s) and recover to ~80 Mbit/s")
    p.set_defaults(func=run)


def _csv(text: str | None, default: tuple, cast: Callable[[str], Any] = float) -> list:
    if not text:
        return list(default)
    return [cast(x) for x in text.split(",") if x.strip()]


@dataclass
class _Settings:
    """The options of one run, defaults resolved (``--quick`` picks the small ones)."""

    quick: bool
    sizes_k: list[float]
    table_mbps: float
    bws: list[float]
    sweep_tokens: int
    milp_sweep_tokens: int
    trace_tokens: int
    stages: int
    limit: float
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "_Settings":
        quick = args.quick
        return cls(quick=quick,
                   sizes_k=_csv(args.sizes, QUICK_SIZES_K if quick else DEFAULT_SIZES_K, float),
                   table_mbps=args.table_mbps,
                   bws=_csv(args.mbps, QUICK_MBPS if quick else DEFAULT_MBPS, float),
                   sweep_tokens=args.sweep_tokens or (4096 if quick else 16384),
                   milp_sweep_tokens=args.milp_sweep_tokens or (2048 if quick else 4096),
                   trace_tokens=4096 if quick else 8192, stages=args.milp_stages,
                   limit=args.milp_time_limit_s or (20.0 if quick else 120.0), seed=args.seed)

    def config(self) -> dict[str, Any]:
        """The JSON's ``config``."""
        return {"quick": self.quick, "sizes_k": self.sizes_k, "table_mbps": self.table_mbps,
                "sweep_mbps": self.bws, "sweep_tokens": self.sweep_tokens,
                "milp_sweep_tokens": self.milp_sweep_tokens, "trace_tokens": self.trace_tokens,
                "milp_stages": self.stages, "milp_time_limit_s": self.limit, "seed": self.seed,
                "model": "SmolLM2-135M profile on this CPU (synthetic instances)",
                "chunk_tokens": 1024, "ttft": "estimate_ttft: simulator at the instance's "
                                              "bandwidth, no noise; excludes planning time"}

    def planners(self, with_milp: bool) -> list[tuple[str, Any]]:
        """The planners of the sweep and the traces (with the MILP or not)."""
        from sparkv.scheduler import Greedy, LocalOnly, Milp, StreamOnly, StrongHybrid

        out = [("greedy", Greedy()), ("hybrid", StrongHybrid()), ("stream", StreamOnly()),
               ("local", LocalOnly())]
        if with_milp:
            out.insert(1, ("milp", Milp(stages=self.stages, time_limit_s=self.limit)))
        return out


def run(args: argparse.Namespace) -> int:
    from sparkv.logs import progress_bar

    if args.adversarial:
        return _adversarial(args)
    s = _Settings.from_args(args)
    wanted = args.json or args.out
    out_path = result_path("scheduler", args.out, quick=s.quick) if wanted else None
    total = len(s.sizes_k) + len(s.bws) * 2 + len(TRACES)
    bar = progress_bar(total=total, desc="scheduler bench", file=sys.stderr, disable=None)
    t_start = time.perf_counter()
    table2 = _table2(s, bar)
    sweep = _sweep(s, bar)
    traces = _traces(s, bar)
    bar.close()

    targets = _targets(table2, sweep)
    payload = {"table2": table2, "sweep": sweep, "traces": traces, "targets": targets,
               "wall_time_s": time.perf_counter() - t_start}
    _print_tables(table2, sweep, traces, targets)
    print(f"\n{payload['wall_time_s']:.0f} s")
    if out_path is not None:
        plot_path = out_path.with_suffix(".png")
        _plot(plot_path, table2, sweep)
        payload["plot"] = str(plot_path)
        path = write_result("scheduler", payload, s.config(), out_path, quick=s.quick)
        print(f"wrote {path} and {plot_path}")
    return 0


def _plan_row(planner: Any, inst: Any) -> dict[str, Any]:
    """One planner on one instance: its (validated) plan's time, TTFT and shape."""
    from sparkv.scheduler import estimate_ttft, validate_plan

    plan = planner.plan(inst)
    validate_plan(plan, inst)
    ttft = estimate_ttft(plan, inst)
    return {"plan_time_s": plan.plan_time_s, "ttft_s": ttft,
            "computed_steps": len(plan.compute_order),
            "streamed_chunks": len(plan.stream_order), "info": _jsonable_info(plan.info)}


def _table2(s: _Settings, bar: Any) -> list[dict[str, Any]]:
    """Part 1, Table II: greedy vs the MILP (K stages, and K=1) at each size, the MILP stopping
    after the first size it does not solve to optimality."""
    from sparkv.scheduler import (Greedy, Milp, PlannerError, lp_bound, lp_dep_bound,
                                  synthetic_instance)

    table2: list[dict[str, Any]] = []
    milp_stop: str | None = None
    for size_k in s.sizes_k:
        tokens = int(size_k * 1024)
        bar.set_postfix_str(f"table2 {tokens} tokens")
        inst = synthetic_instance(tokens, bandwidth_mbps=s.table_mbps, seed=s.seed)
        lb, ldb = lp_bound(inst), lp_dep_bound(inst)
        row: dict[str, Any] = {"tokens": tokens, "token_chunks": inst.n_t,
                               "steps": inst.num_steps, "chunks": inst.num_chunks,
                               "mbps": s.table_mbps, "lp_bound_s": lb, "lp_dep_bound_s": ldb}
        g = _plan_row(Greedy(), inst)
        g["ratio_lp"] = g["ttft_s"] / lb
        row["greedy"] = g
        for key, stages, stop in (("milp", s.stages, milp_stop), ("milp_k1", 1, None)):
            if stop:
                row[key] = {"stages": stages, "skipped": stop}
                continue
            try:
                m = _plan_row(Milp(stages=stages, time_limit_s=s.limit), inst)
            except PlannerError as exc:
                row[key] = {"stages": stages, "error": str(exc)}
                if key == "milp":
                    milp_stop = f"a smaller context got no solution in {s.limit:g} s"
                continue
            m["stages"] = stages
            m["status"] = m["info"]["status"]
            m["gap"] = m["info"]["gap"]
            m["objective_s"] = m["info"]["objective_s"]
            m["ratio_lp"] = m["ttft_s"] / lb
            m["greedy_over_milp"] = g["ttft_s"] / m["ttft_s"]
            m["speedup"] = m["plan_time_s"] / g["plan_time_s"]
            row[key] = m
            if key == "milp" and m["status"] != "optimal":
                milp_stop = (f"{tokens} tokens was not solved to optimality within "
                             f"{s.limit:g} s")
        table2.append(row)
        bar.update(1)
    return table2


def _sweep(s: _Settings, bar: Any) -> list[dict[str, Any]]:
    """Part 2: every planner at each bandwidth (the MILP at the smaller context only)."""
    from sparkv.scheduler import PlannerError, lp_bound, synthetic_instance

    sweep: list[dict[str, Any]] = []
    for tokens, with_milp in ((s.milp_sweep_tokens, True), (s.sweep_tokens, False)):
        for mbps in s.bws:
            bar.set_postfix_str(f"sweep {tokens} tokens {mbps:g} Mbit/s")
            inst = synthetic_instance(tokens, bandwidth_mbps=mbps, seed=s.seed)
            lb = lp_bound(inst)
            entry: dict[str, Any] = {"tokens": tokens, "mbps": mbps, "lp_bound_s": lb,
                                     "planners": {}}
            for name, planner in s.planners(with_milp):
                try:
                    r = _plan_row(planner, inst)
                except PlannerError as exc:
                    entry["planners"][name] = {"error": str(exc)}
                    continue
                r["ratio_lp"] = r["ttft_s"] / lb
                if name == "milp":
                    r["status"], r["gap"] = r["info"]["status"], r["info"]["gap"]
                entry["planners"][name] = r
            sweep.append(entry)
            bar.update(1)
    return sweep


def _traces(s: _Settings, bar: Any) -> list[dict[str, Any]]:
    """Part 3: plans made at each trace's median rate, run under the trace with compute noise,
    static and with the runtime controller (CacheGen's for stream-only)."""
    from sparkv.scheduler import ComputeNoise, ControllerConfig, Trace, simulate, synthetic_instance

    traces: list[dict[str, Any]] = []
    noise = ComputeNoise(sigma=0.1, seed=s.seed)
    for tname in TRACES:
        bar.set_postfix_str(f"trace {tname}")
        trace = Trace.sample(tname)
        plan_mbps = statistics.median(trace.mbps)
        inst = synthetic_instance(s.trace_tokens, bandwidth_mbps=plan_mbps, seed=s.seed)
        entry: dict[str, Any] = {"trace": tname, "tokens": s.trace_tokens, "plan_mbps": plan_mbps,
                                 "trace_mean_mbps": trace.mean_mbps(),
                                 "compute_noise_sigma": noise.sigma, "planners": {}}
        for name, planner in s.planners(False):
            plan = planner.plan(inst)
            static = simulate(plan, inst, trace, noise)
            res = {"static_ttft_s": static.ttft_s, "plan_time_s": plan.plan_time_s}
            cfg = (ControllerConfig.cachegen() if name == "stream"
                   else None if name == "local" else ControllerConfig())
            if cfg is not None:
                adaptive = simulate(plan, inst, trace, noise, controller=cfg)
                res.update({"adaptive_ttft_s": adaptive.ttft_s,
                            "migrations": len(adaptive.migrations),
                            "bytes_wasted": adaptive.bytes_wasted,
                            "controller": "cachegen" if name == "stream" else "sparkv"})
            entry["planners"][name] = res
        traces.append(entry)
        bar.update(1)
    return traces


def _jsonable_info(info: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in info.items() if isinstance(v, (int, float, str, bool, type(None)))}


def _targets(table2: list[dict], sweep: list[dict]) -> dict[str, Any]:
    solved = [r for r in table2 if r.get("milp", {}).get("status") == "optimal"]
    out: dict[str, Any] = {}
    if solved:
        largest = solved[-1]
        sp = largest["milp"]["speedup"]
        out["greedy_speedup_at_largest_solved"] = {
            "tokens": largest["tokens"], "value": sp, "target": ">= 10", "met": sp >= 10}
        pairs = {f"table2 {r['tokens']} tokens": r["milp"]["greedy_over_milp"] for r in solved}
        for e in sweep:
            m, g = e["planners"].get("milp", {}), e["planners"].get("greedy", {})
            if m.get("status") == "optimal" and "ttft_s" in g:
                pairs[f"sweep {e['tokens']} tokens {e['mbps']:g} Mbit/s"] = g["ttft_s"] / m["ttft_s"]
        worst = max(pairs.values())
        out["greedy_ttft_over_milp_max"] = {
            "value": worst, "target": "<= 1.05", "met": worst <= 1.05, "per_instance": pairs}
        k1 = largest.get("milp_k1", {})
        if "plan_time_s" in k1:
            out["greedy_speedup_vs_single_stage_milp"] = {
                "tokens": largest["tokens"], "value": k1["plan_time_s"] /
                largest["greedy"]["plan_time_s"], "target": "(information)", "met": None}
    else:
        out["greedy_speedup_at_largest_solved"] = {"value": None, "met": False,
                                                   "note": "the MILP solved no size"}
    ratios = [r["greedy"]["ratio_lp"] for r in table2]
    ratios += [e["planners"]["greedy"]["ratio_lp"] for e in sweep if "greedy" in e["planners"]]
    out["greedy_ttft_over_lp_bound_max"] = {
        "value": max(ratios), "mean": sum(ratios) / len(ratios), "target": "<= 1.15",
        "met": max(ratios) <= 1.15}
    return out


def _print_tables(table2: list[dict], sweep: list[dict], traces: list[dict],
                  targets: dict[str, Any]) -> None:
    def fmt(x: Any, spec: str = ".3f") -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    print("\nTable II: greedy vs MILP (TTFT = simulated at the instance's bandwidth)")
    rows = []
    for r in table2:
        g, m, m1 = r["greedy"], r.get("milp", {}), r.get("milp_k1", {})
        rows.append([
            r["tokens"], r["steps"], fmt(g["plan_time_s"], ".4f"),
            fmt(m.get("plan_time_s"), ".2f") if "plan_time_s" in m else "skipped",
            m.get("status", "-"), fmt(m.get("gap"), ".3f"), fmt(m.get("speedup"), ".0f"),
            fmt(g["ttft_s"]), fmt(m.get("ttft_s")), fmt(r["lp_bound_s"]),
            fmt(g["ratio_lp"]), fmt(m.get("ratio_lp")), fmt(m.get("greedy_over_milp")),
            fmt(m1.get("plan_time_s"), ".2f"), fmt(m1.get("greedy_over_milp"))])
    print(format_table(["tokens", "steps", "greedy_s", "milp_s", "milp_status", "gap",
                        "speedup", "greedy_ttft", "milp_ttft", "lp_bound", "greedy/lp",
                        "milp/lp", "greedy/milp", "milpK1_s", "greedy/milpK1"], rows))

    names = ["greedy", "milp", "hybrid", "stream", "local"]
    for tokens in sorted({e["tokens"] for e in sweep}):
        print(f"\nTTFT (s) vs bandwidth, {tokens} tokens (lp = LP lower bound)")
        rows = []
        for e in (e for e in sweep if e["tokens"] == tokens):
            row = [f"{e['mbps']:g}", fmt(e["lp_bound_s"])]
            for n in names:
                p = e["planners"].get(n)
                row.append("-" if p is None else fmt(p.get("ttft_s")))
            rows.append(row)
        print(format_table(["mbps", "lp"] + names, rows))

    print("\nUnder traces (compute noise sigma 0.1): TTFT static -> with controller")
    rows = []
    for e in traces:
        row = [e["trace"], f"{e['plan_mbps']:.0f}"]
        for n in ["greedy", "hybrid", "stream", "local"]:
            p = e["planners"][n]
            if "adaptive_ttft_s" in p:
                row.append(f"{p['static_ttft_s']:.2f} -> {p['adaptive_ttft_s']:.2f}")
            else:
                row.append(f"{p['static_ttft_s']:.2f}")
        rows.append(row)
    print(format_table(["trace", "plan_mbps", "greedy", "hybrid", "stream(cachegen)", "local"],
                       rows))

    print("\nTargets")
    rows = [[k, fmt(v.get("value"), ".3f") if v.get("value") is not None else "-",
             v.get("target", ""),
             "-" if v.get("target") == "(information)" else "yes" if v.get("met") else "NO"]
            for k, v in targets.items()]
    print(format_table(["target", "measured", "wanted", "met"], rows))


def _plot(path: Path, table2: list[dict], sweep: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    token_sets = sorted({e["tokens"] for e in sweep})
    fig, axes = plt.subplots(1, len(token_sets) + 1, figsize=(5.2 * (len(token_sets) + 1), 4.2))
    styles = {"greedy": ("C0", "o", "-"), "milp": ("C1", "s", "--"), "hybrid": ("C2", "^", "-"),
              "stream": ("C3", "v", "-"), "local": ("C4", "x", "-")}
    for ax, tokens in zip(axes, token_sets):
        rows = [e for e in sweep if e["tokens"] == tokens]
        x = [e["mbps"] for e in rows]
        for name, (color, marker, ls) in styles.items():
            y = [e["planners"].get(name, {}).get("ttft_s", float("nan")) for e in rows]
            if all(math.isnan(v) for v in y):
                continue
            ax.plot(x, y, color=color, marker=marker, ls=ls, label=name)
        ax.plot(x, [e["lp_bound_s"] for e in rows], color="k", ls=":", label="LP bound")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("bandwidth (Mbit/s)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"{tokens // 1024}K-token context")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax = axes[-1]
    sizes = [r["tokens"] / 1024 for r in table2]
    ax.plot(sizes, [r["greedy"]["plan_time_s"] for r in table2], "o-", color="C0", label="greedy")
    ms = [(r["tokens"] / 1024, r["milp"]["plan_time_s"], r["milp"]["status"]) for r in table2
          if "plan_time_s" in r.get("milp", {})]
    if ms:
        ax.plot([m[0] for m in ms], [m[1] for m in ms], "s--", color="C1", label="MILP")
        for xk, yk, st in ms:
            if st != "optimal":
                ax.annotate(st, (xk, yk), fontsize=7)
    m1 = [(r["tokens"] / 1024, r["milp_k1"]["plan_time_s"]) for r in table2
          if "plan_time_s" in r.get("milp_k1", {})]
    if m1:
        ax.plot([m[0] for m in m1], [m[1] for m in m1], "d:", color="C5", label="MILP K=1")
    ax.set_yscale("log")
    ax.set_xlabel("context (K tokens)")
    ax.set_ylabel("scheduling time (s)")
    ax.set_title("Table II: scheduling time")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _adversarial(args: argparse.Namespace) -> int:
    """Every strategy on ``args.adversarial`` seeded adversarial traces and ``args.fade_start``
    traces that start in a deep fade and recover, simulated end to end
    (:mod:`sparkv.scheduler.whatif`): the quick look before ``sparkv bench ttft --traces
    adversarial:N`` measures it for real."""
    from sparkv.logs import progress_bar

    from sparkv.scheduler.trace import adversarial_traces, fade_start_traces

    families = {"adversarial": adversarial_traces(args.adversarial, args.seed),
                "fade_start": fade_start_traces(max(0, args.fade_start), args.seed)}
    bar = progress_bar(total=2 * sum(len(v) for v in families.values()),
               desc="adversarial (simulated)", file=sys.stderr, disable=None)
    out: dict[str, Any] = {}
    for name, traces in families.items():
        key = "per_size" if name == "adversarial" else name
        out[key] = _family(traces, bar) if traces else []
    bar.close()
    out["targets"] = {"p95": 1.05, "worst": 1.10}
    for name in ("per_size", "fade_start"):
        for e in out[name]:
            worst = max(e["rows"], key=lambda x: x["ratio"])
            what = "adversarial" if name == "per_size" else "fade-start"
            print(f"{e['tokens']} tokens, {e['traces']} {what} traces (simulated): sparkv / best "
                  f"baseline median {e['median']:.3f}, p95 {e['p95']:.3f}, worst "
                  f"{e['worst']:.3f} ({worst['trace']}); sparkv streamed at least "
                  f"{e['sparkv_min_mb_streamed']:.1f} MB on every trace")
    if args.json or args.out:
        path = write_result("scheduler_adversarial", out, {
            "traces": args.adversarial, "fade_start_traces": args.fade_start, "seed": args.seed,
            "chunk_tokens": 512, "levels": "raw,q8,q5",
            "model": "synthetic SmolLM2-135M instances (SMOLLM2_135M_CPU_SPANS: the 2-core "
                     "CPU, --dtype auto, spans and a call's fixed cost)",
            "edge": "the prelude during the manifest, the default 50 Mbit/s prior capped by a "
                    "slow manifest (start_prior), every controller committing spans"}, args.out)
        print(f"wrote {path}")
    return 0


def _family(traces: list[Any], bar: Any) -> list[dict[str, Any]]:
    """Every strategy on ``traces`` at 2K and 4K tokens: per size, sparkv / best baseline per
    trace and its median, 95th percentile and worst."""
    from sparkv.scheduler import synthetic_instance
    from sparkv.scheduler.instance import DEFAULT_LEVELS, SMOLLM2_135M_CPU_SPANS
    from sparkv.scheduler.whatif import compare

    levels = tuple(lv for lv in DEFAULT_LEVELS if lv.name in ("raw", "q8", "q5"))
    per_size = []
    for n in (2048, 4096):
        # the edge as it runs now on the 2-core CPU: mixed precision, a layer's chunks as spans,
        # a call's fixed cost (what fragments pay), the prelude, the default prior
        inst = synthetic_instance(n, chunk_tokens=512, bandwidth_mbps=50, levels=levels, seed=1,
                                  profile=SMOLLM2_135M_CPU_SPANS)
        # the manifest (about 100 bytes gzip per chunk and level) and the token ids
        manifest_bytes = int(100 * inst.num_chunks * len(levels) + 4 * n)
        rows = []
        for tr in traces:
            r = compare(inst, tr, manifest_bytes=manifest_bytes)
            best = min(("local", "stream", "hybrid"), key=lambda k: r[k].ttft_s)
            rows.append({"trace": tr.name, "best": best,
                         **{f"{k}_s": v.ttft_s for k, v in r.items()},
                         "prior_mbps": r["sparkv"].prior_mbps,
                         "sparkv_bytes_streamed": r["sparkv"].bytes_streamed,
                         "ratio": r["sparkv"].ttft_s / r[best].ttft_s})
            bar.update(1)
        ratios = sorted(x["ratio"] for x in rows)
        p95 = ratios[min(len(ratios) - 1, int(round(0.95 * (len(ratios) - 1))))]
        per_size.append({"tokens": n, "traces": len(rows), "median": statistics.median(ratios),
                         "p95": p95, "worst": ratios[-1],
                         "sparkv_min_mb_streamed": min(x["sparkv_bytes_streamed"]
                                                       for x in rows) / 1e6, "rows": rows})
    return per_size
