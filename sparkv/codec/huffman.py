"""Canonical, length-limited Huffman coding of byte symbols, with a fast numba decoder.

The coder works on ``uint8`` symbols from an alphabet of ``A <= 256`` symbols (``A = 2**bits``).

* Code lengths: optimal under a maximum length (:data:`MAX_CODE_LEN` = 12 bits) by package-merge
  (:func:`code_lengths`). Codes are *canonical* (:func:`canonical_codes`): symbols sorted by
  ``(length, symbol)`` get consecutive codes, as in DEFLATE, so the lengths alone define the code.
* Streams: the symbols are cut into ``S`` contiguous, independent sub-streams. Stream ``s`` holds
  symbols ``[s*n//S, (s+1)*n//S)``. Each stream is a sequence of 32-bit words, written
  little-endian; bits are consumed from the most significant bit of each word first; the last
  word is padded with zero bits. A stream takes exactly ``ceil(bits / 32)`` words.
* Decoding (:func:`decode_streams`): a ``2**TABLE_BITS``-entry table (16 KiB, stays in L1) whose
  entries decode up to three whole codes per lookup; a 64-bit bit buffer refilled 32 bits at a
  time; four streams decoded in lockstep by one thread, so that four independent lookup chains
  hide each other's latency; groups of four streams spread over a thread per core. No
  per-symbol Python code anywhere.

Robustness: the decoder never reads outside its buffers whatever the words hold (reads past a
stream's end see zero bits, and over-reading is reported as an error afterwards); it terminates
because every lookup emits at least one symbol. Code lengths from the wire must pass
:func:`check_lengths` (a complete prefix code) before a table is built from them.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np
import numpy.typing as npt

#: the kernels' array types (numba ignores annotations: they are for the type checker)
_U8 = npt.NDArray[np.uint8]
_U32 = npt.NDArray[np.uint32]
_I64 = npt.NDArray[np.int64]
_F64 = npt.NDArray[np.float64]

MAX_CODE_LEN = 12
"""Longest code length the encoder produces and the decoder accepts."""

TABLE_BITS = 12
"""Width of the decoder's lookup window (>= MAX_CODE_LEN)."""

MAX_SYMS_PER_LOOKUP = 3

_SHIFT = np.uint64(64 - TABLE_BITS)


# ------------------------------------------------------------------------------------------------
# Code construction
# ------------------------------------------------------------------------------------------------
def code_lengths(counts: np.ndarray, max_len: int = MAX_CODE_LEN) -> np.ndarray:
    """Optimal length-limited Huffman code lengths (package-merge).

    Args:
        counts: ``[A]`` non-negative symbol counts.
        max_len: the longest allowed code, ``1 <= max_len <= 15``.

    Returns:
        ``uint8 [A]`` code lengths, 0 for unused symbols. With a single used symbol, its length
        is 1 (a caller wanting zero bits for a constant stream handles that case itself).
    """
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.zeros(counts.shape[0], dtype=np.uint8)
    used = np.flatnonzero(counts > 0)
    n = used.size
    if n == 0:
        raise ValueError("no symbol has a non-zero count")
    if n == 1:
        lengths[used[0]] = 1
        return lengths
    if n > (1 << max_len):
        raise ValueError(f"{n} symbols do not fit in codes of at most {max_len} bits")
    # Leaves sorted by weight (ties by symbol: deterministic output).
    order = used[np.lexsort((used, counts[used]))]
    leaves = counts[order].astype(np.float64)  # exact: counts < 2**53
    lengths[order] = _package_merge(leaves, max_len).astype(np.uint8)
    return lengths


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _package_merge(leaves: _F64, max_len: int) -> _I64:  # pragma: no cover - numba
    """The code lengths of ``leaves`` (weights in ascending order, at least two) by
    package-merge: at each of ``max_len`` levels the leaves and the previous level's packages
    are merged by weight (a leaf before a package of equal weight: the order a stable sort of
    leaves-then-packages gives), and adjacent pairs become the next level's packages; walking the
    levels back, each level's first ``take`` items hold the leaves whose code gets one bit
    longer."""
    n = leaves.size
    is_leaf = np.zeros((max_len, 2 * n), dtype=np.bool_)
    sizes = np.zeros(max_len, dtype=np.int64)
    weights = np.empty(2 * n, dtype=np.float64)
    packages = np.empty(2 * n, dtype=np.float64)
    num_packages = 0
    for level in range(max_len):
        i = j = w = 0
        while i < n or j < num_packages:
            if j >= num_packages or (i < n and leaves[i] <= packages[j]):
                weights[w] = leaves[i]
                is_leaf[level, w] = True
                i += 1
            else:
                weights[w] = packages[j]
                j += 1
            w += 1
        sizes[level] = w
        num_packages = w // 2
        for p in range(num_packages):
            packages[p] = weights[2 * p] + weights[2 * p + 1]
    lengths = np.zeros(n, dtype=np.int64)
    take = 2 * n - 2
    for level in range(max_len - 1, -1, -1):
        chosen = 0
        for w in range(min(take, sizes[level])):
            if is_leaf[level, w]:
                chosen += 1
        lengths[:chosen] += 1  # leaves appear in weight order: the lightest ones
        take = 2 * (take - chosen)
    return lengths


_LENGTH_PROBLEMS = {
    1: "a code length exceeds the maximum",
    2: "a Huffman table needs at least two symbols",
    3: "code lengths do not form a complete prefix code",
    4: "code-length table is empty",
}


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _lengths_status(lengths: _U8, max_len: int) -> int:  # pragma: no cover - numba
    if lengths.size == 0:
        return 4
    used = 0
    kraft = 0
    for s in range(lengths.size):
        ln = np.int64(lengths[s])
        if ln > max_len:
            return 1
        if ln > 0:
            used += 1
            kraft += np.int64(1) << (max_len - ln)
    if used < 2:
        return 2
    if kraft != (np.int64(1) << max_len):
        return 3
    return 0


def check_lengths(lengths: np.ndarray, max_len: int = MAX_CODE_LEN) -> str | None:
    """Why ``lengths`` is not a complete prefix code of at most ``max_len`` bits, or ``None``.

    Complete means at least two symbols and a Kraft sum of exactly 1, so that every
    ``max_len``-bit window starts with a valid code.
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1:
        return "code-length table must be one-dimensional"
    status = _lengths_status(np.ascontiguousarray(lengths, dtype=np.uint8), max_len) if (
        lengths.size == 0 or int(lengths.max()) <= 255) else 1
    return _LENGTH_PROBLEMS.get(status)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes (``uint32 [A]``, right-aligned, ``lengths[s]`` bits) for code lengths.

    Symbols sorted by ``(length, symbol)`` receive consecutive code values; the code value is
    shifted left by one for each increase of length (as in DEFLATE, RFC 1951 section 3.2.2).
    Computed as prefix sums: the code of the i-th sorted symbol is
    ``sum(2**(M - len_j) for j < i) >> (M - len_i)`` with ``M`` the longest length.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, dtype=np.uint32)
    used = np.flatnonzero(lengths > 0)
    if used.size == 0:
        return codes
    order = used[np.lexsort((used, lengths[used]))]
    lens = lengths[order]
    top = int(lens[-1])
    weights = np.left_shift(np.int64(1), top - lens)
    prefix = np.concatenate([[0], np.cumsum(weights)[:-1]])
    codes[order] = (prefix >> (top - lens)).astype(np.uint32)
    return codes


def entropy_bits(counts: np.ndarray) -> float:
    """Empirical (zeroth-order) entropy of a symbol histogram, in bits per symbol."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log2(p)).sum())


def stream_bounds(n: int, num_streams: int) -> np.ndarray:
    """``int64 [S+1]``: stream ``s`` holds symbols ``[b[s], b[s+1])`` with ``b[s] = s*n//S``."""
    s = np.arange(num_streams + 1, dtype=np.int64)
    return (s * n) // num_streams


# ------------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------------
@nb.njit(nogil=True, cache=True, boundscheck=False)
def _pack_streams(syms: _U8, codes: _U32, lengths: _U8, bounds: _I64, out: _U32
                  ) -> _I64:  # pragma: no cover - numba
    """Packs each stream of ``syms`` into ``out`` (uint32 words); returns words per stream."""
    num_streams = bounds.size - 1
    nwords = np.zeros(num_streams, dtype=np.int64)
    w = 0
    for s in range(num_streams):
        w0 = w
        acc = np.uint64(0)
        nacc = np.uint64(0)
        for i in range(bounds[s], bounds[s + 1]):
            sym = syms[i]
            ln = np.uint64(lengths[sym])
            acc = (acc << ln) | np.uint64(codes[sym])
            nacc += ln
            if nacc >= np.uint64(32):
                nacc -= np.uint64(32)
                out[w] = np.uint32((acc >> nacc) & np.uint64(0xFFFFFFFF))
                w += 1
        if nacc > np.uint64(0):
            out[w] = np.uint32((acc << (np.uint64(32) - nacc)) & np.uint64(0xFFFFFFFF))
            w += 1
        nwords[s] = w - w0
    return nwords


def encode_streams(syms: np.ndarray, lengths: np.ndarray, num_streams: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Huffman-codes ``syms`` (``uint8 [n]``) into ``num_streams`` independent streams.

    Returns:
        ``(words, words_per_stream)``: all streams' ``uint32`` words concatenated, and ``int64
        [S]`` word counts.
    """
    syms = np.ascontiguousarray(syms, dtype=np.uint8)
    lengths = np.asarray(lengths, dtype=np.uint8)
    if lengths.size != 256:
        lengths = np.concatenate([lengths, np.zeros(256 - lengths.size, dtype=np.uint8)])
    codes = canonical_codes(lengths)
    hist = np.bincount(syms, minlength=256)
    if np.any((hist > 0) & (lengths == 0)):
        raise ValueError("a symbol present in the data has no code")
    total_bits = int(np.dot(hist.astype(np.int64), lengths.astype(np.int64)))
    bounds = stream_bounds(syms.size, num_streams)
    out = np.empty(total_bits // 32 + num_streams + 1, dtype=np.uint32)
    nwords = _pack_streams(syms, codes, lengths, bounds, out)
    return out[: int(nwords.sum())], nwords


# ------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------
@nb.njit(nogil=True, cache=True, boundscheck=False)
def _fill_table(lengths: _U8, table: _U32) -> None:  # pragma: no cover - numba
    """Writes the multi-symbol decode table of a complete code (``check_lengths`` passed).

    Entry for a ``TABLE_BITS``-bit window: bits 0-7 first symbol, 8-15 second, 16-23 third,
    24-27 total code bits of the decoded symbols, 28-29 how many symbols (1..3). Canonical codes
    are assigned as in DEFLATE (count per length, first code per length, then symbol order).
    """
    size = 1 << TABLE_BITS
    mask = size - 1
    bl_count = np.zeros(TABLE_BITS + 1, dtype=np.int64)
    for s in range(lengths.size):
        bl_count[lengths[s]] += 1
    bl_count[0] = 0
    next_code = np.zeros(TABLE_BITS + 2, dtype=np.int64)
    code = 0
    for ln in range(1, TABLE_BITS + 1):
        code = (code + bl_count[ln - 1]) << 1
        next_code[ln] = code
    first_sym = np.zeros(size, dtype=np.uint32)
    first_len = np.zeros(size, dtype=np.uint32)
    for s in range(lengths.size):
        ln = np.int64(lengths[s])
        if ln == 0:
            continue
        c = next_code[ln]
        next_code[ln] += 1
        base = c << (TABLE_BITS - ln)
        for j in range(np.int64(1) << (TABLE_BITS - ln)):
            first_sym[base + j] = s
            first_len[base + j] = ln
    for idx in range(size):
        entry = first_sym[idx]
        total = first_len[idx]
        count = 1
        idx2 = (idx << total) & mask
        l2 = first_len[idx2]
        if total + l2 <= TABLE_BITS:
            entry |= first_sym[idx2] << 8
            total += l2
            count = 2
            idx3 = (idx2 << l2) & mask
            l3 = first_len[idx3]
            if total + l3 <= TABLE_BITS:
                entry |= first_sym[idx3] << 16
                total += l3
                count = 3
        table[idx] = entry | (total << 24) | (np.uint32(count) << 28)


def build_decode_table(lengths: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``uint32 [2**TABLE_BITS]`` decode table for validated code lengths (``uint8 [A]``),
    written into ``out`` when given."""
    lengths = np.ascontiguousarray(lengths, dtype=np.uint8)
    table = np.empty(1 << TABLE_BITS, dtype=np.uint32) if out is None else out
    _fill_table(lengths, table)
    return table


@nb.njit(nogil=True, cache=True, boundscheck=False)
def streams_fit(stream_bytes: _I64, num_symbols: int) -> bool:  # pragma: no cover - numba
    """Stream byte lengths are whole words and between 1 and ``MAX_CODE_LEN`` bits per symbol
    of the streams' symbol counts (:func:`stream_bounds`)."""
    num_streams = stream_bytes.size
    for s in range(num_streams):
        count = ((s + 1) * num_symbols) // num_streams - (s * num_symbols) // num_streams
        nbytes = np.int64(stream_bytes[s])
        lo = 4 * ((count + 31) // 32)
        hi = 4 * ((count * MAX_CODE_LEN + 31) // 32)
        if nbytes % 4 != 0 or nbytes < lo or nbytes > hi:
            return False
    return True


@nb.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _lane_run(words: _U32, i: int, wend: int, buf: np.uint64, n: np.int64, table: _U32,
              lengths: _U8, out: _U8, o: int, oend: int
              ) -> tuple[int, np.int64]:  # pragma: no cover - numba
    """Finishes one stream from its state; returns ``(i, n)`` (word index, bits left in buf)."""
    while o + 3 <= oend:
        e = table[buf >> _SHIFT]
        out[o] = np.uint8(e & np.uint32(0xFF))
        out[o + 1] = np.uint8((e >> np.uint32(8)) & np.uint32(0xFF))
        out[o + 2] = np.uint8((e >> np.uint32(16)) & np.uint32(0xFF))
        o += np.int64(e >> np.uint32(28))
        used = (e >> np.uint32(24)) & np.uint32(15)
        buf = buf << np.uint64(used)
        n -= np.int64(used)
        if n < 32:
            if i < wend:
                buf |= np.uint64(words[i]) << np.uint64(32 - n)
            i += 1
            n += 32
    while o < oend:
        e = table[buf >> _SHIFT]
        sym = e & np.uint32(0xFF)
        out[o] = np.uint8(sym)
        o += 1
        used = lengths[sym]
        buf = buf << np.uint64(used)
        n -= np.int64(used)
        if n < 32:
            if i < wend:
                buf |= np.uint64(words[i]) << np.uint64(32 - n)
            i += 1
            n += 32
    return i, n


@nb.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _lane_init(words: _U32, wstart: int, wend: int
               ) -> tuple[np.uint64, np.int64, int]:  # pragma: no cover - numba
    buf = np.uint64(0)
    if wstart < wend:
        buf = np.uint64(words[wstart]) << np.uint64(32)
    if wstart + 1 < wend:
        buf |= np.uint64(words[wstart + 1])
    return buf, np.int64(64), wstart + 2


@nb.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _lane_ok(i: int, n: np.int64, wstart: int, wend: int
             ) -> np.bool_:  # pragma: no cover - numba
    """The stream was consumed exactly: its bits fit its words, and no word is left unused."""
    consumed = (i - wstart) * 32 - n
    nwords = wend - wstart
    return consumed <= nwords * 32 and consumed > (nwords - 1) * 32


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _decode_group(words: _U32, w_start: _I64, w_end: _I64, table: _U32, lengths: _U8,
                  out: _U8, o_start: _I64, o_end: _I64, first: int, count: int,
                  errors: npt.NDArray[np.bool_]) -> None:  # pragma: no cover - numba
    """Decodes streams ``first .. first+count-1`` (``count <= 4``) with one table.

    Stream ``s`` reads ``words[w_start[s]:w_end[s]]`` and writes ``out[o_start[s]:o_end[s]]``.
    Four streams run in lockstep: the four table loads of a round are issued before any of their
    results is used, so their latencies overlap.

    Why it is long (about 90 lines, over our 80): the four lanes are unrolled by hand, each with
    its own state variables, because numba keeps the four states in registers only when nothing
    is factored into helpers or loops over lanes; splitting it would cost the decoder its speed.
    """
    if count == 4:
        ws0, ws1 = w_start[first], w_start[first + 1]
        ws2, ws3 = w_start[first + 2], w_start[first + 3]
        we0, we1, we2, we3 = w_end[first], w_end[first + 1], w_end[first + 2], w_end[first + 3]
        o0, o1, o2, o3 = o_start[first], o_start[first + 1], o_start[first + 2], o_start[first + 3]
        e0, e1, e2, e3 = o_end[first], o_end[first + 1], o_end[first + 2], o_end[first + 3]
        b0, n0, i0 = _lane_init(words, ws0, we0)
        b1, n1, i1 = _lane_init(words, ws1, we1)
        b2, n2, i2 = _lane_init(words, ws2, we2)
        b3, n3, i3 = _lane_init(words, ws3, we3)
        m8 = np.uint32(0xFF)
        while True:
            # A lookup emits at most 3 symbols: k rounds cannot overrun any stream.
            k = min(min((e0 - o0) // 3, (e1 - o1) // 3), min((e2 - o2) // 3, (e3 - o3) // 3))
            if k <= 0:
                break
            for _ in range(k):
                t0 = table[b0 >> _SHIFT]
                t1 = table[b1 >> _SHIFT]
                t2 = table[b2 >> _SHIFT]
                t3 = table[b3 >> _SHIFT]
                out[o0] = np.uint8(t0 & m8)
                out[o0 + 1] = np.uint8((t0 >> np.uint32(8)) & m8)
                out[o0 + 2] = np.uint8((t0 >> np.uint32(16)) & m8)
                o0 += np.int64(t0 >> np.uint32(28))
                u0 = (t0 >> np.uint32(24)) & np.uint32(15)
                b0 = b0 << np.uint64(u0)
                n0 -= np.int64(u0)
                if n0 < 32:
                    if i0 < we0:
                        b0 |= np.uint64(words[i0]) << np.uint64(32 - n0)
                    i0 += 1
                    n0 += 32
                out[o1] = np.uint8(t1 & m8)
                out[o1 + 1] = np.uint8((t1 >> np.uint32(8)) & m8)
                out[o1 + 2] = np.uint8((t1 >> np.uint32(16)) & m8)
                o1 += np.int64(t1 >> np.uint32(28))
                u1 = (t1 >> np.uint32(24)) & np.uint32(15)
                b1 = b1 << np.uint64(u1)
                n1 -= np.int64(u1)
                if n1 < 32:
                    if i1 < we1:
                        b1 |= np.uint64(words[i1]) << np.uint64(32 - n1)
                    i1 += 1
                    n1 += 32
                out[o2] = np.uint8(t2 & m8)
                out[o2 + 1] = np.uint8((t2 >> np.uint32(8)) & m8)
                out[o2 + 2] = np.uint8((t2 >> np.uint32(16)) & m8)
                o2 += np.int64(t2 >> np.uint32(28))
                u2 = (t2 >> np.uint32(24)) & np.uint32(15)
                b2 = b2 << np.uint64(u2)
                n2 -= np.int64(u2)
                if n2 < 32:
                    if i2 < we2:
                        b2 |= np.uint64(words[i2]) << np.uint64(32 - n2)
                    i2 += 1
                    n2 += 32
                out[o3] = np.uint8(t3 & m8)
                out[o3 + 1] = np.uint8((t3 >> np.uint32(8)) & m8)
                out[o3 + 2] = np.uint8((t3 >> np.uint32(16)) & m8)
                o3 += np.int64(t3 >> np.uint32(28))
                u3 = (t3 >> np.uint32(24)) & np.uint32(15)
                b3 = b3 << np.uint64(u3)
                n3 -= np.int64(u3)
                if n3 < 32:
                    if i3 < we3:
                        b3 |= np.uint64(words[i3]) << np.uint64(32 - n3)
                    i3 += 1
                    n3 += 32
        i0, n0 = _lane_run(words, i0, we0, b0, n0, table, lengths, out, o0, e0)
        i1, n1 = _lane_run(words, i1, we1, b1, n1, table, lengths, out, o1, e1)
        i2, n2 = _lane_run(words, i2, we2, b2, n2, table, lengths, out, o2, e2)
        i3, n3 = _lane_run(words, i3, we3, b3, n3, table, lengths, out, o3, e3)
        errors[first] = not _lane_ok(i0, n0, ws0, we0)
        errors[first + 1] = not _lane_ok(i1, n1, ws1, we1)
        errors[first + 2] = not _lane_ok(i2, n2, ws2, we2)
        errors[first + 3] = not _lane_ok(i3, n3, ws3, we3)
    else:
        for s in range(first, first + count):
            buf, n, i = _lane_init(words, w_start[s], w_end[s])
            i, n = _lane_run(words, i, w_end[s], buf, n, table, lengths, out, o_start[s], o_end[s])
            errors[s] = not _lane_ok(i, n, w_start[s], w_end[s])


@nb.njit(nogil=True, cache=True, boundscheck=False)
def _decode_serial(words: _U32, w_start: _I64, w_end: _I64, tables: _U32, lengths: _U8,
                   out: _U8, o_start: _I64, o_end: _I64, g_first: _I64, g_count: _I64,
                   g_table: _I64, errors: npt.NDArray[np.bool_]
                   ) -> None:  # pragma: no cover - numba
    for g in range(g_first.size):
        t = g_table[g]
        _decode_group(words, w_start, w_end, tables[t], lengths[t], out, o_start, o_end,
                      g_first[g], g_count[g], errors)


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                       thread_name_prefix="sparkv-huffman")
        return _POOL


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


@nb.njit(nogil=True, cache=True, boundscheck=False)
def stream_layout(stream_bytes: _I64, first_word: int, first_symbol: int, num_symbols: int,
                  bounds: _I64, col: int) -> None:  # pragma: no cover - numba
    """Fills columns ``col ..`` of ``bounds`` (``int64 [4, S_total]``: word start, word end,
    symbol start, symbol end) for the streams of one tensor laid out back to back from word
    ``first_word``, its symbols from ``first_symbol``."""
    num_streams = stream_bytes.size
    w = first_word
    for s in range(num_streams):
        bounds[0, col + s] = w
        w += stream_bytes[s] // 4
        bounds[1, col + s] = w
        bounds[2, col + s] = first_symbol + (s * num_symbols) // num_streams
        bounds[3, col + s] = first_symbol + ((s + 1) * num_symbols) // num_streams


@functools.lru_cache(maxsize=256)
def plan_groups(num_streams: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups of at most 4 consecutive streams per table: ``(first, count, table_index)``
    (cached: treat the arrays as read-only)."""
    first, count, table = [], [], []
    base = 0
    for t, s in enumerate(num_streams):
        for g0 in range(0, s, 4):
            first.append(base + g0)
            count.append(min(4, s - g0))
            table.append(t)
        base += s
    return (np.asarray(first, dtype=np.int64), np.asarray(count, dtype=np.int64),
            np.asarray(table, dtype=np.int64))


def decode_streams(words: np.ndarray, word_start: np.ndarray, word_end: np.ndarray,
                   tables: np.ndarray, lengths: np.ndarray, out: np.ndarray,
                   out_start: np.ndarray, out_end: np.ndarray,
                   groups: tuple[np.ndarray, np.ndarray, np.ndarray], parallel: bool = False
                   ) -> np.ndarray:
    """Decodes many streams at once; returns a ``bool [S]`` array flagging malformed streams.

    Args:
        words: ``uint32 [W]``, every stream's words (native order).
        word_start, word_end: ``int64 [S]``: stream ``s`` is ``words[word_start[s]:word_end[s]]``
            (bounds must lie in ``[0, W]``: the caller checks them).
        tables: ``uint32 [T, 2**TABLE_BITS]`` decode tables; lengths: ``uint8 [T, 256]``.
        out: ``uint8 [n]`` output symbols; stream ``s`` fills ``out[out_start[s]:out_end[s]]``.
        groups: :func:`plan_groups` of the per-table stream counts.
        parallel: spread the groups over one thread per core (the numba kernels release the
            GIL); otherwise decode in the calling thread.
    """
    errors = np.zeros(word_start.size, dtype=np.bool_)
    g_first, g_count, g_table = groups
    args = (words, word_start, word_end, tables, lengths, out, out_start, out_end)
    workers = min(os.cpu_count() or 1, g_first.size) if parallel else 1
    if workers <= 1:
        _decode_serial(*args, g_first, g_count, g_table, errors)
        return errors
    # The kernels release the GIL: plain threads, each taking every workers-th group.
    futures = [
        _pool().submit(_decode_serial, *args, np.ascontiguousarray(g_first[w::workers]),
                       np.ascontiguousarray(g_count[w::workers]),
                       np.ascontiguousarray(g_table[w::workers]), errors)
        for w in range(workers)]
    for f in futures:
        f.result()
    return errors


def decode_symbols(words: np.ndarray, words_per_stream: np.ndarray, lengths: np.ndarray, n: int,
                   parallel: bool = False) -> np.ndarray:
    """Decodes ``n`` symbols coded by :func:`encode_streams` (a convenience for tests/benchmarks).

    Raises:
        ValueError: the lengths are not a valid code or a stream is malformed.
    """
    lengths = np.asarray(lengths, dtype=np.uint8)
    if lengths.size != 256:
        lengths = np.concatenate([lengths, np.zeros(256 - lengths.size, dtype=np.uint8)])
    why = check_lengths(lengths)
    if why:
        raise ValueError(why)
    num_streams = int(np.asarray(words_per_stream).size)
    wb = np.zeros(num_streams + 1, dtype=np.int64)
    wb[1:] = np.cumsum(words_per_stream)
    if wb[-1] != words.size:
        raise ValueError("word counts do not add up to the words given")
    ob = stream_bounds(n, num_streams)
    out = np.empty(n, dtype=np.uint8)
    errors = decode_streams(np.ascontiguousarray(words, dtype=np.uint32), wb[:-1], wb[1:],
                            build_decode_table(lengths)[None, :], lengths[None, :], out,
                            ob[:-1], ob[1:], plan_groups((num_streams,)), parallel)
    if errors.any():
        raise ValueError(f"{int(errors.sum())} malformed stream(s)")
    return out
