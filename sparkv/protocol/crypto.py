"""Optional AES-256-GCM encryption of stored frames, one key per context (part of the wire).

An encrypted context's every stored (and served) frame is::

    nonce (12 bytes, random) | AES-256-GCM ciphertext of the codec frame | tag (16 bytes)

with associated data ``"sparkv/v1/<context_id>/<t>/<l>/<g>/<level>"`` (ASCII), so a frame cannot be
replayed as another chunk, level or context. The 32-byte key is generated when the context is
created, returned once to the creating client (base64url, no padding) and kept by the server only
in memory until the encode job ends: the store and any HTTP cache hold only ciphertext. Frame sizes
grow by 28 bytes. The server seals (:meth:`FrameCipher.seal`), the edge opens
(:meth:`FrameCipher.open`). See docs/wire-format.md ("Encrypted frames").
"""

from __future__ import annotations

import base64
import os
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sparkv.protocol.errors import DecryptionError

KEY_BYTES = 32
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES
ALGORITHM: Final = "AES-256-GCM"
AAD_FORMAT = "sparkv/v1/{context_id}/{t}/{l}/{g}/{level}"
LAYOUT = "nonce | ciphertext | tag"


def new_key() -> bytes:
    return AESGCM.generate_key(bit_length=8 * KEY_BYTES)


def key_to_text(key: bytes) -> str:
    return base64.urlsafe_b64encode(key).rstrip(b"=").decode("ascii")


def key_from_text(text: str) -> bytes:
    """The key of its base64url text; raises :class:`DecryptionError` when malformed."""
    try:
        key = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (ValueError, TypeError) as exc:
        raise DecryptionError(f"bad key encoding: {exc}") from None
    if len(key) != KEY_BYTES:
        raise DecryptionError(f"a context key is {KEY_BYTES} bytes, got {len(key)}")
    return key


def frame_aad(context_id: str, t: int, l: int, g: int, level: str) -> bytes:  # noqa: E741
    return AAD_FORMAT.format(context_id=context_id, t=t, l=l, g=g, level=level).encode("ascii")


class FrameCipher:
    """Seals and opens the frames of one context."""

    def __init__(self, key: bytes, context_id: str) -> None:
        if len(key) != KEY_BYTES:
            raise DecryptionError(f"a context key is {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self.context_id = context_id

    @classmethod
    def from_text(cls, key_text: str, context_id: str) -> "FrameCipher":
        return cls(key_from_text(key_text), context_id)

    def seal(self, frame: bytes, t: int, l: int, g: int, level: str) -> bytes:  # noqa: E741
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, frame, frame_aad(self.context_id, t, l, g, level))

    def open(self, data: bytes, t: int, l: int, g: int, level: str) -> bytes:  # noqa: E741
        if len(data) < OVERHEAD:
            raise DecryptionError("encrypted frame too short")
        try:
            return self._aead.decrypt(bytes(data[:NONCE_BYTES]), bytes(data[NONCE_BYTES:]),
                                      frame_aad(self.context_id, t, l, g, level))
        except InvalidTag:
            raise DecryptionError(f"frame ({t}, {l}, {g}, {level}) of {self.context_id} does not "
                                  "authenticate: wrong key, wrong chunk or tampered data") from None
