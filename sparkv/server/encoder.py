"""Pre-encoding a context: prefill, cut into chunks, encode every chunk at every level, store,
then publish the manifest. The server's background jobs and ``sparkv encode`` both run
:func:`encode_context`; only the progress reporting differs.

Context ids are derived from the content: SHA-256 over the tenant, the model's fingerprint, the
tokenizer's identity, the token ids, the chunk geometry parameters, the levels, the codec's frame
version, whether frames are encrypted and, for a compressed context, the press spec (first 32
hex digits; an uncompressed context's id is what it always was). The same request twice names the
same context, so it is encoded once.

A compressed context (``ContextSpec.press``, e.g. ``adakv:0.5``; docs/presses.md, "On the
server") is prefilled with the press's question-agnostic window (the context's last
:data:`PRESS_WINDOW` tokens), compressed by the press, and only the kept entries are encoded: per
chunk ``(t, l, g)``, the group's heads' kept rows, head after head, as one ``[1, R, D]`` codec
frame (R = the rows kept; a chunk that keeps none ships a one-row zero placeholder). The
manifest carries the press and, per chunk, the kept positions (:mod:`sparkv.protocol.kept`).

The manifest (docs/rest-api.md, "Manifest") lists every chunk with, per level, the stored size,
an ``xxh3_128`` checksum of the stored bytes (the chunk's ETag), the bits per value, the empirical
entropy of the quantized values and the quantization parameters of K and of V.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.protocol import ChunkEntry, FrameCipher, Manifest, ModelInfo, kept_entry
from sparkv.protocol.digests import checksum, tokens_bytes, tokens_digest
from sparkv.server.errors import StoreError
from sparkv.server.ordered_pool import ordered_map
from sparkv.server.stores.base import ChunkKey, ChunkStore, Store

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

log = logging.getLogger("sparkv.server.encoder")

ID_VERSION = 1
PRESS_WINDOW = 32
"""The question-agnostic window of a server-side press (as :mod:`sparkv.presses` uses it)."""

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``: phase is ``prefill``, ``encoding`` or ``publishing``."""


class JobCancelled(Exception):
    """The job was cancelled (its context deleted) while it ran."""


@dataclass(frozen=True)
class ContextSpec:
    """What to encode. ``levels`` in canonical order (see :func:`canonical_levels`)."""

    tenant: str
    model: str
    token_ids: tuple[int, ...]
    chunk_tokens: int
    levels: tuple[str, ...]
    heads_per_group: int = 0
    encrypted: bool = False
    press: str | None = None
    """A canonical press spec (:func:`sparkv.presses.canonical_spec`), or ``None``."""
    name: str | None = None
    """The context's label (the manifest's ``name``); not part of its id."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def to_record(self) -> dict[str, Any]:
        d = asdict(self)
        d["token_ids"] = list(self.token_ids)
        d["levels"] = list(self.levels)
        return d

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> "ContextSpec":
        return cls(d["tenant"], d["model"], tuple(int(x) for x in d["token_ids"]),
                   int(d["chunk_tokens"]), tuple(d["levels"]), int(d.get("heads_per_group", 0)),
                   bool(d.get("encrypted", False)), d.get("press") or None,
                   d.get("name") or None)


def canonical_levels(levels: Sequence[str]) -> tuple[str, ...]:
    """Unique levels in the codec's order (best quality first). Raises ``ValueError``."""
    from sparkv.codec import LEVEL_ORDER

    bad = [x for x in levels if x not in LEVEL_ORDER]
    if bad or not levels:
        raise ValueError(f"unknown levels {bad}; known: {', '.join(LEVEL_ORDER)}")
    return tuple(x for x in LEVEL_ORDER if x in set(levels))


def derive_context_id(spec: ContextSpec, model_fingerprint: str, tokenizer_id: str) -> str:
    """The content-derived id (32 lowercase hex digits). See the module docstring."""
    from sparkv.codec.frame import VERSION as FRAME_VERSION

    doc = {
        "id_version": ID_VERSION,
        "tenant": spec.tenant,
        "model": model_fingerprint,
        "tokenizer": tokenizer_id,
        "tokens": tokens_digest(spec.token_ids),
        "num_tokens": spec.num_tokens,
        "chunk_tokens": spec.chunk_tokens,
        "heads_per_group": spec.heads_per_group,
        "levels": list(spec.levels),
        "frame_version": FRAME_VERSION,
        "encrypted": spec.encrypted,
    }
    if spec.press:
        doc["press"] = spec.press
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def largest_frame_bytes(geometry: ChunkGeometry, dtype_bytes: int, encrypted: bool) -> int:
    """Bytes of the largest frame a context of ``geometry`` can store: the raw frame of its
    longest chunk (K and V at ``dtype_bytes`` per value, the frame's header and checksum), plus
    the cipher's nonce and tag when ``encrypted``.

    Every level's frame of a chunk is at most its raw frame (a quantized value takes at most 8
    bits, parameters and tables included, against 16 or 32 for the raw dtype; a compressed
    context keeps at most the chunk's rows), so this bounds every frame the context can have.
    """
    from sparkv.codec import get_level
    from sparkv.protocol.crypto import OVERHEAD

    raw = get_level("raw").estimate_bytes(geometry.heads_per_group, geometry.chunk_len(0),
                                          geometry.head_dim, 0, geometry.num_layers,
                                          dtype_bytes)
    return raw + (OVERHEAD if encrypted else 0)


def frame_cap_error(geometry: ChunkGeometry, dtype_bytes: int, encrypted: bool,
                    limit: int) -> tuple[str, int] | None:
    """``(message, bytes)`` when the context's largest frame (:func:`largest_frame_bytes`) would
    be larger than ``limit`` (the server's ``max_frame_bytes``), else ``None``. Checked before
    anything is encoded: a frame is read whole to be verified and served, so its size bounds
    what one request can make the server hold and send."""
    size = largest_frame_bytes(geometry, dtype_bytes, encrypted)
    if size <= limit:
        return None
    return (f"a chunk of this context would make a {size}-byte frame (T = "
            f"{geometry.chunk_len(0)} tokens x {geometry.heads_per_group} KV heads x "
            f"{geometry.head_dim} channels, K and V at {dtype_bytes} bytes per value); this "
            f"server stores frames of at most {limit} bytes: use a smaller chunk_tokens or "
            "heads_per_group"), size


# ------------------------------------------------------------------------------------------------
# Describing a frame
# ------------------------------------------------------------------------------------------------
def _entropy_bits(q: np.ndarray) -> float:
    if q.size == 0:
        return 0.0
    hist = np.bincount(q.reshape(-1))
    p = hist[hist > 0] / q.size
    return float(-(p * np.log2(p)).sum())


def _const_name(prefix: str, value: int) -> str:
    """The lowercase name of a codec constant (``PRED_CHANNEL`` -> ``channel``)."""
    from sparkv.codec import frame as frame_mod

    for name in dir(frame_mod):
        if name.startswith(prefix) and getattr(frame_mod, name) == value:
            return name[len(prefix):].lower()
    return str(value)


def _tensor_info(th: Any, q: np.ndarray | None) -> tuple[dict[str, Any], float | None, int]:
    """Manifest entry of one tensor, its quantized-value entropy (bits/value) and value count;
    ``q``: its quantization values (:func:`~sparkv.codec.frame.quantized_values`)."""
    from sparkv.codec import quant

    if th.lossless:
        return {"bits": 0, "coding": "plain"}, None, 0
    info: dict[str, Any] = {
        "bits": th.bits,
        "axis": quant.AXIS_NAMES.get(th.axis, str(th.axis)),
        "param_dtype": "fp16" if th.param_dtype == quant.PARAM_FP16 else "fp32",
        "coding": _const_name("CODING_", th.coding),
        "predictor": _const_name("PRED_", th.predictor),
        "streams": th.num_streams,
        "exact_tokens": th.exact_tokens,
    }
    mins, steps = getattr(th, "mins", None), getattr(th, "steps", None)
    if mins is None or steps is None or q is None:  # every token exact: nothing quantized
        return info, None, 0
    info["min"] = float(mins.min())
    info["step_min"] = float(steps.min())
    info["step_max"] = float(steps.max())
    info["step_mean"] = float(steps.mean())
    ent = _entropy_bits(q)
    info["entropy_bits_per_value"] = round(ent, 4)
    return info, ent, q.size


def describe_frame(frame: bytes) -> dict[str, Any]:
    """Size, bits per value, entropy and quantization parameters of one (plaintext) frame.

    Decodes its symbols (so every stored frame's coded streams are known to decode) into the
    quantization values, whose order-0 entropy it measures. (Before, it decoded the whole frame
    and recovered the values from the dequantized ones: twice the time.)
    """
    from sparkv.codec import peek_header
    from sparkv.codec.frame import quantized_values

    hdr = peek_header(frame)
    kq, vq = quantized_values(frame)
    k_info, k_ent, k_n = _tensor_info(hdr.k, kq)
    v_info, v_ent, v_n = _tensor_info(hdr.v, vq)
    entropy = None
    if k_n + v_n:
        entropy = round(((k_ent or 0.0) * k_n + (v_ent or 0.0) * v_n) / (k_n + v_n), 4)
    return {
        "frame_bytes": len(frame),
        "bits_per_value": round(8 * len(frame) / hdr.num_values, 4),
        "entropy_bits_per_value": entropy,
        "dtype": str(hdr.dtype).replace("torch.", ""),
        "k": k_info,
        "v": v_info,
    }


# ------------------------------------------------------------------------------------------------
# Encoding a context
# ------------------------------------------------------------------------------------------------
@dataclass
class EncodeStats:
    """Where an encode spent its time (seconds) and what it did."""

    prefill_s: float = 0.0
    codec_s: float = 0.0
    """Time in :func:`sparkv.codec.encode` alone."""
    describe_s: float = 0.0
    """Decoding every frame back and measuring its entropy (the manifest's details)."""
    encrypt_s: float = 0.0
    store_s: float = 0.0
    total_s: float = 0.0
    frames_encoded: int = 0
    frames_reused: int = 0
    frames_by_level: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _manifest(spec: ContextSpec, context_id: str, entry: Any, geometry: ChunkGeometry,
              chunks: list[dict[str, Any]], press: dict[str, Any] | None = None) -> Manifest:
    from sparkv.codec.frame import VERSION as FRAME_VERSION

    model = ModelInfo(name=spec.model, fingerprint=entry.fingerprint,
                      tokenizer=entry.tokenizer_id,
                      dtype=str(entry.lm.dtype).replace("torch.", ""),
                      compute=entry.lm.compute.prefill_name)    # what made the KV
    return Manifest.build(context_id=context_id, model=model, token_ids=spec.token_ids,
                          geometry=geometry, levels=spec.levels, frame_version=FRAME_VERSION,
                          chunks=[ChunkEntry.model_validate(c) for c in chunks],
                          encrypted=spec.encrypted, press=press, name=spec.name)


def prefill_kv(lm: LoadedModel, token_ids: Sequence[int]) -> list[tuple[Any, Any]]:
    """The model's own full prefill, per layer ``(K, V)`` ``[1, kv_heads, N, head_dim]``.

    The same forward as :func:`sparkv.runtime.reference_prefill` (and bit-identical K/V, tested),
    but asking for the last position's logits only: a ``[N, vocab]`` logits tensor would cost
    1.6 GB at 8K tokens for nothing.
    """
    import torch

    from sparkv.runtime import from_dynamic_cache, reference_prefill
    from sparkv.runtime.hfcache import output_cache

    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    try:
        with torch.inference_mode():
            out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    except TypeError:  # a transformers without logits_to_keep
        return reference_prefill(lm, token_ids)
    return [(k.contiguous(), v.contiguous()) for k, v in from_dynamic_cache(output_cache(out))]


@dataclass
class PressedContext:
    """A context compressed by a press: its full per-layer K/V, the plan's kept positions
    (``keep[l][h]``, ascending int64) and the manifest's ``press`` description."""

    layers: list[tuple[Any, Any]]
    keep: list[list[Any]]
    info: dict[str, Any]


def press_context(lm: LoadedModel, spec: str, token_ids: Sequence[int]) -> PressedContext:
    """Prefills the context and runs the press ``spec`` question-agnostically: the window is the
    context's last :data:`PRESS_WINDOW` tokens, kept by every head, or with ``@repeat`` a fixed
    probe question (:data:`sparkv.presses.PROBES`) run after the context, nothing forced."""
    from sparkv.presses import prefill, split_spec

    split_spec(spec)   # a bad spec fails before the prefill
    layers, window, _ = prefill(lm, token_ids, window=PRESS_WINDOW)
    return press_layers(lm, spec, layers, window)


def press_layers(lm: LoadedModel, spec: str, layers: list[tuple[Any, Any]], window: Any
                 ) -> PressedContext:
    """:func:`press_context` of an already prefilled context: ``layers`` its per-layer K/V and
    ``window`` the question-agnostic window :func:`sparkv.presses.prefill` captured with
    ``window=PRESS_WINDOW`` (the quality benchmark presses its dense reference this way)."""
    from sparkv.presses import PROBES, question_window, score_layers, split_spec
    from sparkv.presses import to_memory
    from sparkv.runtime.generate import prompt_parts

    press, budget, window_name = split_spec(spec)
    memory = to_memory(lm, layers)
    probe = PROBES.get(window_name)
    if probe is not None:   # a fixed probe question after the context (the edge's chat layout)
        window = question_window(lm, memory, prompt_parts(lm, [], probe)[1])
    scores, forced = score_layers(memory, press, window)
    del memory
    plan = press.plan(scores, int(layers[0][0].shape[2]), budget, forced)
    info = {"spec": spec, "name": spec.partition(":")[0], "budget": str(budget),
            "mode": "agnostic", "window": int(plan.forced), "probe": probe,
            "kept_entries": int(plan.kept_entries),
            "kept_fraction": round(float(plan.kept_fraction), 6)}
    return PressedContext([(k.cpu(), v.cpu()) for k, v in layers],
                          [[x.cpu().long() for x in row] for row in plan.keep], info)


def kept_rows(pressed: PressedContext, geometry: ChunkGeometry, cid: KVChunkId
              ) -> tuple[list[Any], Any, Any]:
    """A compressed chunk's kept positions per head (absolute) and its ``[1, R, D]`` K and V
    (the heads' kept rows, head after head; ``R = 1`` zeros when nothing is kept)."""
    import torch

    k, v = pressed.layers[cid.l]
    t0, t1 = geometry.token_range(cid.t)
    h0, h1 = geometry.head_range(cid.g)
    pos, ks, vs = [], [], []
    for h in range(h0, h1):
        keep = pressed.keep[cid.l][h]
        p = keep[(keep >= t0) & (keep < t1)]
        pos.append(p)
        ks.append(k[0, h, p])
        vs.append(v[0, h, p])
    kk, vv = torch.cat(ks), torch.cat(vs)
    if kk.shape[0] == 0:
        kk = torch.zeros(1, geometry.head_dim, dtype=k.dtype)
        vv = torch.zeros_like(kk)
    return pos, kk.unsqueeze(0).contiguous(), vv.unsqueeze(0).contiguous()


class _ContextEncoder:
    """The state of one :func:`encode_context` run over one context.

    Holds the chunk geometry, the context's per-chunk K/V (``pieces``, empty until prefilled),
    the press's result (``pressed``, a compressed context only), the manifest's chunk entries
    built so far (``entries``, in the order chunks first complete) and the stats. One run on one
    thread: no lock.
    """

    def __init__(self, entry: Any, spec: ContextSpec, context_id: str, chunks: ChunkStore,
                 cipher: FrameCipher | None) -> None:
        self.entry, self.spec, self.context_id = entry, spec, context_id
        self.chunks, self.cipher = chunks, cipher
        self.geometry = ChunkGeometry.from_config(entry.lm.config, spec.num_tokens,
                                                  spec.chunk_tokens, spec.heads_per_group)
        self.stats = EncodeStats()
        self.pieces: dict[KVChunkId, tuple[Any, Any]] = {}
        self.pressed: PressedContext | None = None
        self.entries: dict[KVChunkId, dict[str, Any]] = {}
        self._lock = threading.Lock()  # frames are coded on several threads: the stats and
        # the late prefill (a reused frame found damaged) go under it

    def todo(self, reuse_stored: bool) -> list[tuple[KVChunkId, str, bool]]:
        """Every ``(chunk, level, needed)`` in encoding order: ``needed`` is false for a frame
        already stored (reused only when ``reuse_stored`` and not encrypting)."""
        spec = self.spec
        existing = (self.chunks.keys(spec.tenant, self.context_id)
                    if reuse_stored and not self.cipher else set())
        return [(cid, lv, ChunkKey(*cid, lv) not in existing)
                for cid in self.geometry.chunk_ids() for lv in spec.levels]

    # --- the context's K/V --------------------------------------------------------------------
    def prefill(self, any_needed: bool) -> None:
        """Prefills (and presses) the context when a frame must be encoded or a press's kept
        positions must go into the manifest."""
        if self.spec.press:  # the kept positions go into the manifest: always prefilled, pressed
            from sparkv.runtime import split_chunks

            t0 = time.perf_counter()
            self.pressed = press_context(self.entry.lm, self.spec.press, self.spec.token_ids)
            self.pieces = split_chunks(self.pressed.layers, self.geometry)
            self.stats.prefill_s = time.perf_counter() - t0
        elif any_needed:
            self._prefill_plain()

    def _prefill_plain(self) -> None:
        from sparkv.runtime import split_chunks

        t0 = time.perf_counter()
        layer_kv = [(k.cpu(), v.cpu())  # the codec runs on the CPU
                    for k, v in prefill_kv(self.entry.lm, self.spec.token_ids)]
        self.pieces = split_chunks(layer_kv, self.geometry)
        self.stats.prefill_s += time.perf_counter() - t0

    # --- one frame ----------------------------------------------------------------------------
    def frame(self, cid: KVChunkId, level: str, needed: bool) -> tuple[bytes, dict[str, Any]]:
        """The stored bytes of one frame and its description (:func:`describe_frame`): the
        stored frame when it is not ``needed`` and decodes, else a new one encoded and stored."""
        key = ChunkKey(cid.t, cid.l, cid.g, level)
        reused = None if needed else self._reuse(key)
        if reused is not None:
            return reused
        if not self.pieces:  # a reused frame turned out damaged: prefill after all
            with self._lock:
                if not self.pieces:
                    self._prefill_plain()
        return self._encode(cid, level, key)

    def _reuse(self, key: ChunkKey) -> tuple[bytes, dict[str, Any]] | None:
        from sparkv.codec import CodecError

        t0 = time.perf_counter()
        stored = self.chunks.get(self.spec.tenant, self.context_id, key)
        t1 = time.perf_counter()
        info = None
        if stored is not None:
            try:
                info = describe_frame(stored)
            except CodecError:  # damaged leftover: encode it again
                pass
        with self._lock:
            self.stats.store_s += t1 - t0
            if info is not None:
                self.stats.describe_s += time.perf_counter() - t1
                self.stats.frames_reused += 1
        return None if stored is None or info is None else (stored, info)

    def _encode(self, cid: KVChunkId, level: str, key: ChunkKey) -> tuple[bytes, dict[str, Any]]:
        """Quantizes and codes one chunk at one level, seals it (``cipher``) and stores it."""
        from sparkv.codec import KVChunk, encode

        stats, geometry = self.stats, self.geometry
        if self.pressed is not None:
            _, k, v = kept_rows(self.pressed, geometry, cid)
        else:
            k, v = self.pieces[cid]
        t0 = time.perf_counter()
        frame = encode(KVChunk(cid, geometry.token_range(cid.t)[0], k.contiguous(),
                               v.contiguous(), geometry.num_layers), level)
        t1 = time.perf_counter()
        info = describe_frame(frame)
        t2 = time.perf_counter()
        stored = self.cipher.seal(frame, cid.t, cid.l, cid.g, level) if self.cipher else frame
        t3 = time.perf_counter()
        self.chunks.put(self.spec.tenant, self.context_id, key, stored, later=True)
        t4 = time.perf_counter()
        with self._lock:
            stats.codec_s += t1 - t0
            stats.describe_s += t2 - t1
            stats.encrypt_s += t3 - t2
            stats.store_s += t4 - t3
            stats.frames_encoded += 1
            stats.frames_by_level[level] = stats.frames_by_level.get(level, 0) + 1
        return stored, info

    # --- the manifest -------------------------------------------------------------------------
    def record(self, cid: KVChunkId, level: str, stored: bytes, info: dict[str, Any]) -> None:
        """Adds one stored frame to its chunk's manifest entry (made at the chunk's first)."""
        chunk_entry = self.entries.get(cid)
        if chunk_entry is None:
            start, end = self.geometry.token_range(cid.t)
            chunk_entry = self.entries[cid] = {"t": cid.t, "l": cid.l, "g": cid.g,
                                               "token_start": start, "num_tokens": end - start,
                                               "levels": {}}
            if self.pressed is not None:
                pos = kept_rows(self.pressed, self.geometry, cid)[0]
                chunk_entry["kept"] = kept_entry([p.numpy() for p in pos], start,
                                                 end - start).model_dump()
        chunk_entry["levels"][level] = {"bytes": len(stored), "checksum": checksum(stored),
                                        **info}

    def finish(self) -> bytes:
        """Stores the token ids and returns the manifest's JSON (not published)."""
        spec = self.spec
        t0 = time.perf_counter()
        self.chunks.put_tokens(spec.tenant, self.context_id, tokens_bytes(spec.token_ids))
        self.stats.store_s += time.perf_counter() - t0
        press = self.pressed.info if self.pressed is not None else None
        return _manifest(spec, self.context_id, self.entry, self.geometry,
                         list(self.entries.values()), press).to_json()


def encode_context(entry: Any, spec: ContextSpec, context_id: str, chunks: ChunkStore, *,
                   cipher: FrameCipher | None = None, progress: ProgressFn | None = None,
                   should_stop: Callable[[], bool] | None = None, pause_s: float = 0.0,
                   reuse_stored: bool = True, threads: int = 1) -> tuple[bytes, EncodeStats]:
    """Encodes every chunk of a context at every level into ``chunks`` (a store's
    :class:`~sparkv.server.stores.base.ChunkStore`), stores its token ids (``put_tokens``, after
    the last frame) and returns the manifest.

    The caller publishes the manifest (``store.manifests.put``) after this returns, so a crash or a
    cancellation before then leaves no visible context.

    Args:
        entry: the :class:`~sparkv.server.models.ModelEntry` of ``spec.model``.
        cipher: encrypt frames (the manifest then describes the plaintext frames, sizes and
            checksums of the stored ciphertext).
        progress: called as frames complete.
        should_stop: polled between frames; when it returns true, :class:`JobCancelled` is raised.
        pause_s: sleep after each frame (gives CPU back to serving).
        reuse_stored: frames already in the store (a resumed job) are read and described instead
            of encoded again (never with ``cipher``: their key is gone).
        threads: code this many frames at once (:func:`~sparkv.server.ordered_pool.ordered_map`:
            the manifest and the progress keep the frames' order; ``should_stop`` and
            ``pause_s`` act between recorded frames, and a stop waits for the frames in flight
            before it raises, so nothing is stored after it).

    Returns:
        ``(manifest JSON bytes, stats)``.
    """
    t_start = time.perf_counter()
    report = progress or (lambda phase, done, tot: None)
    stop = should_stop or (lambda: False)
    run = _ContextEncoder(entry, spec, context_id, chunks, cipher)
    todo = run.todo(reuse_stored)
    total = len(todo)
    report("prefill", 0, total)
    run.prefill(any(needed for _, _, needed in todo))
    if stop():
        raise JobCancelled()
    report("encoding", 0, total)
    frames = ordered_map(lambda job: run.frame(*job), todo, threads)
    try:
        for done, ((cid, level, _), (stored, info)) in enumerate(zip(todo, frames), 1):
            run.record(cid, level, stored, info)
            report("encoding", done, total)
            if pause_s:
                time.sleep(pause_s)
            if stop():
                raise JobCancelled()
    finally:
        frames.close()  # an early stop: waits for the frames in flight
    report("publishing", total, total)
    data = run.finish()
    run.stats.total_s = time.perf_counter() - t_start
    return data, run.stats


def backfill_tokens(chunks: ChunkStore, spec: ContextSpec, context_id: str) -> bool:
    """Stores the token ids of a published context encoded before they were stored.

    The context id is derived from the token ids (see :func:`derive_context_id`), so a request
    that names an existing context carries exactly its tokens. Returns ``True`` when they were
    missing and are now stored.
    """
    if chunks.has_tokens(spec.tenant, context_id):
        return False
    chunks.put_tokens(spec.tenant, context_id, tokens_bytes(spec.token_ids))
    return True


def discard_unpublished(store: Store, tenant: str, context_id: str) -> None:
    """Removes what a failed or cancelled encode left of a context (frames, token ids) unless its
    manifest was published. A store error is logged, not raised (the job's outcome stands)."""
    try:
        if store.manifests.get(tenant, context_id) is None:
            store.delete_context(tenant, context_id)
    except StoreError:
        log.exception("cannot clean up context %s", context_id)
