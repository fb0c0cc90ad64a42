"""``sparkv bench predictor``: the MLP latency model against the Roofline on real profiled steps.

1. Profiles real SmolLM2 layer steps on this machine (:class:`sparkv.predictor.Profiler`: dense and
   block-sparse at several cdf thresholds, several chunk sizes, induced load levels).
2. Measures this machine's peak FLOP/s and memory bandwidth for the Roofline.
3. Trains the :class:`sparkv.predictor.LatencyModel` on a seeded 80% of the samples.
4. Reports, on the held-out 20%: the mean absolute percentage error (MAPE) of the MLP and of the
   Roofline on attention steps (the MLP's job; the target is a ratio of at least 4x), per load
   level and backend, and of the projection lookup vs the Roofline on last-layer steps. For the
   reader: a Roofline scaled by the MAPE-optimal constant fitted on the training steps (how much
   of the gap is a constant efficiency factor), and the MLP's error had it known the load during
   each step (how much of its error is load changing faster than it can be measured).
5. Checks the profiler's shortcut (only layers 0-1 are profiled): every non-final layer of another
   context, dense and block-sparse, predicted by the same model (skipped with ``--quick``,
   ``--samples`` or ``--no-deep-check``).
6. Times one prediction: the MLP fast path for one chunk, the ``step_seconds`` API, and the
   whole ``t_comp`` matrix of a 8192-token context divided by its steps; the Roofline likewise.

Writes ``bench/results/predictor.json``, ``predictor.png`` (predicted vs measured) and the raw
samples ``predictor_samples.json``. See docs/predictor.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from sparkv.bench.common import add_run_args, format_table, result_path, write_result
from sparkv.cliflags import add_device_args

if TYPE_CHECKING:
    from sparkv.predictor import LatencyModel, Roofline
    from sparkv.predictor.profiler import Sample
    from sparkv.predictor.roofline import ModelArch
    from sparkv.runtime.model import LoadedModel

TARGETS: dict[str, Any] = {"mape_ratio_min": 4.0, "paper_mape_ratio": [4.8, 5.6],
                           "prediction_ms_max": 0.5}


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("predictor", help="MLP latency model vs Roofline on real profiled steps")
    p.add_argument("--quick", action="store_true", help="small profile (under 2 minutes)")
    add_device_args(p)
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="profiling time budget in seconds (default 420, quick 60)")
    p.add_argument("--samples", default=None,
                   help="train and evaluate on an existing samples file instead of profiling")
    p.add_argument("--seed", type=int, default=0, help="split and MLP seed")
    add_run_args(p, "predictor", threads=1, threads_help="torch threads (default 1)",
                 json_help="write bench/results/predictor.json, predictor.png and (unless "
                           "--samples) predictor_samples.json (predictor_quick.* with --quick)")
    p.add_argument("--no-deep-check", action="store_true",
                   help="skip the all-layers validation (on by default unless --quick/--samples)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _profile(args: argparse.Namespace
             ) -> tuple[LoadedModel, list[Sample], dict[str, Any]]:
    from sparkv.predictor import ProfileConfig, Profiler
    from sparkv.predictor.dtypes import load_model_in_dtype

    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    cfg = ProfileConfig.quick() if args.quick else ProfileConfig()
    cfg.threads = args.threads
    cfg.seed = args.seed
    cfg.time_budget_s = (args.time_budget_s if args.time_budget_s is not None
                         else 60.0 if args.quick else 420.0)
    profiler = Profiler(lm, cfg, progress=not args.no_progress)
    samples = profiler.run()
    return lm, samples, profiler.metadata()


def _deep_layer_check(lm: LoadedModel, model: LatencyModel, roof: Roofline, threads: int,
                      progress: bool) -> dict[str, Any]:
    """Every non-final layer of one 2048-token context (another part of the sample text than the
    profile's), T = 512, dense and block-sparse (cdf 0.9), no induced load: does a model trained
    on layers 0-1 predict layers 2..L-2 as well? (The profiler's "a few layers" assumption.)"""
    import torch
    from sparkv.logs import progress_bar

    from sparkv.layout import StepId
    from sparkv.predictor import StepFeatures, detect_monitor, mape
    from sparkv.predictor.device import UtilisationWindow
    from sparkv.runtime import (BlockSparseAttention, DenseAttention, LayerStepper,
                                SparsityConfig, sample_context_ids)

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    window = UtilisationWindow(detect_monitor(str(lm.device)))
    ids = sample_context_ids(lm, 3048)[1000:3048]
    layers = int(lm.config.num_hidden_layers) - 1
    rows: list[tuple[float, ...]] = []
    bar = progress_bar(total=2 * 4 * layers, desc="all-layers check", unit="step", disable=not progress)
    try:
        for backend, sparse in ((DenseAttention(), 0.0),
                                (BlockSparseAttention(SparsityConfig(cdf_threshold=0.9)), 1.0)):
            stepper = LayerStepper(lm, ids, 512, backend)
            for t in range(stepper.geometry.num_token_chunks):
                start, end = stepper.geometry.token_range(t)
                for layer in range(layers):
                    u = window.read()
                    window.tick()
                    t0 = time.perf_counter()
                    res = stepper.run_step(StepId(t, layer))
                    ms = (time.perf_counter() - t0) * 1e3
                    assert res.stats is not None         # an attention layer (not the last)
                    rows.append((layer, end - start, end,
                                 float(res.stats.active_blocks.float().mean()), u, sparse, ms))
                    bar.update(1)
    finally:
        bar.close()
        torch.set_num_threads(old)
    a = np.array(rows, dtype=np.float64)
    f = StepFeatures(a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5], 0.0, 0)
    y, p_mlp, p_roof = a[:, 6], model.predict_ms(f), roof.predict_ms(f)
    out: dict[str, Any] = {}
    for name, sel in (("layers_0_1", a[:, 0] < 2), ("layers_2_up", a[:, 0] >= 2)):
        out[name] = {"n": int(sel.sum()), "mlp_mape": mape(p_mlp[sel], y[sel]),
                     "roofline_mape": mape(p_roof[sel], y[sel]),
                     "active_blocks_range": [float(a[sel, 3].min()), float(a[sel, 3].max())]}
    return out


def _time_per_call(fn: Callable[[], object], calls: int) -> float:
    """Median milliseconds of ``fn()`` over ``calls`` calls, in 5 batches."""
    per_batch = max(1, calls // 5)
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per_batch):
            fn()
        best.append((time.perf_counter() - t0) / per_batch)
    return float(np.median(best) * 1e3)


def _prediction_times(model: LatencyModel, roof: Roofline, arch: ModelArch
                      ) -> dict[str, float]:
    from sparkv.layout import ChunkGeometry
    from sparkv.predictor import StepFeatures

    geo = ChunkGeometry(8192, 1024, arch.num_layers, arch.kv_heads, arch.head_dim)
    f1 = StepFeatures.single(1024, 4096, 300.0, 0.5, True)
    steps = geo.num_token_chunks * geo.num_layers
    return {
        "mlp_one_chunk_ms": _time_per_call(
            lambda: model.predict_one_ms(1024, 4096, 300.0, 0.5, True), 2000),
        "mlp_step_seconds_api_ms": _time_per_call(
            lambda: model.step_seconds(3, 5, geo, utilisation=0.5), 1000),
        "mlp_features_predict_ms": _time_per_call(lambda: model.predict_ms(f1), 1000),
        "mlp_t_comp_per_step_ms": _time_per_call(
            lambda: model.t_comp(geo, utilisation=0.5), 50) / steps,
        "roofline_one_chunk_ms": _time_per_call(lambda: roof.predict_ms(f1), 1000),
        "roofline_t_comp_per_step_ms": _time_per_call(
            lambda: roof.t_comp(geo, utilisation=0.5), 50) / steps,
        "t_comp_context_steps": steps,
    }


@dataclasses.dataclass
class _Evaluation:
    """The fitted MLP and Roofline and their errors on the held-out steps (``att``/``proj``:
    :func:`_evaluate` of the attention and projection test steps)."""

    model: Any
    roof: Any
    threads: int
    train: int
    test: int
    att: dict[str, Any]
    proj: dict[str, Any]
    scale: float
    scaled_mape: float
    oracle_mape: float
    groups: list[dict[str, Any]]
    times: dict[str, float]


def run(args: argparse.Namespace) -> int:
    from sparkv.predictor import load_samples

    wall0 = time.perf_counter()
    if args.json or args.out:
        result_path("predictor", args.out, quick=args.quick)  # a quick run refuses a full file now
    lm = None
    if args.samples:
        samples, meta = load_samples(args.samples)
    else:
        lm, samples, meta = _profile(args)
    profile_s = time.perf_counter() - wall0
    ev = _fit_and_evaluate(samples, meta, args.threads, args.seed)
    deep = None
    if lm is not None and not args.quick and not args.no_deep_check:
        deep = _deep_layer_check(lm, ev.model, ev.roof, ev.threads, not args.no_progress)
    summary = _summary(samples, meta, ev, deep, profile_s)
    _print_report(ev, summary, deep)
    if args.json or args.out:
        path = _write(args, samples, meta, ev, summary)
        print(f"wrote {path} (wall {time.perf_counter() - wall0:.0f} s)")
    return 0


def _evaluate(model: Any, roof: Any, rows: list[Any]) -> dict[str, Any]:
    """MAPE of the MLP and the Roofline on ``rows`` (samples), their ratio, and the
    measured and predicted milliseconds."""
    from sparkv.predictor import StepFeatures, mape

    if not rows:
        return {"n": 0}
    f = StepFeatures.from_samples(rows)
    y = np.array([s.ms for s in rows])
    p_mlp, p_roof = model.predict_ms(f), roof.predict_ms(f)
    return {"n": len(rows), "mlp_mape": mape(p_mlp, y), "roofline_mape": mape(p_roof, y),
            "ratio": mape(p_roof, y) / max(mape(p_mlp, y), 1e-9),
            "measured": y, "mlp": p_mlp, "roofline": p_roof}


def _fit_and_evaluate(samples: list[Any], meta: dict[str, Any], threads_arg: int, seed: int
                      ) -> _Evaluation:
    """Measures the Roofline's peaks, fits the MLP on the seeded training split and evaluates
    both on the held-out steps: overall, per group (load, backend, T), a MAPE-optimally scaled
    Roofline, the MLP had it known the load during each step, and the prediction times."""
    from sparkv.predictor import LatencyModel, ModelArch, Roofline, StepFeatures, mape

    arch = ModelArch.from_dict(meta["arch"])
    threads = int((meta.get("config") or {}).get("threads", threads_arg))
    roof = Roofline.measure(arch, meta.get("device", "cpu"), threads)
    model = LatencyModel(random_state=seed).fit(samples, meta, roof)
    roof.density_prior = model.density_prior

    assert model.train_index is not None and model.test_index is not None    # fitted
    train = [samples[i] for i in model.train_index]
    test = [samples[i] for i in model.test_index]
    att_test = [s for s in test if s.kind == "attention"]
    att_train = [s for s in train if s.kind == "attention"]
    att = _evaluate(model, roof, att_test)
    proj = _evaluate(model, roof, [s for s in test if s.kind == "projection"])
    # a Roofline scaled by the one constant that minimises its MAPE on the training steps
    f_tr = StepFeatures.from_samples(att_train)
    scale = _mape_optimal_scale(roof.predict_ms(f_tr), np.array([s.ms for s in att_train]))
    scaled_mape = mape(att["roofline"] * scale, att["measured"])
    # diagnostic: the same MLP trained and tested with U measured *during* each step (known only
    # afterwards): how much error the load changing within a second costs
    during = [dataclasses.replace(s, utilisation=s.utilisation_during) for s in samples]
    oracle = LatencyModel(random_state=seed).fit(during, meta)
    assert oracle.test_index is not None
    oracle_test = [during[i] for i in oracle.test_index if during[i].kind == "attention"]
    oracle_mape = mape(oracle.predict_ms(StepFeatures.from_samples(oracle_test)),
                       [s.ms for s in oracle_test])
    groups: list[dict[str, Any]] = []
    for key, label in (("load", "load"), ("backend", "backend"), ("chunk_tokens", "T")):
        for value in sorted({getattr(s, key) for s in att_test}):
            r = _evaluate(model, roof, [s for s in att_test if getattr(s, key) == value])
            groups.append({"by": label, "value": value, "n": r["n"], "mlp_mape": r["mlp_mape"],
                           "roofline_mape": r["roofline_mape"], "ratio": r["ratio"]})
    times = _prediction_times(model, roof, arch)
    return _Evaluation(model, roof, threads, len(train), len(test), att, proj, scale,
                       scaled_mape, oracle_mape, groups, times)


def _summary(samples: list[Any], meta: dict[str, Any], ev: _Evaluation,
             deep: dict[str, Any] | None, profile_s: float) -> dict[str, Any]:
    """The JSON's one result row: sample counts, the held-out errors, the targets met."""
    att, proj, roof, model, times = ev.att, ev.proj, ev.roof, ev.model, ev.times
    ms_all = np.array([s.ms for s in samples if s.kind == "attention"])
    return {
        "samples": len(samples),
        "attention_samples": int(len(ms_all)),
        "projection_samples": len(samples) - int(len(ms_all)),
        "train": ev.train, "test": ev.test,
        "test_attention": att["n"], "test_projection": proj["n"],
        "mlp_mape": att["mlp_mape"],
        "roofline_mape": att["roofline_mape"],
        "mape_ratio": att["ratio"],
        "roofline_scaled_mape": ev.scaled_mape, "roofline_scale": ev.scale,
        "mlp_mape_u_during_oracle": ev.oracle_mape,
        "projection_lookup_mape": proj.get("mlp_mape"),
        "projection_roofline_mape": proj.get("roofline_mape"),
        "mlp_one_chunk_ms": times["mlp_one_chunk_ms"],
        "meets_ratio_target": bool(att["ratio"] >= TARGETS["mape_ratio_min"]),
        "meets_time_target": bool(times["mlp_one_chunk_ms"] < TARGETS["prediction_ms_max"]),
        "measured_ms_range": [float(ms_all.min()), float(ms_all.max())],
        "peak_gflops": roof.peak_flops / 1e9, "peak_bandwidth_gbs": roof.peak_bandwidth / 1e9,
        "fit_seconds": model.info["fit_seconds"], "mlp_iterations": model.info["iterations"],
        "profile_seconds": meta.get("elapsed_s", profile_s),
        "skipped_combinations": len(meta.get("skipped", [])),
        "utilisation_range": [float(min(s.utilisation for s in samples)),
                              float(max(s.utilisation for s in samples))],
        "all_layers_check": deep,
    }


def _print_report(ev: _Evaluation, summary: dict[str, Any], deep: dict[str, Any] | None
                  ) -> None:
    att, proj, roof, model, times = ev.att, ev.proj, ev.roof, ev.model, ev.times
    print(format_table(["steps", "n", "MLP MAPE %", "Roofline MAPE %", "ratio"],
                       [["attention (held out)", att["n"], att["mlp_mape"], att["roofline_mape"],
                         att["ratio"]]]
                       + ([["projection (held out)", proj["n"], proj["mlp_mape"],
                            proj["roofline_mape"], proj["ratio"]]] if proj["n"] else [])))
    print()
    print(format_table(["by", "value", "n", "MLP MAPE %", "Roofline MAPE %", "ratio"],
                       [[g["by"], g["value"], g["n"], g["mlp_mape"], g["roofline_mape"],
                         g["ratio"]] for g in ev.groups]))
    print()
    print(f"Roofline scaled by {ev.scale:.2f} (the MAPE-optimal constant on the training steps): "
          f"MAPE {ev.scaled_mape:.1f}%")
    print(f"diagnostic: MLP with U measured during the step (unknowable before it): MAPE "
          f"{ev.oracle_mape:.1f}%")
    print(f"peaks: {roof.peak_flops / 1e9:.1f} GFLOP/s, {roof.peak_bandwidth / 1e9:.1f} GB/s "
          f"({ev.threads} thread(s)); MLP fit {model.info['fit_seconds']:.1f} s, "
          f"{model.info['iterations']} iterations")
    if deep:
        print(format_table(["all-layers check (no load)", "n", "s range", "MLP MAPE %",
                            "Roofline MAPE %"],
                           [[k, v["n"], "%g-%g" % tuple(v["active_blocks_range"]), v["mlp_mape"],
                             v["roofline_mape"]] for k, v in deep.items()]))
    print(format_table(["prediction", "ms"], [[k, v] for k, v in times.items()
                                              if k.endswith("_ms")]))
    target_ok = summary["meets_ratio_target"] and summary["meets_time_target"]
    print(f"targets: ratio >= {TARGETS['mape_ratio_min']}x -> {att['ratio']:.2f}x, "
          f"< {TARGETS['prediction_ms_max']} ms per chunk -> {times['mlp_one_chunk_ms']:.4f} ms: "
          f"{'met' if target_ok else 'NOT met'}")


def _write(args: argparse.Namespace, samples: list[Any], meta: dict[str, Any], ev: _Evaluation,
           summary: dict[str, Any]) -> Any:
    """Writes the JSON, the profiled samples beside it (unless ``--samples``) and the plot;
    returns the JSON's path."""
    from sparkv.predictor import save_samples

    att = ev.att
    config = {"quick": args.quick, "threads": ev.threads, "seed": args.seed,
              "samples_file": args.samples, "profile": meta.get("config"),
              "model": meta.get("model"), "device": meta.get("device"),
              "fingerprint": meta.get("fingerprint"),
              "utilisation_source": meta.get("utilisation_source"),
              "mlp": ev.model.to_dict()["hyperparameters"], "features": list(ev.model.features)}
    scatter = {"measured_ms": att["measured"], "mlp_ms": att["mlp"],
               "roofline_ms": att["roofline"]}
    path = write_result("predictor", {"results": [summary], "groups": ev.groups,
                                      "prediction_times": ev.times, "targets": TARGETS,
                                      "held_out_attention": scatter}, config, args.out,
                        quick=args.quick)
    if not args.samples:
        save_samples(path.with_name(path.stem + "_samples.json"), samples, meta)
    _plot(att, ev.scaled_mape, path.with_suffix(".png"))
    return path


def _mape_optimal_scale(predicted: np.ndarray, measured: np.ndarray) -> float:
    """``argmin_c mean |c p_i - y_i| / y_i``: the weighted median of ``y_i / p_i`` with weights
    ``p_i / y_i``."""
    a = predicted / measured
    v = 1.0 / a
    order = np.argsort(v)
    cum = np.cumsum(a[order])
    return float(v[order][np.searchsorted(cum, cum[-1] / 2.0)])


def _plot(att: dict[str, Any], scaled_mape: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    y = att["measured"]
    fig, ax = plt.subplots(figsize=(5.5, 5))
    ax.scatter(y, att["roofline"], s=10, alpha=0.6, marker="x",
               label=f"Roofline (MAPE {att['roofline_mape']:.1f}%)")
    ax.scatter(y, att["mlp"], s=10, alpha=0.7, label=f"MLP (MAPE {att['mlp_mape']:.1f}%)")
    lo = float(min(y.min(), att["roofline"].min(), att["mlp"].min())) * 0.8
    hi = float(max(y.max(), att["roofline"].max(), att["mlp"].max())) * 1.2
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    ticks = [v for v in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if lo <= v <= hi]
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
        axis.set_ticks(ticks)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"Held-out SmolLM2 layer steps ({att['n']}), this CPU")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
