"""The device side, end to end: :class:`EdgeSession` answers questions about stored contexts.

    with EdgeSession.connect("http://127.0.0.1:8080", api_key=KEY) as session:
        result = session.ask(context_id, "What does it say about warranty?")
        print(result.text); print(result.breakdown.table())

A session owns what outlives one question: the device's model, the cost model of its layer
steps, and the :class:`Priors` learned from earlier loads (link throughput, compute speed,
question-prefill time). Each :meth:`EdgeSession.ask`, under its
:class:`~sparkv.edge.options.AskOptions`, runs these steps (one method each)

    _fetch:  manifest (+ token ids), checked (fetch.py: ContextFetch)
    _plan:   instance (cost model, priors)  ->  planner
    _load:   Engine (chunk source + compute + controller)  ->  assembled cache
    _answer: question prefill  ->  first token  ->  AskResult (answer.py)

and then folds the controller's own estimates of that load back into the priors: the session has
no estimator of its own. An ask about a context kept in the on-device context service is
answered there (kept.py: KeptAsks).

TTFT is wall clock from the call to the first generated token and includes every stage above
(the model is resident on the device before the call, as on a phone that runs the app).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from sparkv.edge.answer import AskResult, Breakdown
from sparkv.edge.bounds import ClientLimits
from sparkv.edge.client import EdgeClient
from sparkv.edge.engine import Engine, EngineConfig, EngineError
from sparkv.edge.fetch import ContextFetch, FetchedContext
from sparkv.edge.frames import decodes_in_turn
from sparkv.edge.kept import AppendedTurn, AskKeeping, KeptAsks, appended_turn
from sparkv.edge.lane import Lane, on_lane
from sparkv.edge.options import AskOptions
from sparkv.edge.planning import (AUTO_FLOOR, DEFAULT_PRIOR_MBPS, STRATEGIES, AskError,
                                  FloorNotEncoded, build_instance, default_backend,
                                  default_quality_floor, device_cost_model, local_instance,
                                  replanner, suffix_estimate)
from sparkv.edge.prelude import Prelude, PreludeResult
from sparkv.edge.prompts import question_suffix
from sparkv.edge.results import (MIN_COMPUTE_SAMPLES, PRELUDE_STEP_S, LoadResult,
                                 TransferStatus)
from sparkv.edge.shaper import LinkShaper
from sparkv.edge.wire import Preconnect
from sparkv.layout import DEFAULT_CHUNK_TOKENS, ChunkGeometry, StepId
from sparkv.protocol import Manifest
from sparkv.protocol.errors import ApiError
from sparkv.runtime.device import fused_spans
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.estimators import SLOW_START_S, start_prior
from sparkv.scheduler.instance import MBPS, Instance
from sparkv.scheduler.plan import Plan

if TYPE_CHECKING:
    from sparkv.device.contract import KeptContexts
    from sparkv.predictor.cost import StepCostModel
    from sparkv.runtime.model import LoadedModel
    from sparkv.runtime.turns import Conversation, TokenPrompt

__all__ = ["AskOptions", "AskResult", "Breakdown", "EdgeSession", "Priors", "apply_kept"]

log = logging.getLogger("sparkv.edge")

#: the most one load may move the compute prior (either way): a load that ran beside a burst
#: of other work moves the next plan by at most this factor, and a lasting change of the
#: device's speed is followed within a few loads (the running load's controller follows it at
#: once)
MAX_COMPUTE_STEP = 2.0
#: quiet steps at which a load's ratio moves the prior half way (in log terms): a load's ratio
#: counts ``n / (n + COMPUTE_SAMPLES_HALF)`` of itself, so a load of a few quiet steps (a deep
#: fade's 4, at 1.2-1.7x: session 65) nudges the prior where a local load's 58 move it most of
#: the way
COMPUTE_SAMPLES_HALF = 16
#: the most stream tax the session believes (seconds per chunk): a load whose steps lost time
#: to something else than its link (another process) must not price streaming out for good
MAX_STREAM_TAX_S = 0.05
#: the decode scale's bounds: measured frame decoding over the codec's nominal rates
MIN_DECODE_SCALE, MAX_DECODE_SCALE = 0.2, 20.0
#: the most receive tax the session believes (a step twice as slow while the link receives)
MAX_RECEIVE_TAX = 1.0
#: the steps a load's receive tax is made of at which it moves the session's half way: one load's
#: reading swings 0.15-0.6 at one link rate on a 2-core CPU whose speed drifts (session 67)
RECEIVE_SAMPLES_HALF = 64


@dataclass
class Priors:
    """What the session learned on this device (the next plan's starting point).

    Attributes:
        bandwidth_Bps: the controller's link throughput over the last load that streamed enough
            to tell (``None``: plan with the manifest download's rate, else 50 Mbit/s).
        compute_scale: measured / predicted layer-step time (each load's median ratio over
            its steps that ran while the link was quiet, weighted by how many there were
            (:data:`COMPUTE_SAMPLES_HALF`), compounded over loads, at most
            :data:`MAX_COMPUTE_STEP` either way per load; 1.0: the cost model as it is).
        question_prefill_s: the last question's prefill + first token (seconds).
        stream_tax_s: compute-path seconds a chunk decoded beside a layer step costs it
            (:attr:`Instance.stream_tax_s <sparkv.scheduler.instance.Instance.stream_tax_s>`):
            each load's estimate, weighted by its chunks like the compute ratio, at most
            :data:`MAX_STREAM_TAX_S`; 0 until a load streamed beside its steps.
        receive_tax: how much slower the steps run while the link receives beside them,
            decodes aside (:attr:`Instance.receive_tax
            <sparkv.scheduler.instance.Instance.receive_tax>`): each load's estimate, weighted by
            its steps (``n / (n + RECEIVE_SAMPLES_HALF)``), at most :data:`MAX_RECEIVE_TAX`; 0
            until a load received beside its steps.
        decode_scale: measured / predicted frame decoding time (each load's
            :attr:`LoadResult.decode_ratio <sparkv.edge.results.LoadResult.decode_ratio>`,
            weighted by its frames like the compute ratio, within
            [:data:`MIN_DECODE_SCALE`, :data:`MAX_DECODE_SCALE`]); the plan's ``t_proc`` is the
            codec's nominal rate times it (1.0 until a load decoded enough frames).
    """

    bandwidth_Bps: float | None = None
    compute_scale: float = 1.0
    question_prefill_s: float | None = None
    stream_tax_s: float = 0.0
    receive_tax: float = 0.0
    decode_scale: float = 1.0

    def learn(self, load: LoadResult) -> None:
        """Folds the controller's estimates of one load in."""
        if load.link_estimate_Bps:
            self.bandwidth_Bps = float(load.link_estimate_Bps)
        r = load.compute_ratio
        n = load.compute_samples
        if n >= MIN_COMPUTE_SAMPLES and math.isfinite(r) and r > 0:
            r = r ** (n / (n + COMPUTE_SAMPLES_HALF))
            r = min(max(r, 1.0 / MAX_COMPUTE_STEP), MAX_COMPUTE_STEP)
            self.compute_scale = float(min(max(self.compute_scale * r, 0.05), 20.0))
        self.stream_tax_s = _toward(self.stream_tax_s, load.stream_tax_s,
                                    load.stream_tax_samples, MAX_STREAM_TAX_S)
        self.receive_tax = _toward(self.receive_tax, load.receive_tax,
                                   load.receive_tax_samples, MAX_RECEIVE_TAX,
                                   half=RECEIVE_SAMPLES_HALF)
        self.decode_scale = max(MIN_DECODE_SCALE, _toward(
            self.decode_scale, load.decode_ratio, load.decode_samples, MAX_DECODE_SCALE))


def _toward(prior: float, measured: float, n: int, most: float,
            half: int = COMPUTE_SAMPLES_HALF) -> float:
    """``prior`` moved toward a load's ``measured`` value by ``n / (n + half)`` (``n``: the
    samples it is made of; none below :data:`MIN_COMPUTE_SAMPLES`), in ``[0, most]``."""
    if n < MIN_COMPUTE_SAMPLES or not math.isfinite(measured):
        return prior
    value = prior + n / (n + half) * (measured - prior)
    return float(min(max(value, 0.0), most))


@dataclass
class _Ask:
    """One ask in flight: its inputs and what its steps share. Made by :meth:`EdgeSession.ask`
    for one call and used on the asking thread only (no lock); ``fallback`` collects why a
    path was not taken, ``prelude`` is the running prelude (if any)."""

    context_id: str
    options: AskOptions
    suffix: list[int]              # the question's tokens
    attention: Any                 # the AttentionBackend of the local steps
    t_start: float                 # perf_counter() at the call (TTFT counts from here)
    token_ids: Sequence[int] | None = None
    lane: Lane | None = None       # its share of a device serving several asks (edge/lane.py)
    prelude: Prelude | None = None
    ahead: Preconnect | None = None   # the load's connections, opened at the ask's start
    fallback: dict[str, Any] = field(default_factory=dict)
    #: set once the plan's thread is done with the load (its handover decided): the result
    #: waits for it, so that it reports the plan the load ended with
    planned_in_full: threading.Event = field(default_factory=threading.Event)

    @property
    def spare(self) -> int:
        """Cache slots past the context (tokens): the question, the answer and 8 more."""
        return len(self.suffix) + self.options.max_new_tokens + 8


@dataclass(frozen=True)
class _Planned:
    """What the planning step decided."""

    geometry: ChunkGeometry
    instance: Instance
    plan: Plan
    controller: ControllerConfig
    strategy: str                  # the strategy that planned: the asked one, or ``local``
    prelude_usable: bool           # the prelude ran on this geometry and these tokens
    prelude_done: frozenset[StepId]    # the steps it finished or promised (priced ~0)
    seconds: float                 # ``Breakdown.planning_s``
    local_s: float                 # the local-prefill estimate (every step + the question)
    first: bool = False            # ``plan`` is the planner's first plan: the full one follows


@dataclass(frozen=True)
class _Loaded:
    """The assembled cache and how it was made."""

    stepper: Any                   # the LayerStepper whose ``kv`` holds the context
    load: LoadResult
    prelude: PreludeResult | None  # the prelude's steps the load used (None: none were)
    prune_s: float                 # pruning to a compressed context's kept positions (s)
    plan: Plan                     # the plan the load ended with (a handover's, if one came)


class _EarlyLink:
    """The plan thread's early start of the load's link (:meth:`EdgeSession._begin`) and the
    asking thread's choice not to take that plan (:meth:`EdgeSession._held`), ordered by one
    lock: a plan is either dropped before its link starts, or taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped = False
        self.engine: Engine | None = None

    def begin(self, start: Callable[[], Engine | None]) -> None:
        """On the plan's thread: runs ``start`` unless the plan was dropped."""
        with self._lock:
            if not self._dropped:
                self.engine = start()

    def drop(self) -> bool:
        """On the asking thread: drops the plan, unless its link has started (``False``: the
        plan must be taken)."""
        with self._lock:
            if self.engine is not None:
                return False
            self._dropped = True
            return True

    def abandon(self) -> None:
        """The ask failed before its load: no link starts, a started one is stopped."""
        with self._lock:
            self._dropped = True
            engine, self.engine = self.engine, None
        if engine is not None:
            engine.abort()


def _first_plan(planner: Any, inst: Instance) -> Plan | None:
    """The planner's first plan (made in a millisecond; its full plan follows), or ``None``
    when it makes none."""
    first = getattr(planner, "first", None)
    return first(inst) if first is not None else None


def _full_plan(planned: _Planned) -> Plan:
    """The full plan of ``planned``'s strategy for its instance."""
    from sparkv.scheduler.planners import get_planner

    return get_planner(STRATEGIES[planned.strategy][0]).plan(planned.instance)


def _judged_full(planned: _Planned) -> Plan | None:
    """The strategy's full plan when it should replace ``planned``'s first (it gives the paths
    other work and the planner's rule takes it: :func:`_hands_over`), else ``None``; the first
    plan's ``info["handover"]`` records the decision."""
    full = _full_plan(planned)
    if _same_work(full, planned.plan):
        return None
    take, simulated = _hands_over(planned, full)
    planned.plan.info["handover"] = {"full": full.info.get("portfolio", {}).get("chosen"),
                                     "taken": take, "simulated_s": simulated}
    return full if take else None


def _refused_why(engine: Engine) -> str:
    """Why a load refused a full plan handed over to it (:meth:`Engine.adopt`)."""
    replanned = engine.ctl.replanned
    return "re-planned" if replanned is not None and replanned["taken"] else "load done"


def _in_full(planned: _Planned) -> _Planned:
    """``planned`` decided before any load starts: its first plan, or the full plan that
    replaces it (:func:`_judged_full`)."""
    t0 = time.perf_counter()
    full = _judged_full(planned)
    return replace(planned, plan=full if full is not None else planned.plan, first=False,
                   seconds=planned.seconds + time.perf_counter() - t0)


def _core_spare(device: Any) -> bool:
    """Whether the full plan may be made beside the running load: not on a CPU whose every
    usable core runs the compute's OpenMP threads (:func:`~sparkv.edge.frames.decode_in_turn`:
    a thread beside them slows every step of the team; there the greedy and the two
    simulations, ~35 ms of a core at 2K, would take the load's cycles for a handover the rule
    declined in every ask measured: docs/edge.md, "The plan's handover")."""
    import torch

    from sparkv.edge.frames import decode_in_turn

    return not decode_in_turn(device, torch.get_num_threads())


def _full_plan_follows(device: Any) -> bool:
    """Whether the planner's full plan follows its first plan: where a core is spare for it
    (:func:`_core_spare`) and the device is not host-bound (a GPU, :func:`~sparkv.runtime.
    device.host_bound`). There the full plan's Python, made beside the prelude or the load,
    starves their kernel launches of the GIL: on the H200 (run 3, 16K-32K tokens) a first plan
    that streamed nothing had the full plan made before the load, 0.07-0.30 s, the prelude
    computing 8 layer steps in 0.35 s at 32K; and in none of the 9 asks did the greedy win: the
    plan each load ended with was the local or split candidate, which the first plan already
    is. The load keeps the first plan there, and the controller still moves work between the
    paths at run time."""
    from sparkv.runtime.device import host_bound

    return _core_spare(device) and not host_bound(device)


def _hands_over(planned: _Planned, full: Plan) -> tuple[bool, dict[str, float]]:
    """Whether the load started by ``planned.plan`` takes ``full`` (the planner's rule,
    :meth:`Portfolio.hands_over <sparkv.scheduler.planners.portfolio.Portfolio.hands_over>`;
    always, for a planner without one), with what the rule measured."""
    from sparkv.scheduler.planners import get_planner

    rule = getattr(get_planner(STRATEGIES[planned.strategy][0]), "hands_over", None)
    if rule is None:
        return True, {}
    return rule(planned.plan, full, planned.instance, planned.controller)


def _same_work(a: Plan, b: Plan) -> bool:
    """Whether two plans give the paths the same work in the same order at the same levels."""
    return (a.compute_order == b.compute_order and a.stream_order == b.stream_order
            and a.levels == b.levels)


def _claim_prelude(pre: Prelude | None, tokens: list[int],
                   geometry: ChunkGeometry) -> tuple[bool, frozenset[StepId]]:
    """Asks a running prelude to stop; returns whether its work fits this load (same geometry
    and tokens) and, if so, the steps it finished or is finishing (the plan does not wait for
    its stepper to be built: the load does)."""
    usable = pre is not None and pre.geometry == geometry and pre.tokens == list(tokens)
    if usable:
        assert pre is not None
        return True, pre.request_stop()
    if pre is not None:
        pre.request_stop(promise_first=False)
    return False, frozenset()


def _time_left(ask: _Ask, limit_s: float) -> float | None:
    """Seconds left of the ask's time limit ``limit_s`` (at least 0; ``None``: no limit)."""
    if math.isinf(limit_s):
        return None
    return max(0.0, limit_s - (time.perf_counter() - ask.t_start))


def _computed_all(prelude: Prelude, done: PreludeResult) -> bool:
    """Whether the prelude finished every layer step of its context."""
    g = prelude.geometry
    return done.ok and len(set(done.steps)) == g.num_token_chunks * g.num_layers


def _within_slow_start(ahead: Future[Any], t_start: float) -> bool:
    """Whether the manifest and the plan (``ahead``) are done, waiting for them until the ask
    has run :data:`~sparkv.scheduler.estimators.SLOW_START_S`: a server that answers at once
    (an error included) is heard; only a slow start is not waited for."""
    try:
        ahead.exception(timeout=max(0.0, SLOW_START_S - (time.perf_counter() - t_start)))
    except FutureTimeout:
        return False
    return True


def _held_geometry(lm: LoadedModel, prelude: Prelude | None, tokens: list[int]) -> ChunkGeometry:
    """The chunking of a context planned without a manifest: the prelude's, when it ran on these
    tokens (its work is kept), else the default chunk size."""
    if prelude is not None and prelude.tokens == list(tokens):
        return prelude.geometry
    return _default_geometry(lm, len(tokens))


def _default_geometry(lm: LoadedModel, num_tokens: int) -> ChunkGeometry:
    """The chunking of a context without a manifest: the default chunk size."""
    return ChunkGeometry.from_config(lm.config, num_tokens,
                                     min(DEFAULT_CHUNK_TOKENS, num_tokens))


class EdgeSession:
    """The device: a model, its cost model and priors, and a REST client of one server.

    Args:
        client: the server's REST client (its shaper emulates the link for every byte).
        model: a :class:`~sparkv.runtime.model.LoadedModel`, a checkpoint path or name, or
            ``None`` for the bundled SmolLM2 (loaded on first use).
        priors: start from these (default: nothing learned yet).
        engine_config: the engine's knobs for every load (default :class:`EngineConfig`).
        device, dtype: where the model runs when the session loads it (``cpu``, ``cuda[:N]``,
            ``auto``; see :mod:`sparkv.runtime.device`); a model given loaded keeps its own.
        context_service: a :class:`~sparkv.device.contract.KeptContexts` of the same model (a
            :class:`~sparkv.device.ContextService`): ``ask(..., keep=True)`` keeps the loaded
            cache there as a managed context, and a later question about it is answered from the
            service (no load; docs/device-service.md).

    One ask at a time: ``ask`` updates :attr:`priors` without a lock (its engine's threads end
    within the call).
    """

    def __init__(self, client: EdgeClient, model: LoadedModel | str | None = None, *,
                 priors: Priors | None = None, engine_config: EngineConfig | None = None,
                 device: str = "cpu", dtype: str = "auto",
                 context_service: KeptContexts | None = None) -> None:
        self.client = client
        self.context_service = context_service
        self._model_arg = model
        self.device, self.dtype = device, dtype
        self._lm: LoadedModel | None = None
        self._cost: StepCostModel | None = None
        self.priors = priors or Priors()
        self.engine_config = engine_config

    @classmethod
    def connect(cls, server_url: str, api_key: str | None = None,
                model: LoadedModel | str | None = None, *,
                shaper: LinkShaper | None = None, timeout_s: float = 10.0,
                cache_dir: str | os.PathLike[str] | None = None,
                limits: ClientLimits | None = None,
                engine_config: EngineConfig | None = None, device: str = "cpu",
                dtype: str = "auto", context_service: KeptContexts | None = None
                ) -> "EdgeSession":
        """A session with its own :class:`EdgeClient` of ``server_url`` (``limits``: its
        bounds, default :class:`ClientLimits`)."""
        from sparkv.runtime.compute import resolve_dtype
        from sparkv.runtime.device import resolve_device

        resolve_dtype(dtype, resolve_device(device))     # a clear error before any request
        client = EdgeClient(server_url, api_key, shaper=shaper, timeout_s=timeout_s,
                            cache_dir=cache_dir, limits=limits)
        return cls(client, model, engine_config=engine_config, device=device, dtype=dtype,
                   context_service=context_service)

    # ---- what the session owns ---------------------------------------------------------------
    @property
    def lm(self) -> LoadedModel:
        """The device's model (loaded on first use)."""
        if self._lm is None:
            from sparkv.predictor.dtypes import load_model_in_dtype
            from sparkv.runtime.model import LoadedModel
            self._lm = (self._model_arg if isinstance(self._model_arg, LoadedModel)
                        else load_model_in_dtype(self._model_arg, dtype=self.dtype,
                                                 device=self.device))
        return self._lm

    @property
    def vocab_size(self) -> int:
        """How many token ids the model has embeddings for (``0 .. vocab_size - 1``)."""
        return int(self.lm.decoder.embed_tokens.num_embeddings)

    @property
    def cost_model(self) -> StepCostModel:
        """The step-cost model of this device (profiled, else a roofline; made on first use)."""
        if self._cost is None:
            self._cost = device_cost_model(self.lm)
        return self._cost

    def reset_priors(self) -> None:
        """Forget what earlier loads taught (e.g. before a run that must probe afresh)."""
        self.priors = Priors()

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "EdgeSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- ask ---------------------------------------------------------------------------------
    def ask(self, context_id: str, question: str | Conversation | TokenPrompt,
            options: AskOptions | None = None, *,
            token_ids: Sequence[int] | None = None, lane: Lane | None = None,
            **overrides: Any) -> AskResult:
        """Answers ``question`` about context ``context_id`` as ``options`` say.

        Args:
            question: the question, or an app's conversation after the context whose last turn
                is the question (:class:`~sparkv.runtime.turns.Conversation`: instructions,
                earlier questions and answers).
            options: the policy (default: ``AskOptions()``, the fields' defaults).
            token_ids: the context's tokens when the device holds the document (no request).
            lane: the ask's share of a device serving several asks at once
                (:mod:`sparkv.edge.lane`): its layer steps run in turn with theirs.
            overrides: :class:`AskOptions` fields replacing those of ``options`` (``ask(cid, q,
                strategy="local")``); a name that is no field raises :class:`TypeError`.

        Raises:
            AskError: an unknown strategy, decode policy or level; the server out of reach
                (or an answer over its size limit or past its deadline) while the context is
                not on this device; ``keep`` without a context service.
            ManifestError: a manifest of another model, or whose geometry is absurd for it.
            PromptTooLong: the context, the question and ``max_new_tokens`` past the model's
                positions (before any work).
        """
        opts = AskOptions.resolve(options, overrides).seeded()
        suffix = question_suffix(self.lm, question, opts.chat)
        attn = self._attention(opts.backend)
        if not opts.keep:
            # the device's step costs, made once per model and thread count (a first ask
            # measures them: 11 s once on a loaded 2-core machine): set-up, like loading the
            # model, not the ask's time, whose limit it used to spend before the load began
            _ = self.cost_model
        ask = _Ask(context_id, opts, suffix, attn, time.perf_counter(), token_ids, lane)
        if opts.keep:
            kept = self._kept().answer(self.lm.fingerprint, ask.context_id, ask.suffix,
                                         ask.options, ask.t_start)
            if kept is not None:
                return kept
        if opts.runs_prelude:
            ask.prelude = self._prelude(ask)     # may refuse the ask (PromptTooLong): first
        if opts.strategy != "local":
            ask.ahead = self.client.preconnect()   # beside the manifest and the plan
        try:
            return self._ask_loaded(ask)
        finally:
            if ask.prelude is not None:
                ask.prelude.join()   # a no-op after a load; stops it when the ask failed early
            if ask.ahead is not None:
                ask.ahead.close()    # unless a load's pool took it

    def _attention(self, backend: Any) -> Any:
        """The :class:`AttentionBackend` of ``AskOptions.backend`` (``auto`` resolved for the
        model); :class:`AskError` for one this machine cannot run (``spas_sage`` without its
        package or CUDA)."""
        from sparkv.runtime.attention import BackendUnavailableError, get_backend

        if isinstance(backend, str) and backend == "auto":
            backend = default_backend(self.lm.base_fingerprint, compute=self.lm.compute)
        if not isinstance(backend, str):
            return backend
        try:
            return get_backend(backend)
        except BackendUnavailableError as exc:
            raise AskError(str(exc)) from None

    def _prelude(self, ask: _Ask) -> Prelude | None:
        """A prelude over the context's tokens when the device holds them (the geometry of a
        cached manifest, else the default chunking); ``None`` otherwise."""
        from sparkv.runtime.stepper import LayerStepper

        tokens = (list(ask.token_ids) if ask.token_ids is not None
                  else self.client.known_tokens(ask.context_id))
        if not tokens:
            return None
        known = self.client.known_manifest(ask.context_id)
        geo = (known.chunk_geometry if known is not None
               and known.chunk_geometry.num_tokens == len(tokens)
               else _default_geometry(self.lm, len(tokens)))
        self._contexts().check_room(ask, len(tokens))
        lm, attn, spare, lane = self.lm, ask.attention, ask.spare, ask.lane

        def make() -> LayerStepper:
            return on_lane(LayerStepper(lm, tokens, geo.chunk_tokens, backend=attn,
                                        heads_per_group=geo.heads_per_group, spare_tokens=spare,
                                        lazy=True), lane)

        return Prelude(make, geo, tokens)

    def _ask_loaded(self, ask: _Ask) -> AskResult:
        """:meth:`ask` from the manifest on (beside the prelude, if any)."""
        begun = None
        if ask.prelude is not None:
            fetched, planned, begun = self._plan_beside_prelude(ask, ask.prelude)
        else:
            fetched = self._fetch(ask)
            planned = self._plan(ask, fetched, first=True)
            if planned.first:
                planned = _in_full(planned)
        loaded = self._load(ask, fetched, planned, begun)
        return self._answer(ask, fetched, planned, loaded)

    def _plan_beside_prelude(self, ask: _Ask, prelude: Prelude
                             ) -> tuple[FetchedContext, _Planned, Engine | None]:
        """The manifest and the plan, made by a thread of their own (``sparkv-plan``) while the
        prelude's steps run on the asking thread: the plan stops the prelude after its span in
        progress and starts the load's link at once (:meth:`_begin`: the engine returned), a
        failed fetch or plan stops it too (and is raised here). The asking
        thread computes, not another: the prelude's steps ran 2.2x their time alone on a thread
        of their own (session 70, docs/edge.md). The cost model is made first, here (on a
        session's first ask it measures the model's steps: alone, not beside the prelude's)."""
        import torch

        from sparkv.runtime.threads import use_threads

        _ = self.cost_model   # made (a first ask: measured) before the prelude starts
        threads = torch.get_num_threads()     # the cost model's key: the plan's thread reads it
        ahead: Future[tuple[FetchedContext, _Planned]] = Future()
        mine = replace(ask, fallback={})      # the plan thread's own record, merged when taken
        early = _EarlyLink()

        def fetch_and_plan() -> None:
            try:
                use_threads(threads)
                fetched = self._fetch(mine)
                planned = self._plan(mine, fetched, first=True)
                early.begin(lambda: self._begin(mine, fetched, planned))
                if planned.first and early.engine is None:
                    planned = _in_full(planned)     # no load runs yet: the full plan now
            except BaseException as e:  # noqa: BLE001 - raised again on the asking thread
                ahead.set_exception(e)
                ask.planned_in_full.set()
                return
            finally:
                prelude.request_stop(promise_first=False)
            ahead.set_result((fetched, planned))
            try:
                if planned.first and early.engine is not None:
                    self._hand_over(planned, early.engine)
            finally:
                ask.planned_in_full.set()

        threading.Thread(target=fetch_and_plan, name="sparkv-plan", daemon=True).start()
        try:
            done = prelude.run()
        except BaseException:
            early.abandon()
            raise
        if (_computed_all(prelude, done) and not _within_slow_start(ahead, ask.t_start)
                and early.drop()):
            return (*self._held(ask, prelude), None)
        fetched, planned = ahead.result()
        ask.fallback.update(mine.fallback)
        return fetched, planned, early.engine

    def _held(self, ask: _Ask, prelude: Prelude) -> tuple[FetchedContext, _Planned]:
        """The prelude computed every step, and the manifest step has taken longer than a slow
        start (a link in a fade, or a slow server): nothing is left that streaming could save,
        so the ask goes on with the context as the device holds it, planned locally, instead of
        waiting. The manifest's thread finishes alone; its answer is dropped (a configuration
        error it meets, a refused key or a redirect, is reported by the next ask: within the
        slow start it is waited for and raised here)."""
        ask.fallback["manifest"] = ("the manifest came after the device had computed the whole "
                                    "context: answered from its own computation")
        fetched = self._contexts().held(ask, prelude.tokens)
        return fetched, self._plan(ask, fetched)

    # ---- the steps of a load, in order -------------------------------------------------------
    def _fetch(self, ask: _Ask) -> FetchedContext:
        """The manifest and the token ids, checked against the device's model."""
        return self._contexts().fetch(ask)

    def _contexts(self) -> ContextFetch:
        return ContextFetch(self.client, self.lm)

    def _plan(self, ask: _Ask, fetched: FetchedContext, first: bool = False) -> _Planned:
        """The instance (this device's step costs, the link prior), the strategy's plan and
        its controller's configuration. ``first``: the planner's first plan when it makes one
        (:meth:`Portfolio.first <sparkv.scheduler.planners.portfolio.Portfolio.first>`, in a
        millisecond), its full plan to follow (:meth:`_hand_over`) where a core is spare for it
        (:func:`_core_spare`; else the first plan is the plan)."""
        from sparkv.scheduler.planners import get_planner

        t_plan = time.perf_counter()
        manifest, tokens = fetched.manifest, fetched.tokens
        geometry = (manifest.chunk_geometry if manifest is not None
                    else _held_geometry(self.lm, ask.prelude, tokens))
        t_comp = (self.cost_model.t_comp(geometry, sparse=ask.attention.name != "dense",
                                         utilisation=0.0) * self.priors.compute_scale)
        usable, pre_done = _claim_prelude(ask.prelude, tokens, geometry)
        if pre_done:
            t_comp = t_comp.copy()
            for s in pre_done:
                t_comp[s.t, s.l] = PRELUDE_STEP_S
        t_suffix = (self.priors.question_prefill_s if self.priors.question_prefill_s is not None
                    else suffix_estimate(t_comp, geometry, len(ask.suffix)))
        inst, effective = self._instance(ask, fetched, geometry, t_comp, t_suffix)
        if self._decodes_in_turn(ask):
            inst = inst.replace(decode_in_turn=True)
        planner_name, ctl_factory = STRATEGIES[effective]
        planner = get_planner(planner_name)
        quick = _first_plan(planner, inst) if first else None
        plan = quick if quick is not None else planner.plan(inst)
        controller = ask.options.controller
        ctl_cfg = (controller if controller is not None and effective == ask.options.strategy
                   else ctl_factory().with_spans(fused_spans(self.lm.device)))
        return _Planned(geometry, inst, plan, ctl_cfg, effective, usable, pre_done,
                        time.perf_counter() - t_plan, float(t_comp.sum()) + t_suffix,
                        first=quick is not None and _full_plan_follows(self.lm.device))

    def _decodes_in_turn(self, ask: _Ask) -> bool:
        """Whether the load's compute thread will decode its frames itself (the engine's rule,
        :func:`sparkv.edge.frames.decodes_in_turn`): its plan and controller count the
        decoding on the compute path."""
        import torch

        return decodes_in_turn(ask.options.engine_config or self.engine_config,
                               self.lm.device, torch.get_num_threads())

    def _hand_over(self, planned: _Planned, engine: Engine) -> None:
        """On the plan's thread, the load running by the planner's first plan: the full plan,
        handed to the load when it differs and the planner's rule takes it (:func:`_hands_over`;
        docs/edge.md, "The plan's handover"); the first plan's ``info["handover"]`` says what
        was decided (``taken`` false with ``ignored`` when the load refused it: it was done, or
        it had re-planned at the link's measured rate). A planner that fails leaves the load to
        its first plan."""
        try:
            full = _judged_full(planned)
        except Exception as e:  # noqa: BLE001 - the load goes on by the plan it has
            log.warning("the full plan failed (%s: %s); the load keeps its first plan",
                        type(e).__name__, e)
            return
        if full is not None and not engine.adopt(full):
            planned.plan.info["handover"].update(taken=False, ignored=_refused_why(engine))

    def _instance(self, ask: _Ask, fetched: FetchedContext, geometry: ChunkGeometry,
                  t_comp: Any, t_suffix: float) -> tuple[Instance, str]:
        """The scheduler's instance and the strategy that plans it (``local`` when the server
        is out of reach or no encoded level meets the measured floor)."""
        opts, manifest = ask.options, fetched.manifest
        effective = opts.strategy if (manifest is not None and not ask.fallback) else "local"
        if manifest is None:
            return local_instance(geometry, t_comp, t_suffix), effective
        levels = None if opts.level == "auto" else [opts.level]
        floor = (default_quality_floor(self.lm.base_fingerprint)
                 if opts.quality_floor == AUTO_FLOOR and not levels else opts.quality_floor)
        if levels and opts.level not in manifest.levels:
            raise AskError(f"level {opts.level!r} was not encoded for context {ask.context_id} "
                           f"(it has {list(manifest.levels)})")
        try:
            return build_instance(manifest, t_comp,
                                  self._bandwidth_prior(opts.bandwidth_mbps, fetched),
                                  levels=levels, quality_floor=floor,
                                  rtt_s=self.client.last_first_byte_s, t_suffix_s=t_suffix,
                                  stream_tax_s=self.priors.stream_tax_s,
                                  decode_scale=self.priors.decode_scale,
                                  receive_tax=(self.priors.receive_tax if opts.plan_receive_tax
                                               else 0.0)), effective
        except FloorNotEncoded as e:
            if opts.quality_floor != AUTO_FLOOR:
                raise
            # the measured floor forbids every encoded level: compute rather than degrade
            ask.fallback["quality"] = f"{e} (measured floor {floor}): computed locally"
            return local_instance(geometry, t_comp, t_suffix), "local"

    def _load(self, ask: _Ask, fetched: FetchedContext, planned: _Planned,
              begun: Engine | None = None) -> _Loaded:
        """Runs the engine (the prelude's stepper when its work is usable; ``begun``: one whose
        link the plan's thread started already, :meth:`_begin`), folds the load into the priors
        and prunes a compressed context's cache to its kept positions."""
        pre = ask.prelude
        # a prelude whose stepper could not be built ran nothing it promised: not reused
        reuse = planned.prelude_usable and pre is not None and pre.wait_stepper() is not None
        engine = begun or self._engine(ask, fetched, planned,
                                       self._stepper(ask, fetched.tokens, planned.geometry, reuse),
                                       reuse)
        try:
            load = engine.run()
        except EngineError as e:
            if isinstance(e.__cause__, ApiError):   # the server refused this client's key
                raise e.__cause__ from None
            raise
        if "deadline" in load.fallback:
            limit = ask.options.time_limit_s(planned.local_s)
            load.fallback["deadline"] = (f"the ask's {limit:.3g} s time limit passed: the link "
                                         "was stopped and every missing chunk computed locally")
        pre_res = pre.join() if pre is not None else None
        if pre_res is not None and not pre_res.ok:
            ask.fallback["prelude"] = (f"{type(pre_res.error).__name__}: {pre_res.error}"
                                       + ("" if reuse else " (discarded)"))
        self.priors.learn(load)
        pressed = fetched.pressed
        prune_s = apply_kept(engine.stepper.kv, pressed, ask.spare) if pressed is not None else 0.0
        return _Loaded(engine.stepper, load, pre_res if reuse else None, prune_s, engine.plan)

    def _engine(self, ask: _Ask, fetched: FetchedContext, planned: _Planned, stepper: Any,
                reuse: bool) -> Engine:
        """The load's engine over ``stepper`` (``reuse``: the prelude's, its steps done)."""
        pre, plan, ctl_cfg, pressed = ask.prelude, planned.plan, planned.controller, fetched.pressed
        # a link whenever the plan streams or its controller may move work onto the link later
        linked = bool(plan.stream_order) or (planned.strategy != "local" and ctl_cfg.may_stream)
        source = self.client.chunk_source(ask.context_id, ahead=ask.ahead) if linked else None
        limit = ask.options.time_limit_s(planned.local_s)
        return Engine(stepper, plan, planned.instance, ctl_cfg, source=source,
                      config=ask.options.engine_config or self.engine_config,
                      open_frame=self._contexts().frame_opener(fetched.manifest),
                      kept=pressed.kept_positions if pressed is not None else None,
                      prelude=pre if reuse else None,
                      prelude_done=planned.prelude_done if reuse else frozenset(),
                      deadline_s=_time_left(ask, limit), lane=ask.lane,
                      # the re-plan at the measured rate; on a lane (a device service's ask)
                      # only while no other ask's bytes are ahead of it on the link
                      # (``LinkEstimator.ahead_bytes``: the controller's guard)
                      planner=replanner(planned.strategy))

    def _begin(self, ask: _Ask, fetched: FetchedContext, planned: _Planned) -> Engine | None:
        """On the plan's thread, once the plan is made: the load's engine with its link started,
        while the asking thread finishes the prelude's span in progress (on a link-bound load
        the link would otherwise idle for that span: ~80 ms on a 2-core CPU without AMX, where
        a layer over 2K tokens is one span); ``None`` when the prelude's work is not reused
        (a fresh stepper waits for the prelude) or the plan streams nothing, and on any error
        (the asking thread then builds the engine itself and meets it)."""
        pre = ask.prelude
        if (pre is None or not planned.prelude_usable or not planned.plan.stream_order
                or pre.wait_stepper() is None):
            return None
        try:
            engine = self._engine(ask, fetched, planned, pre.stepper, True)
            engine.start()
        except Exception:  # noqa: BLE001 - the asking thread builds it again and reports it
            return None
        return engine

    def _stepper(self, ask: _Ask, tokens: list[int], geometry: ChunkGeometry,
                 reuse: bool) -> Any:
        """The prelude's stepper (``reuse``: the engine waits for its last step), else a fresh
        one once the discarded prelude's last step is done (it must not compete with the
        load)."""
        from sparkv.runtime.stepper import LayerStepper

        pre = ask.prelude
        if reuse:
            assert pre is not None and pre.stepper is not None
            return pre.stepper
        if pre is not None:
            pre.join()
        return on_lane(LayerStepper(self.lm, tokens, geometry.chunk_tokens, backend=ask.attention,
                                    heads_per_group=geometry.heads_per_group,
                                    spare_tokens=ask.spare, lazy=True), ask.lane)

    def _answer(self, ask: _Ask, fetched: FetchedContext, planned: _Planned,
                loaded: _Loaded) -> AskResult:
        """The question's prefill and the answer over the assembled cache; the result. A cache
        that other asks wait for is kept at the answer's first token (:class:`AskKeeping`),
        else after the answer, with its turn."""
        opts, tokens, kv = ask.options, fetched.tokens, loaded.stepper.kv
        keeping = AskKeeping(self._kept(), ask.context_id) if opts.keep else None
        keep_early = ((lambda: keeping.early(tokens, kv, ask.suffix)) if keeping is not None
                      else None)
        decode_stats: dict[str, Any] = {}
        turn: AppendedTurn | None = None
        if not opts.uses_decode_policy:
            from sparkv.runtime.generate import greedy_generate

            gen = greedy_generate(self.lm, kv, len(tokens), ask.suffix, opts.max_new_tokens,
                                  stop_at_eos=opts.stop_at_eos, stop=opts.stop,
                                  truncate=not opts.keep, sampling=opts.sampling,
                                  after_first=keep_early)
            if opts.keep:                # the turn's KV goes to the service with the context
                turn = appended_turn(kv, ask.suffix, gen.tokens)
        else:
            from sparkv.decode import generate as policy_generate

            if keep_early is not None:  # a decode policy may drop the context's entries
                keep_early()
            gen, dstats = policy_generate(self.lm, kv, len(tokens), ask.suffix,
                                          opts.max_new_tokens, kv_policy=opts.decode,
                                          ram_budget=opts.ram_budget,
                                          stop_at_eos=opts.stop_at_eos, stop=opts.stop,
                                          sampling=opts.sampling)
            decode_stats = dstats.to_dict()
        ttft = (time.perf_counter() - ask.t_start) - (gen.total_s - gen.first_token_s)
        if ask.prelude is not None and not ask.fallback.get("manifest"):
            ask.planned_in_full.wait()   # the plan's thread decided its handover
        self.priors.question_prefill_s = gen.first_token_s
        ask.fallback.update(loaded.load.fallback)
        kept_id = keeping.end(tokens, kv, turn) if keeping is not None else None
        breakdown = _breakdown(ask, fetched, planned, loaded, gen, ttft)
        breakdown.decode = decode_stats
        breakdown.kept_early_s = keeping.early_s if keeping is not None else None
        breakdown.seed = gen.seed
        return AskResult(gen.text, gen.tokens, breakdown, loaded.plan, planned.instance,
                         loaded.load, gen.first_logits, len(tokens), kept_id, planned.controller,
                         planned.plan, len(ask.suffix))

    # ---- kept contexts (the on-device context service) ---------------------------------------
    def _kept(self) -> KeptAsks:
        return KeptAsks(self.client, self.context_service)

    # ---- pieces of ask -----------------------------------------------------------------------
    def _bandwidth_prior(self, mbps: float | None, fetched: FetchedContext) -> float:
        """The plan's link rate: the ask's own (``mbps``); else what the link did last (the
        last load's estimate, or the last large download's rate, or the default), capped by a
        manifest step that was slow now (:func:`~sparkv.scheduler.estimators.start_prior`)."""
        if mbps is not None:
            return float(mbps) * MBPS
        return start_prior(self._last_rate(), fetched.wire_bytes, fetched.wire_seconds)

    def _last_rate(self) -> float:
        if self.priors.bandwidth_Bps:
            return float(self.priors.bandwidth_Bps)
        d = self.client.last_download
        rate = d.rate_Bps() if d is not None else None
        return rate if rate else DEFAULT_PRIOR_MBPS * MBPS


def apply_kept(kv: Any, manifest: Manifest, spare_tokens: int = 0) -> float:
    """Prunes every layer of an assembled cache to a compressed context's kept positions
    (:meth:`Manifest.keep_lists`), so streamed (already pruned) and locally computed (whole)
    chunks end in one shape; returns the seconds it took."""
    import torch

    t0 = time.perf_counter()
    for l, row in enumerate(manifest.keep_lists()):  # noqa: E741
        kv.prune_layer(l, [torch.from_numpy(x) for x in row], spare_tokens=spare_tokens)
    return time.perf_counter() - t0


def _breakdown(ask: _Ask, fetched: FetchedContext, planned: _Planned, loaded: _Loaded, gen: Any,
               ttft_s: float) -> Breakdown:
    """The load's :class:`Breakdown` (the prelude's steps the load used counted in; ``decode``
    left to the caller)."""
    load, pre = loaded.load, loaded.prelude
    levels_used: dict[str, int] = {}
    for x in load.transfers:
        if x.status == TransferStatus.ARRIVED:
            levels_used[x.level] = levels_used.get(x.level, 0) + 1
    bd = Breakdown(
        strategy=ask.options.strategy, ttft_s=ttft_s, manifest_s=fetched.seconds,
        planning_s=planned.seconds, loading_s=load.ready_s, streaming_s=load.link_active_s,
        decoding_s=load.decode_busy_s, local_compute_s=load.compute_busy_s,
        question_prefill_s=gen.prefill_s, first_token_s=max(0.0, gen.first_token_s - gen.prefill_s),
        bytes_streamed=load.bytes_streamed, bytes_wasted=load.bytes_wasted,
        chunks_streamed=load.sources.get("streamed", 0),
        chunks_computed=load.sources.get("computed", 0), steps_computed=len(load.steps),
        migrations=len(load.migrations), requests=load.requests, levels=levels_used,
        fallback=ask.fallback, replan=load.replan)
    bd.loading_s += loaded.prune_s
    if pre is not None:
        bd.prelude_steps = len(pre.steps)
        bd.local_compute_s += pre.busy_s
        bd.steps_computed += len(pre.steps)
    return bd
