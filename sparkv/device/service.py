"""The on-device context service (LLMS): many contexts under a memory budget, switched fast.

    svc = ContextService(lm, memory_budget_bytes=64 << 20, swap_dir="/data/sparkv-device")
    cid = svc.new_context("You are a helpful assistant.")
    out = svc.call(cid, "Remember the pass key 7191.", max_new_tokens=32)
    print(out.text, out.switch_s)
    svc.delete(cid)

A **context** is its token ids (kept resident: recomputation needs them) and its KV memory ``C``, a
segmented :class:`~sparkv.cache.ContextKV` cut into chunks of 16 tokens across all layers (one KV
group), each token chunk at its own level (int8 / int4 / int2 from an int8 base, or fp), resident,
on flash, or absent. A call:

1. **locks** the context (a second call on it waits; the eviction never touches a locked context);
2. **switches it in** (the switching latency, timed): reclaims memory from other contexts by the
   eviction policy until its missing chunks, its working memory and its new chunks fit the
   budget, then loads it (:mod:`sparkv.device.loader`): resident chunks dequantized into the
   working memory, flash chunks read and some recomputed, pipelined layer by layer, the split
   chosen by :mod:`sparkv.device.planner` from this device's I/O and recompute profiles;
3. **runs** the prompt and decodes the answer over the working memory (a dense fp arena with
   spare slots: generation appends in place), with the attention hooks recording the density
   of every key the new rows attend (:mod:`sparkv.device.density`);
4. **folds** the new tokens back: the context grows by the prompt and the answer, its new chunks
   enter ``C`` at the levels their densities earn (the densest keep the most bits, the mix meets
   the global ratio);
5. **swaps out ahead of time** every chunk it modified (one file per token chunk holding every
   layer, :mod:`sparkv.device.flashio`; one grouped, durable write), so that a later reclaim of
   this context writes nothing; then journals the context and returns.

With ``keep_working`` (LLMS's presets) the call's working memory is kept after it returns while
the budget has room: a later call on the same context uses it as it is (no load, no
dequantization). Kept working memories are reclaimed before any chunk, least recently used first;
dropping one writes nothing (the context's chunks hold everything).

The budget is never exceeded: every allocation (a restored chunk, the working memory, a new
chunk) is reserved first, and the service checks its account (the sum of the KV memories' own
``nbytes``) after every layer and chunk it adds, keeping the high-water mark.

Policies (:class:`ServiceConfig`) make the LLMS ablations and the chunk-swapping baselines with
the same code: ``compression`` (``tolerance`` / ``int8`` / ``fp``), ``pipeline`` (IO-recompute
pipeline, or read everything first), ``aot`` (ahead-of-time swap-out, or write at reclaim) and
``eviction`` (``lctru``: fp and int8 chunks first, then int4, then int2, least recently used
first in each; or ``lru``). Levels: ``fp_protect`` first chunks (the attention sinks) at fp outside
the global ``ratio``, the densest ``fp_fraction`` at fp inside it, the rest int8 / int4 / int2
(:func:`sparkv.device.density.plan_levels`). A call given a ``remote`` (the server's copy,
:mod:`sparkv.device.remote`) restores missing chunks from flash, the server or by recompute,
planned by :func:`sparkv.device.restore.restore_plan`.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from sparkv.cache import ContextKV, FlashRef, PayloadError, Residency, Source
from sparkv.cache.payload import ChunkPayload, contiguous_positions
from sparkv.device.density import (DensityRecorder, chunk_densities, install_hooks, plan_levels,
                                   recording)
from sparkv.device.errors import (BudgetTooSmall, ContextBusy, DeviceError, PromptTooLong,
                                  UnknownContext)
from sparkv.device.flashio import (IOProfile, ServiceFlash, load_io_profile, token_chunk_header,
                                   token_chunk_name)
from sparkv.device.journal import Journal
from sparkv.device.loader import (LoadOptions, LoadRequest, LoadStats, chunk_payload, grow_arena,
                                  load, payload_nbytes, token_chunk_ids, working_nbytes)
from sparkv.device.planner import (MissingChunk, RecomputeProfile, Split, plan_split,
                                   recompute_cost_model)
from sparkv.layout import ChunkGeometry, KVChunkId

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
LEVEL_RANK = {"fp": 0, "int8": 0, "int4": 1, "int2": 2}


@dataclass
class ServiceConfig:
    """The service's policies (module docstring)."""

    name: str = "llms"
    chunk_tokens: int = 16
    compression: str = "tolerance"     # tolerance | int8 | fp
    ratio: float = 1.0                 # global ratio of bytes to int8 (tolerance only)
    fp_fraction: float = 0.0           # the densest fraction of chunks kept at fp (tolerance)
    fp_protect: int = 1                # the first chunks (attention sinks) kept at fp, outside
    #                                    the ratio (tolerance only)
    pipeline: bool = True              # IO-recompute pipeline; else read every missing chunk first
    aot: bool = True                   # ahead-of-time swap-out when a call returns
    eviction: str = "lctru"            # lctru | lru
    keep_working: bool = True          # keep the last working memory (fp) while it fits: a call
    #                                    on a context still hot switches without a load
    hot_margin_tokens: int = 48        # spare slots a kept working memory gets beyond the call's
    io_threads: int = 4
    max_context_tokens: int = 0        # 0: the model's positions
    max_new_tokens: int = 512
    journal: bool = True
    measure_io: bool = True            # measure the per-file read latency once per swap dir

    def __post_init__(self) -> None:
        if self.compression not in ("tolerance", "int8", "fp"):
            raise ValueError(f"compression must be tolerance, int8 or fp, not {self.compression!r}")
        if self.eviction not in ("lctru", "lru"):
            raise ValueError(f"eviction must be lctru or lru, not {self.eviction!r}")
        if not 0.25 <= self.ratio <= 4.0:
            raise ValueError("ratio must be in [0.25, 4] (bytes relative to int8)")
        if not 0.0 <= self.fp_fraction <= 1.0 or self.fp_protect < 0:
            raise ValueError("fp_fraction must be in [0, 1] and fp_protect >= 0")
        if self.chunk_tokens < 16:
            raise ValueError("chunk_tokens must be >= 16")

    # ---- the systems of the benchmark --------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **kw: Any) -> "ServiceConfig":
        """``llms``, ``llms-no-compression``, ``llms-no-pipeline``, ``llms-no-lifecycle``,
        ``vllm-s`` (16-token chunks swapped, fp, LRU, written at reclaim, no recompute) and
        ``vllm-sq`` (the same at int8)."""
        presets = {
            "llms": {},
            "llms-no-compression": {"compression": "int8"},
            "llms-no-pipeline": {"pipeline": False},
            "llms-no-lifecycle": {"aot": False, "eviction": "lru", "keep_working": False},
            "vllm-s": {"compression": "fp", "pipeline": False, "aot": False, "eviction": "lru",
                       "keep_working": False},
            "vllm-sq": {"compression": "int8", "pipeline": False, "aot": False,
                        "eviction": "lru", "keep_working": False},
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(presets)}")
        return cls(name=name, **{**presets[name], **kw})


@dataclass
class CallResult:
    """What one call returned and what it cost (seconds)."""

    context_id: str
    text: str
    tokens: list[int]
    switch_s: float               # switching latency: reclaim + load, until the context is ready
    reclaim_s: float = 0.0
    load_s: float = 0.0
    first_token_s: float = 0.0    # from the call to the first answer token
    total_s: float = 0.0
    aot_s: float = 0.0            # the ahead-of-time swap-out after the answer
    context_tokens: int = 0       # after the call
    bytes_evicted: int = 0
    bytes_written_at_reclaim: int = 0
    bytes_written_aot: int = 0
    load: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Context:
    """One context (module docstring)."""

    def __init__(self, ctx_id: str, tokens: list[int], system_prompt: str | None,
                 tier: ServiceFlash) -> None:
        self.id = ctx_id
        self.tokens = list(tokens)
        self.pending: list[int] = []
        self.system_prompt = system_prompt
        self.memory: ContextKV | None = None
        self.mass = torch.zeros(0, dtype=torch.float64)
        self.rows = torch.zeros(0, dtype=torch.float64)
        self.levels: list[str] = []
        self.modified: set[int] = set()
        self.last_used = 0
        self.created_unix = time.time()
        self.calls = 0
        self.lock = threading.Lock()
        self.deleted = False
        self.tier = tier
        self.label: str | None = None    # a caller's name for it (the edge: server + context id)
        self.hot: ContextKV | None = None  # its last working memory, kept while it fits

    def add_density(self, rec: DensityRecorder, upto: int) -> None:
        n = upto
        if self.mass.numel() < n:
            extra = n - self.mass.numel()
            self.mass = torch.cat([self.mass, torch.zeros(extra, dtype=torch.float64)])
            self.rows = torch.cat([self.rows, torch.zeros(extra, dtype=torch.float64)])
        m = min(n, rec.mass.numel())
        self.mass[:m] += rec.mass[:m]
        self.rows[:m] += rec.rows[:m]

    def record(self, fingerprint: str) -> dict[str, Any]:
        return {"tokens": self.tokens, "pending": self.pending,
                "system_prompt": self.system_prompt,
                "chunk_tokens": (self.memory.geometry.chunk_tokens if self.memory is not None
                                 else None),
                "levels": self.levels, "mass": [round(float(x), 9) for x in self.mass.tolist()],
                "rows": self.rows.tolist(), "calls": self.calls, "last_used": self.last_used,
                "created_unix": self.created_unix, "label": self.label, "model": fingerprint}


class ContextService:
    """Many contexts of one model under one KV-memory budget (module docstring).

    Args:
        model: a :class:`~sparkv.runtime.model.LoadedModel`, a checkpoint path or name, or
            ``None`` for the bundled SmolLM2.
        memory_budget_bytes: the most bytes every context's KV memory together may hold (the
            memories' own account, working memories included).
        swap_dir: the flash tier and the journal; contexts journaled there are reopened.
        config: the policies (default: full LLMS); keyword overrides apply on top.
        io_profile: ``T_IO`` (default: the flash profile + a per-file latency measured once).
    """

    def __init__(self, model: Any, memory_budget_bytes: int, swap_dir: str | Path, *,
                 config: ServiceConfig | None = None, io_profile: IOProfile | None = None,
                 cost_model: Any = None, **overrides: Any) -> None:
        from sparkv.runtime.model import LoadedModel, load_model

        self.lm = model if isinstance(model, LoadedModel) else load_model(model)
        cfg = config or ServiceConfig()
        self.config = replace(cfg, **overrides) if overrides else cfg
        self.budget = int(memory_budget_bytes)
        if self.budget <= 0:
            raise BudgetTooSmall("the memory budget must be a positive number of bytes")
        self.swap_dir = Path(swap_dir)
        self.swap_dir.mkdir(parents=True, exist_ok=True)
        (self.swap_dir / "contexts").mkdir(exist_ok=True)
        self.journal = Journal(self.swap_dir / "journal") if self.config.journal else None
        install_hooks(self.lm.model)
        cfgm = self.lm.config
        self.geometry0 = ChunkGeometry.from_config(cfgm, 1, self.config.chunk_tokens)
        self.max_tokens = self.config.max_context_tokens or self.lm.max_positions or (1 << 15)
        self._probe_tier = ServiceFlash(self.swap_dir / "probe")
        self.io = io_profile or load_io_profile(self.swap_dir, self._probe_tier,
                                                self.config.io_threads,
                                                measure=self.config.measure_io)
        self.recompute = RecomputeProfile(cost_model or recompute_cost_model(self.lm),
                                          self.geometry0.num_layers, self.config.chunk_tokens)
        self.contexts: dict[str, Context] = {}
        self._working: dict[str, ContextKV] = {}
        self._mem = threading.RLock()
        self._run = threading.Lock()
        self._clock = 0
        self.peak_bytes = 0
        self.violations = 0
        self.counters: dict[str, float] = {
            "calls": 0, "evicted_chunks": 0, "evicted_bytes": 0, "reclaim_written_bytes": 0,
            "aot_written_bytes": 0, "read_bytes": 0, "recomputed_chunks": 0, "read_chunks": 0,
            "faults": 0, "hot_hits": 0, "hot_dropped": 0, "streamed_chunks": 0}
        self.reopened = self._reopen()

    # ---- ids, lookups ----------------------------------------------------------------------------
    def _get(self, ctx_id: str) -> Context:
        with self._mem:
            ctx = self.contexts.get(ctx_id)
        if ctx is None or ctx.deleted:
            raise UnknownContext(f"no context {ctx_id!r}")
        return ctx

    def _tick(self) -> int:
        with self._mem:
            self._clock += 1
            return self._clock

    @property
    def _eos(self) -> set[int]:
        from sparkv.runtime.generate import _eos_ids
        return _eos_ids(self.lm)

    @property
    def _chatml(self) -> bool:
        if not hasattr(self, "_chatml_cached"):   # get_vocab() costs tens of ms: once
            tok = self.lm.tokenizer
            self._chatml_cached = tok is not None and "<|im_start|>" in tok.get_vocab()
        return self._chatml_cached

    # ---- accounting ------------------------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes every context's KV memory holds now (their own accounts)."""
        with self._mem:
            total = sum(c.memory.nbytes for c in self.contexts.values() if c.memory is not None)
            return total + sum(w.nbytes for w in self._working.values())

    def _check(self) -> int:
        used = self.used_bytes()
        if used > self.peak_bytes:
            self.peak_bytes = used
        if used > self.budget:
            self.violations += 1
        return used

    def min_budget(self, tokens: int = 128) -> int:
        """The smallest budget that runs one context of ``tokens`` tokens with as many tokens
        of prompt and answer (its memory at fp, its working memory)."""
        g = ChunkGeometry.from_config(self.lm.config, tokens, self.config.chunk_tokens)
        return 2 * working_nbytes(g, tokens, self.lm.dtype)

    # ---- the API ---------------------------------------------------------------------------------
    def new_context(self, system_prompt: str | None = None, *,
                    system_ids: Sequence[int] | None = None) -> str:
        """Makes a context holding the system prompt (its KV computed now); returns its id."""
        if system_ids is not None:
            ids = list(system_ids)
        elif self.lm.tokenizer is None:
            raise DeviceError("this model has no tokenizer: pass system_ids")
        else:
            sp = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
            text = f"<|im_start|>system\n{sp}<|im_end|>\n" if self._chatml else sp
            ids = self.lm.encode_text(text)
        if not ids:
            raise DeviceError("a context needs at least one token (give a system prompt)")
        if len(ids) + 1 > self.max_tokens:
            raise PromptTooLong(f"the system prompt has {len(ids)} tokens; contexts hold at most "
                                f"{self.max_tokens}")
        ctx_id = uuid.uuid4().hex[:16]
        ctx = Context(ctx_id, ids, system_prompt, ServiceFlash(self.swap_dir / "contexts" / ctx_id))
        with ctx.lock, self._run, self._adding(ctx):
            self._create(ctx)
        return ctx_id

    @contextlib.contextmanager
    def _adding(self, ctx: Context) -> Iterator[None]:
        """Registers a new context for the block. On any failure it is unregistered and its
        flash directory removed; on success it becomes the most recently used and is swapped
        out ahead of time like any returned call."""
        with self._mem:
            self.contexts[ctx.id] = ctx
        try:
            yield
        except BaseException:
            with self._mem:
                self.contexts.pop(ctx.id, None)
            shutil.rmtree(ctx.tier.root, ignore_errors=True)
            raise
        ctx.last_used = self._tick()
        self._after_call(ctx)

    def import_context(self, token_ids: Sequence[int], layers: Any, *,
                       density: tuple[torch.Tensor, torch.Tensor] | None = None,
                       system_prompt: str | None = None, label: str | None = None) -> str:
        """Adopts a context whose KV was made elsewhere (the edge's loaded cache, a benchmark's
        prefill): ``layers`` is a :class:`ContextKV` holding every chunk (any chunk size) or per
        layer ``(K, V)`` ``[1, H, N, D]``. ``density``: per-token ``(mass, rows)`` if known (else
        the levels assume equal densities until calls measure them). ``label``: a name to find it
        by later (:meth:`find`; journaled, so it survives a restart)."""
        ids = list(token_ids)
        n = len(ids)
        if isinstance(layers, ContextKV):
            src = layers
            if src.geometry.num_tokens != n:
                raise DeviceError(f"the memory holds {src.geometry.num_tokens} tokens, "
                                  f"the context has {n}")
        else:
            src = None
        ctx_id = uuid.uuid4().hex[:16]
        ctx = Context(ctx_id, ids, system_prompt, ServiceFlash(self.swap_dir / "contexts" / ctx_id))
        ctx.label = label
        g = ChunkGeometry.from_config(self.lm.config, n, self.config.chunk_tokens)
        with ctx.lock, self._run, self._adding(ctx):
            if density is not None:
                ctx.mass = density[0].double()[:n].clone()
                ctx.rows = density[1].double()[:n].clone()
            levels = self._levels(ctx, g)
            est = sum(payload_nbytes(levels[t], g.num_kv_heads * g.chunk_len(t), g.head_dim,
                                     self.lm.dtype) * g.num_layers
                      for t in range(g.num_token_chunks))
            self._reserve(est, ctx)
            C = ContextKV(g, self.lm.dtype, self.lm.device, segmented=True)
            ctx.memory = C
            ctx.levels = levels
            for t in range(g.num_token_chunks):
                t0, t1 = g.token_range(t)
                for l in range(g.num_layers):  # noqa: E741
                    if src is not None:
                        k, v = _dense_range(src, l, t0, t1)
                    else:
                        k, v = layers[l][0][0, :, t0:t1], layers[l][1][0, :, t0:t1]
                    hh = g.num_kv_heads
                    p = ChunkPayload(KVChunkId(t, l, 0), "fp", [t1 - t0] * hh,
                                     contiguous_positions([t1 - t0] * hh, t0),
                                     k.reshape(-1, g.head_dim).to(self.lm.dtype).clone(),
                                     v.reshape(-1, g.head_dim).to(self.lm.dtype).clone(),
                                     self.lm.dtype)
                    lv = levels[t]
                    C.put_payload(p if lv == "fp" else p.at_level(lv), Source.INJECTED)
                ctx.modified.add(t)
                self._check()
        return ctx_id

    def call(self, ctx_id: str, prompt: str | None = None, max_new_tokens: int = 32, *,
             prompt_ids: Sequence[int] | None = None, grow: bool = True, stop_at_eos: bool = True,
             timeout_s: float | None = None, remote: Any = None) -> CallResult:
        """Runs ``prompt`` in context ``ctx_id`` and returns the answer.

        Args:
            prompt: the user's turn (wrapped in the chat template for chat models).
            prompt_ids: raw token ids to append instead of a text prompt.
            max_new_tokens: answer length; 0 appends the prompt without generating.
            grow: keep the prompt and the answer in the context (a chat); ``False`` answers over
                the context and leaves it as it was (a question about a document).
            timeout_s: how long to wait for a busy context (``None``: wait; then 409).
            remote: a :class:`~sparkv.device.remote.RemoteSource` holding this context (the
                server's copy, :class:`~sparkv.device.remote.ServerStream`): missing chunks may
                then come from it too, the restore planned by
                :func:`~sparkv.device.restore.restore_plan` (flash, server or recompute per
                chunk, by predicted cost). Used only while the context holds exactly the
                remote's tokens (``grow=False`` calls, as ``ask`` makes).
        """
        ctx = self._get(ctx_id)
        if max_new_tokens < 0 or max_new_tokens > self.config.max_new_tokens:
            raise DeviceError(f"max_new_tokens must be in [0, {self.config.max_new_tokens}]")
        if not ctx.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise ContextBusy(f"context {ctx_id} is running another call")
        try:
            if ctx.deleted:
                raise UnknownContext(f"no context {ctx_id!r}")
            ids = self._turn_ids(ctx, prompt, prompt_ids)
            if not ids:
                raise DeviceError("the prompt is empty")
            if len(ctx.tokens) + len(ids) + max_new_tokens > self.max_tokens:
                raise PromptTooLong(
                    f"context {ctx_id} holds {len(ctx.tokens)} tokens; with a {len(ids)}-token "
                    f"prompt and {max_new_tokens} new tokens it would exceed the longest context "
                    f"allowed ({self.max_tokens} tokens)")
            with self._run:
                return self._call(ctx, ids, max_new_tokens, grow, stop_at_eos, remote)
        finally:
            ctx.lock.release()

    def delete(self, ctx_id: str) -> None:
        """Deletes a context: its memory, its flash files and its journal record."""
        ctx = self._get(ctx_id)
        with ctx.lock:
            with self._mem:
                ctx.deleted = True
                self._drop_hot(ctx)
                self.contexts.pop(ctx_id, None)
                ctx.memory = None
            shutil.rmtree(ctx.tier.root, ignore_errors=True)
            if self.journal is not None:
                self.journal.remove(ctx_id)

    @staticmethod
    def server_stream(client: Any, context_id: str, **kwargs: Any) -> Any:
        """The server's copy of ``context_id`` through ``client`` (an ``EdgeClient``), made
        lazily, for :meth:`call`'s ``remote`` (:func:`sparkv.device.remote.server_stream`)."""
        from sparkv.device.remote import server_stream

        return server_stream(client, context_id, **kwargs)

    def find(self, label: str) -> str | None:
        """The id of the (most recently used) context imported with ``label``, or ``None``."""
        with self._mem:
            found = [c for c in self.contexts.values() if c.label == label and not c.deleted]
        return max(found, key=lambda c: c.last_used).id if found else None

    def swap_out(self, ctx_id: str) -> int:
        """Reclaims every resident chunk of a context now (an app sent to the background, a
        test): clean chunks are dropped, modified ones written. Returns the bytes written."""
        ctx = self._get(ctx_id)
        with ctx.lock, self._mem:
            self._drop_hot(ctx)
            if ctx.memory is None:
                return 0
            before = self.counters["reclaim_written_bytes"]
            self._evict(ctx, range(ctx.memory.geometry.num_token_chunks))
            self._check()
            return int(self.counters["reclaim_written_bytes"] - before)

    @contextlib.contextmanager
    def locked(self, ctx_id: str) -> Iterator[Context]:
        """Holds a context's lock (as a running call does): nothing of it is evicted meanwhile."""
        ctx = self._get(ctx_id)
        with ctx.lock:
            yield ctx

    def list(self) -> list[dict[str, Any]]:
        with self._mem:
            return [self._describe(c) for c in self.contexts.values() if not c.deleted]

    def describe(self, ctx_id: str) -> dict[str, Any]:
        return self._describe(self._get(ctx_id))

    def _describe(self, c: Context) -> dict[str, Any]:
        res = fl = ab = 0
        if c.memory is not None:
            g = c.memory.geometry
            for t in range(g.num_token_chunks):
                r = [c.memory.residency(cid) for cid in token_chunk_ids(g, t)]
                if all(x == Residency.RESIDENT for x in r):
                    res += 1
                elif any(x == Residency.ABSENT for x in r):
                    ab += 1
                else:
                    fl += 1
        mix: dict[str, int] = {}
        for lv in c.levels:
            mix[lv] = mix.get(lv, 0) + 1
        return {"id": c.id, "tokens": len(c.tokens), "calls": c.calls,
                "bytes": c.memory.nbytes if c.memory is not None else 0,
                "chunks": {"resident": res, "flash": fl, "absent": ab}, "levels": mix,
                "last_used": c.last_used, "busy": c.lock.locked(), "hot": c.hot is not None,
                "system_prompt": c.system_prompt, "label": c.label}

    def stats(self) -> dict[str, Any]:
        with self._mem:
            used = self.used_bytes()
            levels: dict[str, int] = {}
            for c in self.contexts.values():
                if c.memory is not None:
                    for lv, b in c.memory.account().resident.items():
                        levels[lv] = levels.get(lv, 0) + b
            return {"policy": self.config.name, "budget_bytes": self.budget, "used_bytes": used,
                    "peak_bytes": self.peak_bytes, "budget_violations": self.violations,
                    "contexts": len(self.contexts), "resident_bytes_by_level": levels,
                    "io_profile": self.io.to_dict(),
                    "recompute_scale": self.recompute.scale, "reopened": self.reopened,
                    **self.counters}

    def text(self, ctx_id: str) -> str:
        """The context's text so far (its token ids decoded)."""
        ctx = self._get(ctx_id)
        return self.lm.decode_tokens(ctx.tokens + ctx.pending)

    # ---- prompts ---------------------------------------------------------------------------------
    def _turn_ids(self, ctx: Context, prompt: str | None,
                  prompt_ids: Sequence[int] | None) -> list[int]:
        if prompt_ids is not None:
            return ctx.pending + [int(x) for x in prompt_ids]
        if prompt is None:
            raise DeviceError("give a prompt or prompt_ids")
        if self.lm.tokenizer is None:
            raise DeviceError("this model has no tokenizer: pass prompt_ids")
        if not self._chatml:
            return ctx.pending + self.lm.encode_text(prompt)
        pre: list[int] = []
        if ctx.pending:
            closed = ctx.pending[-1] in self._eos
            pre = ctx.pending + self.lm.encode_text("\n" if closed else "<|im_end|>\n")
        return pre + self.lm.encode_text(
            f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")

    # ---- one call --------------------------------------------------------------------------------
    def _call(self, ctx: Context, ids: list[int], max_new: int, grow: bool,
              stop_at_eos: bool, remote: Any = None) -> CallResult:
        from sparkv.cache import SparkvCache
        from sparkv.runtime.generate import greedy_generate

        t0 = time.perf_counter()
        n = len(ctx.tokens)
        spare = len(ids) + max_new + 1
        before = dict(self.counters)
        W, lstats, split, reclaim_s = self._prepare(ctx, spare, remote)
        switch_s = time.perf_counter() - t0
        rec = DensityRecorder(n + spare)
        tokens: list[int] = []
        first_s = 0.0
        with recording(rec):
            if max_new > 0:
                gen = greedy_generate(self.lm, W, n, ids, max_new, stop_at_eos=stop_at_eos,
                                      keep=grow)
                tokens = gen.tokens
                first_s = switch_s + gen.first_token_s
            else:
                with torch.inference_mode():
                    cache = SparkvCache(W)
                    x = torch.tensor([ids], dtype=torch.long, device=self.lm.device)
                    pos = torch.arange(n, n + len(ids), device=self.lm.device)
                    self.lm.model(input_ids=x, past_key_values=cache, position_ids=pos[None],
                                  cache_position=pos, use_cache=True, logits_to_keep=1)
                    if grow:
                        cache.commit()
                    else:
                        W.truncate()
                first_s = time.perf_counter() - t0
        if grow:
            added = ids + (tokens[:-1] if tokens else [])
            ctx.add_density(rec, n + len(added))
            ctx.tokens = ctx.tokens + added
            ctx.pending = tokens[-1:] if tokens else []
            self._finish(ctx, W, n)
        else:
            ctx.add_density(rec, n)
            self._keep_or_discard(ctx, W)
        ctx.calls += 1
        ctx.last_used = self._tick()
        t_aot = time.perf_counter()
        aot_bytes = self._after_call(ctx)
        aot_s = time.perf_counter() - t_aot
        self.counters["calls"] += 1
        text = self.lm.decode_tokens([t for t in tokens if t not in self._eos]) if tokens else ""
        return CallResult(
            ctx.id, text, tokens, switch_s, reclaim_s=reclaim_s,
            load_s=lstats.total_s if lstats else 0.0, first_token_s=first_s,
            total_s=time.perf_counter() - t0, aot_s=aot_s, context_tokens=len(ctx.tokens),
            bytes_evicted=int(self.counters["evicted_bytes"] - before["evicted_bytes"]),
            bytes_written_at_reclaim=int(self.counters["reclaim_written_bytes"]
                                         - before["reclaim_written_bytes"]),
            bytes_written_aot=aot_bytes, load=lstats.to_dict() if lstats else {},
            plan=split.__dict__ if split else {})

    # ---- levels ----------------------------------------------------------------------------------
    def _levels(self, ctx: Context, g: ChunkGeometry) -> list[str]:
        """The level of every token chunk of geometry ``g``: those already assigned keep theirs
        (a level never goes up; the flash copies stay valid), the others by the policy."""
        nt = g.num_token_chunks
        mode = self.config.compression
        if mode != "tolerance":
            lv = "fp" if mode == "fp" else "int8"
            return [lv] * nt
        dens = chunk_densities(ctx.mass, ctx.rows, g.chunk_tokens, g.num_tokens) \
            if ctx.mass.numel() >= g.num_tokens else None
        if dens is None or not dens.any():
            # no measured densities yet: equal densities, the mix alone decides
            import numpy as np
            dens = np.ones(nt)
        mix = plan_levels(dens, self.config.ratio, fp_fraction=self.config.fp_fraction,
                          protect=range(min(self.config.fp_protect, nt)),
                          fp_ratio=self._fp_ratio(g))
        keep = ctx.levels
        full = g.num_tokens // g.chunk_tokens
        return [keep[t] if t < len(keep) and t < full and t < len(keep) else mix.levels[t]
                for t in range(nt)]

    def _fp_ratio(self, g: ChunkGeometry) -> float:
        """An fp chunk's bytes relative to an int8 one (what it costs in the global ratio)."""
        rows = g.heads_per_group * g.chunk_tokens
        return (payload_nbytes("fp", rows, g.head_dim, self.lm.dtype)
                / payload_nbytes("int8", rows, g.head_dim, self.lm.dtype))

    # ---- memory: reserve, evict ------------------------------------------------------------------
    def _reserve(self, need: int, active: Context) -> float:
        """Evicts by the policy until ``need`` more bytes fit the budget; returns seconds spent.
        Raises :class:`BudgetTooSmall` when even evicting everything it may is not enough."""
        t0 = time.perf_counter()
        with self._mem:
            if self.used_bytes() + need <= self.budget:
                return 0.0
            # kept working memories go first (least recently used first): dropping one costs
            # nothing now, its context's chunks hold everything
            for c in sorted((c for c in self.contexts.values()
                             if c.hot is not None and c is not active and not c.lock.locked()),
                            key=lambda c: c.last_used):
                if self.used_bytes() + need <= self.budget:
                    return time.perf_counter() - t0
                self._drop_hot(c)
            if self.used_bytes() + need <= self.budget:
                return time.perf_counter() - t0
            victims = self._victims(active)
            freeable = sum(b for _, _, b in victims)
            if self.used_bytes() - freeable + need > self.budget:
                raise BudgetTooSmall(
                    f"context {active.id} needs {need / 1e6:.1f} MB more to run "
                    f"({len(active.tokens)} tokens); the budget is {self.budget / 1e6:.1f} MB "
                    f"and only {freeable / 1e6:.1f} MB can be reclaimed from other contexts")
            chosen: dict[str, list[int]] = {}
            over = self.used_bytes() + need - self.budget
            for c, t, b in victims:
                if over <= 0:
                    break
                chosen.setdefault(c.id, []).append(t)
                over -= b
            for cid, ts in chosen.items():
                self._evict(self.contexts[cid], ts)
        return time.perf_counter() - t0

    def _victims(self, active: Context) -> list[tuple[Context, int, int]]:
        """Resident token chunks that may be evicted, in eviction order, with their bytes."""
        out: list[tuple[tuple, Context, int, int]] = []
        for c in self.contexts.values():
            if c is active or c.memory is None or c.deleted:
                continue
            if c.lock.locked():       # a call holds it (or someone locked it): never evicted
                continue
            for t, b in sorted(c.memory.resident_bytes_by_token().items()):
                if not b:
                    continue
                lv = c.levels[t] if t < len(c.levels) else "int8"
                if self.config.eviction == "lctru":
                    key = (LEVEL_RANK.get(lv, 0), c.last_used, t)
                else:
                    key = (c.last_used, t)
                out.append((key, c, t, b))
        out.sort(key=lambda x: x[0])
        return [(c, t, b) for _, c, t, b in out]

    def _evict(self, ctx: Context, ts: Sequence[int]) -> None:
        """Reclaims token chunks of ``ctx``: a clean chunk (its flash copy up to date) is just
        dropped; a modified one is written first (its token chunk file, one grouped write)."""
        C = ctx.memory
        assert C is not None
        g = C.geometry
        freed = written = 0
        with ctx.tier.batch():
            for t in ts:
                written += self._write_token_chunk(ctx, t)
                for cid in token_chunk_ids(g, t):
                    freed += C.drop(cid)
                self.counters["evicted_chunks"] += 1
        self.counters["evicted_bytes"] += freed
        self.counters["reclaim_written_bytes"] += written

    def _write_token_chunk(self, ctx: Context, t: int) -> int:
        """Writes token chunk ``t`` (every layer and group) as one file of the context's tier,
        unless its flash copy is up to date; returns the bytes written. A chunk not wholly
        resident, or not at one level, is not written (it stays modified: dropped, it is
        recomputed)."""
        C = ctx.memory
        assert C is not None
        cids = token_chunk_ids(C.geometry, t)
        states = [C.state(cid) for cid in cids]
        if all(st.flash is not None and not st.dirty for st in states):
            return 0
        if any(st.residency != Residency.RESIDENT or st.payload is None for st in states):
            return 0
        try:
            ref = ctx.tier.write_token_chunk([st.payload for st in states])
        except PayloadError:
            return 0
        for cid, st in zip(cids, states):
            C.attach_flash(cid, ref, st.level)
        return ref.nbytes

    # ---- switching in ----------------------------------------------------------------------------
    def _missing(self, ctx: Context) -> tuple[list[MissingChunk], int, int]:
        """Missing token chunks, resident (t, l) chunks, and the bytes restoring needs."""
        C = ctx.memory
        assert C is not None
        g = C.geometry
        out: list[MissingChunk] = []
        resident = 0
        restore = 0
        for t in range(g.num_token_chunks):
            paths: dict[str, int] = {}
            readable = True
            miss = 0
            for cid in token_chunk_ids(g, t):
                st = C.state(cid)
                if st.residency == Residency.RESIDENT:
                    resident += 1
                    continue
                miss += 1
                if st.residency == Residency.FLASH and st.flash is not None and not st.dirty:
                    paths[st.flash.path] = st.flash.nbytes
                else:
                    readable = False
            files, nbytes = len(paths), sum(paths.values())
            if miss:
                lv = ctx.levels[t] if t < len(ctx.levels) else "int8"
                out.append(MissingChunk(t, lv, files, nbytes, readable, miss))
                restore += miss * payload_nbytes(lv, g.heads_per_group * g.chunk_len(t),
                                                 g.head_dim, self.lm.dtype)
        return out, resident, restore

    def _new_chunk_bytes(self, g: ChunkGeometry, spare: int) -> int:
        cfg = self.config
        fp = cfg.compression == "fp" or (cfg.compression == "tolerance" and (
            cfg.fp_fraction > 0 or cfg.ratio > 1.0
            or g.num_tokens + spare > cfg.fp_protect * g.chunk_tokens > g.num_tokens))
        lv = "fp" if fp else "int8"
        chunks = math.ceil(spare / g.chunk_tokens) + 1
        return chunks * g.num_layers * payload_nbytes(lv, g.num_kv_heads * g.chunk_tokens,
                                                      g.head_dim, self.lm.dtype)

    def _prepare(self, ctx: Context, spare: int, remote: Any = None
                 ) -> tuple[ContextKV, LoadStats | None, Split | None, float]:
        C = ctx.memory
        assert C is not None
        g = C.geometry
        hot = self._take_hot(ctx, spare)
        if hot is not None:
            return hot
        missing, resident, restore = self._missing(ctx)
        need = restore + working_nbytes(g, spare, self.lm.dtype) + self._new_chunk_bytes(g, spare)
        spare, need = self._with_margin(g, spare, need)
        reclaim_s = self._reserve(need, ctx)
        rp = None
        if (remote is not None and missing and len(remote.token_ids) == len(ctx.tokens)
                and list(remote.token_ids) == ctx.tokens):
            rp = self._restore_plan(ctx, remote)
            split = Split(rp.read, rp.recompute, rp.estimate_s, 0.0, 0.0, 0.0)
        elif self.config.pipeline:
            split = plan_split(missing, g.num_tokens, resident, self.io, self.recompute)
        else:
            split = plan_split(missing, g.num_tokens, resident, self.io, self.recompute,
                               allow_recompute=False)
        W = ContextKV(g, self.lm.dtype, self.lm.device, spare_tokens=spare)
        with self._mem:
            self._working[ctx.id] = W
        self._check()
        levels = ctx.levels
        stats = load(self.lm, ctx.tokens, C, W, ctx.tier,
                     LoadRequest(split.read, split.recompute, stream=rp.stream if rp else (),
                                 remote=remote if rp else None,
                                 remote_chunks=rp.server if rp else ()),
                     LoadOptions(pipeline=self.config.pipeline, io_threads=self.config.io_threads,
                                 on_layer=self._check, level_of=lambda t: levels[t]))
        stats.predicted_s = split.predicted_s
        if rp is not None:
            stats.notes.append(f"restore plan: {rp.counts()}")
            self.counters["streamed_chunks"] += stats.streamed_chunks
        ctx.modified.update(split.recompute)
        ctx.modified.update(rp.stream if rp else ())
        if stats.faults:
            ctx.modified.update(range(g.num_token_chunks))
        self.counters["read_bytes"] += stats.bytes_read
        self.counters["read_chunks"] += stats.read_chunks
        self.counters["recomputed_chunks"] += stats.recomputed_chunks
        self.counters["faults"] += stats.faults
        if stats.recomputed_chunks and not stats.faults:
            self.recompute.learn(stats.recomputed_chunks, g.num_tokens, stats.recompute_s)
        self.recompute.learn_fill(resident + stats.read_chunks * g.num_layers * g.num_groups,
                                  stats.fill_s)
        return W, stats, split, reclaim_s

    def _restore_plan(self, ctx: Context, remote: Any) -> Any:
        """The three-source restore plan of ``ctx`` from ``remote`` (server chunks), flash and
        recompute (:func:`sparkv.device.restore.restore_plan`)."""
        import numpy as np

        from sparkv.device.restore import restore_plan

        gs = remote.geometry
        n = len(ctx.tokens)
        per = np.array([float(self.recompute.seconds([max(1, gs.chunk_len(t)
                                                              // self.config.chunk_tokens)],
                                                     n)[0]) / gs.num_layers
                        for t in range(gs.num_token_chunks)])
        t_comp = np.repeat(per[:, None], gs.num_layers, axis=1)
        return restore_plan(self, ctx.id, gs, remote.sizes, t_comp, remote.link_Bps,
                            rtt_s=remote.rtt_s)

    def drop_flash(self, ctx_id: str) -> None:
        """Drops a context's chunks from RAM **and** flash (a device reclaiming flash space, or
        flash lost): every chunk is absent; the next call recomputes them, or restores them
        from a remote source (:meth:`call`'s ``remote``). Its tokens and journal stay."""
        ctx = self._get(ctx_id)
        with ctx.lock, self._mem:
            self._drop_hot(ctx)
            C = ctx.memory
            if C is None:
                return
            g = C.geometry
            for t in range(g.num_token_chunks):
                for cid in token_chunk_ids(g, t):
                    C.drop(cid)
                    C.forget_flash(cid, ctx.tier)
                ctx.modified.add(t)
            self._check()

    def _take_hot(self, ctx: Context, spare: int
                  ) -> tuple[ContextKV, LoadStats, None, float] | None:
        """The context's kept working memory, if it is still valid: used as it is when it has
        ``spare`` free slots, else grown layer by layer (a copy, no dequantization)."""
        W = ctx.hot
        if W is None:
            return None
        n = len(ctx.tokens)
        g = W.geometry
        if g.num_tokens != n or max(W.positions) != n or any(
                st is None or st.ragged for st in W.layers):
            self._drop_hot(ctx)
            return None
        t0 = time.perf_counter()
        ctx.hot = None                    # in use: the working memory of this call
        cap = min(st.capacity for st in W.layers if st is not None)
        stats = LoadStats(resident_chunks=g.num_token_chunks, notes=["hot working memory"])
        if cap >= n + spare:
            reclaim_s = self._reserve(self._new_chunk_bytes(g, spare), ctx)
        else:
            grow = working_nbytes(g, spare, self.lm.dtype) - W.nbytes
            need = max(0, grow) + W.nbytes // g.num_layers + 4096 + self._new_chunk_bytes(g, spare)
            extra, need = self._with_margin(g, spare, need)
            try:
                reclaim_s = self._reserve(need, ctx)
            except BudgetTooSmall:
                ctx.hot = W
                self._drop_hot(ctx)
                return None
            key = ctx.id + "#grow"

            def adopt(new: ContextKV) -> None:
                with self._mem:
                    self._working[key] = new

            old = W
            W = grow_arena(old, extra, on_layer=self._check, adopt=adopt)
            with self._mem:
                self._working.pop(key, None)
                self._working[ctx.id] = W
            del old
            stats.notes.append("grown")
        self.counters["hot_hits"] += 1
        stats.total_s = time.perf_counter() - t0
        return W, stats, None, reclaim_s

    def _with_margin(self, g: ChunkGeometry, spare: int, need: int) -> tuple[int, int]:
        """A working memory that will be kept gets ``hot_margin_tokens`` more spare slots (so
        the next calls reuse it without growing), only if they fit the budget as it is now."""
        m = self.config.hot_margin_tokens if self.config.keep_working else 0
        if m <= 0:
            return spare, need
        more = working_nbytes(g, spare + m, self.lm.dtype) - working_nbytes(g, spare,
                                                                             self.lm.dtype)
        if self.used_bytes() + need + more <= self.budget:
            return spare + m, need + more
        return spare, need

    def _drop_hot(self, ctx: Context) -> int:
        """Frees a context's kept working memory (its chunks hold everything: nothing to write)."""
        W = ctx.hot
        if W is None:
            return 0
        with self._mem:
            ctx.hot = None
            if self._working.get(ctx.id) is W:
                self._working.pop(ctx.id, None)
        b = W.nbytes
        del W
        self.counters["hot_dropped"] += 1
        return b

    def _keep_or_discard(self, ctx: Context, W: ContextKV) -> None:
        n = len(ctx.tokens)
        if (self.config.keep_working and W.geometry.num_tokens == n
                and max(W.positions) == n and all(st is not None and not st.ragged
                                                  for st in W.layers)):
            with self._mem:
                ctx.hot = W
            self._check()
            return
        self._discard(ctx, W)

    def _create(self, ctx: Context) -> None:
        """The first prefill of a new context (every chunk recomputed into a working memory,
        densities recorded), then folded into its memory."""
        n = len(ctx.tokens)
        g = ChunkGeometry.from_config(self.lm.config, n, self.config.chunk_tokens)
        w = working_nbytes(g, 0, self.lm.dtype)
        self._reserve(w + w // g.num_layers + 4096, ctx)
        W = ContextKV(g, self.lm.dtype, self.lm.device)
        with self._mem:
            self._working[ctx.id] = W
        self._check()
        rec = DensityRecorder(n)
        with recording(rec):
            load(self.lm, ctx.tokens, W, W, ctx.tier,
                 LoadRequest(recompute=range(g.num_token_chunks)),
                 LoadOptions(on_layer=self._check, store_recomputed=False))
        ctx.add_density(rec, n)
        self._fold_new(ctx, W)

    def _fold_new(self, ctx: Context, W: ContextKV) -> None:
        """A new context: its memory is made from the working memory, layer by layer (each layer
        of the working memory freed as soon as its chunks are in), at the chunks' levels."""
        g = W.geometry
        ctx.levels = self._levels(ctx, g)
        C = ContextKV(g, self.lm.dtype, self.lm.device, segmented=True)
        with self._mem:
            ctx.memory = C
        for l in range(g.num_layers):  # noqa: E741
            for t in range(g.num_token_chunks):
                for gg in range(g.num_groups):
                    C.put_payload(chunk_payload(W, KVChunkId(t, l, gg), ctx.levels[t]),
                                  Source.COMPUTED)
            self._check()
            W.segment(l)         # W's chunk table is empty: this frees the layer's arena
        ctx.modified.update(range(g.num_token_chunks))
        self._discard(ctx, W)

    def _finish(self, ctx: Context, W: ContextKV, n_old: int) -> None:
        """Folds the call's new tokens into the context's memory, then frees the working memory."""
        C = ctx.memory
        assert C is not None
        g_new = W.geometry
        if g_new.num_tokens > n_old:
            C.extend(g_new.num_tokens)
            ctx.levels = self._levels(ctx, g_new)
            t_first = n_old // g_new.chunk_tokens
            for t in range(t_first, g_new.num_token_chunks):
                for l in range(g_new.num_layers):  # noqa: E741
                    for gg in range(g_new.num_groups):
                        cid = KVChunkId(t, l, gg)
                        C.put_payload(chunk_payload(W, cid, ctx.levels[t]), Source.APPENDED)
                ctx.modified.add(t)
                self._check()
        self._keep_or_discard(ctx, W)

    def _discard(self, ctx: Context, W: ContextKV) -> None:
        with self._mem:
            self._working.pop(ctx.id, None)
        del W
        self._check()

    # ---- after a call: ahead-of-time swap-out, journal -------------------------------------------
    def _after_call(self, ctx: Context) -> int:
        written = 0
        C = ctx.memory
        if self.config.aot and C is not None and ctx.modified:
            g = C.geometry
            with ctx.tier.batch():
                for t in sorted(ctx.modified):
                    if t < g.num_token_chunks:
                        written += self._write_token_chunk(ctx, t)
            ctx.modified.clear()
        self.counters["aot_written_bytes"] += written
        if self.journal is not None:
            self.journal.write(ctx.id, ctx.record(self.lm.fingerprint))
        return written

    # ---- reopening after a restart ---------------------------------------------------------------
    def _reopen(self) -> int:
        if self.journal is None:
            return 0
        n = 0
        for doc in self.journal.records():
            if doc.get("model") != self.lm.fingerprint:
                continue
            tokens = [int(x) for x in doc.get("tokens", [])]
            if not tokens:
                continue
            ctx_id = doc["id"]
            T = int(doc.get("chunk_tokens") or self.config.chunk_tokens)
            if T != self.config.chunk_tokens:
                continue
            ctx = Context(ctx_id, tokens, doc.get("system_prompt"),
                          ServiceFlash(self.swap_dir / "contexts" / ctx_id))
            ctx.pending = [int(x) for x in doc.get("pending", [])]
            ctx.levels = list(doc.get("levels", []))
            ctx.mass = torch.tensor(doc.get("mass", []), dtype=torch.float64)
            ctx.rows = torch.tensor(doc.get("rows", []), dtype=torch.float64)
            ctx.calls = int(doc.get("calls", 0))
            ctx.label = doc.get("label")
            ctx.created_unix = float(doc.get("created_unix", time.time()))
            g = ChunkGeometry.from_config(self.lm.config, len(tokens), T)
            if len(ctx.levels) < g.num_token_chunks:
                ctx.levels = self._levels(ctx, g)
            C = ContextKV(g, self.lm.dtype, self.lm.device, segmented=True)
            full = g.num_tokens // T          # a partial last chunk is recomputed
            for t in range(min(full, g.num_token_chunks)):
                path = ctx.tier.root / token_chunk_name(t)
                try:
                    with open(path, "rb") as f:
                        head = token_chunk_header(f.read(64))
                    size = path.stat().st_size
                except (OSError, PayloadError):
                    continue                    # recomputed when the context is called
                if (head["t"] != t or head["layers"] != g.num_layers
                        or head["groups"] != g.num_groups or head["tokens"] != g.chunk_len(t)):
                    continue
                ref = FlashRef(str(path), size)
                for cid in token_chunk_ids(g, t):
                    C.attach_flash(cid, ref, str(head["level"]))
            ctx.memory = C
            ctx.last_used = int(doc.get("last_used", 0))
            self._clock = max(self._clock, ctx.last_used)
            self.contexts[ctx_id] = ctx
            n += 1
        return n


def _dense_range(src: ContextKV, l: int, t0: int, t1: int  # noqa: E741
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H, t1-t0, D]`` K/V of positions ``t0..t1`` of layer ``l`` of any memory."""
    if src.is_dense(l):
        store = src.layers[l]
        assert store is not None and store.k is not None and store.v is not None
        return store.k[0, :, t0:t1], store.v[0, :, t0:t1]
    heads = src.layer_entries(l, stop=t1)
    ks, vs = [], []
    for e in heads:
        keep = e.pos >= t0
        if int(keep.sum()) != t1 - t0:
            raise DeviceError("the memory to adopt is pruned: the context service keeps whole "
                              "chunks")
        ks.append(e.k[keep])
        vs.append(e.v[keep])
    return torch.stack(ks), torch.stack(vs)
