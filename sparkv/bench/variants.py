"""The lossy knobs of the quality table as *variants* of one dense reference (docs/quality.md).

A variant is one way of turning a context into the KV cache an answer is generated from, made in
this process from the dense full-precision reference (:class:`Reference`: one prefill per task)
or computed as that configuration would compute it. One class per group, behind
:data:`VARIANTS`:

=========  ============================  ======================================================
group      value                         the cache
=========  ============================  ======================================================
level      ``q8``, ``q6``, ... ``raw``   every chunk of the dense K/V (the server's geometry,
                                         ``T`` tokens) through the codec's real ``encode`` and
                                         ``decode``: bit for bit what streaming that level
                                         delivers (tested against the server and the edge)
backend    ``dense``, ``block_sparse``   the edge's local path: a :class:`LayerStepper` with
                                         that attention backend computes every chunk
dtype      ``bfloat16``, ``mixed``, ...  the edge's local path (dense attention) on a copy of
                                         the model in that compute configuration
                                         (:mod:`sparkv.runtime.compute`); the answer in it too
press      a spec, ``adakv:0.5@repeat``  the server's question-agnostic press
                                         (:func:`sparkv.server.encoder.press_layers`) on the
                                         dense K/V, pruned as the edge prunes a compressed
                                         context (raw values: the press alone)
device     a ratio, ``0.75``             the device service's tolerance compression: its own
                                         :class:`~sparkv.device.levels.LevelPolicy` assigns
                                         each 16-token chunk's level from the densities measured
                                         on the reference prefill; its payloads quantize them
                                         into a paged memory, filled into a working memory as
                                         a switch fills one (what the service answers from)
=========  ============================  ======================================================

``variant.load(reference)`` returns a :class:`VariantLoad`: the model to answer with, the
assembled :class:`~sparkv.cache.ContextKV` and what it cost (bytes, chunks, levels).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch

from sparkv.bench.answers import Config

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

#: dense slots every assembled cache keeps for the question and the answer
SPARE_TOKENS = 128
#: the server's token chunk (``sparkv bench quality --chunk-tokens``; the TTFT benchmarks' T)
SERVER_CHUNK_TOKENS = 512


@dataclass
class Reference:
    """The dense full-precision reference of one context, shared by every variant.

    Attributes:
        lm: the reference model (fp32).
        token_ids: the context's tokens (N).
        layers: per layer ``(K, V)`` ``[1, kv_heads, N, head_dim]``, the model's own prefill.
        window: the question-agnostic press window captured on that prefill
            (:func:`sparkv.presses.prefill`, ``PRESS_WINDOW`` tokens).
        mass, rows: the device service's attention statistics of that prefill
            (:class:`~sparkv.device.density.DensityRecorder`), ``None`` unless asked.
        chunk_tokens: the server's T.
        prefill_s, prefill_cpu_s: seconds (wall, CPU) the prefill took.
    """

    lm: LoadedModel
    token_ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    window: Any
    mass: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    chunk_tokens: int = SERVER_CHUNK_TOKENS
    prefill_s: float = 0.0
    prefill_cpu_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def prefill_reference(lm: LoadedModel, token_ids: Sequence[int], *, density: bool = False,
                      chunk_tokens: int = SERVER_CHUNK_TOKENS) -> Reference:
    """The model's own full fp32 prefill of the context (the K/V of
    :func:`~sparkv.runtime.generate.reference_prefill`, logits of the last position only), with
    the press window and, when ``density``, the device service's densities recorded on it."""
    from sparkv.device.density import DensityRecorder, install_hooks, recording
    from sparkv.presses import prefill
    from sparkv.server.encoder import PRESS_WINDOW

    t0, c0 = time.perf_counter(), time.process_time()
    rec = DensityRecorder(len(token_ids)) if density else None
    if rec is not None:
        install_hooks(lm.model)
    with recording(rec):
        layers, window, _ = prefill(lm, token_ids, window=PRESS_WINDOW)
    return Reference(lm, list(token_ids), layers, window,
                     rec.mass if rec is not None else None, rec.rows if rec is not None else None,
                     chunk_tokens, time.perf_counter() - t0, time.process_time() - c0)


@dataclass
class VariantLoad:
    """A variant's cache of one context, and what making it cost. The attribute names are the
    edge's :class:`~sparkv.edge.results.Breakdown`'s, so the rows are scored alike.

    Attributes:
        lm: the model that answers over ``kv`` (the reference's, or a copy in another dtype).
        kv: the assembled cache (N context tokens plus :data:`SPARE_TOKENS` free slots).
        bytes_streamed: what the cache costs on the wire (level, press) or in the device's
            memory (device); 0 for computed caches.
        chunks_streamed, chunks_computed: chunks of the server's geometry made each way.
        levels: chunks per level (``{"q5": 120}``, ``{"fp": 1, "int8": 120}``).
        info: the variant's own facts (a press's ``kept_fraction``).
        load_s: seconds it took to make (prefill of computed variants included).
        load_cpu_s: CPU seconds of this process over the same span (all threads): the cost on
            a shared machine, where wall time measures the other jobs too.
    """

    lm: LoadedModel
    kv: Any
    bytes_streamed: int = 0
    chunks_streamed: int = 0
    chunks_computed: int = 0
    levels: dict[str, int] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    load_s: float = 0.0
    load_cpu_s: float = 0.0


class Variant:
    """One configuration made in process (module docstring). Subclasses set ``group`` and
    implement :meth:`_load`."""

    group: ClassVar[str] = ""

    def __init__(self, value: str) -> None:
        self.value = str(value).strip()
        if not self.value:
            raise ValueError(f"a {self.group} variant needs a value")

    @property
    def name(self) -> str:
        raise NotImplementedError

    def config(self) -> Config:
        """The row's configuration (``Config.group`` is :attr:`group`)."""
        raise NotImplementedError

    def needs_density(self) -> bool:
        """Whether the reference must record the device service's densities."""
        return False

    def load(self, ref: Reference) -> VariantLoad:
        """This variant's cache of the reference's context (timed in ``load_s``)."""
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = self._load(ref)
        out.load_s, out.load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        return out

    def _load(self, ref: Reference) -> VariantLoad:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.value!r})"


def server_geometry(lm: LoadedModel, n: int, chunk_tokens: int) -> Any:
    """The chunk geometry the server encodes a context of ``n`` tokens with."""
    from sparkv.layout import ChunkGeometry

    return ChunkGeometry.from_config(lm.config, n, chunk_tokens)


class LevelVariant(Variant):
    """Every chunk streamed at one codec level: the codec's real encode + decode."""

    group = "level"

    def __init__(self, value: str) -> None:
        from sparkv.codec import get_level

        super().__init__(value)
        get_level(self.value)   # CodecError for an unknown level

    @property
    def name(self) -> str:
        return f"stream@{self.value}"

    def config(self) -> Config:
        return Config(self.name, self.group, "stream", self.value, "dense")

    def _load(self, ref: Reference) -> VariantLoad:
        from sparkv.cache import ContextKV
        from sparkv.codec import KVChunk, decode, encode
        from sparkv.runtime import split_chunks

        g = server_geometry(ref.lm, ref.num_tokens, ref.chunk_tokens)
        kv = ContextKV(g, ref.lm.dtype, ref.lm.device, spare_tokens=SPARE_TOKENS)
        nbytes = 0
        for cid, (k, v) in split_chunks(ref.layers, g).items():
            frame = encode(KVChunk(cid, g.token_range(cid.t)[0], k.contiguous(), v.contiguous(),
                                   g.num_layers), self.value)
            nbytes += len(frame)
            chunk = decode(frame)
            kv.put(cid, chunk.k, chunk.v, source="streamed")
        n = g.num_chunks
        return VariantLoad(ref.lm, kv, nbytes, n, 0, {self.value: n})


def local_cache(lm: LoadedModel, ref: Reference, backend: Any) -> Any:
    """The edge's local path: every chunk of the server's geometry computed by a
    :class:`~sparkv.runtime.stepper.LayerStepper` with ``backend``; its KV memory."""
    from sparkv.runtime.stepper import LayerStepper

    stepper = LayerStepper(lm, ref.token_ids, ref.chunk_tokens, backend=backend,
                           spare_tokens=SPARE_TOKENS)
    stepper.complete()
    return stepper.kv


class BackendVariant(Variant):
    """Every chunk computed locally with one attention backend."""

    group = "backend"

    def __init__(self, value: str) -> None:
        from sparkv.runtime.attention import get_backend

        super().__init__(value)
        get_backend(self.value)   # BackendUnavailableError for an unknown backend

    @property
    def name(self) -> str:
        return f"local/{self.value}"

    def config(self) -> Config:
        return Config(self.name, self.group, "local", None, self.value)

    def _load(self, ref: Reference) -> VariantLoad:
        from sparkv.runtime.attention import get_backend

        kv = local_cache(ref.lm, ref, get_backend(self.value))
        n = kv.geometry.num_chunks
        return VariantLoad(ref.lm, kv, chunks_computed=n)


#: the reference model in another compute configuration, by (model id, name): one copy per
#: process
_CONVERTED: dict[tuple[int, str], Any] = {}


def model_in_compute(lm: LoadedModel, name: str) -> Any:
    """``lm`` itself when it already computes in configuration ``name``, else a copy of it in
    that configuration (made once; :func:`sparkv.predictor.dtypes.convert`)."""
    from sparkv.predictor.dtypes import convert
    from sparkv.runtime.compute import get_compute
    from sparkv.runtime.model import LoadedModel

    config = get_compute(name)
    if lm.compute == config:
        return lm
    key = (id(lm), config.name)
    if key not in _CONVERTED:
        model = copy.deepcopy(lm.model)
        model.eval()
        other = LoadedModel(model, lm.tokenizer, lm.name, lm.fingerprint,
                            {"base_fingerprint": lm.base_fingerprint})
        convert(other, config.name)       # mixed-layers: with the model's stored selection
        _CONVERTED[key] = other
    return _CONVERTED[key]


class DtypeVariant(Variant):
    """The local path (dense attention) in another compute configuration (a dtype, or
    ``mixed``, ``int4``, ...: :mod:`sparkv.runtime.compute`); answered in it too."""

    group = "dtype"

    def __init__(self, value: str) -> None:
        from sparkv.runtime.compute import ComputeError, get_compute

        super().__init__(value)
        try:
            self.compute = get_compute(self.value)
        except ComputeError as exc:                 # a bad value, as every group reports it
            raise ValueError(str(exc)) from None

    @property
    def name(self) -> str:
        return f"local/dense@{self.value}"

    def config(self) -> Config:
        return Config(self.name, self.group, "local", None, "dense", dtype=self.value)

    def _load(self, ref: Reference) -> VariantLoad:
        from sparkv.runtime.attention import DenseAttention

        lm = model_in_compute(ref.lm, self.value)
        kv = local_cache(lm, ref, DenseAttention())
        return VariantLoad(lm, kv, chunks_computed=kv.geometry.num_chunks)


class PressVariant(Variant):
    """The server's question-agnostic press on the dense K/V; the cache pruned to what it keeps,
    as the edge prunes a compressed context (:func:`sparkv.edge.session.apply_kept`)."""

    group = "press"

    def __init__(self, value: str) -> None:
        from sparkv.presses import canonical_spec, split_spec

        super().__init__(canonical_spec(value))   # PressError for a bad spec
        self.budget = split_spec(self.value)[1]

    @property
    def name(self) -> str:
        return f"press/{self.value}"

    def config(self) -> Config:
        return Config(self.name, self.group, "stream", "raw", "dense", press=self.value,
                      ratio=self.budget.ratio)

    def _load(self, ref: Reference) -> VariantLoad:
        from sparkv.runtime import memory_from_layers
        from sparkv.server.encoder import press_layers

        pressed = press_layers(ref.lm, self.value, ref.layers, ref.window)
        g = server_geometry(ref.lm, ref.num_tokens, ref.chunk_tokens)
        kv = memory_from_layers(ref.layers, g, spare_tokens=SPARE_TOKENS)
        for l, keep in enumerate(pressed.keep):  # noqa: E741
            kv.prune_layer(l, keep, spare_tokens=SPARE_TOKENS)
        k = ref.layers[0][0]
        nbytes = int(pressed.info["kept_entries"]) * 2 * int(k.shape[-1]) * k.element_size()
        return VariantLoad(ref.lm, kv, nbytes, g.num_chunks, 0, {"raw": g.num_chunks},
                           info={"kept_fraction": pressed.info["kept_fraction"]})


@dataclass
class _Measured:
    """A reference prefill's densities, as the service's level policy reads a context's
    (:class:`~sparkv.device.levels.LevelInputs`; no chunk has a level yet)."""

    mass: torch.Tensor
    rows: torch.Tensor
    levels: list[str] = field(default_factory=list)


class DeviceVariant(Variant):
    """The device service's tolerance compression at a global ratio (bytes relative to int8)."""

    group = "device"

    def __init__(self, value: str) -> None:
        from sparkv.device.config import ServiceConfig

        super().__init__(value)
        self.ratio = float(self.value)
        self.service = ServiceConfig(ratio=self.ratio)   # ValueError outside [0.25, 4]

    @property
    def name(self) -> str:
        return f"device@{self.ratio:g}"

    def config(self) -> Config:
        from sparkv.device.density import ladder_key

        return Config(self.name, self.group, "device", None, "dense", ratio=self.ratio,
                      ladder=ladder_key())

    def needs_density(self) -> bool:
        return True

    def levels(self, ref: Reference) -> tuple[Any, Any, list[str]]:
        """The service's policy, its geometry of this context and every token chunk's level
        (:meth:`LevelPolicy.assign <sparkv.device.levels.LevelPolicy.assign>` on the densities
        recorded on the reference prefill)."""
        from sparkv.device.levels import LevelPolicy
        from sparkv.layout import ChunkGeometry

        if ref.mass is None or ref.rows is None:
            raise ValueError("the reference was prefilled without densities (density=True)")
        cfg = self.service
        policy = LevelPolicy(cfg.compression, self.ratio, cfg.fp_fraction, cfg.fp_protect,
                             ref.lm.dtype)
        g = ChunkGeometry.from_config(ref.lm.config, ref.num_tokens, cfg.chunk_tokens)
        measured = _Measured(ref.mass.clone(), ref.rows.clone())
        return policy, g, policy.assign(measured, g)

    def _load(self, ref: Reference) -> VariantLoad:
        """The context held as the service holds it (each token chunk's payloads at its level in
        a paged :class:`~sparkv.cache.ContextKV`, as its ``adopt`` puts them) and filled into a
        working memory as a switch fills one (:func:`~sparkv.device.loader.fill_layers`, from
        the pages): the cache the service answers from."""
        from sparkv.cache import ContextKV
        from sparkv.device.keeper import adopted_chunks
        from sparkv.device.loader import fill_layers

        policy, g, levels = self.levels(ref)
        C = ContextKV(g, ref.lm.dtype, ref.lm.device, paged=True)
        for payloads in adopted_chunks(ref.layers, g, levels, ref.lm.dtype):
            C.put_payloads(payloads, "injected")
        W = ContextKV(g, ref.lm.dtype, ref.lm.device, spare_tokens=SPARE_TOKENS)
        fill_layers(C, W, range(g.num_layers))
        counts = {lv: levels.count(lv) for lv in dict.fromkeys(levels)}
        return VariantLoad(ref.lm, W, policy.chunks_nbytes(g, levels), 0, 0, counts)


#: the variant classes by group
VARIANTS: dict[str, type[Variant]] = {c.group: c for c in (
    LevelVariant, BackendVariant, DtypeVariant, PressVariant, DeviceVariant)}


def make_variant(group: str, value: str) -> Variant:
    """The variant of ``group`` (a key of :data:`VARIANTS`) at ``value``; ``ValueError`` (or the
    group's own error type) for an unknown group or a bad value."""
    cls = VARIANTS.get(group)
    if cls is None:
        raise ValueError(f"unknown variant group {group!r}; known: {', '.join(VARIANTS)}")
    return cls(value)


def make_variants(spec: dict[str, Sequence[str]]) -> list[Variant]:
    """Every variant of ``{group: [values]}``, in :data:`VARIANTS` order, duplicates dropped."""
    out: dict[str, Variant] = {}
    for group in VARIANTS:
        for value in spec.get(group) or ():
            v = make_variant(group, value)
            out.setdefault(v.name, v)
    return list(out.values())
