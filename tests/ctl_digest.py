"""Seeded cases through the runtime controller, and a digest of every result: the proof that a
restructuring of :mod:`sparkv.scheduler.controller` changed no decision.

Three kinds of case, each reduced to one sha256 of the exact ``repr`` of what it produced:

* ``sim``: :func:`~sparkv.scheduler.simulator.simulate` of a seeded synthetic instance, planner,
  trace, compute noise and controller configuration: the whole timeline (every step's and
  transfer's times, the migration log, TTFT) and the controller's final estimates;
* ``drive``: the controller driven the way the edge engine drives it (columns from
  ``next_steps``, batches of ``next_fetch`` sized by ``bandwidth_estimate``, rate samples with a
  chunk id, silences, cancellations taken at chunk boundaries and on a ``has_cancellations``
  peek, decode delays, prelude steps done before loading), with seeded random timing and a
  seeded piecewise link: every call's arguments and answer;
* ``replay``: calls the real edge engine made to its controller (recorded with a tiny random
  Llama and scripted sources: ``--record``), replayed against a fresh controller: every answer.

    PYTHONPATH=. python tests/ctl_digest.py --out /tmp/before.json            # every case
    PYTHONPATH=. python tests/ctl_digest.py --record /tmp/engine_calls.json.gz   # engine calls
    PYTHONPATH=. python tests/ctl_digest.py --out F --replay /tmp/engine_calls.json.gz
    PYTHONPATH=. python tests/ctl_digest.py --compare /tmp/before.json /tmp/after.json

``tests/test_scheduler_digest.py`` runs every :data:`REDUCED_EVERY`-th case against the stored
``tests/data/controller_digest.json`` (and replays the stored engine calls).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from sparkv.layout import ChunkGeometry, KVChunkId, StepId
from sparkv.scheduler import (ComputeNoise, Controller, ControllerConfig, Instance, Trace,
                              simulate, synthetic_instance)
from sparkv.scheduler.instance import MBPS
from sparkv.scheduler.plan import Plan
from sparkv.scheduler.planners import get_planner
from sparkv.scheduler.planners.base import make_plan
from sparkv.scheduler.rules import ProbeIdleLink, Rebalance, RecomputeColumns, ToCompute, ToStream
from sparkv.scheduler.trace import adversarial_trace, fade_start_trace

#: the regression test runs every n-th case of each kind
REDUCED_EVERY = 13
DATA = Path(__file__).resolve().parent / "data"
DIGEST_FILE = DATA / "controller_digest.json"
ENGINE_CALLS_FILE = DATA / "controller_engine_calls.json.gz"


# ---- configurations, by name -----------------------------------------------------------------
def configs() -> dict[str, Callable[[], ControllerConfig]]:
    """The controller configurations the cases use, by name (one API's spelling of each)."""
    C = ControllerConfig
    return {
        "static": C.static,
        "default": C,
        "cachegen": C.cachegen,
        "cachegen_0.5": lambda: C.cachegen(0.5),
        "recompute": lambda: C(rebalance=Rebalance(RecomputeColumns(ToCompute()), ToStream())),
        "no_probe": lambda: C(probe=None),
        "no_stream": lambda: C(probe=None, rebalance=Rebalance(to_stream=None)),
        "without_link": lambda: C().without_link(),
        "capped": lambda: C(rebalance=Rebalance(max_per_stage=1, stage_s=0.5,
                                                bulk_ratio=math.inf)),
        "small_probe": lambda: C(probe=ProbeIdleLink(rate_Bps=50_000.0, burst_bytes=100_000.0)),
        "no_fast_window": lambda: C(window_s=0.5, fast_window_s=0.0, probe=None),
    }


PLANNERS = ("greedy", "local", "stream", "hybrid", "sparkv")


# ---- normalising results ---------------------------------------------------------------------
def norm(x: Any) -> Any:
    """Plain Python values (numpy scalars to float/int, tuples kept, ids as tuples), so the
    ``repr`` is exact and independent of how a value was typed."""
    if isinstance(x, (StepId, KVChunkId)):
        return tuple(int(v) for v in x)
    if isinstance(x, (bool, str, type(None))):
        return x
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x)
    if isinstance(x, dict):
        return {repr(norm(k)): norm(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [norm(v) for v in x]
    if isinstance(x, (set, frozenset)):
        return sorted(repr(norm(v)) for v in x)
    if hasattr(x, "_asdict"):
        return norm(x._asdict())
    if hasattr(x, "to_dict"):
        return norm(x.to_dict())
    return repr(x)


def sha(x: Any) -> str:
    return hashlib.sha256(repr(norm(x)).encode()).hexdigest()


def plan_digest(plan: Plan) -> list:
    return [[(s.t, s.l) for s in plan.compute_order],
            [(c.t, c.l, c.g, plan.levels[c]) for c in plan.stream_order],
            plan.stage_budget_s, plan.estimated_ttft_s]


def controller_state(ctl: Controller, now: float) -> list:
    return [ctl.run_bandwidth(), ctl.compute_ratio(), ctl.compute_samples, ctl.revision,
            ctl.done, list(ctl.remaining(now)), ctl.bandwidth_estimate(now),
            [m.to_dict() for m in ctl.migrations]]


# ---- instances, traces, noise ----------------------------------------------------------------
SIZES = ((2048, 512, 8), (4096, 512, 8), (4096, 1024, 30))
BANDWIDTHS = (2.0, 25.0, 80.0, 300.0)


def instance(size: int, bw: float, seed: int) -> Instance:
    n, ct, L = SIZES[size]
    return synthetic_instance(n, chunk_tokens=ct, num_layers=L, bandwidth_mbps=bw, seed=seed)


TRACES = ("const", "wifi", "lte", "deep-fade", "fade-start", "adversarial", "fade_start_k",
          "dead_then", "collapse")


def trace(name: str, bw: float, k: int) -> Trace:
    if name == "const":
        return Trace.constant(bw)
    if name == "adversarial":
        return adversarial_trace(k)
    if name == "fade_start_k":
        return fade_start_trace(k)
    if name == "dead_then":
        return Trace.from_rows([0.0, 1.5], [0.01, 80.0], [300.0, 20.0], loop=False)
    if name == "collapse":
        return Trace.from_rows([0.0, 0.3], [bw, 2.0], loop=False)
    return Trace.sample(name)


def noise(kind: int, seed: int) -> ComputeNoise:
    return [ComputeNoise(), ComputeNoise(sigma=0.1, seed=seed),
            ComputeNoise(slowdowns=((0.2, 1.0, 3.0),))][kind]


# ---- cases -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    kind: str          # sim | drive | replay
    key: str
    params: tuple


def sim_cases() -> Iterator[Case]:
    """Every instance x planner x configuration, twice, with a trace and a noise cycling through
    their lists (seeded by the case's index)."""
    names = list(configs())
    i = 0
    for rep in range(2):
        for size in range(len(SIZES)):
            for bw in BANDWIDTHS:
                for seed in (0, 1):
                    for planner in PLANNERS:
                        for cfg in names:
                            tr = TRACES[(i * 7 + rep) % len(TRACES)]
                            nz = (i + rep) % 3
                            key = f"sim/{size}/{bw:g}/{seed}/{planner}/{cfg}/{tr}/{nz}/{rep}"
                            yield Case("sim", key, (size, bw, seed, planner, cfg, tr, nz, i))
                            i += 1
    # layer-by-layer streams (every column locked once its bottom layers arrive)
    for size in range(2):
        for cfg in ("default", "recompute", "cachegen", "static"):
            for tr in ("collapse", "deep-fade", "adversarial"):
                yield Case("sim", f"sim/layers/{size}/{cfg}/{tr}", (size, 100.0, 0, "layers", cfg,
                                                                   tr, 0, 3))


def run_sim(case: Case) -> Any:
    size, bw, seed, planner, cfg, tr, nz, k = case.params
    inst = instance(size, bw, seed)
    if planner == "layers":
        order = sorted(range(inst.num_chunks),
                       key=lambda c: (inst.chunk_id(c).l, inst.chunk_id(c).t))
        plan = make_plan(inst, [], order)
    else:
        plan = get_planner(planner).plan(inst)
    ctl = Controller(plan, inst, configs()[cfg]())
    tl = simulate(plan, inst, trace(tr, bw, k), noise(nz, k), controller=ctl)
    d = tl.to_dict()
    d["available_s"] = sorted((tuple(c), t) for c, t in tl.available_s.items())
    d.update(link_wait_s=tl.link_wait_s, suffix_start_s=tl.suffix_start_s)
    return [plan_digest(plan), d, controller_state(ctl, tl.ttft_s)]


# ---- the engine-like driver ------------------------------------------------------------------
def drive_cases() -> Iterator[Case]:
    names = [n for n in configs() if n != "without_link"]
    i = 0
    for seed in range(6):
        for size in (0, 1):
            for planner in PLANNERS:
                for cfg in names:
                    yield Case("drive", f"drive/{seed}/{size}/{planner}/{cfg}",
                               (seed, size, planner, cfg, i))
                    i += 1


def _link_rates(rng: random.Random, bw_Bps: float) -> list[tuple[float, float]]:
    """A seeded piecewise link: ``(until_s, bytes/s)`` segments, with dead spells."""
    out, t = [], 0.0
    while t < 120.0:
        t += rng.uniform(0.1, 1.5)
        r = rng.random()
        rate = 0.0 if r < 0.1 else bw_Bps * (rng.uniform(0.005, 0.05) if r < 0.3
                                             else rng.uniform(0.3, 3.0))
        out.append((t, rate))
    return out


def _rate_at(rates: list[tuple[float, float]], t: float) -> float:
    for until, r in rates:
        if t < until:
            return r
    return rates[-1][1]


class Driver:
    """Drives one controller like the edge engine does (see the module docstring); ``log``
    holds every call with its arguments and answer."""

    def __init__(self, ctl: Controller, inst: Instance, rng: random.Random,
                 done: set[StepId], column: bool) -> None:
        self.ctl, self.inst, self.rng = ctl, inst, rng
        self.done, self.column = set(done), column
        self.log: list = []
        self.rates = _link_rates(rng, inst.bandwidth_Bps)
        self.have: set[KVChunkId] = set()          # chunks in place
        for s in done:
            for g in range(inst.G):
                self.have.add(KVChunkId(s.t, s.l, g))
        self.running: list[StepId] = []
        self.run_end = 0.0
        self.batch: list = []                        # Fetches of the current request
        self.pos = 0                                 # bytes of batch[0] received
        self.cancelled: set[KVChunkId] = set()
        self.decoding: list[tuple[float, KVChunkId]] = []

    def call(self, name: str, *args: Any) -> Any:
        attr = getattr(self.ctl, name)
        out = attr(*args) if callable(attr) else attr
        self.log.append((name, args, out))
        return out

    def run(self, limit_s: float = 200.0) -> list:
        rng, now = self.rng, 0.0
        self.call("start", 0.0)
        while now < limit_s:
            dt = rng.choice((0.01, 0.02, 0.05, 0.05, 0.1))
            now = round(now + dt, 6)
            self._decoder(now)
            self._compute(now)
            self._link(now, dt)
            if rng.random() < 0.2:
                self.call("bandwidth_estimate", now)
                self.call("remaining", now)
            if self.ctl.done and not self.running:
                break
        self.log.append(("end", now, controller_state(self.ctl, now)))
        return self.log

    def _compute(self, now: float) -> None:
        if self.running and self.run_end <= now:
            t = now - self.run_end
            for s in self.running:
                secs = self.inst.comp_time(s) * self.rng.uniform(0.7, 1.6)
                self.call("step_done", s, round(now - t, 6), secs)
                self.done.add(s)
                for g in range(self.inst.G):
                    self.have.add(KVChunkId(s.t, s.l, g))
            self.running = []
        if not self.running:
            steps = self.call("next_steps", now, self.column)
            ran = [s for s in steps if s in self.done]
            for s in ran:
                self.call("step_done", s, now, 0.0)
            steps = [s for s in steps if s not in self.done]
            if steps:
                self.running = steps
                self.run_end = now + sum(self.inst.comp_time(s) for s in steps) * \
                    self.rng.uniform(0.8, 1.5)

    def _pull(self, now: float) -> None:
        target = max(64_000, self.call("bandwidth_estimate", now) * 0.25)
        total = 0
        while len(self.batch) < 64 and total < target:
            f = self.call("next_fetch", now)
            if f is None:
                break
            self.cancelled.discard(f.cid)
            self.batch.append(f)
            total += self.inst.bytes_of(f.cid, f.level)

    def _take(self) -> None:
        for cid in self.call("take_cancellations"):
            self.cancelled.add(cid)

    def _link(self, now: float, dt: float) -> None:
        if not self.batch:
            self._pull(now)
            self.pos = 0
            if not self.batch:
                return
        budget = _rate_at(self.rates, now) * dt
        if budget <= 0:
            self.call("rate_sample", now, 0.0, dt)
            return
        while self.batch and budget > 0:
            if self.pos == 0:
                self._take()
                if self.batch[0].cid in self.cancelled:
                    self.batch.pop(0)
                    continue
            f = self.batch[0]
            size = self.inst.bytes_of(f.cid, f.level)
            got = min(budget, size - self.pos)
            self.pos += got
            budget -= got
            self.call("rate_sample", now, float(got), dt, f.cid)
            if self.pos >= size:
                self.call("chunk_received", f.cid, now)
                self.decoding.append((now + self.rng.uniform(0.0, 0.05), f.cid))
                self.batch.pop(0)
                self.pos = 0
            elif self.call("has_cancellations"):
                self._take()
                if f.cid in self.cancelled:
                    self.batch.pop(0)
                    self.pos = 0

    def _decoder(self, now: float) -> None:
        due = [x for x in self.decoding if x[0] <= now]
        self.decoding = [x for x in self.decoding if x[0] > now]
        for t, cid in sorted(due):
            self.have.add(cid)
            self.call("chunk_arrived", cid, t)


def run_drive(case: Case) -> Any:
    seed, size, planner, cfg, k = case.params
    rng = random.Random(1000 + k)
    inst = instance(size, rng.choice(BANDWIDTHS), seed)
    plan = get_planner(planner).plan(inst)
    done: set[StepId] = set()
    if rng.random() < 0.3:   # a prelude finished the first steps of token chunk 0
        done = {StepId(0, l) for l in range(rng.randint(1, inst.L))}   # noqa: E741
    ctl = Controller(plan, inst, configs()[cfg](), done_steps=done)
    return [plan_digest(plan), Driver(ctl, inst, rng, done, rng.random() < 0.8).run()]


# ---- recorded engine calls -------------------------------------------------------------------
_RECORDED = ("start", "next_steps", "next_step", "next_fetch", "take_cancellations",
             "rate_sample", "chunk_received", "chunk_arrived", "step_done", "bandwidth_estimate",
             "run_bandwidth", "compute_ratio", "remaining", "link_estimate")
_PROPS = ("has_cancellations", "compute_samples", "done")


def _encode(x: Any) -> Any:
    if isinstance(x, StepId):
        return {"s": [x.t, x.l]}
    if isinstance(x, KVChunkId):
        return {"c": [x.t, x.l, x.g]}
    if isinstance(x, (list, tuple)):
        return [_encode(v) for v in x]
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def _decode(x: Any) -> Any:
    if isinstance(x, dict) and "s" in x:
        return StepId(*x["s"])
    if isinstance(x, dict) and "c" in x:
        return KVChunkId(*x["c"])
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return x


def recording_controller(log: list) -> type:
    """A :class:`Controller` subclass that appends ``(name, args, answer)`` of every call the
    engine makes to ``log`` (the engine's own calls: not those the controller makes to itself)."""
    import threading

    depth = threading.local()

    def wrap(name: str) -> Callable:
        def method(self: Any, *args: Any) -> Any:
            outer = getattr(depth, "n", 0) == 0
            depth.n = getattr(depth, "n", 0) + 1
            try:
                out = getattr(Controller, name)(self, *args)
            finally:
                depth.n -= 1
            if outer:
                log.append((name, list(args), out))
            return out
        return method

    def prop(name: str) -> property:
        def get(self: Any) -> Any:
            out = getattr(Controller, name).fget(self)
            if getattr(depth, "n", 0) == 0:
                log.append((name, None, out))
            return out
        return property(get)

    ns = {n: wrap(n) for n in _RECORDED}
    ns.update({n: prop(n) for n in _PROPS})
    return type("RecordingController", (Controller,), ns)


def _engine_scenarios() -> Iterator[tuple[str, dict[str, Any]]]:
    for rep in range(3):
        for planner in ("stream", "sparkv", "hybrid", "local"):
            for cfg in ("default", "cachegen", "recompute", "static"):
                for link in ("fast", "paced", "dead_then", "slow_then_fast"):
                    yield (f"{rep}/{planner}/{cfg}/{link}",
                           dict(planner=planner, cfg=cfg, link=link, rep=rep))


def record_engine(out: Path, limit: int | None = None) -> int:
    """Runs the real engine (a tiny random Llama, scripted sources) on the scenarios and writes
    every controller call it made, with the instance and the plan, to ``out``."""
    import asyncio
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import sparkv.edge.engine as engine_mod
    from helpers import raw_world
    from sparkv.edge.engine import Engine, EngineConfig
    from sparkv.runtime import LoadedModel
    from sparkv.runtime.attention import get_backend
    from sparkv.runtime.stepper import LayerStepper
    from test_edge_engine import Behaviour, ScriptedSource
    from test_edge_handback import TraceSource

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=2048, rope_theta=10000.0, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)
    lm = LoadedModel.from_model(LlamaForCausalLM(cfg).to(torch.float32), None, "tiny-llama")
    world = raw_world(lm, 96, 16, seed=1)
    geo = world["geo"]
    sizes = {cid: {"raw": len(world["frames"][(cid, "raw")])} for cid in geo.chunk_ids()}

    class SlowStepper(LayerStepper):
        def run_step(self, step):  # type: ignore[no-untyped-def]
            t0 = time.perf_counter()
            res = super().run_step(step)
            time.sleep(max(0.0, 0.01 - (time.perf_counter() - t0)))
            res.seconds = max(res.seconds, 0.01)
            return res

    records = []
    for n, (key, sc) in enumerate(_engine_scenarios()):
        if limit is not None and n >= limit:
            break
        mbps = {"fast": 1000.0, "paced": 5.0, "dead_then": 0.02,
                "slow_then_fast": 1000.0}[sc["link"]]
        inst = Instance.from_mappings(geo, sizes, {s: 0.004 for s in geo.step_ids()},
                                      mbps * MBPS, t_proc=1e-4, name="tiny")
        plan = get_planner(sc["planner"]).plan(inst)
        if sc["link"] in ("fast", "slow_then_fast"):
            async def pace(sent: int) -> None:
                if sent >= 4000:
                    await asyncio.sleep(0.02)
            script = ((lambda i: Behaviour()) if sc["link"] == "fast"
                      else (lambda i: Behaviour(pace=pace) if i == 0 else Behaviour()))
            src: Any = ScriptedSource(world["frames"], script)
        else:
            tr = (Trace.constant(5.0, 2.0) if sc["link"] == "paced"
                  else Trace.from_rows([0.0, 0.4], [0.02, 50.0], [30.0, 2.0], loop=False))
            src = TraceSource(world["frames"], tr)
        log: list = []
        engine_mod.Controller = recording_controller(log)
        try:
            stepper = SlowStepper(lm, world["tokens"], 16, backend=get_backend("dense"))
            ctl_cfg = configs()[sc["cfg"]]()
            engine = Engine(stepper, plan, inst, ctl_cfg, source=src,
                            config=EngineConfig(retry_backoff_s=0.01, stall_fallback_s=30.0))
            engine.run()
        finally:
            engine_mod.Controller = Controller
        records.append({"key": key, "cfg": sc["cfg"], "mbps": mbps, "plan": plan.to_dict(),
                        "calls": [[nm, _encode(a), _encode(o)] for nm, a, o in log]})
        print(f"recorded {key}: {len(log)} calls", file=sys.stderr)
    doc = {"geometry": geo.to_dict(),
           "sizes": [[c.t, c.l, c.g, s["raw"]] for c, s in sizes.items()],
           "step_s": 0.004, "t_proc": 1e-4, "records": records}
    with gzip.open(out, "wt") as f:
        json.dump(doc, f)
    return len(records)


def load_replays(path: Path) -> tuple[dict[str, Any], list[Case]]:
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    return doc, [Case("replay", f"replay/{r['key']}", (i,)) for i, r in enumerate(doc["records"])]


def run_replay(doc: dict[str, Any], case: Case) -> Any:
    """Replays one recorded engine load; returns every answer, and the calls whose answer
    differs from the recorded one (``mismatches``: their indices)."""
    rec = doc["records"][case.params[0]]
    geo = ChunkGeometry.from_dict(doc["geometry"])
    sizes = {KVChunkId(t, l, g): {"raw": b} for t, l, g, b in doc["sizes"]}  # noqa: E741
    inst = Instance.from_mappings(geo, sizes, {s: doc["step_s"] for s in geo.step_ids()},
                                  rec["mbps"] * MBPS, t_proc=doc["t_proc"], name="tiny")
    plan = Plan.from_dict(rec["plan"])
    calls = rec["calls"]
    done = set()
    ctl = Controller(plan, inst, configs()[rec["cfg"]](), done_steps=done)
    answers, mismatches = [], []
    for i, (name, args, want) in enumerate(calls):
        if args is None:
            got = getattr(ctl, name)
        else:
            got = getattr(ctl, name)(*_decode(args))
        got = _encode(got)
        answers.append(got)
        if json.loads(json.dumps(got)) != want:
            mismatches.append(i)
    return {"answers": answers, "mismatches": mismatches}


# ---- running and comparing -------------------------------------------------------------------
def all_cases() -> list[Case]:
    return list(sim_cases()) + list(drive_cases())


def reduced(cases: list[Case]) -> list[Case]:
    return [c for i, c in enumerate(cases) if i % REDUCED_EVERY == 0]


def run_case(case: Case, replays: dict[str, Any] | None = None) -> str:
    if case.kind == "sim":
        return sha(run_sim(case))
    if case.kind == "drive":
        return sha(run_drive(case))
    assert replays is not None
    return sha(run_replay(replays, case))


def dump(cases: list[Case], replays: dict[str, Any] | None = None) -> dict[str, str]:
    return {c.key: run_case(c, replays) for c in cases}


def compare(a: dict[str, str], b: dict[str, str]) -> tuple[int, list[str]]:
    """``(cases in both, keys whose digest differs or is missing from one)``."""
    keys = sorted(set(a) | set(b))
    return len(set(a) & set(b)), [k for k in keys if a.get(k) != b.get(k)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write {case: sha256} of the cases here (JSON)")
    p.add_argument("--reduced", action="store_true",
                   help="only every REDUCED_EVERY-th simulated and driven case")
    p.add_argument("--replay", help="also replay these recorded engine calls (.json.gz)")
    p.add_argument("--record", help="record the real engine's controller calls here (.json.gz)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args(argv)
    if args.compare:
        a, b = (json.loads(Path(x).read_text()) for x in args.compare)
        both, diff = compare(a, b)
        kinds: dict[str, int] = {}
        for k in a:
            kinds[k.split("/")[0]] = kinds.get(k.split("/")[0], 0) + 1
        print(f"{both} cases in both ({kinds}); {len(diff)} differ")
        for k in diff[:20]:
            print("  ", k)
        return 1 if diff else 0
    if args.record:
        n = record_engine(Path(args.record))
        print(f"{n} engine loads recorded to {args.record}")
        return 0
    cases = reduced(all_cases()) if args.reduced else all_cases()
    replays = None
    if args.replay:
        replays, rc = load_replays(Path(args.replay))
        cases += rc
    out = {}
    for i, c in enumerate(cases):
        out[c.key] = run_case(c, replays)
        if i % 200 == 0:
            print(f"{i}/{len(cases)} {c.key}", file=sys.stderr)
    if args.replay:
        bad = [c.key for c in cases if c.kind == "replay"
               and run_replay(replays, c)["mismatches"]] if replays else []
        print(f"replays with an answer unlike the recorded one: {len(bad)} {bad[:5]}")
    Path(args.out).write_text(json.dumps(out, indent=0, sort_keys=True))
    print(f"{len(out)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
