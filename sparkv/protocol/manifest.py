"""The manifest: the one description of a stored context (``GET /v1/contexts/{id}``).

One typed model, used everywhere the manifest exists:

* the encoder builds it (:meth:`Manifest.build`) and stores :meth:`Manifest.to_json`;
* the server validates the stored bytes (:meth:`Manifest.parse`) before it serves them, and
  OpenAPI shows this model as the response schema;
* the edge parses what it receives (:meth:`Manifest.parse`) and plans from its sizes.

Parsing checks the whole document, not only its types: the geometry is self-consistent, every
chunk ``(t, l, g)`` of the geometry is listed exactly once with exactly the manifest's levels, each
chunk's token range is the geometry's, every level entry has a positive size and a well-formed
checksum, encrypted entries are 28 bytes larger than their frame, and ``total_bytes`` adds up.
A compressed context (``press`` present) lists, per chunk, the kept positions of each KV head
(:mod:`sparkv.protocol.kept`), checked too: counts match the positions, positions are inside the
chunk, ascending and unique; every chunk has them exactly when the manifest has a press.
Anything else raises :class:`~sparkv.protocol.errors.ManifestError` with a message that names the
first problem. Unknown fields are ignored (a newer server may add some).

Rejecting is cheap: every list and mapping of the document stops at its first bad item
(``fail_fast``), so the cost of a hostile document is its parse, not one error record per bad
entry (a 14 MiB manifest of 416,000 invalid chunk entries took 21 s and 1.5 GB of RSS to
reject; it takes 0.4 s and about nine times its size).

A device checks more than the document's consistency before it trusts a server's sizes:
:meth:`Manifest.check_model` (the model's fingerprint), :meth:`Manifest.check_geometry` (the
model's layers, KV heads and head size, a bound on the tokens, and every frame no larger than its
chunk's values could need) and :meth:`Manifest.check_tokens` (the token ids' digest).
"""

from __future__ import annotations

import json
import re
import time
from functools import cached_property
from typing import Any, Collection, Final, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.protocol.crypto import AAD_FORMAT, ALGORITHM, LAYOUT, NONCE_BYTES, OVERHEAD, TAG_BYTES
from sparkv.protocol.digests import CHECKSUM_PATTERN, tokens_digest
from sparkv.protocol.errors import ManifestError
from sparkv.protocol.kept import CODINGS, decode_kept, encode_kept

MANIFEST_FORMAT: Final = "sparkv-manifest/1"
CONTEXT_ID_PATTERN = r"^[0-9a-f]{32}$"
LEVEL_PATTERN = r"^[a-z0-9_]{1,16}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"
#: a context's name: printable, no control character, at most :data:`MAX_NAME_CHARS`
CONTEXT_NAME_PATTERN = r"^[^\x00-\x1f\x7f]+$"
MAX_NAME_CHARS = 100
MAX_LEVELS = 16
"""Levels a manifest may name (the codec has seven)."""


class TensorQuant(BaseModel):
    """How one tensor (K or V) of a frame is coded. ``bits`` 0 and ``coding`` ``plain``: stored
    exactly. The statistics are informative (the frame header is authoritative)."""

    model_config = ConfigDict(extra="allow")
    bits: int = Field(ge=0, le=16)
    coding: str
    axis: Optional[str] = None
    param_dtype: Optional[str] = None
    predictor: Optional[str] = None
    streams: Optional[int] = None
    exact_tokens: Optional[int] = None
    min: Optional[float] = None
    step_min: Optional[float] = None
    step_max: Optional[float] = None
    step_mean: Optional[float] = None
    entropy_bits_per_value: Optional[float] = None


class LevelEntry(BaseModel):
    """One stored frame: a chunk at one level."""

    bytes: int = Field(gt=0, description="stored (served) size of the frame")
    checksum: str = Field(pattern=CHECKSUM_PATTERN,
                          description="xxh3_128:<hex> of the stored bytes (the frame's ETag)")
    frame_bytes: int = Field(gt=0, description="size of the codec frame before encryption")
    bits_per_value: float = Field(ge=0, description="8 * frame_bytes / (2 * H * N * D) with the "
                                  "frame header's H, N, D: heads_per_group and num_tokens of the "
                                  "chunk, or 1 and kept.frame_rows in a compressed context")
    entropy_bits_per_value: Optional[float] = None
    dtype: Optional[str] = None
    k: TensorQuant
    v: TensorQuant


class KeptInfo(BaseModel):
    """A compressed context's chunk: per KV head of the group, how many entries it keeps and
    where (relative to ``token_start``; coding in :mod:`sparkv.protocol.kept`). The chunk's frames
    hold exactly these rows, head after head (``[1, sum(counts), D]``; a chunk that keeps nothing
    ships a one-row placeholder frame, docs/wire-format.md)."""

    counts: list[int] = Field(min_length=1, fail_fast=True)
    coding: Literal["bitmap", "delta"]
    positions: str = Field(description="canonical base64 of the coded relative positions")

    @property
    def frame_rows(self) -> int:
        """Rows (``N``) of the chunk's frames: ``sum(counts)``, or 1 for the placeholder."""
        return max(1, sum(self.counts))


class PressInfo(BaseModel):
    """How a compressed context was compressed (``POST /v1/contexts`` with ``press``)."""

    spec: str = Field(description="the press spec, canonical (NAME:BUDGET[@WINDOW])")
    name: str
    budget: str = Field(description="a kept ratio (0.5) or tokens per head (256t)")
    mode: Literal["agnostic"] = "agnostic"
    window: int = Field(ge=0, description="the context's last tokens every head keeps")
    probe: Optional[str] = Field(None, description="the fixed probe question used as the "
                                 "window (spec NAME:BUDGET@repeat), or null: the context's end")
    kept_entries: int = Field(ge=0)
    kept_fraction: float = Field(ge=0, le=1)


class ChunkEntry(BaseModel):
    """One KV chunk ``(t, l, g)`` and its frames per level."""

    t: int = Field(ge=0)
    l: int = Field(ge=0)  # noqa: E741
    g: int = Field(ge=0)
    token_start: int = Field(ge=0)
    num_tokens: int = Field(ge=1)
    levels: dict[str, LevelEntry] = Field(fail_fast=True)
    kept: Optional[KeptInfo] = None

    @property
    def id(self) -> KVChunkId:
        return KVChunkId(self.t, self.l, self.g)


class GeometryInfo(BaseModel):
    """How the context is cut into chunks (docs/runtime.md), with the derived counts."""

    num_tokens: int = Field(ge=1)
    chunk_tokens: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    heads_per_group: int = Field(ge=1)  # resolved: a request's 0 ("all") is never stored
    num_token_chunks: int = Field(ge=1)
    num_groups: int = Field(ge=1)
    num_chunks: int = Field(ge=1)

    @classmethod
    def of(cls, g: ChunkGeometry) -> "GeometryInfo":
        return cls(**g.to_dict(), num_token_chunks=g.num_token_chunks, num_groups=g.num_groups,
                   num_chunks=g.num_chunks)

    def to_geometry(self) -> ChunkGeometry:
        return ChunkGeometry(self.num_tokens, self.chunk_tokens, self.num_layers,
                             self.num_kv_heads, self.head_dim, self.heads_per_group)


class ModelInfo(BaseModel):
    """The model whose KV this is, and how the server computed it: ``dtype`` (the KV's) and
    ``compute`` (its compute configuration, docs/dtypes.md; absent in manifests written before
    configurations existed: ``dtype``'s plain configuration)."""

    model_config = ConfigDict(extra="allow", protected_namespaces=())
    name: str
    fingerprint: str
    tokenizer: Optional[str] = None
    dtype: Optional[str] = None
    compute: Optional[str] = Field(None, pattern=r"^[a-z0-9][a-z0-9_.+-]{0,31}$")

    @property
    def compute_name(self) -> str:
        """``compute``, else the plain configuration of ``dtype`` (float32 when neither is
        given)."""
        return self.compute or self.dtype or "float32"


class EncryptionInfo(BaseModel):
    """Present when every stored frame is AES-256-GCM ciphertext (docs/wire-format.md)."""

    algorithm: Literal["AES-256-GCM"] = ALGORITHM
    nonce_bytes: Literal[12] = NONCE_BYTES
    tag_bytes: Literal[16] = TAG_BYTES
    layout: str = LAYOUT
    aad: str = AAD_FORMAT


class Manifest(BaseModel):
    """A stored context's manifest (docs/rest-api.md, "Manifest")."""

    model_config = ConfigDict(protected_namespaces=())
    format: Literal["sparkv-manifest/1"] = MANIFEST_FORMAT
    context_id: str = Field(pattern=CONTEXT_ID_PATTERN)
    created_unix: float
    model: ModelInfo
    num_tokens: int = Field(ge=1)
    tokens_sha256: str = Field(pattern=SHA256_PATTERN)
    geometry: GeometryInfo
    levels: list[str] = Field(min_length=1, max_length=MAX_LEVELS, fail_fast=True)
    frame_version: int = Field(ge=1)
    encryption: Optional[EncryptionInfo] = None
    press: Optional[PressInfo] = None
    name: Optional[str] = Field(None, min_length=1, max_length=MAX_NAME_CHARS,
                                pattern=CONTEXT_NAME_PATTERN)
    """The label given when the context was created (``POST /v1/contexts``'s ``name``); not part
    of its id: the first name given to a text stays."""
    total_bytes: dict[str, int] = Field(fail_fast=True)
    chunks: list[ChunkEntry] = Field(fail_fast=True)

    _nbytes: int = PrivateAttr(default=0)

    # ---- consistency ---------------------------------------------------------------------------
    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        g = self.geometry
        try:
            geo = g.to_geometry()
        except ValueError as e:
            raise ValueError(f"geometry: {e}") from None
        for name, want in (("num_token_chunks", geo.num_token_chunks),
                           ("num_groups", geo.num_groups), ("num_chunks", geo.num_chunks)):
            if getattr(g, name) != want:
                raise ValueError(f"geometry.{name} is {getattr(g, name)}; the geometry gives "
                                 f"{want}")
        if self.num_tokens != g.num_tokens:
            raise ValueError(f"num_tokens {self.num_tokens} != geometry.num_tokens "
                             f"{g.num_tokens}")
        for lv in self.levels:
            if not re.match(LEVEL_PATTERN, lv):
                raise ValueError(f"level name {lv!r} is malformed")
        if len(set(self.levels)) != len(self.levels):
            raise ValueError(f"levels {self.levels} repeat a level")
        want_levels = set(self.levels)
        if len(self.chunks) != geo.num_chunks:
            raise ValueError(f"the manifest lists {len(self.chunks)} chunks; the geometry has "
                             f"{geo.num_chunks}")
        seen: set[tuple[int, int, int]] = set()
        totals = dict.fromkeys(self.levels, 0)
        overhead = OVERHEAD if self.encryption is not None else 0
        for c in self.chunks:
            key = (c.t, c.l, c.g)
            if c.t >= geo.num_token_chunks or c.l >= geo.num_layers or c.g >= geo.num_groups:
                raise ValueError(f"chunk {key} is outside the geometry")
            if key in seen:
                raise ValueError(f"chunk {key} is listed twice")
            seen.add(key)
            start, end = geo.token_range(c.t)
            if (c.token_start, c.num_tokens) != (start, end - start):
                raise ValueError(f"chunk {key} covers tokens [{c.token_start}, "
                                 f"{c.token_start + c.num_tokens}); the geometry says "
                                 f"[{start}, {end})")
            if set(c.levels) != want_levels:
                raise ValueError(f"chunk {key} has levels {sorted(c.levels)}; the manifest has "
                                 f"{sorted(want_levels)}")
            if (c.kept is None) != (self.press is None):
                raise ValueError(f"chunk {key}: kept positions "
                                 + ("missing in a compressed context" if c.kept is None
                                    else "in a context without a press"))
            if c.kept is not None:
                if len(c.kept.counts) != geo.heads_per_group:
                    raise ValueError(f"chunk {key}: kept counts for {len(c.kept.counts)} heads; "
                                     f"the group has {geo.heads_per_group}")
                try:
                    decode_kept(c.kept.counts, c.kept.coding, c.kept.positions, c.num_tokens)
                except ValueError as e:
                    raise ValueError(f"chunk {key}: kept positions: {e}") from None
            for lv, entry in c.levels.items():
                if entry.bytes != entry.frame_bytes + overhead:
                    raise ValueError(f"chunk {key} level {lv}: {entry.bytes} stored bytes for a "
                                     f"{entry.frame_bytes}-byte frame (expected +{overhead})")
                totals[lv] += entry.bytes
        if self.press is not None:
            kept = sum(sum(c.kept.counts) for c in self.chunks if c.kept is not None)
            if kept != self.press.kept_entries:
                raise ValueError(f"the chunks keep {kept} entries; press.kept_entries says "
                                 f"{self.press.kept_entries}")
        if self.total_bytes != totals:
            raise ValueError(f"total_bytes {self.total_bytes} do not add up to the chunks' "
                             f"{totals}")
        return self

    # ---- building, parsing, serialising --------------------------------------------------------
    @classmethod
    def build(cls, *, context_id: str, model: ModelInfo | Mapping[str, Any],
              token_ids: Sequence[int], geometry: ChunkGeometry, levels: Sequence[str],
              frame_version: int, chunks: Sequence[ChunkEntry | Mapping[str, Any]],
              encrypted: bool = False, created_unix: float | None = None,
              press: PressInfo | Mapping[str, Any] | None = None,
              name: str | None = None) -> "Manifest":
        """The manifest of a freshly encoded context (``total_bytes`` is computed). Raises
        :class:`ManifestError` when the pieces do not fit together."""
        entries = [c if isinstance(c, ChunkEntry) else ChunkEntry.model_validate(c)
                   for c in chunks]
        totals = {lv: sum(c.levels[lv].bytes for c in entries if lv in c.levels)
                  for lv in levels}
        try:
            return cls(context_id=context_id,
                       created_unix=time.time() if created_unix is None else created_unix,
                       model=model if isinstance(model, ModelInfo) else ModelInfo(**model),
                       num_tokens=len(token_ids), tokens_sha256=tokens_digest(token_ids),
                       geometry=GeometryInfo.of(geometry), levels=list(levels),
                       frame_version=frame_version,
                       encryption=EncryptionInfo() if encrypted else None,
                       press=(None if press is None else press if isinstance(press, PressInfo)
                              else PressInfo(**press)),
                       name=name, total_bytes=totals, chunks=entries)
        except ValidationError as e:
            raise ManifestError(f"cannot build the manifest: {_first_error(e)}") from None

    @classmethod
    def parse(cls, data: bytes | bytearray | str | Mapping[str, Any]) -> "Manifest":
        """Validates a manifest document (JSON bytes or text, or a decoded mapping)."""
        try:
            if isinstance(data, Mapping):
                m = cls.model_validate(data)
                size = 0
            else:
                m = cls.model_validate_json(data)
                size = len(data)
        except ValidationError as e:
            raise ManifestError(f"malformed manifest: {_first_error(e)}") from None
        except (ValueError, TypeError) as e:  # pragma: no cover - pydantic wraps these
            raise ManifestError(f"malformed manifest: {e}") from None
        m._nbytes = size
        return m

    def to_json(self) -> bytes:
        """The compact JSON document (what the store keeps and the server serves verbatim)."""
        doc = self.model_dump(mode="json", exclude_none=False)
        # an uncompressed context's document is exactly what it was before presses existed
        if doc.get("press") is None:
            doc.pop("press", None)
            for c in doc["chunks"]:
                c.pop("kept", None)
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()

    # ---- views ---------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Size of the parsed document (0 when parsed from a mapping)."""
        return self._nbytes

    @cached_property
    def chunk_geometry(self) -> ChunkGeometry:
        return self.geometry.to_geometry()

    @cached_property
    def index(self) -> dict[tuple[int, int, int, str], LevelEntry]:
        """``(t, l, g, level) -> LevelEntry`` of every stored frame."""
        return {(c.t, c.l, c.g, lv): e for c in self.chunks for lv, e in c.levels.items()}

    @cached_property
    def sizes(self) -> dict[KVChunkId, dict[str, int]]:
        """Per chunk, per level: the stored (served) frame's bytes."""
        return {c.id: {lv: e.bytes for lv, e in c.levels.items()} for c in self.chunks}

    @cached_property
    def checksums(self) -> dict[KVChunkId, dict[str, str]]:
        return {c.id: {lv: e.checksum for lv, e in c.levels.items()} for c in self.chunks}

    @property
    def encrypted(self) -> bool:
        return self.encryption is not None

    @property
    def compressed(self) -> bool:
        """Whether a press compressed the context (its frames hold only kept entries)."""
        return self.press is not None

    @cached_property
    def kept_positions(self) -> dict[KVChunkId, tuple[list[int], list[Any]]]:
        """Compressed contexts: per chunk, ``(counts, absolute positions per head)`` (numpy
        int64, ascending); empty for an uncompressed one."""
        out: dict[KVChunkId, tuple[list[int], list[Any]]] = {}
        for c in self.chunks:
            if c.kept is None:
                continue
            rel = decode_kept(c.kept.counts, c.kept.coding, c.kept.positions, c.num_tokens)
            out[c.id] = (list(c.kept.counts), [r + c.token_start for r in rel])
        return out

    def keep_lists(self) -> list[list[Any]]:
        """Compressed contexts: per layer, per KV head, every kept position (numpy int64,
        ascending), the shape :meth:`ContextKV.prune_layer` takes."""
        import numpy as np

        g = self.chunk_geometry
        parts: list[list[list[Any]]] = [[[] for _ in range(g.num_kv_heads)]
                                        for _ in range(g.num_layers)]
        for cid, (_, pos) in sorted(self.kept_positions.items()):
            h0, _ = g.head_range(cid.g)
            for i, p in enumerate(pos):
                parts[cid.l][h0 + i].append(p)
        return [[np.concatenate(p) if p else np.zeros(0, dtype=np.int64) for p in layer]
                for layer in parts]

    def kept_bytes(self) -> int:
        """Bytes of the position lists (their base64 text) in the manifest."""
        return sum(len(c.kept.positions) for c in self.chunks if c.kept is not None)

    def entry(self, cid: KVChunkId, level: str) -> LevelEntry:
        """The frame of ``cid`` at ``level``; raises ``KeyError``."""
        return self.index[(cid.t, cid.l, cid.g, level)]

    def level_bytes(self, level: str) -> int:
        return int(self.total_bytes.get(level, 0))

    def value_count(self) -> int:
        """Scalars in K and V of the whole context (for bits-per-value summaries)."""
        g = self.geometry
        return 2 * g.num_layers * g.num_kv_heads * g.head_dim * self.num_tokens

    # ---- fitness for a device ------------------------------------------------------------------
    def check_geometry(self, *, num_layers: int, num_kv_heads: int, head_dim: int,
                       max_tokens: int | None = None) -> None:
        """Raises :class:`ManifestError` when the context's geometry is not the device model's
        (``num_layers``, ``num_kv_heads``, ``head_dim``), it has more than ``max_tokens`` tokens
        (the model's positions, or a configured bound; ``None``: no bound), or a frame is larger
        than its chunk's values could need (:func:`max_frame_bytes`): the sizes the edge reads
        frames with are then bounded by the model, whatever a server declares."""
        g = self.geometry
        for name, want in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                           ("head_dim", head_dim)):
            if getattr(g, name) != want:
                raise ManifestError(f"context {self.context_id} declares geometry.{name} = "
                                    f"{getattr(g, name)}; this device's model has {want}")
        if max_tokens is not None and self.num_tokens > max_tokens:
            raise ManifestError(f"context {self.context_id} declares {self.num_tokens} tokens; "
                                f"this device accepts at most {max_tokens}")
        overhead = OVERHEAD if self.encryption is not None else 0
        for c in self.chunks:
            bound = max_frame_bytes(c.num_tokens, g.heads_per_group, g.head_dim) + overhead
            for lv, e in c.levels.items():
                if e.bytes > bound:
                    raise ManifestError(f"context {self.context_id}: chunk {(c.t, c.l, c.g)} "
                                        f"level {lv} declares {e.bytes} bytes; a frame of "
                                        f"{c.num_tokens} tokens needs at most {bound}")

    def check_model(self, fingerprint: str, name: str = "") -> None:
        """Raises :class:`ManifestError` when the context was encoded with another model."""
        if self.model.fingerprint and self.model.fingerprint != fingerprint:
            raise ManifestError(
                f"context {self.context_id} was encoded with model {self.model.name!r} "
                f"(fingerprint {self.model.fingerprint}); this device runs {name or 'a model'} "
                f"(fingerprint {fingerprint}): its KV cache cannot be used")

    def check_compute(self, known: Collection[str]) -> str:
        """The compute configuration that made the context's KV (:attr:`ModelInfo.compute_name`);
        raises :class:`ManifestError` when it is not one of ``known`` (a newer server's). A known
        one is used as it is: its frames are cast once, at the edge's KV memory
        (docs/dtypes.md)."""
        name = self.model.compute_name
        if name not in known:
            raise ManifestError(
                f"context {self.context_id} was computed with compute configuration {name!r}, "
                f"which this device does not know ({', '.join(sorted(known))}): its KV values "
                "cannot be interpreted; upgrade the device or re-encode the context with a "
                "known configuration (docs/dtypes.md)")
        return name

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Raises :class:`ManifestError` when ``token_ids`` are not the context's tokens."""
        if len(token_ids) != self.num_tokens:
            raise ManifestError(f"the context has {self.num_tokens} tokens, the device's copy "
                                f"has {len(token_ids)}")
        if tokens_digest(token_ids) != self.tokens_sha256:
            raise ManifestError("the device's token ids differ from the context's "
                                "(tokens_sha256 mismatch)")


#: a frame's bytes beyond its values (header, quantisation parameters, Huffman tables)
FRAME_SLACK_BYTES = 64 << 10


def max_frame_bytes(num_tokens: int, heads: int, head_dim: int) -> int:
    """The most bytes a codec frame of one chunk can take: K and V of ``num_tokens`` tokens of
    ``heads`` heads at 4 bytes a value (``raw`` of a float32 model, the widest level) plus
    :data:`FRAME_SLACK_BYTES`."""
    return 2 * 4 * int(num_tokens) * int(heads) * int(head_dim) + FRAME_SLACK_BYTES


def _first_error(e: ValidationError) -> str:
    errs = e.errors()
    if not errs:  # pragma: no cover
        return str(e)
    first = errs[0]
    loc = ".".join(str(x) for x in first.get("loc", ()))
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc + ': ' if loc else ''}{msg}{more}"


def kept_entry(positions: Sequence[Any], token_start: int, num_tokens: int) -> KeptInfo:
    """The manifest's :class:`KeptInfo` of one chunk from its heads' absolute positions."""
    counts, coding, text = encode_kept(positions, token_start, num_tokens)
    return KeptInfo(counts=counts, coding=coding, positions=text)


__all__ = ["MANIFEST_FORMAT", "CONTEXT_ID_PATTERN", "Manifest", "ChunkEntry", "LevelEntry",
           "TensorQuant", "GeometryInfo", "ModelInfo", "EncryptionInfo", "KeptInfo", "PressInfo",
           "kept_entry", "max_frame_bytes", "CODINGS"]
