"""An ask's context from the server, checked against the device's model: :class:`ContextFetch`.

The first step of :meth:`EdgeSession.ask <sparkv.edge.session.EdgeSession.ask>`: the manifest
and the token ids (from the server, else what this device cached or was given: a local ask
skips the manifest when the device holds the tokens, and a server out of reach falls back to
them), every check a hostile or mistaken server could make necessary (the model's fingerprint,
compute configuration and geometry, the context's length, the tokens' vocabulary), and how to
open an encrypted context's frames.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from sparkv.edge.bounds import out_of_vocabulary
from sparkv.edge.client import EdgeClient
from sparkv.edge.options import AskOptions
from sparkv.edge.planning import AskError
from sparkv.layout import DEFAULT_CHUNK_TOKENS, ChunkGeometry, KVChunkId
from sparkv.protocol import Manifest
from sparkv.protocol.crypto import FrameCipher
from sparkv.protocol.errors import ApiError, ServerUnavailable

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel


class AskInputs(Protocol):
    """What the fetch reads of an ask (``fallback``: it notes a server out of reach there)."""

    context_id: str
    options: AskOptions
    suffix: list[int]
    t_start: float
    token_ids: Sequence[int] | None
    fallback: dict[str, Any]


@dataclass(frozen=True)
class FetchedContext:
    """The context as the manifest step found it."""

    manifest: Manifest | None      # None: the server is out of reach, or a local ask skipped it
    tokens: list[int]
    pressed: Manifest | None       # a compressed context's manifest: its kept positions apply
    seconds: float                 # from the call to here (``Breakdown.manifest_s``)
    wire_bytes: int = 0            # what this step's shaped requests moved over the link,
    wire_seconds: float = 0.0      # and their time (0: none went out, a cached manifest)


class ContextFetch:
    """Fetches and checks contexts of ``client``'s server for the device's model ``lm``."""

    def __init__(self, client: EdgeClient, lm: LoadedModel) -> None:
        self.client, self.lm = client, lm

    @property
    def vocab_size(self) -> int:
        return int(self.lm.decoder.embed_tokens.num_embeddings)

    def fetch(self, ask: AskInputs) -> FetchedContext:
        """The manifest and the token ids, checked against the device's model."""
        wire = self.client.shaped_totals()
        manifest, tokens = self._context(ask)
        self.check_room(ask, len(tokens))
        if manifest is not None:
            self.check_manifest(manifest)
            manifest.check_tokens(tokens)
        pressed = self._pressed(ask.context_id, manifest, tokens)
        after = self.client.shaped_totals()
        return FetchedContext(manifest, tokens, pressed, time.perf_counter() - ask.t_start,
                              after[0] - wire[0], after[1] - wire[1])

    def held(self, ask: AskInputs, tokens: Sequence[int]) -> FetchedContext:
        """The context as the device holds it, without asking the server: its token ids and a
        cached compressed manifest's kept positions (no manifest: nothing is streamed)."""
        self.check_room(ask, len(tokens))
        pressed = self._pressed(ask.context_id, None, list(tokens))
        return FetchedContext(None, list(tokens), pressed, time.perf_counter() - ask.t_start)

    def _pressed(self, context_id: str, manifest: Manifest | None,
                 tokens: list[int]) -> Manifest | None:
        """A compressed context's manifest (docs/presses.md, "On the server"): its kept
        positions shape the assembled cache whichever path makes each chunk (without a fresh
        manifest, the cached one's), checked; ``None`` for an uncompressed context."""
        pressed = manifest if manifest is not None else self.client.known_manifest(context_id)
        if pressed is not None and not pressed.compressed:
            return None
        if pressed is not None and manifest is None:
            self.check_manifest(pressed)
            pressed.check_tokens(tokens)
        return pressed

    def check_room(self, ask: AskInputs, context_tokens: int) -> None:
        """:class:`~sparkv.device.errors.PromptTooLong` when the context, the question and the
        longest answer asked for would run past the model's positions: the device service's rule
        (:func:`~sparkv.device.inputs.check_length`), checked before any load or prelude."""
        from sparkv.device.inputs import check_length

        if self.lm.max_positions:
            check_length(context_tokens, len(ask.suffix) + ask.options.max_new_tokens,
                         self.lm.max_positions,
                         f"context {ask.context_id} ({context_tokens} tokens), with a "
                         f"{len(ask.suffix)}-token question and {ask.options.max_new_tokens} "
                         "new tokens,")

    def check_manifest(self, manifest: Manifest) -> None:
        """Raises :class:`ManifestError` unless ``manifest`` is of this device's model: its
        fingerprint, its geometry, at most the model's positions (and the client's bound) in
        tokens, frames no larger than their chunks could need."""
        from sparkv.runtime.compute import CONFIGS

        lm = self.lm
        manifest.check_model(lm.fingerprint, lm.name)
        manifest.check_compute(CONFIGS)      # a known one is cast once, at the KV memory
        ref = ChunkGeometry.from_config(lm.config, DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_TOKENS)
        bound = self.client.limits.max_context_tokens
        manifest.check_geometry(num_layers=ref.num_layers, num_kv_heads=ref.num_kv_heads,
                                head_dim=ref.head_dim,
                                max_tokens=min(bound, lm.max_positions or bound))

    def frame_opener(self, manifest: Manifest | None) -> Any:
        """Opens an encrypted context's frames with its key (``None``: not encrypted); raises
        :class:`AskError` when the client holds no key for it."""
        if manifest is None or not manifest.encrypted:
            return None
        key = self.client.encryption_keys.get(manifest.context_id)
        if key is None:
            raise AskError(f"context {manifest.context_id} is encrypted: pass its key "
                           "(EdgeClient.encryption_keys[context_id] or --encryption-key)")
        cipher = FrameCipher.from_text(key, manifest.context_id)

        def open_frame(data: bytes, cid: KVChunkId, level: str) -> bytes:
            return cipher.open(data, cid.t, cid.l, cid.g, level)

        return open_frame

    def _context(self, ask: AskInputs) -> tuple[Manifest | None, list[int]]:
        """The manifest (``None`` when the server is out of reach) and the token ids."""
        client, context_id = self.client, ask.context_id
        if ask.token_ids is not None:
            client.remember_tokens(context_id, ask.token_ids)
        tokens = client.known_tokens(context_id)
        manifest: Manifest | None = None
        if ask.options.strategy != "local" or tokens is None:
            try:
                manifest = client.manifest(context_id, use_cache=ask.options.use_cache)
                self.check_manifest(manifest)   # before its token ids: it sizes their body
                if tokens is None:
                    tokens = client.tokens(context_id, vocab_size=self.vocab_size)
            except (ServerUnavailable, ApiError) as e:
                if isinstance(e, ApiError) and not e.retryable:
                    raise
                manifest = client.known_manifest(context_id)
                tokens = client.known_tokens(context_id)
                if tokens is None:
                    raise AskError(f"{e}; and context {context_id} is not on this device (no "
                                   "cached token ids), so it cannot be computed locally") from e
                ask.fallback["server"] = f"unreachable at the start ({type(e).__name__})"
        if tokens is None:  # pragma: no cover - every branch above sets them or raises
            raise AskError(f"no token ids for context {context_id}")
        outside = out_of_vocabulary(tokens, self.vocab_size)
        if outside is not None:   # given by the caller (the server's are checked on arrival)
            raise AskError(f"the token ids of context {context_id} are not this model's: "
                           f"{outside}")
        return manifest, tokens
