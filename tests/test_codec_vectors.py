"""docs/wire-format.md and the codec cannot drift apart: the q5 test vector (its bytes, checksum
and decoded values, read out of the doc and out of tests/data/q5_vector.hex), the constants table,
and the behaviour the doc states for padding, fully exact tensors, the canonical code,
dequantization rounding and non-finite values."""

from __future__ import annotations

import ast
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

import sparkv.codec as codec
from sparkv.codec import (
    AXIS_CHANNEL, AXIS_TOKEN, CODING_CONSTANT, PARAM_FP16, PARAM_FP32, PRED_NONE, CodecError,
    KVChunk, decode, decode_into, encode, peek_header,
)
from sparkv.codec import huffman, quant
from sparkv.codec.frame import coded_symbols, quantized_values
from sparkv.layout import KVChunkId

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "wire-format.md").read_text()
FIXTURE = Path(__file__).resolve().parent / "data" / "q5_vector.hex"


# ---- reading the doc -------------------------------------------------------------------------
def doc_block(name: str) -> str:
    m = re.search(rf"<!-- {name}:begin -->\n(.*?)<!-- {name}:end -->", DOC, re.S)
    assert m, f"docs/wire-format.md lost its {name} block"
    return m.group(1)


def parse_hex_dump(text: str) -> bytes:
    """``OOOO  hh hh ...`` lines (offset, then up to 16 bytes); other lines (fences, ``#``
    comments, blanks) are skipped. Offsets must follow each other."""
    out = bytearray()
    for line in text.splitlines():
        if not re.match(r"^[0-9a-f]{4}  ", line):
            continue
        offset, *tokens = line.split()
        assert int(offset, 16) == len(out), f"hex dump offset {offset} after {len(out)} bytes"
        assert 1 <= len(tokens) <= 16 and all(re.fullmatch(r"[0-9a-f]{2}", t) for t in tokens), line
        out += bytes(int(t, 16) for t in tokens)
    return bytes(out)


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:]  # without the heading


# ---- the vector's chunk ----------------------------------------------------------------------
def vector_chunk() -> KVChunk:
    """Example 2 of docs/wire-format.md."""
    k = [[[((5 * n + 2 * d) % 23 - 11) / 8 for d in range(8)] for n in range(20)]]
    v = [[[((3 * n * d + n + 7 * d) % 19 - 9) / 16 for d in range(8)] for n in range(20)]]
    return KVChunk(KVChunkId(0, 10, 2), 0, torch.tensor(k, dtype=torch.float32),
                   torch.tensor(v, dtype=torch.float32), 30)


def vector_frame() -> bytes:
    return encode(vector_chunk(), "q5", v_axis=AXIS_TOKEN)


def test_q5_vector_bytes_match_doc_and_fixture():
    frame = vector_frame()
    in_doc = parse_hex_dump(doc_block("q5-vector"))
    in_fixture = parse_hex_dump(FIXTURE.read_text())
    assert len(frame) == 500
    assert frame == in_fixture, "the encoder no longer writes tests/data/q5_vector.hex"
    assert in_doc == in_fixture, "docs/wire-format.md's q5 vector differs from the fixture"


def test_q5_vector_checksum_is_real():
    frame = parse_hex_dump(doc_block("q5-vector"))
    (stored,) = struct.unpack_from("<Q", frame, len(frame) - 8)
    assert stored == xxhash.xxh64_intdigest(frame[:-8])
    stated = set(re.findall(r"XXH64 = (0x[0-9a-f]{16})", DOC))
    stated |= set(re.findall(r"XXH64 of `000-1eb` = `(0x[0-9a-f]{16})`", DOC))
    assert stated == {f"0x{stored:016x}"}


def test_q5_vector_layout_as_documented():
    frame = parse_hex_dump(doc_block("q5-vector"))
    h = peek_header(frame)
    assert (h.header_len, h.payload_len) == (0x128, 0xC4)
    assert tuple(h.chunk_id) == (0, 10, 2) and h.shape == (1, 20, 8) and h.num_layers == 30
    k, v = h.k, h.v
    assert (k.bits, k.axis, k.param_dtype, k.coding, k.predictor, k.values_per_symbol,
            k.exact_tokens, k.num_streams) == (6, AXIS_CHANNEL, PARAM_FP16, 1, 1, 1, 1, 1)
    assert (v.bits, v.axis, v.param_dtype, v.coding, v.predictor, v.values_per_symbol,
            v.exact_tokens, v.num_streams) == (5, AXIS_TOKEN, PARAM_FP16, 1, 0, 1, 1, 1)
    assert k.alpha.tolist() == [[4] * 8] and k.center.tolist() == [[31, 31, 31, 32, 31, 32, 32, 32]]
    assert np.flatnonzero(k.code_lengths).tolist() == [6, 10, 12, 13, 14, 15, 17, 25, 45, 53, 60,
                                                       63]
    assert k.stream_bytes.tolist() == [44] and v.stream_bytes.tolist() == [88]
    assert v.steps[0, 3] == 0
    # header padding: 4 zero bytes at 0x124; the V section starts at frame offset 0x174
    assert frame[0x124:0x128] == bytes(4)
    assert h.header_len + v.payload_offset == 0x174 and 0x174 % 8 == 4
    assert frame[0x174:0x178] == struct.pack("<f", -0.5625)  # V[0, 0, 0]


def test_q5_vector_decoded_values_as_documented():
    frame = parse_hex_dump(doc_block("q5-vector"))
    chunk, h = decode(frame), peek_header(frame)
    src = vector_chunk()
    qk, qv = quantized_values(frame)
    rows = table_rows(doc_block("q5-values"))
    assert len(rows) >= 8
    for which, pos, inp, q, mn, st, p, x, bits in rows:
        hh, n, d = ast.literal_eval(pos)
        out = (chunk.k if which == "K" else chunk.v)[hh, n, d]
        th = h.k if which == "K" else h.v
        assert float((src.k if which == "K" else src.v)[hh, n, d]) == float(inp)
        assert float(out) == float(x)
        assert f"{np.float32(out).view(np.uint32):08x}" == bits.strip("`")
        if q == "exact":
            assert n < th.exact_tokens and float(out) == float(inp)
            continue
        m = n - th.exact_tokens
        qs = (qk if which == "K" else qv).reshape(h.num_heads, h.num_tokens - th.exact_tokens,
                                                  h.head_dim)
        assert int(qs[hh, m, d]) == int(q)
        group = (hh, d) if th.axis == AXIS_CHANNEL else (hh, m)
        for cell, arr in ((mn, th.mins), (st, th.steps)):
            hexbits, value = re.fullmatch(r"`([0-9a-f]{4})` = (\S+)", cell).groups()
            assert f"{np.float16(arr[group]).view(np.uint16):04x}" == hexbits
            assert float(arr[group]) == float(value)
        prod = np.float32(int(q)) * np.float32(th.steps[group])
        assert float(prod) == float(p)
        assert np.float32(th.mins[group]) + prod == np.float32(out)


def test_q5_vector_decodes_with_the_doc_only_reader():
    from test_codec_wire import reference_decode

    frame = parse_hex_dump(doc_block("q5-vector"))
    ref, ours = reference_decode(frame), decode(frame)
    np.testing.assert_array_equal(ref["k"], ours.k.numpy())
    np.testing.assert_array_equal(ref["v"], ours.v.numpy())


# ---- constants -------------------------------------------------------------------------------
def test_constants_table_matches_the_exports():
    rows = table_rows(doc_block("constants"))
    names = set()
    for name, value, _ in rows:
        name = name.strip("`")
        names.add(name)
        assert name in codec.__all__, f"{name} is documented but not exported by sparkv.codec"
        assert getattr(codec, name) == ast.literal_eval(value.strip("`")), name
    assert {"AXIS_TOKEN", "AXIS_CHANNEL", "PARAM_FP16", "PARAM_FP32", "CODING_PLAIN",
            "CODING_HUFFMAN", "CODING_CONSTANT", "PRED_NONE", "PRED_CHANNEL", "MAGIC",
            "VERSION"} <= names
    assert {c: dt for c, (dt, _) in codec.DTYPE_CODES.items()} == {
        1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
    assert {n: lvl.code for n, lvl in codec.LEVELS.items()} == {
        "raw": 0, "q8": 8, "q6": 6, "q5": 5, "q4": 4, "q3": 3, "q2": 2}


def test_level_tables_match_the_levels():
    """docs/wire-format.md section 7 states the per-layer offsets a decoder checks bits against."""
    from sparkv.codec import levels

    section = DOC[DOC.index("## 7. Levels"):DOC.index("## 8. Padding")]
    rows = {name: [int(x) for x in cells.strip("`").split()]
            for name, cells in table_rows(section)}
    assert rows["K (q6, q5, q4, q3)"] == list(levels.PROFILE_K)
    assert rows["V (q6, q5, q4, q3)"] == list(levels.PROFILE_V)
    assert rows["K (q2)"] == list(levels.PROFILE_K_FLOOR)
    assert rows["V (q2)"] == list(levels.PROFILE_V_FLOOR)
    for name in ("q6", "q5", "q4", "q3", "q2"):
        lvl = codec.get_level(name)
        k_off, v_off = ((levels.PROFILE_K_FLOOR, levels.PROFILE_V_FLOOR) if name == "q2"
                        else (levels.PROFILE_K, levels.PROFILE_V))
        for num_layers in (7, 30, 32, 61):
            for layer in range(num_layers):
                p = layer * 30 // num_layers
                want = tuple(min(max(lvl.base_bits + o[p], 2), 8) for o in (k_off, v_off))
                assert lvl.bits(layer, num_layers) == want
    assert codec.get_level("q8").bits(5, 30) == (8, 8)


# ---- fully exact tensors ---------------------------------------------------------------------
def test_fully_exact_tensor_descriptor_as_documented():
    k = torch.tensor([[[1.5, -2.0, 3.25]]])
    frame = encode(KVChunk(KVChunkId(0, 6, 0), 0, k, -k, 30), "q5")
    assert frame[40:52] == bytes.fromhex("05 02 01 02 00 01 00 00 01 00 00 00")
    assert frame[52:64] == bytes.fromhex("06 02 01 02 00 01 00 00 01 00 00 00")
    h = peek_header(frame)
    assert (h.header_len, h.payload_len) == (64, 32)
    assert frame[64:80] == k.numpy().tobytes() + bytes(4)
    assert torch.equal(decode(frame).k, k)
    # any E = N tensor: sink_tokens covering the chunk, axis as asked, no sections at all
    c = KVChunk(KVChunkId(0, 24, 1), 0, torch.randn(2, 5, 3), torch.randn(2, 5, 3), 30)
    frame = encode(c, "q3", sink_tokens=8, k_axis=AXIS_TOKEN)
    h = peek_header(frame)
    bits = codec.get_level("q3").bits(24, 30)  # (4, 3): layer 24's offsets are +1 and 0
    assert bits == (4, 3)
    for th, axis, b in ((h.k, AXIS_TOKEN, bits[0]), (h.v, AXIS_CHANNEL, bits[1])):
        assert (th.bits, th.axis, th.param_dtype, th.coding, th.predictor, th.values_per_symbol,
                th.const_symbol, th.exact_tokens, th.num_streams) == (
                    b, axis, PARAM_FP16, CODING_CONSTANT, PRED_NONE, 2, 0, 5, 0)
    assert h.header_len == 64 and h.payload_len == 2 * 2 * 5 * 3 * 4
    out = decode(frame)
    assert torch.equal(out.k, c.k) and torch.equal(out.v, c.v)


def test_fully_exact_tensor_decoder_rules():
    k = torch.tensor([[[1.5, -2.0, 3.25]]])
    frame = bytearray(encode(KVChunk(KVChunkId(0, 6, 0), 0, k, -k, 30), "q5"))
    for offset, value, ok in ((41, 1, True), (42, 2, True),  # axis, param_dtype: not used
                              (43, 1, False), (44, 1, False), (46, 1, False), (50, 1, False)):
        bad = bytearray(frame)
        bad[offset] = value
        bad = reseal(bad)
        if ok:
            assert torch.equal(decode(bad).k, k)
        else:
            with pytest.raises(CodecError):
                decode(bad)


# ---- canonical code: count[0] = 0 ------------------------------------------------------------
def doc_canonical(lengths, count0_is_zero=True):
    count = [0] * 13
    for ln in lengths:
        count[ln] += 1  # count[0] counts the unused symbols here ...
    if count0_is_zero:
        count[0] = 0  # ... and the doc says it is 0
    next_code = [0] * 13
    for n in range(1, 13):
        next_code[n] = (next_code[n - 1] + count[n - 1]) << 1
    codes = [0] * len(lengths)
    for s, ln in enumerate(lengths):
        if ln:
            codes[s] = next_code[ln]
            next_code[ln] += 1
    return codes


def test_canonical_code_counts_no_zero_lengths():
    rng = np.random.default_rng(0)
    for alphabet in (32, 64, 256):
        hist = rng.integers(0, 50, alphabet) * (rng.random(alphabet) < 0.4)
        hist[:2] += 1
        lengths = huffman.code_lengths(hist)
        assert (lengths == 0).sum() > 0 and huffman.check_lengths(lengths) is None
        assert doc_canonical(lengths.tolist()) == huffman.canonical_codes(lengths).tolist()
        assert doc_canonical(lengths.tolist(), False) != huffman.canonical_codes(lengths).tolist()
        syms = rng.choice(np.flatnonzero(lengths), 500).astype(np.uint8)
        words, per_stream = huffman.encode_streams(syms, lengths, 2)
        assert np.array_equal(huffman.decode_symbols(words, per_stream, lengths, 500), syms)


# ---- padding ---------------------------------------------------------------------------------
def reseal(frame: bytes | bytearray) -> bytes:
    f = bytearray(frame)
    f[-8:] = struct.pack("<Q", xxhash.xxh64_intdigest(bytes(f[:-8])))
    return bytes(f)


def test_header_padding_must_be_zero_and_exact():
    frame = parse_hex_dump(doc_block("q5-vector"))
    bad = bytearray(frame)
    bad[0x125] = 1
    with pytest.raises(CodecError, match="padding"):
        decode(reseal(bad))
    # eight more zero bytes of header: header_len is no longer pad8(64 + sections)
    h = peek_header(frame)
    longer = bytearray(frame[:h.header_len] + bytes(8) + frame[h.header_len:])
    struct.pack_into("<I", longer, 8, h.header_len + 8)
    with pytest.raises(CodecError, match="header length"):
        decode(reseal(longer))


def test_payload_padding_is_not_checked():
    """docs/wire-format.md section 8: sparkv's decoder accepts non-zero payload padding and
    stream tail bits (under a matching checksum) and its values do not change."""
    k = torch.tensor([[[1.0, 2.0, 3.0]]], dtype=torch.float16)
    raw = encode(KVChunk(KVChunkId(0, 0, 0), 0, k, -k, 0), "raw")
    bad = bytearray(raw)
    bad[64 + 6:64 + 8] = b"\xab\xcd"  # K's raw padding
    out = decode(reseal(bad))
    assert torch.equal(out.k, k) and torch.equal(out.v, -k)

    gen = torch.Generator().manual_seed(0)
    c = KVChunk(KVChunkId(0, 0, 0), 0, torch.randn(1, 20, 3, generator=gen).half(),
                torch.randn(1, 20, 3, generator=gen).half(), 3)
    frame = encode(c, "q5")
    h, good = peek_header(frame), decode(frame)
    bad = bytearray(frame)
    bad[h.header_len + 6:h.header_len + 8] = b"\xff\x7f"  # K's exact padding
    last = h.header_len + h.k.payload_offset + h.k.payload_bytes - 4  # K's last stream word
    (word,) = struct.unpack_from("<I", bad, last)
    k_syms, _ = coded_symbols(frame)
    assert h.k.code_lengths.astype(np.int64)[k_syms].sum() % 32 != 0  # the last word has pad bits
    assert word & 1 == 0
    struct.pack_into("<I", bad, last, word | 1)
    out = decode(reseal(bad))
    assert torch.equal(out.k, good.k) and torch.equal(out.v, good.v)


# ---- dequantization rounding -----------------------------------------------------------------
def doc_dequantize(frame: bytes) -> list[np.ndarray]:
    """Section 6 step 3, in numpy: fl32(min + fl32(q * step)), then the chunk dtype."""
    h = peek_header(frame)
    out = []
    for th, q in zip((h.k, h.v), quantized_values(frame)):
        m = h.num_tokens - th.exact_tokens
        q = q.reshape(h.num_heads, m, h.head_dim).astype(np.float32)
        if th.axis == AXIS_CHANNEL:
            mn, st = th.mins[:, None, :], th.steps[:, None, :]
        else:
            mn, st = th.mins[:, :, None], th.steps[:, :, None]
        out.append((mn.astype(np.float32) + q * st.astype(np.float32), mn, st, q))
    return out


def to_dtype_bits(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if dtype == torch.float16:
        return x.astype(np.float16).view(np.uint16)
    b = x.view(np.uint32).astype(np.uint64)  # bfloat16: round to nearest even on the bits
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def test_dequantization_is_two_float32_roundings_without_fma():
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 64, 16, generator=gen) * 1e6  # float32 parameters: the product rounds
    c = KVChunk(KVChunkId(1, 0, 0), 64, k, torch.randn(2, 64, 16, generator=gen), 3)
    differs = 0
    for axis in (AXIS_TOKEN, AXIS_CHANNEL):
        frame = encode(c, "q8", k_axis=axis, v_axis=axis)
        assert peek_header(frame).k.param_dtype == PARAM_FP32
        out = decode(frame)
        for (x, mn, st, q), got in zip(doc_dequantize(frame), (out.k, out.v)):
            assert np.array_equal(x, got.numpy())
            fused = (mn.astype(np.float64) + q.astype(np.float64) * st).astype(np.float32)
            differs += int((fused != x).sum())
    assert differs > 0  # an FMA would not pass this test
    mn, st, q = np.float32(-1.0), np.uint32(0x3DCCCCCD).view(np.float32), np.float32(7)
    p = q * st
    assert p.view(np.uint32) == 0x3F333333 and (mn + p).view(np.uint32) == 0xBE99999A
    assert np.float32(np.float64(mn) + 7 * np.float64(st)).view(np.uint32) == 0xBE999999


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantization_rounds_float32_to_the_chunk_dtype(dtype):
    gen = torch.Generator().manual_seed(5)
    c = KVChunk(KVChunkId(1, 0, 0), 40, (torch.randn(2, 40, 8, generator=gen) * 3).to(dtype),
                torch.randn(2, 40, 8, generator=gen).to(dtype), 3)
    frame = encode(c, "q4")
    out = decode(frame)
    for (x, *_), got in zip(doc_dequantize(frame), (out.k, out.v)):
        got_bits = got.view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(to_dtype_bits(x, dtype), got_bits)


def test_subnormals_are_kept():
    mins = np.array([[0.0, 1e-38]], np.float32)
    steps = np.array([[1e-40, 3e-39]], np.float32)
    q = np.array([1, 3, 2, 1], np.uint8)
    out = np.empty((1, 2, 2), np.float32)
    quant.reconstruct(q, 8, mins, steps, AXIS_CHANNEL, out)
    want = mins[:, None, :] + q.reshape(1, 2, 2).astype(np.float32) * steps[:, None, :]
    assert np.array_equal(out, want) and out[0, 0, 0] != 0


def test_the_channel_prediction_needs_both_its_arrays():
    mins, steps = np.zeros((1, 2), np.float32), np.ones((1, 2), np.float32)
    q, out = np.array([1, 3, 2, 1], np.uint8), np.empty((1, 2, 2), np.float32)
    with pytest.raises(ValueError, match="alpha and center"):
        quant.reconstruct(q, 8, mins, steps, AXIS_CHANNEL, out, alpha=np.zeros((1, 2), np.uint8))


# ---- NaN and Inf -----------------------------------------------------------------------------
SPECIALS = {  # NaNs (quiet, negative, signalling, with payload), +Inf, -Inf
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA5A5A5, 0x7F800000, 0xFF800000],
    torch.float16: [0x7E00, 0xFE00, 0x7C01, 0x7D55, 0x7C00, 0xFC00],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7F81, 0x7FC1, 0x7F80, 0xFF80],
}


def bits_of(t: torch.Tensor) -> list[int]:
    t = t.contiguous()
    if t.dtype == torch.float32:
        return t.view(torch.int32).numpy().view(np.uint32).tolist()
    return t.view(torch.int16).numpy().view(np.uint16).tolist()


def with_bits(dtype: torch.dtype, patterns: list[int]) -> torch.Tensor:
    if dtype == torch.float32:
        return torch.from_numpy(np.array(patterns, np.uint32).view(np.int32)).view(dtype)
    return torch.from_numpy(np.array(patterns, np.uint16).view(np.int16)).view(dtype)


@pytest.mark.parametrize("dtype", list(SPECIALS))
def test_non_finite_values(dtype):
    pats = SPECIALS[dtype]
    k = torch.randn(1, 8, len(pats), generator=torch.Generator().manual_seed(0)).to(dtype)
    k[0, 0] = with_bits(dtype, pats)  # token 0: the sink, exact at quantized levels
    c = KVChunk(KVChunkId(0, 0, 0), 0, k, k.clone(), 3)
    # raw: bit for bit
    assert bits_of(decode(encode(c, "raw")).k[0, 0]) == pats
    # quantized, in the exact block: the frame holds the bits and decode() gives them back
    # unchanged in every dtype, NaN sign and payload included (passed through, not canonicalized)
    frame = encode(c, "q5")
    h = peek_header(frame)
    assert h.k.exact_tokens == 1
    assert frame[h.header_len:h.header_len + len(pats) * k.element_size()] == bytes(
        k[0, 0].contiguous().view(torch.uint8).numpy())
    got = decode(frame).k[0, 0]
    assert bits_of(got) == pats
    same = torch.empty(1, 8, len(pats), dtype=dtype)  # decode_into an output of the chunk dtype
    decode_into(frame, same, torch.empty_like(same))
    assert bits_of(same[0, 0]) == pats
    # an output of another dtype converts the values (not wire): NaN stays a NaN
    into = torch.empty(1, 8, len(pats))
    decode_into(frame, into, torch.empty(1, 8, len(pats)))
    assert torch.isnan(into[0, 0, :4]).all() and bits_of(into[0, 0, 4:]) == [0x7F800000,
                                                                              0xFF800000]
    # quantized tokens: NaN or Inf anywhere is refused
    for p in (pats[0], pats[2], pats[4], pats[5]):
        bad = k.clone()
        bad[0, 0] = 0
        bad[0, 5, 1] = with_bits(dtype, [p])[0]
        for which in ("k", "v"):
            args = (bad, k) if which == "k" else (k, bad)
            with pytest.raises(CodecError, match="only the raw level"):
                encode(KVChunk(KVChunkId(0, 0, 0), 0, *args, 3), "q5")


def test_quantized_values_never_decode_to_an_infinity():
    """Version 2: decoded quantized values are clamped to the chunk dtype's finite range (the
    encoder rounds the step up, so a group reaching the dtype's largest value overshoots it:
    a float16 group spanning [0, 65504] at 6 bits has step 1040 and 63 * 1040 = 65520, which
    version 1 decoded as +Inf)."""
    k = torch.zeros(1, 2, 2, dtype=torch.float16)
    k[0, 1, 0] = 65504.0
    frame = encode(KVChunk(KVChunkId(1, 3, 0), 2, k, k.clone(), 30), "q5", k_axis=AXIS_TOKEN)
    h = peek_header(frame)
    assert h.k.bits == 6 and h.k.exact_tokens == 0
    assert float(h.k.mins[0, 1]) == 0.0 and float(h.k.steps[0, 1]) == 1040.0
    assert 63 * 1040 == 65520  # would round to +Inf in float16
    out = decode(frame).k
    assert out[0, 1, 0] == 65504.0 and out[0, 1, 1] == 0
    into = torch.empty(1, 2, 2, dtype=torch.float32)  # the clamp is the chunk dtype's, not out's
    decode_into(frame, into, torch.empty(1, 2, 2))
    assert into[0, 1, 0] == 65504.0
    ref = __import__("test_codec_wire").reference_decode(frame)
    assert ref["k"][0, 1, 0] == 65504.0
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        big = torch.finfo(dtype).max
        for level in ("q8", "q5", "q2"):
            for axis in (AXIS_TOKEN, AXIS_CHANNEL):
                x = torch.zeros(1, 8, 4, dtype=dtype)
                x[0, 3, 0], x[0, 4, 0], x[0, 5, 1] = big, -big, big
                x[0, 6, 2] = -big
                out = decode(encode(KVChunk(KVChunkId(1, 0, 0), 8, x, x.clone(), 3), level,
                                    k_axis=axis, v_axis=axis))
                for t in (out.k, out.v):
                    assert torch.isfinite(t).all(), (dtype, level, axis)
                    assert t.float().abs().max() <= big


def test_forged_parameters_beyond_the_dtype_decode_clamped():
    """A frame from another encoder whose min or min + q * step lies outside the chunk dtype's
    range decodes to the dtype's largest finite values, never an infinity."""
    x = torch.zeros(1, 4, 2, dtype=torch.float16)
    x[0, :, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    frame = bytearray(encode(KVChunk(KVChunkId(1, 0, 0), 4, x, x.clone(), 3), "q8",
                             predictor="none")[:-8])
    h = peek_header(bytes(frame))
    assert h.k.param_dtype == PARAM_FP16 and h.k.axis == AXIS_CHANNEL
    # K mins (2 x fp16 at 64), then K steps (2 x fp16 at 68): min -65504, step 65504
    struct.pack_into("<2e2e", frame, 64, -65504.0, -65504.0, 65504.0, 65504.0)
    frame += struct.pack("<Q", xxhash.xxh64_intdigest(bytes(frame)))
    out = decode(bytes(frame)).k
    assert torch.isfinite(out).all()
    assert out[0, 0, 0] == -65504.0  # q = 0: the min itself
    assert out[0, 1, 0] == 65504.0 / 1  # -65504 + q * 65504 with q >= 2 clamps to the top
    assert out.float().max() == 65504.0


# ---- around the frame (sparkv.protocol) ------------------------------------------------------
def test_stream_record_and_encryption_as_documented():
    from sparkv.protocol import crypto, stream

    frame = vector_frame()
    assert stream.encode_records([frame, frame]) == 2 * (struct.pack("<I", len(frame)) + frame)
    assert stream.stream_length([len(frame)] * 2) == 2 * (4 + len(frame))
    assert "`sparkv/v1/{context_id}/{t}/{l}/{g}/{level}`" in DOC.replace('"', "`")
    assert crypto.AAD_FORMAT == "sparkv/v1/{context_id}/{t}/{l}/{g}/{level}"
    assert (crypto.NONCE_BYTES, crypto.TAG_BYTES, crypto.KEY_BYTES) == (12, 16, 32)
    ctx = "0123456789abcdef0123456789abcdef"
    assert crypto.frame_aad(ctx, 3, 29, 0, "q5") == f"sparkv/v1/{ctx}/3/29/0/q5".encode()
    assert f"sparkv/v1/{ctx}/3/29/0/q5" in DOC
    key = crypto.new_key()
    sealed = crypto.FrameCipher(key, ctx).seal(frame, 0, 10, 2, "q5")
    assert len(sealed) == len(frame) + 28
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aad = f"sparkv/v1/{ctx}/0/10/2/q5".encode("ascii")
    assert AESGCM(key).decrypt(sealed[:12], sealed[12:], aad) == frame
