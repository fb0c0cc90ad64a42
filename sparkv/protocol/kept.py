"""Kept positions of a compressed context's chunk, as the manifest carries them (docs/wire-format.md,
"Compressed contexts").

A chunk ``(t, l, g)`` of ``n`` tokens starting at ``token_start`` keeps, per KV head of its group,
an ascending set of positions. The manifest stores them relative to ``token_start`` in one of two
codings, whichever is smaller for that chunk (ties: ``bitmap``), in canonical base64 (standard
alphabet, with padding, the unused low bits of the last character zero: ``AQ==``, never ``AR==``;
anything else is refused, so each position list has exactly one text):

* ``bitmap``: ``heads x n`` bits, head after head, each head's ``n`` bits starting on a byte
  boundary (``ceil(n / 8)`` bytes per head), bit ``i`` of a head (LSB first within each byte) set
  when relative position ``i`` is kept; the padding bits of a head's last byte are zero;
* ``delta``: per head, ``counts[h]`` unsigned LEB128 varints: the first is the first relative
  position, each later one the gap to the previous position minus one (so every value is
  ``>= 0`` and positions are strictly ascending by construction); heads follow each other with no
  separator (``counts`` says where one ends). Each varint is the shortest encoding of its value
  (a varint of two bytes or more never ends in ``0x00``) and at most :data:`MAX_VARINT_BYTES`
  bytes long.

:func:`encode_kept` picks the coding; :func:`decode_kept` checks everything (counts match the
positions, positions inside the chunk, ascending and unique, no trailing or missing bytes, zero
padding bits, canonical base64, short and shortest varints) and raises ``ValueError`` with the
first problem.
"""

from __future__ import annotations

import base64
import binascii
from typing import Final, Literal, Sequence

import numpy as np

BITMAP: Final = "bitmap"
DELTA: Final = "delta"
CODINGS = (BITMAP, DELTA)
MAX_VARINT_BYTES = 5
"""Longest delta varint: 5 bytes hold 35 bits, enough for any gap in a chunk of a frame's ``u32``
token count; a longer one is refused before it is summed (and a gap past the chunk after)."""


def _bitmap(rel: Sequence[np.ndarray], n: int) -> bytes:
    per = (n + 7) // 8
    out = bytearray()
    for r in rel:
        bits = np.zeros(per * 8, dtype=np.uint8)
        bits[np.asarray(r, dtype=np.int64)] = 1
        out += np.packbits(bits, bitorder="little").tobytes()
    return bytes(out)


def _varints(values: np.ndarray) -> bytes:
    out = bytearray()
    for x in values.tolist():
        x = int(x)
        while True:
            b = x & 0x7F
            x >>= 7
            if x:
                out.append(b | 0x80)
            else:
                out.append(b)
                break
    return bytes(out)


def _delta(rel: Sequence[np.ndarray]) -> bytes:
    out = bytearray()
    for r in rel:
        r = np.asarray(r, dtype=np.int64)
        if r.size:
            gaps = np.concatenate([r[:1], np.diff(r) - 1])
            out += _varints(gaps)
    return bytes(out)


def encode_kept(positions: Sequence[Sequence[int] | np.ndarray], token_start: int,
                num_tokens: int) -> tuple[list[int], Literal["bitmap", "delta"], str]:
    """Per head, the absolute positions kept in ``[token_start, token_start + num_tokens)``
    (ascending, unique) -> ``(counts, coding, base64 text)``. Raises ``ValueError`` on positions
    outside the chunk or not strictly ascending."""
    rel = []
    for h, p in enumerate(positions):
        r = np.asarray(p, dtype=np.int64).reshape(-1) - int(token_start)
        if r.size and (int(r[0]) < 0 or int(r[-1]) >= num_tokens or bool((np.diff(r) <= 0).any())):
            raise ValueError(f"head {h}: kept positions must be ascending, unique and inside "
                             f"[{token_start}, {token_start + num_tokens})")
        rel.append(r)
    counts = [int(r.size) for r in rel]
    bm, dl = _bitmap(rel, num_tokens), _delta(rel)
    if len(bm) <= len(dl):
        return counts, BITMAP, base64.b64encode(bm).decode("ascii")
    return counts, DELTA, base64.b64encode(dl).decode("ascii")


def _strict_b64decode(text: str) -> bytes:
    """The bytes of canonical base64 (standard alphabet, padded, zero trailing bits)."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise ValueError("positions are not valid base64") from None
    if base64.b64encode(raw).decode("ascii") != text:
        raise ValueError("positions are not canonical base64: the unused bits of the last "
                         "character must be zero")
    return raw


def _read_varint(raw: bytes, i: int, head: int, count: int) -> tuple[int, int]:
    """The unsigned LEB128 varint at ``raw[i:]`` and the offset after it. Raises ``ValueError``
    when it is cut short, longer than :data:`MAX_VARINT_BYTES` or not its shortest encoding."""
    x, shift, start = 0, 0, i
    while True:
        if i - start == MAX_VARINT_BYTES:
            raise ValueError(f"head {head}: a delta varint is longer than {MAX_VARINT_BYTES} "
                             "bytes")
        if i >= len(raw):
            raise ValueError(f"head {head}: delta positions cut short ({count} counted)")
        b = raw[i]
        i += 1
        x |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    if b == 0 and i - start > 1:
        raise ValueError(f"head {head}: a delta varint is overlong (not the shortest encoding "
                         "of its value)")
    return x, i


def decode_kept(counts: Sequence[int], coding: str, text: str, num_tokens: int
                ) -> list[np.ndarray]:
    """Per head, the kept positions relative to the chunk's start (int64, ascending). Raises
    ``ValueError`` naming the first problem (module docstring)."""
    if coding not in CODINGS:
        raise ValueError(f"unknown position coding {coding!r} (known: {', '.join(CODINGS)})")
    if any(int(c) < 0 or int(c) > num_tokens for c in counts):
        raise ValueError(f"counts {list(counts)} must each be in [0, {num_tokens}]")
    raw = _strict_b64decode(text)
    heads = len(counts)
    out: list[np.ndarray] = []
    if coding == BITMAP:
        per = (num_tokens + 7) // 8
        if len(raw) != per * heads:
            raise ValueError(f"a bitmap of {heads} heads x {num_tokens} tokens has "
                             f"{per * heads} bytes, got {len(raw)}")
        arr = np.frombuffer(raw, dtype=np.uint8)
        for h in range(heads):
            bits = np.unpackbits(arr[h * per:(h + 1) * per], bitorder="little")
            if bits[num_tokens:].any():
                raise ValueError(f"head {h}: bitmap padding bits are set (positions past the "
                                 f"chunk's {num_tokens} tokens)")
            pos = np.flatnonzero(bits[:num_tokens]).astype(np.int64)
            if pos.size != int(counts[h]):
                raise ValueError(f"head {h}: counts say {int(counts[h])} kept, the bitmap has "
                                 f"{pos.size}")
            out.append(pos)
        return out
    i = 0
    for h in range(heads):
        vals = []
        for _ in range(int(counts[h])):
            x, i = _read_varint(raw, i, h, int(counts[h]))
            vals.append(x)
        pos = np.cumsum(np.asarray(vals, dtype=np.int64) + 1) - 1 if vals else \
            np.zeros(0, dtype=np.int64)
        if pos.size and int(pos[-1]) >= num_tokens:
            raise ValueError(f"head {h}: position {int(pos[-1])} is past the chunk's "
                             f"{num_tokens} tokens")
        out.append(pos)
    if i != len(raw):
        raise ValueError(f"{len(raw) - i} trailing bytes after the delta positions")
    return out


__all__ = ["BITMAP", "DELTA", "CODINGS", "MAX_VARINT_BYTES", "encode_kept", "decode_kept"]
