"""Where a streaming load's compute time goes (docs/benchmarks.md, "The compute path beside a
link"): each ``sparkv`` ask's compute calls, recorded as they ran (the prelude's steps, then the
engine's units), are replayed on a fresh layer stepper with the streamed chunks already in
place and no link; beside them, the same computed steps as one span a layer per run of
consecutive token chunks, and every step of the context that way (a local prefill's work). A
``local`` ask between the sparkv ones gives the same in-load figure without a link.

    python bench/compute_replay.py [--link lte] [--rounds 4] [--tokens 2048] [--out F.json]

A real server on loopback (file store), the bundled SmolLM2 in ``--dtype auto``, T=512, the
link emulated in-process, a fresh link prior each ask (as the demo's first ask). Wall clock on
whatever machine runs it; the replays are the best of two.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time
from typing import Any

import torch

from sparkv.layout import KVChunkId, StepId

Calls = list[tuple[StepId, ...]]


class Recorder:
    """Records the compute worker's units and the stepper's call time (the prelude's calls
    apart: they run on the asking thread, as the engine's units do, outside a unit)."""

    def __init__(self) -> None:
        from sparkv.edge import compute
        from sparkv.runtime import stepper

        self.units: Calls = []
        self.kernel_s = 0.0
        self.prelude_kernel_s = 0.0
        self.in_unit = False
        run = compute.ComputeWorker._run
        st_cls = stepper.LayerStepper
        rec = self

        def _run(worker: Any, steps: list[StepId]) -> None:
            rec.in_unit = True
            try:
                run(worker, steps)
            finally:
                rec.in_unit = False
            rec.units.append(tuple(steps))

        def _timed(fn: Any) -> Any:
            def call(st: Any, *a: Any) -> Any:
                start = time.perf_counter()
                out = fn(st, *a)
                took = time.perf_counter() - start
                if rec.in_unit:
                    rec.kernel_s += took
                else:
                    rec.prelude_kernel_s += took
                return out
            return call

        compute.ComputeWorker._run = _run                       # type: ignore[method-assign,assignment]
        for name in ("run_span", "run_column"):     # run_step runs a span of one
            setattr(st_cls, name, _timed(getattr(st_cls, name)))

    def clear(self) -> None:
        self.units, self.kernel_s, self.prelude_kernel_s = [], 0.0, 0.0


def run_calls(lm: Any, ids: list[int], ref: Any, calls: Calls, streamed: list[StepId]) -> float:
    """Seconds to run ``calls`` on a fresh stepper whose ``streamed`` steps' chunks are
    ``ref``'s, put in place first."""
    from sparkv.runtime import LayerStepper, get_backend

    s = LayerStepper(lm, ids, 512, backend=get_backend("dense"))
    g = s.geometry
    for step in streamed:
        a, b = g.token_range(step.t)
        for gg in range(g.num_groups):
            cid = KVChunkId(step.t, step.l, gg)
            p = ref.kv.read(cid)
            shape = (g.heads_per_group, b - a, -1)
            s.kv.put(cid, p.k.reshape(shape), p.v.reshape(shape), source="streamed")
    start = time.perf_counter()
    with torch.inference_mode():
        for unit in calls:
            _run_unit(s, unit)
    return time.perf_counter() - start


def _run_unit(s: Any, unit: tuple[StepId, ...]) -> None:
    """One unit as the compute worker runs it: a step, spans of one layer, or a column."""
    if len(unit) == 1:
        s.run_step(unit[0])
    elif unit[1].l == unit[0].l:
        for run in _runs(sorted(x.t for x in unit)):
            s.run_span(run[0], run[-1] + 1, unit[0].l)
    else:
        s.run_column(unit[0].t, unit[0].l, unit[-1].l + 1)


def _runs(ts: list[int]) -> list[list[int]]:
    """``ts`` (sorted) cut into runs of consecutive integers."""
    out: list[list[int]] = []
    for t in ts:
        if out and t == out[-1][-1] + 1:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def as_spans(steps: set[StepId], num_layers: int) -> Calls:
    """``steps`` as one span a layer per run of consecutive token chunks, layer by layer."""
    calls: Calls = []
    for l in range(num_layers):  # noqa: E741
        for run in _runs(sorted(s.t for s in steps if s.l == l)):
            calls.append(tuple(StepId(t, l) for t in run))
    return calls


def sparkv_row(lm: Any, ids: list[int], ref: Any, res: Any, rec: Recorder) -> dict[str, Any]:
    """One sparkv ask's figures: in the load, and its calls replayed without a link."""
    g, bd = ref.geometry, res.breakdown
    order = [StepId(t, l) for t in range(g.num_token_chunks)  # noqa: E741
             for l in range(g.num_layers)]
    from sparkv.edge.prelude import prelude_units

    prelude: Calls = []
    for unit in prelude_units(g):                 # the prelude's spans, as it ran them
        if sum(len(u) for u in prelude) >= bd.prelude_steps:
            break
        prelude.append(unit)
    calls: Calls = prelude + rec.units
    computed = {s for unit in calls for s in unit}
    streamed = [s for s in order if s not in computed]
    best = lambda c, st: min(run_calls(lm, ids, ref, c, st) for _ in range(2))  # noqa: E731
    return {"strategy": "sparkv", "ttft_s": bd.ttft_s, "loading_s": bd.loading_s,
            "kernel_s": rec.kernel_s, "prelude_kernel_s": rec.prelude_kernel_s,
            "prelude_steps": bd.prelude_steps,
            "computed_steps": len(computed), "streamed_steps": len(streamed),
            "calls": len(calls), "replay_s": best(calls, streamed),
            "replay_prelude_s": best(calls[:len(prelude)], streamed),
            "replay_spans_s": best(as_spans(computed, g.num_layers), streamed),
            "all_spans_s": best(as_spans(set(order), g.num_layers), [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="lte", help="a bundled trace name or Mbit/s")
    p.add_argument("--rounds", type=int, default=4, help="sparkv asks (a local ask after each)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--no-prelude", action="store_true", help="sparkv asks without the prelude")
    p.add_argument("--out", default="bench/results/compute_replay.json")
    args = p.parse_args(argv)
    rows = measure(args)
    pathlib.Path(args.out).write_text(json.dumps({"benchmark": "compute_replay",
                                                  "link": args.link, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from sparkv.edge.commands import shaper_from_args
    from sparkv.edge.options import AskOptions
    from sparkv.edge.prompts import chat_context
    from sparkv.edge.session import EdgeSession
    from sparkv.edge.shaper import LinkShaper
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime import LayerStepper, get_backend, sample_context_ids
    from sparkv.server.process import ServerProcess

    rec = Recorder()
    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    ids = chat_context(lm, sample_context_ids(lm, args.tokens))
    ref = LayerStepper(lm, ids, 512, backend=get_backend("dense"))
    ref.complete()
    num = args.link.replace(".", "", 1).isdigit()
    link = argparse.Namespace(trace=None if num else args.link,
                              mbps=float(args.link) if num else None, rtt_ms=20.0)
    q = "What does this text say about warranty? Answer in one sentence."
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        with ServerProcess(None, f"file://{tmp}/store", log_path=f"{tmp}/server.log",
                           torch_threads=2) as srv:
            s = EdgeSession.connect(srv.url, model=lm, timeout_s=120.0)
            cid = s.client.create_context(token_ids=ids, levels=["raw", "q8", "q5"],
                                          chunk_tokens=512)
            s.client.shaper = LinkShaper.unlimited()
            s.ask(cid, q, AskOptions(strategy="local", max_new_tokens=2, use_cache=False))
            s.ask(cid, q, AskOptions(strategy="sparkv", max_new_tokens=2))  # the manifest cached
            for rnd in range(2 * args.rounds):
                strategy = "local" if rnd % 2 else "sparkv"
                s.client.shaper, s.priors.bandwidth_Bps = shaper_from_args(link), None
                rec.clear()
                res = s.ask(cid, q, AskOptions(strategy=strategy, max_new_tokens=4,
                                               use_cache=False,
                                               prelude=False if args.no_prelude else None))
                s.client.shaper = LinkShaper.unlimited()
                row = (sparkv_row(lm, ids, ref, res, rec) if strategy == "sparkv" else
                       {"strategy": "local", "ttft_s": res.breakdown.ttft_s,
                        "loading_s": res.breakdown.loading_s, "kernel_s": rec.kernel_s,
                        "calls": len(rec.units)})
                rows.append(row)
                print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                      flush=True)
            s.close()
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
