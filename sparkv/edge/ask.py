"""One question about one stored context, end to end: :func:`ask` -> :class:`AskResult`.

    manifest (+ token ids)  ->  cost model (predictor, link estimate)  ->  planner  ->  Engine
    (stream + compute + controller)  ->  assembled cache  ->  question prefill  ->  first token

TTFT is wall clock from the call to the first generated token and includes every stage above
(the model is resident on the device before the call, as on a phone that runs the app).

Strategies (the same codec, chunks, sparse kernel and engine for all; only the plan and the
controller differ, ../shared/notes/sparkv-design.md):

=========  ===============================  ======================================================
name       planner                          controller
=========  ===============================  ======================================================
sparkv     ``Portfolio``: the greedy    adaptive (migrations both ways, prefetch, cancellation)
           (dependency- and potential-
           aware), checked against the
           structured plans by estimate
local      ``LocalOnly``                    static; no network at all when the tokens are known
stream     ``StreamOnly`` (CacheGen)        per-chunk level from the measured rate and the SLO
hybrid     ``StrongHybrid`` (Cake)          adaptive (the meeting point moves)
=========  ===============================  ======================================================
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from sparkv.edge.client import EdgeClient, ServerError, ServerUnavailable
from sparkv.edge.engine import Engine, EngineConfig, LoadResult
from sparkv.edge.manifest import Manifest, ManifestError
from sparkv.errors import SparkvError
from sparkv.layout import DEFAULT_CHUNK_TOKENS, ChunkGeometry, KVChunkId
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.instance import DEFAULT_LEVELS, MBPS, Instance
from sparkv.scheduler.plan import Plan

#: strategy -> (planner registry name, controller configuration factory)
STRATEGIES: dict[str, tuple[str, Any]] = {
    "sparkv": ("sparkv", ControllerConfig),
    "local": ("local", ControllerConfig.static),
    "stream": ("stream", ControllerConfig.cachegen),
    "hybrid": ("hybrid", ControllerConfig),
}

#: decode throughput (million values/s, one core, this machine: bench/results/codec.json)
DECODE_MVPS: dict[str, float] = {"raw": 1100.0, "q8": 200.0, "q6": 250.0, "q5": 300.0,
                                 "q4": 300.0, "q3": 350.0, "q2": 480.0}
DEFAULT_FLOOR = "q5"
DEFAULT_PRIOR_MBPS = 50.0


class AskError(SparkvError):
    """The question cannot be answered (e.g. the server is unreachable and the context is not on
    this device)."""


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
              f" ({self.steps_computed} layer steps)"),
             ("controller migrations", f"{self.migrations}")]
        if self.levels:
            r.append(("levels streamed", ", ".join(f"{k} x{v}" for k, v in self.levels.items())))
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

    @property
    def ttft_s(self) -> float:
        return self.breakdown.ttft_s


# ------------------------------------------------------------------------------------------------
# cost model
# ------------------------------------------------------------------------------------------------
_COST_MODELS: dict[tuple[str, int], Any] = {}


def device_cost_model(lm: Any) -> Any:
    """The step-cost model for this device: the profiled :class:`LatencyModel` when
    ``sparkv profile`` has been run here, else a :class:`Roofline` from measured peaks."""
    import torch

    key = (lm.fingerprint, torch.get_num_threads())
    if key in _COST_MODELS:
        return _COST_MODELS[key]
    import warnings

    from sparkv.predictor.commands import default_model_path
    from sparkv.predictor.model import load_predictor
    from sparkv.predictor.roofline import ModelArch, Roofline

    path = default_model_path(lm.fingerprint)
    model = None
    if path.is_file():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = load_predictor(path, lm=lm)
        except SparkvError:
            model = None
    if model is None:
        model = Roofline.measure(ModelArch.from_model(lm), quick=True)
    _COST_MODELS[key] = model
    return model


def decode_seconds(geometry: ChunkGeometry, cid: KVChunkId, level: str) -> float:
    values = geometry.chunk_values(cid)
    return 2e-4 + values / (DECODE_MVPS.get(level, 250.0) * 1e6)


def build_instance(manifest: Manifest, t_comp: np.ndarray, bandwidth_Bps: float, *,
                   levels: Sequence[str] | None = None, quality_floor: str | None = DEFAULT_FLOOR,
                   rtt_s: float = 0.0, t_suffix_s: float = 0.0) -> Instance:
    """The scheduler's instance for a manifest: exact frame sizes, predicted compute times."""
    g = manifest.geometry
    allowed = set(levels) if levels else set(manifest.levels)
    sizes = {cid: {lv: b for lv, b in s.items() if lv in allowed}
             for cid, s in manifest.sizes.items()}
    if not any(sizes.values()):
        raise AskError(f"none of the levels {sorted(allowed)} was encoded for this context "
                       f"(it has {list(manifest.levels)})")
    known = {lv.name for lv in DEFAULT_LEVELS}
    present = {lv for s in sizes.values() for lv in s}
    if present - known:
        raise AskError(f"unknown levels {sorted(present - known)}")
    floor = quality_floor if quality_floor in present else None
    if levels:  # an explicit level list is its own floor
        floor = None
    t_proc = {cid: {lv: decode_seconds(g, cid, lv) for lv in s} for cid, s in sizes.items()}
    step_t = {s: float(t_comp[s.t, s.l]) for s in g.step_ids()}
    return Instance.from_mappings(g, sizes, step_t, bandwidth_Bps, t_proc=t_proc, rtt_s=rtt_s,
                                  t_suffix_s=t_suffix_s, quality_floor=floor,
                                  name=f"{manifest.context_id[:8]}-{g.num_tokens}tok")


# ------------------------------------------------------------------------------------------------
# ask
# ------------------------------------------------------------------------------------------------
def question_suffix(lm: Any, question: str, chat: bool = True) -> list[int]:
    """The question's tokens after a context made by :func:`chat_context`."""
    from sparkv.runtime.generate import prompt_parts

    if not chat:
        return lm.encode_text(question)
    return prompt_parts(lm, [], question)[1]


def chat_context(lm: Any, document_ids: Sequence[int]) -> list[int]:
    """The reusable context for a document (ChatML system turn + the document)."""
    from sparkv.runtime.generate import prompt_parts

    return prompt_parts(lm, document_ids, "")[0]


def ask(client: EdgeClient, context_id: str, question: str, *, strategy: str = "sparkv",
        level: str = "auto", quality_floor: str | None = DEFAULT_FLOOR,
        backend: Any = "auto", max_new_tokens: int = 32, bandwidth_mbps: float | None = None,
        use_cache: bool = True, chat: bool = True, engine_config: EngineConfig | None = None,
        controller: ControllerConfig | None = None, stop_at_eos: bool = True,
        token_ids: Sequence[int] | None = None) -> AskResult:
    """Answers ``question`` about context ``context_id`` with ``strategy``.

    Args:
        level: ``auto`` (the planner picks per chunk among the encoded levels at or above
            ``quality_floor``) or one level name (every streamed chunk at that level).
        backend: attention backend of the local steps, a name (``auto``: block-sparse on the
            CPU) or an :class:`~sparkv.runtime.attention.AttentionBackend`.
        bandwidth_mbps: the link estimate to plan with; default: the client's last measured
            throughput, else the manifest download's rate, else 50 Mbit/s. The controller
            corrects it from measured rates either way.
        use_cache: reuse a manifest the client already holds (no request).
        token_ids: the context's tokens when the device holds the document (no request).
    """
    from sparkv.runtime.attention import get_backend
    from sparkv.runtime.generate import greedy_generate
    from sparkv.runtime.stepper import LayerStepper
    from sparkv.scheduler.planners import get_planner

    if strategy not in STRATEGIES:
        raise AskError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    lm = client.lm
    suffix = question_suffix(lm, question, chat)
    attn = get_backend(backend) if isinstance(backend, str) else backend
    t_start = time.perf_counter()
    fallback: dict[str, Any] = {}

    # ---- manifest and tokens -----------------------------------------------------------------
    manifest: Manifest | None = None
    if token_ids is not None:
        client.remember_tokens(context_id, token_ids)
    tokens: list[int] | None = client.known_tokens(context_id)
    if strategy != "local" or tokens is None:
        try:
            manifest = client.manifest(context_id, use_cache=use_cache)
            if tokens is None:
                tokens = client.tokens(context_id)
        except (ServerUnavailable, ServerError) as e:
            if isinstance(e, ServerError) and e.status < 500:
                raise
            manifest = client.known_manifest(context_id)
            tokens = client.known_tokens(context_id)
            if tokens is None:
                raise AskError(f"{e}; and context {context_id} is not on this device "
                               f"(no cached token ids), so it cannot be computed locally") from e
            fallback["server"] = f"unreachable at the start ({type(e).__name__})"
    assert tokens is not None
    if manifest is not None:
        manifest.check_model(lm.fingerprint, lm.name)
        manifest.check_tokens(tokens)
    manifest_s = time.perf_counter() - t_start

    # ---- plan --------------------------------------------------------------------------------
    t_plan = time.perf_counter()
    if manifest is not None:
        geometry = manifest.geometry
    else:
        geometry = ChunkGeometry.from_config(lm.config, len(tokens),
                                             min(DEFAULT_CHUNK_TOKENS, len(tokens)))
    cost = device_cost_model(lm)
    sparse = attn.name != "dense"
    t_comp = cost.t_comp(geometry, sparse=sparse, utilisation=0.0) * client.compute_scale
    t_suffix = (client.question_prefill_s if client.question_prefill_s is not None
                else _suffix_estimate(t_comp, geometry, len(suffix)))
    effective = strategy if (manifest is not None and not fallback) else "local"
    if manifest is None:
        inst = _local_instance(geometry, t_comp, t_suffix)
    else:
        bw = _bandwidth_prior(client, bandwidth_mbps)
        levels = None if level == "auto" else [level]
        if levels and level not in manifest.levels:
            raise AskError(f"level {level!r} was not encoded for context {context_id} "
                           f"(it has {list(manifest.levels)})")
        inst = build_instance(manifest, t_comp, bw, levels=levels, quality_floor=quality_floor,
                              rtt_s=client.rtt_estimate_s, t_suffix_s=t_suffix)
    planner_name, ctl_factory = STRATEGIES[effective]
    plan = get_planner(planner_name).plan(inst)
    ctl_cfg = controller if (controller is not None and effective == strategy) else ctl_factory()
    planning_s = time.perf_counter() - t_plan

    # ---- load --------------------------------------------------------------------------------
    stepper = LayerStepper(lm, tokens, geometry.chunk_tokens, backend=attn,
                           heads_per_group=geometry.heads_per_group)
    open_frame = _frame_opener(client, manifest) if manifest is not None else None
    engine = Engine(stepper, plan, inst, ctl_cfg, server_url=client.base_url,
                    headers=client.auth_headers(), context_id=context_id, shaper=client.shaper,
                    config=engine_config, open_frame=open_frame)
    load = engine.run()
    _learn(client, load, inst)

    # ---- answer ------------------------------------------------------------------------------
    gen = greedy_generate(lm, stepper.kv.layer_kv(), len(tokens), suffix, max_new_tokens,
                          stop_at_eos=stop_at_eos)
    ttft = (time.perf_counter() - t_start) - (gen.total_s - gen.first_token_s)
    client.question_prefill_s = gen.first_token_s
    fallback.update(load.fallback)
    levels_used: dict[str, int] = {}
    for x in load.transfers:
        if x.status == "arrived":
            levels_used[x.level] = levels_used.get(x.level, 0) + 1
    bd = Breakdown(
        strategy=strategy, ttft_s=ttft, manifest_s=manifest_s, planning_s=planning_s,
        loading_s=load.ready_s, streaming_s=load.link_active_s, decoding_s=load.decode_busy_s,
        local_compute_s=load.compute_busy_s, question_prefill_s=gen.prefill_s,
        first_token_s=max(0.0, gen.first_token_s - gen.prefill_s),
        bytes_streamed=load.bytes_streamed, bytes_wasted=load.bytes_wasted,
        chunks_streamed=load.sources.get("streamed", 0),
        chunks_computed=load.sources.get("computed", 0), steps_computed=len(load.steps),
        migrations=len(load.migrations), requests=load.requests, levels=levels_used,
        fallback=fallback)
    return AskResult(gen.text, gen.tokens, bd, plan, inst, load, gen.first_logits, len(tokens))


def _local_instance(geometry: ChunkGeometry, t_comp: np.ndarray, t_suffix: float) -> Instance:
    sizes = {cid: {"raw": 1} for cid in geometry.chunk_ids()}
    step_t = {s: float(t_comp[s.t, s.l]) for s in geometry.step_ids()}
    return Instance.from_mappings(geometry, sizes, step_t, 1.0 * MBPS, t_suffix_s=t_suffix,
                                  name="local")


def _suffix_estimate(t_comp: np.ndarray, geometry: ChunkGeometry, n: int) -> float:
    """Question prefill ~ a layer step of ``n`` query tokens at the context's end, every layer."""
    last = t_comp[-1, :-1].sum() if t_comp.shape[1] > 1 else t_comp[-1].sum()
    return float(last) * max(n, 1) / max(geometry.chunk_len(geometry.num_token_chunks - 1), 1) \
        + 0.01


def _bandwidth_prior(client: EdgeClient, mbps: float | None) -> float:
    if mbps is not None:
        return float(mbps) * MBPS
    if client.bandwidth_estimate_Bps:
        return float(client.bandwidth_estimate_Bps)
    probe = client.last_probe_Bps
    return float(probe) if probe else DEFAULT_PRIOR_MBPS * MBPS


def _learn(client: EdgeClient, load: LoadResult, inst: Instance) -> None:
    """Updates the client's priors from what this run measured."""
    if load.measured_Bps and load.bytes_received > (1 << 20):
        client.bandwidth_estimate_Bps = load.measured_Bps
    ratios = [(b - a) / inst.comp_time(s) for s, (a, b) in load.steps.items()
              if inst.comp_time(s) > 0 and s.l < inst.L - 1]
    if len(ratios) >= 4:
        r = statistics.median(ratios)
        if math.isfinite(r) and r > 0:
            client.compute_scale = float(min(max(client.compute_scale * r, 0.05), 20.0))


def _frame_opener(client: EdgeClient, manifest: Manifest) -> Any:
    if not manifest.encryption:
        return None
    key = client.encryption_keys.get(manifest.context_id)
    if key is None:
        raise AskError(f"context {manifest.context_id} is encrypted: pass its key "
                       "(EdgeClient.encryption_keys[context_id] or --key)")
    from sparkv.protocol.crypto import FrameCipher, key_from_text

    cipher = FrameCipher(key_from_text(key), manifest.context_id)

    def open_frame(data: bytes, cid: KVChunkId, level: str) -> bytes:
        return cipher.open(data, cid.t, cid.l, cid.g, level)

    return open_frame
