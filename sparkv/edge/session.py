"""The device side, end to end: :class:`EdgeSession` answers questions about stored contexts.

    with EdgeSession.connect("http://127.0.0.1:8080", api_key=KEY) as session:
        result = session.ask(context_id, "What does it say about warranty?")
        print(result.answer); print(result.breakdown.table())

A session owns what outlives one question: the device's model, the cost model of its layer
steps, and the :class:`Priors` learned from earlier loads (link throughput, compute speed,
question-prefill time). Each :meth:`EdgeSession.ask` runs

    manifest (+ token ids)  ->  instance (cost model, priors)  ->  planner  ->  Engine
    (chunk source + compute + controller)  ->  assembled cache  ->  question prefill  ->  first token

and then folds the controller's own estimates of that load back into the priors: the session has
no estimator of its own.

TTFT is wall clock from the call to the first generated token and includes every stage above
(the model is resident on the device before the call, as on a phone that runs the app).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from sparkv.edge.client import EdgeClient
from sparkv.edge.engine import Engine, EngineConfig
from sparkv.edge.planning import (AUTO_FLOOR, DEFAULT_PRIOR_MBPS, PRELUDE_STRATEGIES,
                                  STRATEGIES, AskError,
                                  FloorNotEncoded, build_instance, default_backend,
                                  default_quality_floor,
                                  device_cost_model, local_instance, suffix_estimate)
from sparkv.edge.prompts import question_suffix
from sparkv.edge.prelude import Prelude
from sparkv.edge.results import LoadResult, TransferStatus
from sparkv.edge.shaper import LinkShaper
from sparkv.layout import DEFAULT_CHUNK_TOKENS, ChunkGeometry, KVChunkId
from sparkv.protocol import Manifest
from sparkv.protocol.crypto import FrameCipher
from sparkv.protocol.errors import ApiError, ServerUnavailable
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.instance import MBPS, Instance
from sparkv.scheduler.plan import Plan

#: layer steps the controller must have timed before its compute ratio moves the prior
MIN_COMPUTE_SAMPLES = 4


@dataclass
class Priors:
    """What the session learned on this device (the next plan's starting point).

    Attributes:
        bandwidth_Bps: the controller's link throughput over the last load that streamed enough
            to tell (``None``: plan with the manifest download's rate, else 50 Mbit/s).
        compute_scale: measured / predicted layer-step time (the controller's ratio, compounded
            over loads; 1.0: the cost model as it is).
        question_prefill_s: the last question's prefill + first token (seconds).
    """

    bandwidth_Bps: float | None = None
    compute_scale: float = 1.0
    question_prefill_s: float | None = None

    def learn(self, load: LoadResult) -> None:
        """Folds the controller's estimates of one load in."""
        if load.link_estimate_Bps:
            self.bandwidth_Bps = float(load.link_estimate_Bps)
        r = load.compute_ratio
        if load.compute_samples >= MIN_COMPUTE_SAMPLES and math.isfinite(r) and r > 0:
            self.compute_scale = float(min(max(self.compute_scale * r, 0.05), 20.0))


#: the predicted time of a step the prelude ran (the instance wants positive times)
PRELUDE_STEP_S = 1e-6


@dataclass
class Breakdown:
    """Where the time to first token went (seconds) and what each path did."""

    strategy: str
    ttft_s: float
    manifest_s: float = 0.0
    planning_s: float = 0.0
    loading_s: float = 0.0          # overlapped: until every KV chunk is in place
    streaming_s: float = 0.0        # the link's active time (first to last body byte)
    decoding_s: float = 0.0         # decode worker busy time (overlapped)
    local_compute_s: float = 0.0    # compute thread busy time (overlapped)
    question_prefill_s: float = 0.0
    first_token_s: float = 0.0      # sampling after the question's forward pass
    bytes_streamed: int = 0
    bytes_wasted: int = 0
    chunks_streamed: int = 0
    chunks_computed: int = 0
    steps_computed: int = 0
    migrations: int = 0
    requests: int = 0
    levels: dict[str, int] = field(default_factory=dict)
    fallback: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)   # DecodeStats of a decode policy
    prelude_steps: int = 0          # layer steps computed before the plan (sparkv.edge.prelude)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def rows(self) -> list[tuple[str, str]]:
        r = [("time to first token", f"{self.ttft_s:8.3f} s"),
             ("  manifest + tokens", f"{self.manifest_s:8.3f} s"),
             ("  planning", f"{self.planning_s:8.3f} s"),
             ("  loading the cache", f"{self.loading_s:8.3f} s   (overlapped:)"),
             ("    streaming (link active)", f"{self.streaming_s:8.3f} s"),
             ("    decoding", f"{self.decoding_s:8.3f} s"),
             ("    local compute", f"{self.local_compute_s:8.3f} s"),
             ("  question prefill", f"{self.question_prefill_s:8.3f} s"),
             ("  first token", f"{self.first_token_s:8.3f} s"),
             ("bytes streamed", f"{self.bytes_streamed / 1e6:8.2f} MB"
              + (f" (+{self.bytes_wasted / 1e6:.2f} MB wasted)" if self.bytes_wasted else "")),
             ("chunks streamed / computed", f"{self.chunks_streamed} / {self.chunks_computed}"
              f" ({self.steps_computed} layer steps"
              + (f", {self.prelude_steps} before the plan" if self.prelude_steps else "") + ")"),
             ("controller migrations", f"{self.migrations}")]
        if self.levels:
            r.append(("levels streamed", ", ".join(f"{k} x{v}" for k, v in self.levels.items())))
        if self.decode:
            d = self.decode
            r.append((f"decode ({d['policy']})",
                      f"{d['tokens_per_s']:8.2f} tok/s, flash "
                      f"{d['flash_read_bytes_per_token'] / 1e3:.1f} kB/token in "
                      f"{d['flash_read_ops_per_token']:.1f} reads, hit rate {d['hit_rate']:.2f}, "
                      f"RAM peak {d['ram_peak_bytes'] / 1e6:.1f} MB"))
        if self.fallback:
            r.append(("FELL BACK to local compute", "; ".join(f"{k}: {v}"
                                                           for k, v in self.fallback.items())))
        return r

    def table(self) -> str:
        w = max(len(a) for a, _ in self.rows())
        return "\n".join(f"{a:<{w}}  {b}" for a, b in self.rows())


@dataclass
class AskResult:
    """The answer and everything measured on the way."""

    answer: str
    tokens: list[int]
    breakdown: Breakdown
    plan: Plan | None
    instance: Instance | None
    load: LoadResult | None
    first_logits: Any = None
    context_tokens: int = 0
    kept_id: str | None = None     # the context service's id of the kept context (``keep``)

    @property
    def ttft_s(self) -> float:
        return self.breakdown.ttft_s


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
        context_service: a :class:`~sparkv.device.ContextService` of the same model: ``ask(...,
            keep=True)`` keeps the loaded cache there as a managed context, and a later question
            about it is answered from the service (no load; docs/device-service.md).
    """

    def __init__(self, client: EdgeClient, model: Any = None, *, priors: Priors | None = None,
                 engine_config: EngineConfig | None = None, device: str = "cpu",
                 dtype: str = "auto", context_service: Any = None) -> None:
        self.client = client
        self.context_service = context_service
        self._model_arg = model
        self.device, self.dtype = device, dtype
        self._lm: Any = None
        self._cost: Any = None
        self.priors = priors or Priors()
        self.engine_config = engine_config

    @classmethod
    def connect(cls, server_url: str, api_key: str | None = None, model: Any = None, *,
                shaper: LinkShaper | None = None, timeout_s: float = 10.0,
                cache_dir: str | os.PathLike[str] | None = None,
                engine_config: EngineConfig | None = None, device: str = "cpu",
                dtype: str = "auto", context_service: Any = None) -> "EdgeSession":
        """A session with its own :class:`EdgeClient` of ``server_url``."""
        from sparkv.runtime.device import resolve_device, resolve_dtype

        resolve_dtype(dtype, resolve_device(device))     # a clear error before any request
        client = EdgeClient(server_url, api_key, shaper=shaper, timeout_s=timeout_s,
                            cache_dir=cache_dir)
        return cls(client, model, engine_config=engine_config, device=device, dtype=dtype,
                   context_service=context_service)

    # ---- what the session owns ---------------------------------------------------------------
    @property
    def lm(self) -> Any:
        """The device's model (loaded on first use)."""
        if self._lm is None:
            from sparkv.runtime.model import LoadedModel, load_model
            self._lm = (self._model_arg if isinstance(self._model_arg, LoadedModel)
                        else load_model(self._model_arg, dtype=self.dtype, device=self.device))
        return self._lm

    @property
    def cost_model(self) -> Any:
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
    def ask(self, context_id: str, question: str, *, strategy: str = "sparkv",
            level: str = "auto", quality_floor: str | None = AUTO_FLOOR, backend: Any = "auto",
            max_new_tokens: int = 32, bandwidth_mbps: float | None = None, use_cache: bool = True,
            chat: bool = True, engine_config: EngineConfig | None = None,
            controller: ControllerConfig | None = None, stop_at_eos: bool = True,
            token_ids: Sequence[int] | None = None, keep: bool = False, decode: str = "full",
            ram_budget: float | None = None, prelude: bool | None = None) -> AskResult:
        """Answers ``question`` about context ``context_id`` with ``strategy``.

        Args:
            level: ``auto`` (the planner picks per chunk among the encoded levels at or above
                ``quality_floor``) or one level name (every streamed chunk at that level).
            quality_floor: the lowest level a streamed chunk may use; ``auto`` (the default):
                the floor of this model's measured quality table (``sparkv bench quality
                --save-table``, docs/quality.md), ``q5`` without one; when no encoded level meets
                the measured floor, the context is computed locally (``breakdown.fallback``);
                ``None``: any level.
            backend: attention backend of the local steps, a name (``auto``: block-sparse on
                the CPU, unless the model's quality table measured it failing the default
                policy's thresholds while dense passes: then dense) or an
                :class:`~sparkv.runtime.attention.AttentionBackend`.
            bandwidth_mbps: the link estimate to plan with; default: the priors' (the
                controller's throughput of the last load), else the manifest download's rate,
                else 50 Mbit/s. The controller corrects it from measured rates either way.
            use_cache: reuse a manifest the client already holds (no request).
            token_ids: the context's tokens when the device holds the document (no request).
            keep: keep the loaded cache as a context of ``context_service`` (after the answer);
                if it already holds this context, answer from it: no manifest, no stream, only
                the question's prefill (plus restoring chunks it swapped out, from flash or by
                recomputation).
            decode, ram_budget: the decode-time KV policy (:data:`sparkv.decode.POLICIES`;
                ``full``: everything in RAM) and its RAM budget (bytes, or a fraction <= 1 of the
                final KV); its stats go to ``breakdown.decode`` (docs/dynakv.md).
            prelude: compute the first layer steps while the manifest and the plan are on
                their way (:mod:`sparkv.edge.prelude`; needs the context's tokens on the
                device). ``None``: on for the strategies in :data:`PRELUDE_STRATEGIES`
                (``sparkv``).
        """
        from sparkv.runtime.attention import get_backend

        if strategy not in STRATEGIES:
            raise AskError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
        if decode != "full" or ram_budget is not None:
            from sparkv.decode import POLICIES

            if decode not in POLICIES:
                raise AskError(f"unknown decode policy {decode!r}; choose one of {list(POLICIES)}")
        lm, client = self.lm, self.client
        suffix = question_suffix(lm, question, chat)
        if isinstance(backend, str) and backend == "auto":
            backend = default_backend(lm.fingerprint)
        attn = get_backend(backend) if isinstance(backend, str) else backend
        t_start = time.perf_counter()
        fallback: dict[str, Any] = {}
        if keep:
            kept = self._ask_kept(context_id, suffix, max_new_tokens, stop_at_eos, t_start)
            if kept is not None:
                return kept

        spare = len(suffix) + max_new_tokens + 8
        pre = None
        if prelude if prelude is not None else strategy in PRELUDE_STRATEGIES:
            pre = self._start_prelude(context_id, token_ids, attn, spare)
        try:
            return self._ask_loaded(
                context_id, strategy, lm, client, suffix, attn, t_start, fallback, pre, spare,
                level=level, quality_floor=quality_floor, max_new_tokens=max_new_tokens,
                bandwidth_mbps=bandwidth_mbps, use_cache=use_cache, engine_config=engine_config,
                controller=controller, stop_at_eos=stop_at_eos, token_ids=token_ids, keep=keep,
                decode=decode, ram_budget=ram_budget)
        finally:
            if pre is not None:
                pre.join()   # a no-op after a load; stops it when the ask failed early

    def _start_prelude(self, context_id: str, token_ids: Sequence[int] | None, attn: Any,
                       spare: int) -> Prelude | None:
        """A running prelude over the context's tokens when the device holds them (the
        geometry of a cached manifest, else the default chunking); ``None`` otherwise."""
        from sparkv.runtime.stepper import LayerStepper

        tokens = list(token_ids) if token_ids is not None else self.client.known_tokens(context_id)
        if not tokens:
            return None
        known = self.client.known_manifest(context_id)
        geo = (known.chunk_geometry if known is not None
               and known.chunk_geometry.num_tokens == len(tokens)
               else ChunkGeometry.from_config(self.lm.config, len(tokens),
                                              min(DEFAULT_CHUNK_TOKENS, len(tokens))))
        if self.lm.max_positions and len(tokens) > self.lm.max_positions:
            return None   # too long for the model: the load says so with its own error
        lm = self.lm

        def make() -> LayerStepper:
            return LayerStepper(lm, tokens, geo.chunk_tokens, backend=attn,
                                heads_per_group=geo.heads_per_group, spare_tokens=spare)

        return Prelude(make, geo, tokens).start()

    def _ask_loaded(self, context_id: str, strategy: str, lm: Any, client: EdgeClient,
                    suffix: list[int], attn: Any, t_start: float, fallback: dict[str, Any],
                    pre: Prelude | None, spare: int, *, level: str, quality_floor: str | None,
                    max_new_tokens: int, bandwidth_mbps: float | None, use_cache: bool,
                    engine_config: EngineConfig | None, controller: ControllerConfig | None,
                    stop_at_eos: bool, token_ids: Sequence[int] | None, keep: bool, decode: str,
                    ram_budget: float | None) -> AskResult:
        """:meth:`ask` from the manifest on (the prelude, if any, is running)."""
        from sparkv.runtime.generate import greedy_generate
        from sparkv.runtime.stepper import LayerStepper
        from sparkv.scheduler.planners import get_planner

        # ---- manifest and tokens -------------------------------------------------------------
        manifest, tokens = self._context(context_id, strategy, use_cache, token_ids, fallback)
        if manifest is not None:
            manifest.check_model(lm.fingerprint, lm.name)
            manifest.check_tokens(tokens)
        # a compressed context (docs/presses.md, "On the server"): its kept positions shape the
        # assembled cache whichever path makes each chunk (a local ask uses a cached manifest)
        pressed = manifest if manifest is not None else client.known_manifest(context_id)
        if pressed is not None and not pressed.compressed:
            pressed = None
        if pressed is not None and manifest is None:
            pressed.check_model(lm.fingerprint, lm.name)
            pressed.check_tokens(tokens)
        manifest_s = time.perf_counter() - t_start

        # ---- plan ----------------------------------------------------------------------------
        t_plan = time.perf_counter()
        if manifest is not None:
            geometry = manifest.chunk_geometry
        else:
            geometry = ChunkGeometry.from_config(lm.config, len(tokens),
                                                 min(DEFAULT_CHUNK_TOKENS, len(tokens)))
        sparse = attn.name != "dense"
        t_comp = (self.cost_model.t_comp(geometry, sparse=sparse, utilisation=0.0)
                  * self.priors.compute_scale)
        # the prelude's steps (finished, or finishing while this plans) cost nothing more; the
        # plan does not wait for its stepper to be built (the load does, below)
        usable = pre is not None and pre.geometry == geometry and pre.tokens == list(tokens)
        pre_done: frozenset = frozenset()
        if usable:
            assert pre is not None
            pre_done = pre.request_stop()
            t_comp = t_comp.copy()
            for s in pre_done:
                t_comp[s.t, s.l] = PRELUDE_STEP_S
        elif pre is not None:
            pre.request_stop(promise_first=False)
        t_suffix = (self.priors.question_prefill_s if self.priors.question_prefill_s is not None
                    else suffix_estimate(t_comp, geometry, len(suffix)))
        effective = strategy if (manifest is not None and not fallback) else "local"
        inst = None
        if manifest is not None:
            levels = None if level == "auto" else [level]
            floor = (default_quality_floor(lm.fingerprint)
                     if quality_floor == AUTO_FLOOR and not levels else quality_floor)
            if levels and level not in manifest.levels:
                raise AskError(f"level {level!r} was not encoded for context {context_id} "
                               f"(it has {list(manifest.levels)})")
            try:
                inst = build_instance(manifest, t_comp, self._bandwidth_prior(bandwidth_mbps),
                                      levels=levels, quality_floor=floor,
                                      rtt_s=client.last_first_byte_s, t_suffix_s=t_suffix)
            except FloorNotEncoded as e:
                if quality_floor != AUTO_FLOOR:
                    raise
                # the measured floor forbids every encoded level: compute rather than degrade
                fallback["quality"] = f"{e} (measured floor {floor}): computed locally"
                effective = "local"
        if inst is None:
            inst = local_instance(geometry, t_comp, t_suffix)
        planner_name, ctl_factory = STRATEGIES[effective]
        plan = get_planner(planner_name).plan(inst)
        ctl_cfg = controller if (controller is not None and effective == strategy) \
            else ctl_factory()
        planning_s = time.perf_counter() - t_plan

        # ---- load ----------------------------------------------------------------------------
        reuse = usable and pre is not None and pre.wait_stepper() is not None
        if not reuse:
            pre_done = frozenset()   # its stepper could not be built: nothing it promised ran
        if reuse:
            assert pre is not None and pre.stepper is not None
            stepper = pre.stepper   # the engine waits for the prelude's last step
        else:
            if pre is not None:
                pre.join()          # discarded: its last step must not compete with the load
            stepper = LayerStepper(lm, tokens, geometry.chunk_tokens, backend=attn,
                                   heads_per_group=geometry.heads_per_group, spare_tokens=spare)
        # a link whenever the plan streams or its controller may move work onto the link later
        linked = bool(plan.stream_order) or (effective != "local" and ctl_cfg.may_stream)
        source = client.chunk_source(context_id) if linked else None
        engine = Engine(stepper, plan, inst, ctl_cfg, source=source,
                        config=engine_config or self.engine_config,
                        open_frame=self._frame_opener(manifest),
                        kept=pressed.kept_positions if pressed is not None else None,
                        prelude=pre if reuse else None, prelude_done=pre_done)
        load = engine.run()
        pre_res = pre.join() if pre is not None else None
        if pre_res is not None and not pre_res.ok:
            fallback["prelude"] = (f"{type(pre_res.error).__name__}: {pre_res.error}"
                                   + ("" if reuse else " (discarded)"))
        self.priors.learn(load)
        prune_s = (apply_kept(stepper.kv, pressed, len(suffix) + max_new_tokens + 8)
                   if pressed is not None else 0.0)

        # ---- answer --------------------------------------------------------------------------
        decode_stats: dict[str, Any] = {}
        if decode == "full" and ram_budget is None:
            gen = greedy_generate(lm, stepper.kv, len(tokens), suffix, max_new_tokens,
                                  stop_at_eos=stop_at_eos)
        else:
            from sparkv.decode import generate as policy_generate

            gen, dstats = policy_generate(lm, stepper.kv, len(tokens), suffix, max_new_tokens,
                                          kv_policy=decode, ram_budget=ram_budget,
                                          stop_at_eos=stop_at_eos)
            decode_stats = dstats.to_dict()
        ttft = (time.perf_counter() - t_start) - (gen.total_s - gen.first_token_s)
        self.priors.question_prefill_s = gen.first_token_s
        fallback.update(load.fallback)
        kept_id = (self.context_service.import_context(tokens, stepper.kv,
                                                       label=self._kept_label(context_id))
                   if keep else None)
        breakdown = _breakdown(strategy, ttft, manifest_s, planning_s, load, gen, fallback)
        breakdown.loading_s += prune_s
        if reuse and pre_res is not None:
            breakdown.prelude_steps = len(pre_res.steps)
            breakdown.local_compute_s += pre_res.busy_s
            breakdown.steps_computed += len(pre_res.steps)
        breakdown.decode = decode_stats
        return AskResult(gen.text, gen.tokens, breakdown,
                         plan, inst, load, gen.first_logits, len(tokens), kept_id)

    # ---- kept contexts (the on-device context service) ---------------------------------------
    def _kept_label(self, context_id: str) -> str:
        return f"{self.client.base_url}#{context_id}"

    def _ask_kept(self, context_id: str, suffix: Sequence[int], max_new_tokens: int,
                  stop_at_eos: bool, t_start: float) -> AskResult | None:
        """The answer from the context service if it holds the context (else ``None``)."""
        svc = self.context_service
        if svc is None:
            raise AskError("keep=True needs a context service (EdgeSession(context_service=...))")
        if svc.lm.fingerprint != self.lm.fingerprint:
            raise AskError("the context service runs another model than this session")
        sid = svc.find(self._kept_label(context_id))
        if sid is None:
            return None
        # chunks the service evicted entirely may come back from the server (made lazily: a
        # resident context fetches nothing)
        make_remote = getattr(svc, "server_stream", None)
        remote = make_remote(self.client, context_id) if make_remote is not None else None
        res = svc.call(sid, prompt_ids=list(suffix), max_new_tokens=max_new_tokens, grow=False,
                       stop_at_eos=stop_at_eos, remote=remote)
        ttft = (time.perf_counter() - t_start) - (res.total_s - res.first_token_s)
        bd = Breakdown("kept", ttft, loading_s=res.switch_s,
                       question_prefill_s=res.first_token_s - res.switch_s,
                       chunks_computed=int(res.load.get("recomputed_chunks", 0)),
                       chunks_streamed=int(res.load.get("streamed_chunks", 0)),
                       bytes_streamed=int(getattr(getattr(remote, "stats", None), "bytes", 0))
                       if remote is not None and getattr(remote, "error", None) is None
                       and res.load.get("streamed_chunks") else 0)
        n = svc.describe(sid)["tokens"]
        return AskResult(res.text, res.tokens, bd, None, None, None, None, n, sid)

    # ---- pieces of ask -----------------------------------------------------------------------
    def _context(self, context_id: str, strategy: str, use_cache: bool,
                 token_ids: Sequence[int] | None, fallback: dict[str, Any]
                 ) -> tuple[Manifest | None, list[int]]:
        """The manifest (``None`` when the server is out of reach) and the token ids."""
        client = self.client
        if token_ids is not None:
            client.remember_tokens(context_id, token_ids)
        tokens = client.known_tokens(context_id)
        manifest: Manifest | None = None
        if strategy != "local" or tokens is None:
            try:
                manifest = client.manifest(context_id, use_cache=use_cache)
                if tokens is None:
                    tokens = client.tokens(context_id)
            except (ServerUnavailable, ApiError) as e:
                if isinstance(e, ApiError) and not e.retryable:
                    raise
                manifest = client.known_manifest(context_id)
                tokens = client.known_tokens(context_id)
                if tokens is None:
                    raise AskError(f"{e}; and context {context_id} is not on this device (no "
                                   "cached token ids), so it cannot be computed locally") from e
                fallback["server"] = f"unreachable at the start ({type(e).__name__})"
        if tokens is None:  # pragma: no cover - every branch above sets them or raises
            raise AskError(f"no token ids for context {context_id}")
        return manifest, tokens

    def _bandwidth_prior(self, mbps: float | None) -> float:
        if mbps is not None:
            return float(mbps) * MBPS
        if self.priors.bandwidth_Bps:
            return float(self.priors.bandwidth_Bps)
        d = self.client.last_download
        if d is not None and d.seconds > d.first_byte_s:
            return d.wire_bytes / (d.seconds - d.first_byte_s)
        return DEFAULT_PRIOR_MBPS * MBPS

    def _frame_opener(self, manifest: Manifest | None) -> Any:
        if manifest is None or not manifest.encrypted:
            return None
        key = self.client.encryption_keys.get(manifest.context_id)
        if key is None:
            raise AskError(f"context {manifest.context_id} is encrypted: pass its key "
                           "(EdgeClient.encryption_keys[context_id] or --key)")
        cipher = FrameCipher.from_text(key, manifest.context_id)

        def open_frame(data: bytes, cid: KVChunkId, level: str) -> bytes:
            return cipher.open(data, cid.t, cid.l, cid.g, level)

        return open_frame


def apply_kept(kv: Any, manifest: Manifest, spare_tokens: int = 0) -> float:
    """Prunes every layer of an assembled cache to a compressed context's kept positions
    (:meth:`Manifest.keep_lists`), so streamed (already pruned) and locally computed (whole)
    chunks end in one shape; returns the seconds it took."""
    import torch

    t0 = time.perf_counter()
    for l, row in enumerate(manifest.keep_lists()):  # noqa: E741
        kv.prune_layer(l, [torch.from_numpy(x) for x in row], spare_tokens=spare_tokens)
    return time.perf_counter() - t0


def _breakdown(strategy: str, ttft: float, manifest_s: float, planning_s: float,
               load: LoadResult, gen: Any, fallback: dict[str, Any]) -> Breakdown:
    levels_used: dict[str, int] = {}
    for x in load.transfers:
        if x.status == TransferStatus.ARRIVED:
            levels_used[x.level] = levels_used.get(x.level, 0) + 1
    return Breakdown(
        strategy=strategy, ttft_s=ttft, manifest_s=manifest_s, planning_s=planning_s,
        loading_s=load.ready_s, streaming_s=load.link_active_s, decoding_s=load.decode_busy_s,
        local_compute_s=load.compute_busy_s, question_prefill_s=gen.prefill_s,
        first_token_s=max(0.0, gen.first_token_s - gen.prefill_s),
        bytes_streamed=load.bytes_streamed, bytes_wasted=load.bytes_wasted,
        chunks_streamed=load.sources.get("streamed", 0),
        chunks_computed=load.sources.get("computed", 0), steps_computed=len(load.steps),
        migrations=len(load.migrations), requests=load.requests, levels=levels_used,
        fallback=fallback)
