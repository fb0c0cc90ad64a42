"""Hostile input: every mutated frame raises CodecError - never another exception, a crash, a
hang or a big allocation. Two kinds of mutation: plain ones (the checksum must catch them, or the
header parser before it) and forged ones whose checksum is recomputed (the parser and decoder
must hold up on their own)."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkv.codec import CodecError, KVChunk, decode, decode_into, encode, peek_header
from sparkv.codec import quant
from sparkv.codec.frame import HEADER_MIN
from sparkv.layout import KVChunkId

MB = 1 << 20
FUZZ = settings(max_examples=150, deadline=2000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _chunk(dtype=torch.float32, n=24, t=0, start=0, seed=0) -> KVChunk:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(2, n, 8, generator=g) * 3).to(dtype)
    v = torch.randn(2, n, 8, generator=g).to(dtype)
    return KVChunk(KVChunkId(t, 1, 0), start, k, v, 4)


def _const_chunk() -> KVChunk:
    c = _chunk(t=1, start=24)
    c.k.fill_(1.5)
    return c


FRAMES = {
    "raw-f32": encode(_chunk(), "raw"),
    "raw-bf16": encode(_chunk(torch.bfloat16), "raw"),
    "q5-sink": encode(_chunk(), "q5"),
    "q3-token-channel": encode(_chunk(t=1, start=24), "q3", k_axis=quant.AXIS_TOKEN,
                             predictor="channel", streams=3),
    "q2-f16": encode(_chunk(torch.float16, t=2, start=48), "q2"),
    "q8-const": encode(_const_chunk(), "q8"),
    "q6-streams": encode(_chunk(n=64, t=1, start=64, seed=2), "q6", streams=7),
}
frame_names = st.sampled_from(sorted(FRAMES))
for _frame in FRAMES.values():  # compile (or load) the numba kernels outside hypothesis deadlines
    decode(_frame)


def reseal(body: bytes | bytearray) -> bytes:
    """A frame with its checksum recomputed over ``body`` (all but the last 8 bytes)."""
    body = bytes(body)
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def must_fail_cleanly(data) -> None:
    with pytest.raises(CodecError):
        decode(data)


def decode_or_codec_error(data) -> None:
    """Forged frames may happen to be valid; anything but CodecError or success is a bug."""
    tracemalloc.start()
    try:
        decode(data)
    except CodecError:
        pass
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < 100 * MB


def test_all_sample_frames_decode():
    for name, frame in FRAMES.items():
        out = decode(frame)
        assert out.k.shape[1] in (24, 64), name


# ---- plain mutations: caught -----------------------------------------------------------------
@FUZZ
@given(frame_names, st.data())
def test_truncation(name, data):
    frame = FRAMES[name]
    cut = data.draw(st.integers(0, len(frame) - 1))
    must_fail_cleanly(frame[:cut])
    if cut < peek_header(frame).header_len:
        with pytest.raises(CodecError):
            peek_header(frame[:cut])


@FUZZ
@given(frame_names, st.data())
def test_bit_flips(name, data):
    frame = bytearray(FRAMES[name])
    flips = data.draw(st.lists(st.integers(0, len(frame) * 8 - 1), min_size=1, max_size=8,
                               unique=True))
    for bit in flips:
        frame[bit // 8] ^= 1 << (bit % 8)
    must_fail_cleanly(bytes(frame))


@FUZZ
@given(frame_names, st.data())
def test_single_payload_bit_flip_is_caught_by_the_checksum(name, data):
    frame = FRAMES[name]
    hdr = peek_header(frame)
    if hdr.payload_len == 0:
        return
    bit = data.draw(st.integers(0, hdr.payload_len * 8 - 1))
    bad = bytearray(frame)
    bad[hdr.header_len + bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CodecError, match="checksum"):
        decode(bytes(bad))


@FUZZ
@given(frame_names, st.binary(min_size=1, max_size=64))
def test_appended_garbage(name, extra):
    must_fail_cleanly(FRAMES[name] + extra)


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes(blob):
    must_fail_cleanly(blob)
    must_fail_cleanly(b"SPKV\x01" + blob)


@pytest.mark.parametrize("junk", [None, "SPKV", 12, [1, 2, 3], 3.5, torch.zeros(3)])
def test_not_bytes_at_all(junk):
    with pytest.raises(CodecError):
        decode(junk)
    with pytest.raises(CodecError):
        peek_header(junk)


# ---- forged mutations (checksum recomputed) --------------------------------------------------
@FUZZ
@given(frame_names, st.data())
def test_forged_byte_changes(name, data):
    frame = bytearray(FRAMES[name][:-8])
    region = data.draw(st.sampled_from(["header", "anywhere"]))
    hi = (peek_header(FRAMES[name]).header_len if region == "header" else len(frame)) - 1
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, hi))
        frame[pos] = data.draw(st.integers(0, 255))
    decode_or_codec_error(reseal(frame))


# Offsets in the fixed header (docs/wire-format.md).
FIELDS = {"version": (4, "B"), "dtype": (5, "B"), "level": (6, "B"), "flags": (7, "B"),
          "header_len": (8, "I"), "payload_len": (12, "I"), "layer": (20, "H"),
          "tokens": (28, "I"), "heads": (32, "H"), "head_dim": (34, "H"), "num_layers": (36, "H"),
          "k_bits": (40, "B"), "k_axis": (41, "B"), "k_coding": (43, "B"), "k_per": (45, "B"),
          "k_exact": (48, "H"), "k_streams": (50, "H"), "v_streams": (62, "H")}


@FUZZ
@given(frame_names, st.sampled_from(sorted(FIELDS)), st.data())
def test_forged_fields_huge_and_wrong(name, field, data):
    off, fmt = FIELDS[field]
    top = {"B": 0xFF, "H": 0xFFFF, "I": 0xFFFFFFFF}[fmt]
    value = data.draw(st.one_of(st.sampled_from([0, 1, 2, 3, top, top - 1, top // 2]),
                                st.integers(0, top)))
    frame = bytearray(FRAMES[name][:-8])
    old = struct.unpack_from("<" + fmt, frame, off)[0]
    struct.pack_into("<" + fmt, frame, off, value)
    forged = reseal(frame)
    if value == old:
        decode(forged)
        return
    decode_or_codec_error(forged)


def test_wrong_version_is_named():
    for version in (0, 1, 3, 255):  # 1: frames of the first format (decoded without clamping)
        frame = bytearray(FRAMES["q5-sink"][:-8])
        frame[4] = version
        with pytest.raises(CodecError, match=f"version {version} "):
            decode(reseal(frame))
        with pytest.raises(CodecError, match=f"version {version} "):
            peek_header(reseal(frame))


def test_huge_shape_is_refused_before_allocating():
    frame = bytearray(FRAMES["q8-const"][:-8])
    struct.pack_into("<IHH", frame, 28, 0xFFFFFFFF, 0xFFFF, 0xFFFF)  # tokens, heads, head_dim
    tracemalloc.start()
    with pytest.raises(CodecError, match="limit"):
        decode(reseal(frame))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < MB


def test_huge_payload_length_is_refused():
    frame = bytearray(FRAMES["q5-sink"][:-8])
    struct.pack_into("<I", frame, 12, 0xFFFFFFF0)
    with pytest.raises(CodecError):
        decode(reseal(frame))


@FUZZ
@given(frame_names, st.integers(0, 2**32 - 1))
def test_forged_payload_garbage(name, seed):
    """Valid header, random payload bytes, valid checksum: Huffman streams that decode to the
    wrong length are reported; anything else decodes to some values."""
    frame = FRAMES[name]
    hdr = peek_header(frame)
    g = torch.Generator().manual_seed(seed)
    junk = torch.randint(0, 256, (hdr.payload_len,), generator=g, dtype=torch.uint8)
    body = frame[:hdr.header_len] + bytes(junk.numpy().tobytes())
    decode_or_codec_error(reseal(body))


def test_wrong_output_shapes():
    frame = FRAMES["q5-sink"]
    for shape in [(2, 24, 9), (1, 24, 8), (2, 23, 8), (2, 24)]:
        with pytest.raises(CodecError):
            decode_into(frame, torch.zeros(shape), torch.zeros(2, 24, 8))
    with pytest.raises(CodecError):
        decode_into(frame, "k", "v")  # type: ignore[arg-type]


def test_header_min_is_64():
    assert HEADER_MIN == 64
    with pytest.raises(CodecError, match="truncated"):
        peek_header(FRAMES["raw-f32"][:63])
