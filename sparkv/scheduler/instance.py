"""A scheduling instance: what the planner knows about one context before it starts loading it.

An :class:`Instance` holds, for one context cut into chunks by a :class:`~sparkv.layout.ChunkGeometry`:

* per KV chunk ``(t, l, g)`` and per codec level: the compressed size in bytes and the decode time
  ``t_proc`` in seconds (Huffman + dequantize + copy on this device);
* per layer step ``(t, l)``: the predicted compute time ``t_comp`` in seconds (attention + dense part
  for ``l < L-1``, the projection only for the last layer ``l = L-1``);
* the link: the expected throughput in bytes/s and the round-trip time in seconds;
* ``t_suffix_s``: the prefill of the question over the assembled cache (the end of TTFT);
* the quality floor: the lowest codec level a streamed chunk may use.

Arrays are indexed by dense integer ids (see :meth:`Instance.step_index` / :meth:`Instance.chunk_index`):
step ``s = t * L + l``, chunk ``c = s * G + g``, which is the order of
:meth:`ChunkGeometry.step_ids` / :meth:`ChunkGeometry.chunk_ids`.

:func:`synthetic_instance` builds realistic instances for SmolLM2-135M on a 2-core CPU (see
:data:`SMOLLM2_135M_CPU` for where the numbers come from).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

import numpy as np

from sparkv.errors import SparkvError
from sparkv.layout import ChunkGeometry, KVChunkId, StepId

MBPS = 1e6 / 8  # bytes per second in one Mbit/s


def portable_exp(x: np.ndarray) -> np.ndarray:
    """``exp`` of every element by the C library's scalar ``exp``: the same bits on every CPU.
    ``np.exp`` takes AVX512 code where the CPU has it, a few ulps from the scalar result, so a
    seeded instance, trace or compute noise would differ between machines (and with it every
    timeline simulated from it: tests/test_scheduler_digest.py)."""
    arr = np.asarray(x, dtype=np.float64)
    flat = (math.exp(v) for v in arr.ravel().tolist())
    return np.fromiter(flat, dtype=np.float64, count=arr.size).reshape(arr.shape)


_T = TypeVar("_T")


class InstanceError(SparkvError):
    """An instance is inconsistent (wrong shapes, negative times, unknown level...)."""


@dataclass(frozen=True)
class StreamLevel:
    """One codec level a chunk can be streamed at, as the scheduler ranks it (the codec's own
    :class:`sparkv.codec.Level` holds its bit widths; this holds its quality rank).

    Attributes:
        name: the codec's name for it (``"raw"``, ``"q8"``, ..., ``"q3"``).
        rank: quality rank, higher is better (used for the quality floor and for upgrades).
        bits: nominal bits per value before entropy coding (informational).
    """

    name: str
    rank: int
    bits: float = 0.0


#: The levels of the codec, best first. q5 is the paper's default operating point.
DEFAULT_LEVELS: tuple[StreamLevel, ...] = (
    StreamLevel("raw", 5, 16), StreamLevel("q8", 4, 8), StreamLevel("q6", 3, 6),
    StreamLevel("q5", 2, 5), StreamLevel("q4", 1, 4), StreamLevel("q3", 0, 3),
)
DEFAULT_QUALITY_FLOOR = "q5"


@dataclass(eq=False)
class Instance:
    """Everything a planner needs about one context. Times in seconds, sizes in bytes.

    Attributes:
        geometry: how the context is cut into chunks.
        levels: the codec levels, in the column order of ``chunk_bytes`` / ``t_proc``.
        chunk_bytes: ``int64[num_chunks, num_levels]``; ``-1`` where a level is not available.
        t_proc: ``float64[num_chunks, num_levels]``: decode time of the chunk at that level.
        t_comp: ``float64[num_token_chunks, num_layers]``: compute time of layer step ``(t, l)``.
        bandwidth_Bps: expected link throughput, bytes/s.
        rtt_s: round-trip time of one request.
        t_suffix_s: question prefill after the cache is complete.
        quality_floor: name of the lowest level a streamed chunk may use (``None``: any level).
        name: free text for reports.
        decode_overlaps: the device decodes a chunk while the next one transfers (as the simulator
            and the engine do); changes only the planners' ``t_stream`` (see :attr:`stream_times`).
        recent_floor: the floor of the last token chunk's chunks (the tokens next to the
            question), where it is above ``quality_floor`` (``None``: the same floor for every
            chunk). The chunk next to the question is the most sensitive to quantization
            (docs/quality.md); planners and the controller see it through :attr:`allowed_mask`.
        stream_tax_s: compute-path seconds each streamed chunk costs when it is decoded while a
            layer step runs: receiving and decoding it take the cores the step uses (on a
            2-core CPU whose steps use both, about its decode time and more); 0 where the
            decoding has hardware of its own (a spare core, a GPU's host). The simulator and
            :func:`~sparkv.scheduler.simulator.ttft_of` lengthen the running step by it; the
            session learns it (docs/edge.md, "Priors").
        receive_tax: how much slower the layer steps run while a transfer's bytes arrive (its
            first to its last byte): a step's compute stretches by ``1 + receive_tax`` for that
            time. Receiving a link's bytes (the socket, the copies, the checks, and on
            a benchmark's one machine the server's sending) takes the cores the steps use, in
            proportion to the time the link is busy, where ``stream_tax_s`` is paid once per
            chunk. 0 where the receive path has hardware of its own. The simulator and
            :func:`~sparkv.scheduler.simulator.ttft_of` stretch the steps by it, the greedy
            planner and the controller's moves to the link charge each chunk ``receive_tax x``
            its time on the link; the session learns it (docs/edge.md, "Priors").
        call_s: the fixed seconds of one compute call, not in ``t_comp``: the simulator charges
            it once per call, where a call is a layer over a span of consecutive token chunks
            (:class:`~sparkv.scheduler.rules.CommitSpans`) or a single step, so a layer's token
            chunks computed as one span pay it once and as fragments once each (the kernels'
            dispatch and a small GEMM's lower rate: on the 2-core CPU a 512-token step alone
            took ~2x its share of a span, docs/scheduler.md, "A call's fixed cost"). 0: ``t_comp``
            carries every cost (planners never read it).
        decode_in_turn: the compute thread decodes every received frame itself, between its
            calls, before its next step (a CPU without a spare core:
            :func:`sparkv.edge.frames.decode_in_turn`), where without it a decoder of its own
            does (a GPU host). The simulator and :func:`~sparkv.scheduler.simulator.ttft_of`
            then run each decode (``t_proc``) on the compute thread, and the controller counts
            the decoding still to come in the compute path's remaining work
            (docs/scheduler.md, "Decoding in turn").
    """

    geometry: ChunkGeometry
    levels: tuple[StreamLevel, ...]
    chunk_bytes: np.ndarray
    t_proc: np.ndarray
    t_comp: np.ndarray
    bandwidth_Bps: float
    rtt_s: float = 0.0
    t_suffix_s: float = 0.0
    quality_floor: str | None = None
    name: str = ""
    decode_overlaps: bool = True
    recent_floor: str | None = None
    stream_tax_s: float = 0.0
    receive_tax: float = 0.0
    call_s: float = 0.0
    decode_in_turn: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        g = self.geometry
        self.levels = tuple(self.levels)
        nl = len(self.levels)
        if nl == 0:
            raise InstanceError("an instance needs at least one codec level")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != nl:
            raise InstanceError(f"duplicate level names in {names}")
        self.chunk_bytes = np.asarray(self.chunk_bytes, dtype=np.int64)
        self.t_proc = np.asarray(self.t_proc, dtype=np.float64)
        self.t_comp = np.asarray(self.t_comp, dtype=np.float64)
        if self.chunk_bytes.shape != (g.num_chunks, nl):
            raise InstanceError(f"chunk_bytes has shape {self.chunk_bytes.shape}, expected "
                                f"{(g.num_chunks, nl)} (chunks x levels)")
        if self.t_proc.shape != (g.num_chunks, nl):
            raise InstanceError(f"t_proc has shape {self.t_proc.shape}, expected {(g.num_chunks, nl)}")
        if self.t_comp.shape != (g.num_token_chunks, g.num_layers):
            raise InstanceError(f"t_comp has shape {self.t_comp.shape}, expected "
                                f"{(g.num_token_chunks, g.num_layers)} (token chunks x layers)")
        if not np.all(np.isfinite(self.t_comp)) or np.any(self.t_comp <= 0):
            raise InstanceError("every t_comp must be a positive number of seconds")
        if not np.all(np.isfinite(self.t_proc)) or np.any(self.t_proc < 0):
            raise InstanceError("every t_proc must be a non-negative number of seconds")
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise InstanceError(f"bandwidth must be positive bytes/s, got {self.bandwidth_Bps}")
        if self.rtt_s < 0 or self.t_suffix_s < 0:
            raise InstanceError("rtt_s and t_suffix_s must be >= 0")
        if not (math.isfinite(self.stream_tax_s) and self.stream_tax_s >= 0):
            raise InstanceError(f"stream_tax_s must be >= 0 seconds, got {self.stream_tax_s}")
        if not (math.isfinite(self.receive_tax) and self.receive_tax >= 0):
            raise InstanceError(f"receive_tax must be >= 0, got {self.receive_tax}")
        if not (math.isfinite(self.call_s) and self.call_s >= 0):
            raise InstanceError(f"call_s must be >= 0 seconds, got {self.call_s}")
        if self.quality_floor is not None and self.quality_floor not in names:
            raise InstanceError(f"quality floor {self.quality_floor!r} is not one of {names}")
        if self.recent_floor is not None and self.recent_floor not in names:
            raise InstanceError(f"recent floor {self.recent_floor!r} is not one of {names}")
        if not np.any(self.allowed_mask, axis=1).all():
            bad = int(np.flatnonzero(~np.any(self.allowed_mask, axis=1))[0])
            raise InstanceError(f"{self.chunk_id(bad)} has no level at or above the quality floor "
                                f"{self.quality_floor!r} (recent floor {self.recent_floor!r})")
        self._cache = {}

    # --- construction helpers ---------------------------------------------------------------
    @classmethod
    def from_mappings(
        cls, geometry: ChunkGeometry, chunk_bytes: Mapping[KVChunkId, Mapping[str, int]],
        t_comp: Mapping[StepId, float], bandwidth_Bps: float, *,
        t_proc: float | Mapping[KVChunkId, Mapping[str, float]] = 0.0, rtt_s: float = 0.0,
        t_suffix_s: float = 0.0, levels: Sequence[StreamLevel] = DEFAULT_LEVELS,
        quality_floor: str | None = None, name: str = "",
        decode_overlaps: bool = True,
    ) -> "Instance":
        """Builds an instance from per-chunk / per-step mappings (e.g. a manifest + a predictor).

        A level missing from a chunk's mapping is "not available" for that chunk. Levels that no
        chunk has are dropped.
        """
        present = {lv for sizes in chunk_bytes.values() for lv in sizes}
        levels = tuple(lv for lv in levels if lv.name in present)
        col = {lv.name: i for i, lv in enumerate(levels)}
        nb = np.full((geometry.num_chunks, len(levels)), -1, dtype=np.int64)
        tp = np.zeros((geometry.num_chunks, len(levels)))
        for i, cid in enumerate(geometry.chunk_ids()):
            sizes = chunk_bytes.get(cid)
            if sizes is None:
                raise InstanceError(f"no sizes given for {cid}")
            for lv, b in sizes.items():
                if lv in col:
                    nb[i, col[lv]] = int(b)
                    if isinstance(t_proc, Mapping):
                        tp[i, col[lv]] = float(t_proc[cid][lv])
                    else:
                        tp[i, col[lv]] = float(t_proc)
        tc = np.zeros((geometry.num_token_chunks, geometry.num_layers))
        for step in geometry.step_ids():
            if step not in t_comp:
                raise InstanceError(f"no compute time given for {step}")
            tc[step.t, step.l] = float(t_comp[step])
        return cls(geometry, levels, nb, tp, tc, float(bandwidth_Bps), rtt_s, t_suffix_s,
                   quality_floor, name, decode_overlaps)

    @property
    def receive_share(self) -> float:
        """The share of a chunk's time on the link the compute path loses beside it (its steps
        run :attr:`receive_tax` + 1 times slower then): ``receive_tax / (1 + receive_tax)``."""
        return self.receive_tax / (1.0 + self.receive_tax)

    def replace(self, **changes: object) -> "Instance":
        """A copy with some fields changed (e.g. ``bandwidth_Bps``, ``quality_floor``)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name != "_cache"}
        fields.update(changes)
        return Instance(**fields)

    def with_bandwidth(self, bandwidth_Bps: float) -> "Instance":
        return self.replace(bandwidth_Bps=float(bandwidth_Bps))

    # --- ids --------------------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return self.geometry.num_token_chunks * self.geometry.num_layers

    @property
    def num_chunks(self) -> int:
        return self.geometry.num_chunks

    @property
    def G(self) -> int:  # noqa: N802 - the paper's name
        return self.geometry.num_groups

    @property
    def L(self) -> int:  # noqa: N802
        return self.geometry.num_layers

    @property
    def n_t(self) -> int:
        return self.geometry.num_token_chunks

    def step_index(self, step: StepId) -> int:
        return step[0] * self.L + step[1]

    def step_id(self, s: int) -> StepId:
        return StepId(s // self.L, s % self.L)

    def chunk_index(self, cid: KVChunkId) -> int:
        return (cid[0] * self.L + cid[1]) * self.G + cid[2]

    def chunk_id(self, c: int) -> KVChunkId:
        s, g = divmod(c, self.G)
        return KVChunkId(s // self.L, s % self.L, g)

    def dense_ids(self) -> tuple[list[StepId], list[KVChunkId]]:
        """Every step's and chunk's id by dense index (made once: :func:`make_plan
        <sparkv.scheduler.planners.base.make_plan>` maps a plan's indices through them)."""
        return self._cached("ids", lambda: ([self.step_id(s) for s in range(self.num_steps)],
                                            [self.chunk_id(c) for c in range(self.num_chunks)]))

    def level_index(self, name: str) -> int:
        for i, lv in enumerate(self.levels):
            if lv.name == name:
                return i
        raise InstanceError(f"unknown level {name!r}; levels are {[lv.name for lv in self.levels]}")

    # --- derived costs ----------------------------------------------------------------------
    def _cached(self, key: str, build: Callable[[], _T]) -> _T:
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def as_lists(self) -> tuple[list[list[int]], list[list[float]], list[float]]:
        """``chunk_bytes``, ``t_proc`` and :attr:`step_t_comp` as Python lists (made once: the
        estimator's inner loops read them element by element, where a NumPy scalar read costs
        several times a list's)."""
        return self._cached("lists", lambda: (self.chunk_bytes.tolist(), self.t_proc.tolist(),
                                              self.step_t_comp.tolist()))

    @property
    def floor_rank(self) -> int:
        if self.quality_floor is None:
            return min(lv.rank for lv in self.levels)
        return self.levels[self.level_index(self.quality_floor)].rank

    @property
    def allowed_mask(self) -> np.ndarray:
        """``bool[num_chunks, num_levels]``: the level exists for the chunk and is >= the floor
        (for the last token chunk's chunks, >= :attr:`recent_floor` too)."""
        def build() -> np.ndarray:
            ranks = np.array([lv.rank for lv in self.levels])
            need = np.full(self.num_chunks, self.floor_rank)
            if self.recent_floor is not None:
                last = np.array([cid.t == self.geometry.num_token_chunks - 1
                                 for cid in self.geometry.chunk_ids()])
                rec = self.levels[self.level_index(self.recent_floor)].rank
                need[last] = np.maximum(need[last], rec)
            mask = (self.chunk_bytes >= 0) & (ranks[None, :] >= need[:, None])
            mask.setflags(write=False)   # cached and shared: read-only
            return mask
        return self._cached("allowed", build)

    def level_allowed(self, c: int, li: int) -> bool:
        return bool(self.allowed_mask[c, li])

    @property
    def transfer_times(self) -> np.ndarray:
        """``float64[num_chunks, num_levels]``: bytes / bandwidth (inf where not allowed)."""
        def build() -> np.ndarray:
            t = self.chunk_bytes / self.bandwidth_Bps
            return np.where(self.allowed_mask, t, np.inf)
        return self._cached("transfer", build)

    @property
    def stream_times(self) -> np.ndarray:
        """``t_stream`` per chunk and level: what one more streamed chunk costs the stream path.

        The paper's ``bytes / bw + t_proc`` when decoding does not overlap transfers; with
        ``decode_overlaps`` (the engine decodes a chunk while the next one transfers) the path is a
        two-stage pipeline and a chunk occupies its bottleneck stage: ``max(bytes / bw, t_proc)``.
        inf where the level is not allowed.
        """
        if self.decode_overlaps:
            return self._cached("stream", lambda: np.maximum(self.transfer_times, self.t_proc))
        return self._cached("stream", lambda: self.transfer_times + self.t_proc)

    @property
    def cheapest_level(self) -> np.ndarray:
        """``int[num_chunks]``: the allowed level with the smallest ``t_stream`` for each chunk."""
        return self._cached("cheapest", lambda: np.argmin(self.stream_times, axis=1))

    @property
    def min_stream_time(self) -> np.ndarray:
        """``float64[num_chunks]``: ``t_stream`` at the cheapest allowed level."""
        return self._cached("min_stream", lambda: self.stream_times.min(axis=1))

    @property
    def step_t_comp(self) -> np.ndarray:
        """``float64[num_steps]``: ``t_comp`` flattened in step-index order."""
        return self._cached("step_t_comp", lambda: self.t_comp.reshape(-1).copy())

    @property
    def step_stream_time(self) -> np.ndarray:
        """``float64[num_steps]``: cheapest streaming time of all the chunks of a step together."""
        return self._cached("step_stream",
                            lambda: self.min_stream_time.reshape(self.num_steps, self.G).sum(axis=1))

    def t_stream(self, cid: KVChunkId, level: str | None = None) -> float:
        c = self.chunk_index(cid)
        li = self.cheapest_level[c] if level is None else self.level_index(level)
        return float(self.stream_times[c, li])

    def bytes_of(self, cid: KVChunkId, level: str) -> int:
        return int(self.chunk_bytes[self.chunk_index(cid), self.level_index(level)])

    def comp_time(self, step: StepId) -> float:
        return float(self.t_comp[step[0], step[1]])

    def summary(self) -> dict[str, object]:
        """Totals for reports: all-local compute, all-stream transfer at the cheapest levels."""
        cheap = self.cheapest_level
        nbytes = self.chunk_bytes[np.arange(self.num_chunks), cheap]
        return {
            "name": self.name,
            "geometry": self.geometry.to_dict(),
            "num_steps": self.num_steps,
            "num_chunks": self.num_chunks,
            "bandwidth_mbps": self.bandwidth_Bps / MBPS,
            "rtt_ms": self.rtt_s * 1e3,
            "quality_floor": self.quality_floor,
            "recent_floor": self.recent_floor,
            "total_compute_s": float(self.t_comp.sum()),
            "total_stream_bytes": int(nbytes.sum()),
            "total_stream_s": float(self.min_stream_time.sum()),
            "t_suffix_s": self.t_suffix_s,
            "stream_tax_s": self.stream_tax_s,
            "receive_tax": self.receive_tax,
            "decode_in_turn": self.decode_in_turn,
        }


# ------------------------------------------------------------------------------------------------
# Synthetic instances
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CostProfile:
    """Per-device cost model used by :func:`synthetic_instance`. Times for a 1024-token chunk.

    ``t_comp(t, l) = step_base_s * n/1024 + step_attn_s * (n/1024) * (end/1024)`` for ``l < L-1``
    (``n`` tokens in chunk ``t``, ``end`` the position after its last token: the attention runs over
    the whole prefix), and ``proj_s * n/1024`` for the last layer (projection only).
    """

    step_base_s: float
    step_attn_s: float
    proj_s: float
    decode_fixed_s: float = 0.001
    decode_Bps: float = 100e6      # Huffman + dequantize throughput (compressed bytes/s)
    raw_copy_Bps: float = 2e9      # fp16 levels are only copied
    entropy_fraction: float = 0.8  # coded size / (values * bits / 8), on average
    scale_bytes_per_channel: float = 4.0  # per-channel min/step in fp16 for K and V
    suffix_tokens: int = 64        # the question
    call_s: float = 0.0            # a compute call's fixed cost (Instance.call_s)


#: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64) on this 2-core CPU. Dense prefill measured:
#: 1K tokens 2.2 s, 2K 3.8 s, 4K 10.2 s, 8K 25.9 s. A least-squares fit of
#: ``30 * (a*n + b*n*(n+1)/2)`` (n = 1K chunks) gives a ~ 0.054, b ~ 0.0117; chunked prefill pays a
#: little more per step (smaller matrix products), so a = 0.058: ~70 ms per layer step at t = 0,
#: rising by 11.7 ms per preceding 1K chunk. The last layer's K/V projection of 1K tokens: ~8 ms.
SMOLLM2_135M_CPU = CostProfile(step_base_s=0.058, step_attn_s=0.0117, proj_s=0.008)

#: SmolLM2-135M as the edge runs it now on a 2-core AVX512-BF16/AMX CPU (``--dtype auto``, here
#: ``mixed-mlp``; a layer's token chunks as one span, session 71, ``python bench/call_cost.py``):
#: a layer of a 2K context as one span of four 512-token chunks 32.9 ms, as four single steps
#: 41.1 ms (8.4, 9.9, 10.8, 11.7), as two spans 35.9-37.7 ms: a call's fixed cost ~2.7 ms, a
#: 512-token chunk's work 5.7 ms plus 1.1 ms per 512 tokens before it. A local prefill at 2K
#: ~1.0 s (the fp32 profile above: 3.8 s).
SMOLLM2_135M_CPU_SPANS = CostProfile(step_base_s=0.0092, step_attn_s=0.0044, proj_s=0.004,
                                     call_s=0.0027)


def synthetic_instance(
    num_tokens: int, *, chunk_tokens: int = 1024, num_layers: int = 30, num_kv_heads: int = 3,
    head_dim: int = 64, heads_per_group: int = 0, bandwidth_mbps: float = 50.0,
    rtt_ms: float = 20.0, profile: CostProfile = SMOLLM2_135M_CPU, heterogeneity: float = 0.3,
    seed: int = 0, levels: Sequence[StreamLevel] = DEFAULT_LEVELS,
    quality_floor: str | None = DEFAULT_QUALITY_FLOOR,
) -> Instance:
    """A realistic random instance (defaults: SmolLM2-135M on this CPU, 1K-token chunks).

    ``heterogeneity`` is the log-normal sigma of the per-step attention cost (sparsity varies by
    chunk and layer) and, halved, of the per-chunk entropy-coded size. 0 gives a homogeneous
    instance. Sizes: ``values * bits / 8 * entropy + scales`` bytes (raw: 2 bytes per value).
    """
    geom = ChunkGeometry(num_tokens, chunk_tokens, num_layers, num_kv_heads, head_dim,
                         heads_per_group)
    rng = np.random.default_rng(seed)
    n_t, L = geom.num_token_chunks, geom.num_layers
    ref = 1024.0
    t_comp = np.empty((n_t, L))
    attn_noise = (portable_exp(rng.normal(0.0, heterogeneity, size=(n_t, L))) if heterogeneity
                  else np.ones((n_t, L)))
    for t in range(n_t):
        start, end = geom.token_range(t)
        n = end - start
        base = profile.step_base_s * n / ref
        attn = profile.step_attn_s * (n / ref) * (end / ref)
        t_comp[t, :] = base + attn * attn_noise[t, :]
        t_comp[t, L - 1] = profile.proj_s * n / ref
    levels = tuple(levels)
    nb = np.empty((geom.num_chunks, len(levels)), dtype=np.int64)
    tp = np.empty((geom.num_chunks, len(levels)))
    ent = (portable_exp(rng.normal(0.0, heterogeneity / 2, size=geom.num_chunks))
           if heterogeneity else np.ones(geom.num_chunks))
    ent = np.clip(profile.entropy_fraction * ent, 0.4, 1.0)
    for c, cid in enumerate(geom.chunk_ids()):
        values = geom.chunk_values(cid)
        scales = 2 * geom.heads_per_group * head_dim * profile.scale_bytes_per_channel
        for i, lv in enumerate(levels):
            if lv.bits >= 16:
                size = values * 2
                tp[c, i] = profile.decode_fixed_s / 2 + size / profile.raw_copy_Bps
            else:
                size = int(values * lv.bits / 8 * ent[c] + scales)
                tp[c, i] = profile.decode_fixed_s + size / profile.decode_Bps
            nb[c, i] = int(size)
    q = profile.suffix_tokens
    t_suffix = L * (profile.call_s + profile.step_base_s * q / ref
                    + profile.step_attn_s * (q / ref) * ((num_tokens + q) / ref))
    return Instance(geom, levels, nb, tp, t_comp, bandwidth_mbps * MBPS, rtt_ms / 1e3, t_suffix,
                    quality_floor, name=f"synthetic-{num_tokens}tok-{bandwidth_mbps:g}mbps-s{seed}",
                    call_s=profile.call_s)
