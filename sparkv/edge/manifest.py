"""The edge's view of a context manifest (docs/rest-api.md, ``GET /v1/contexts/{id}``).

Only what the device needs: the geometry, the levels, each frame's exact size and checksum, the
model that produced it, the token digest and the encryption scheme. Parsing validates the
document; anything inconsistent raises :class:`ManifestError` (a clear message, never a KeyError).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.layout import ChunkGeometry, KVChunkId

MANIFEST_FORMAT = "sparkv-manifest/1"


class ManifestError(SparkvError):
    """A manifest is malformed or does not fit this device (model, tokens)."""


def tokens_digest(token_ids: Sequence[int]) -> str:
    """SHA-256 of the token ids as little-endian u32 (the manifest's ``tokens_sha256``)."""
    return hashlib.sha256(np.asarray(list(token_ids), dtype="<u4").tobytes()).hexdigest()


@dataclass
class Manifest:
    """A parsed manifest.

    Attributes:
        context_id: the context's id.
        geometry: how the context is cut into chunks.
        levels: the encoded levels, in the server's (codec) order.
        sizes: per chunk, per level: the served frame's bytes.
        checksums: per chunk, per level: ``xxh3_128:<hex>`` of the served bytes (may be empty).
        model_name, model_fingerprint: the model whose KV this is.
        tokens_sha256: digest of the context's token ids.
        encryption: ``None`` or the manifest's encryption description.
        raw: the document as received.
        nbytes: size of the document on the wire (after decompression).
    """

    context_id: str
    geometry: ChunkGeometry
    levels: tuple[str, ...]
    sizes: dict[KVChunkId, dict[str, int]]
    checksums: dict[KVChunkId, dict[str, str]]
    model_name: str
    model_fingerprint: str
    tokens_sha256: str
    encryption: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    nbytes: int = 0

    @classmethod
    def parse(cls, doc: Mapping[str, Any], nbytes: int = 0) -> "Manifest":
        try:
            fmt = doc.get("format")
            if fmt != MANIFEST_FORMAT:
                raise ManifestError(f"unsupported manifest format {fmt!r} (this client reads "
                                    f"{MANIFEST_FORMAT!r})")
            geom = ChunkGeometry.from_dict(doc["geometry"])
            levels = tuple(str(x) for x in doc["levels"])
            sizes: dict[KVChunkId, dict[str, int]] = {}
            sums: dict[KVChunkId, dict[str, str]] = {}
            for ch in doc["chunks"]:
                cid = KVChunkId(int(ch["t"]), int(ch["l"]), int(ch["g"]))
                geom.check(cid)
                lv = ch["levels"]
                sizes[cid] = {name: int(info["bytes"]) for name, info in lv.items()}
                sums[cid] = {name: str(info.get("checksum", "")) for name, info in lv.items()}
                if any(b <= 0 for b in sizes[cid].values()):
                    raise ManifestError(f"{cid}: a frame size is not positive")
            missing = [c for c in geom.chunk_ids() if c not in sizes]
            if missing:
                raise ManifestError(f"the manifest lists {len(sizes)} of {geom.num_chunks} chunks "
                                    f"(first missing: {missing[0]})")
            model = doc.get("model") or {}
            return cls(
                context_id=str(doc["context_id"]), geometry=geom, levels=levels, sizes=sizes,
                checksums=sums, model_name=str(model.get("name", "")),
                model_fingerprint=str(model.get("fingerprint", "")),
                tokens_sha256=str(doc.get("tokens_sha256", "")),
                encryption=doc.get("encryption"), raw=dict(doc), nbytes=nbytes)
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ManifestError(f"malformed manifest: {type(e).__name__}: {e}") from e

    @property
    def num_tokens(self) -> int:
        return self.geometry.num_tokens

    def total_bytes(self, level: str) -> int:
        return sum(s[level] for s in self.sizes.values() if level in s)

    def check_model(self, fingerprint: str, name: str = "") -> None:
        """Raises when the context was encoded with another model than the device's."""
        if self.model_fingerprint and self.model_fingerprint != fingerprint:
            raise ManifestError(
                f"context {self.context_id} was encoded with model {self.model_name!r} "
                f"(fingerprint {self.model_fingerprint}); this device runs {name or 'a model'} "
                f"(fingerprint {fingerprint}): its KV cache cannot be used")

    def check_tokens(self, token_ids: Sequence[int]) -> None:
        """Raises when ``token_ids`` are not the context's tokens."""
        if len(token_ids) != self.num_tokens:
            raise ManifestError(f"the context has {self.num_tokens} tokens, the device's copy has "
                                f"{len(token_ids)}")
        if self.tokens_sha256 and tokens_digest(token_ids) != self.tokens_sha256:
            raise ManifestError("the device's token ids differ from the context's "
                                "(tokens_sha256 mismatch)")
