"""Content digests of the wire: frame checksums (the chunks' ETags) and the token-id digest.

* A stored frame's checksum is ``xxh3_128:<32 hex digits>`` of the stored (served) bytes: the
  manifest lists it per chunk and level, the server checks it before it serves a frame, and its
  hex digest in double quotes is the frame's strong ETag.
* The token ids travel as little-endian ``u32`` each; ``tokens_sha256`` is the SHA-256 (hex) of
  those bytes.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import xxhash

CHECKSUM_ALGORITHM = "xxh3_128"
CHECKSUM_PATTERN = r"^xxh3_128:[0-9a-f]{32}$"


def checksum(data: bytes | bytearray | memoryview) -> str:
    """``xxh3_128:<hex>`` of stored bytes: the manifest's checksum and the frame's ETag."""
    return f"{CHECKSUM_ALGORITHM}:" + xxhash.xxh3_128_hexdigest(data)


def verify(data: bytes | bytearray | memoryview, checksum_text: str) -> bool:
    """Whether ``data`` has the checksum ``checksum_text`` (constant work: one hash)."""
    return checksum(data) == checksum_text


def etag_of(checksum_text: str) -> str:
    """The strong ETag of a checksum: its hex digest in double quotes."""
    return '"' + checksum_text.split(":", 1)[-1] + '"'


def tokens_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as stored and served (``GET .../tokens``): little-endian ``u32`` each."""
    return np.asarray(list(token_ids), dtype="<u4").tobytes()


def tokens_digest(token_ids: Sequence[int]) -> str:
    """The manifest's ``tokens_sha256``: SHA-256 (hex) of :func:`tokens_bytes`."""
    return hashlib.sha256(tokens_bytes(token_ids)).hexdigest()


def tokens_from_bytes(data: bytes) -> list[int]:
    """The token ids of a ``u32`` body; raises ``ValueError`` when it is not whole ``u32``s."""
    if len(data) % 4:
        raise ValueError(f"a token body of {len(data)} bytes is not a whole number of u32")
    return np.frombuffer(data, dtype="<u4").tolist()
