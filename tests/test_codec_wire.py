"""docs/wire-format.md is enough to write a decoder: an independent, slow, pure-Python reader
written from that page must decode what the codec encodes, value for value."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
import xxhash

from sparkv.codec import KVChunk, decode, encode, quant
from sparkv.layout import KVChunkId


# ---- a reader written from docs/wire-format.md alone -----------------------------------------
def pad8(x: int) -> int:
    return (x + 7) // 8 * 8


class Bits:
    """MSB-first bits from little-endian 32-bit words."""

    def __init__(self, data: bytes) -> None:
        self.words = struct.unpack(f"<{len(data) // 4}I", data)
        self.pos = 0

    def bit(self) -> int:
        word, off = divmod(self.pos, 32)
        self.pos += 1
        return (self.words[word] >> (31 - off)) & 1


def canonical(lengths: list[int]) -> dict[tuple[int, int], int]:
    count = [0] * 13
    for ln in lengths:
        if ln:
            count[ln] += 1
    next_code = [0] * 14
    code = 0
    for ln in range(1, 13):
        code = (code + count[ln - 1]) << 1 if ln > 1 else 0
        next_code[ln] = code
    table = {}
    for sym, ln in enumerate(lengths):
        if ln:
            table[(ln, next_code[ln])] = sym
            next_code[ln] += 1
    return table


def reference_decode(frame: bytes) -> dict:
    assert frame[:4] == b"SPKV" and frame[4] == 2
    dtype_code, level, flags = frame[5], frame[6], frame[7]
    header_len, payload_len = struct.unpack_from("<II", frame, 8)
    assert len(frame) == header_len + payload_len + 8
    body = header_len + payload_len
    assert struct.unpack_from("<Q", frame, body)[0] == xxhash.xxh64_intdigest(frame[:body])
    t, l, g, token_start, n, h, d, num_layers = struct.unpack_from("<IHHIIHHH", frame, 16)
    itemsize = 4 if dtype_code == 1 else 2
    storage = {1: "<f4", 2: "<f2", 3: "<u2"}[dtype_code]
    pos = 64
    payload_pos = header_len
    out = {"id": (t, l, g), "token_start": token_start, "shape": (h, n, d), "level": level}
    for name, desc_off in (("k", 40), ("v", 52)):
        b, axis, pdt, coding, pred, per, const, _, e, s = struct.unpack_from("<8BHH", frame,
                                                                          desc_off)
        x = np.zeros((h, n, d), dtype=np.float32)
        if level == 0:
            raw = np.frombuffer(frame, storage, h * n * d, payload_pos).reshape(h, n, d)
            payload_pos += pad8(h * n * d * itemsize)
            out[name] = raw.copy()
            continue
        if e:
            exact = np.frombuffer(frame, storage, h * e * d, payload_pos).reshape(h, e, d)
            payload_pos += pad8(h * e * d * itemsize)
            x[:, :e] = to_float32(exact, dtype_code)
        m = n - e
        nq = h * m * d
        if nq == 0:
            out[name] = x
            continue
        groups = h * m if axis == 1 else h * d
        p = "<f2" if pdt == 1 else "<f4"
        psize = 2 if pdt == 1 else 4
        mins = np.frombuffer(frame, p, groups, pos).astype(np.float32)
        pos += groups * psize
        steps = np.frombuffer(frame, p, groups, pos).astype(np.float32)
        pos += groups * psize
        alpha = center = None
        if pred == 1:
            alpha = list(frame[pos:pos + h * d])
            pos += h * d
            center = list(frame[pos:pos + h * d])
            pos += h * d
        num_symbols = math.ceil(nq / per)
        alphabet = 1 << (b * per)
        if coding == 2:
            symbols = [const] * num_symbols
        else:
            lengths = list(frame[pos:pos + alphabet])
            pos += alphabet
            sizes = struct.unpack_from(f"<{s}I", frame, pos)
            pos += 4 * s
            codes = canonical(lengths)
            symbols = []
            for i in range(s):
                count = (i + 1) * num_symbols // s - i * num_symbols // s
                bits = Bits(frame[payload_pos:payload_pos + sizes[i]])
                payload_pos += sizes[i]
                for _ in range(count):
                    code, ln = 0, 0
                    while (ln, code) not in codes:
                        code = (code << 1) | bits.bit()
                        ln += 1
                        assert ln <= 12
                    symbols.append(codes[(ln, code)])
                assert math.ceil(bits.pos / 32) == len(bits.words)
        mask = (1 << b) - 1
        values = []
        for sym in symbols:
            for j in range(per):
                values.append((sym >> (b * (per - 1 - j))) & mask)
        r = np.array(values[:nq], dtype=np.int64).reshape(h, m, d)
        q = r.copy()
        if pred == 1:
            for hh in range(h):
                for dd in range(d):
                    a, c = alpha[hh * d + dd], center[hh * d + dd]
                    q[hh, 0, dd] = (r[hh, 0, dd] + c) & mask
                    for mm in range(1, m):
                        q[hh, mm, dd] = (r[hh, mm, dd] + ((a * q[hh, mm - 1, dd] + (4 - a) * c
                                                          + 2) >> 2)) & mask
        if axis == 1:
            mn, st = mins.reshape(h, m, 1), steps.reshape(h, m, 1)
        else:
            mn, st = mins.reshape(h, 1, d), steps.reshape(h, 1, d)
        with np.errstate(over="ignore"):
            dq = mn + q.astype(np.float32) * st
        top = FINITE_MAX[dtype_code]  # section 6, step 4: clamp to the dtype's finite range
        x[:, e:] = np.clip(dq, -top, top)
        out[name] = x
    pos = pad8(pos)
    assert pos == header_len and payload_pos == body
    return out


FINITE_MAX = {1: np.float32(np.finfo(np.float32).max), 2: np.float32(65504.0),
              3: np.uint32(0x7F7F0000).view(np.float32)}
"""The largest finite value of each chunk dtype, as a float32."""


def to_float32(a: np.ndarray, dtype_code: int) -> np.ndarray:
    if dtype_code == 3:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


# ---- tests -----------------------------------------------------------------------------------
def sample(n: int = 20, t: int = 0, dtype=torch.float32, seed: int = 0) -> KVChunk:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(2, n, 6, generator=gen) * 2 + torch.arange(6.0)
    v = torch.randn(2, n, 6, generator=gen)
    k[:, :, 1] += torch.linspace(0, 3, n)  # a slowly drifting channel: the predictor likes it
    return KVChunk(KVChunkId(t, 2, 1), t * n, k.to(dtype), v.to(dtype), 8)


@pytest.mark.parametrize("level", ["raw", "q8", "q6", "q5", "q4", "q3", "q2"])
@pytest.mark.parametrize("t", [0, 1])
def test_reference_reader_agrees(level, t):
    c = sample(t=t)
    frame = encode(c, level, streams=3)
    ref = reference_decode(frame)
    ours = decode(frame)
    assert ref["id"] == tuple(c.id) and ref["shape"] == tuple(c.k.shape)
    np.testing.assert_array_equal(ref["k"], as_numpy(ours.k))
    np.testing.assert_array_equal(ref["v"], as_numpy(ours.v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_reader_half_precision(dtype):
    c = sample(t=0, dtype=dtype)
    for level in ("raw", "q4"):
        frame = encode(c, level)
        ref = reference_decode(frame)
        ours = decode(frame)
        if level == "raw":
            np.testing.assert_array_equal(ref["k"], as_numpy(ours.k))
        else:  # the reference stops at float32; the codec then rounds to the chunk dtype
            assert torch.equal(torch.from_numpy(ref["k"]).to(dtype), ours.k)


@pytest.mark.parametrize("axis", [quant.AXIS_TOKEN, quant.AXIS_CHANNEL])
@pytest.mark.parametrize("predictor", ["none", "channel"])
def test_reference_reader_options(axis, predictor):
    c = sample(n=33, t=1, seed=4)
    frame = encode(c, "q3", k_axis=axis, v_axis=axis, predictor=predictor, streams=5)
    ref = reference_decode(frame)
    ours = decode(frame)
    np.testing.assert_array_equal(ref["k"], ours.k.numpy())
    np.testing.assert_array_equal(ref["v"], ours.v.numpy())


def test_documented_example_bytes():
    c = KVChunk(KVChunkId(0, 0, 0), 0, torch.tensor([[[1.0, 2.0]]]),
                torch.tensor([[[-1.0, 0.5]]]), 0)
    frame = encode(c, "raw")
    assert len(frame) == 88
    expected = bytes.fromhex(
        "5350 4b56 0201 0000 4000 0000 1000 0000"
        "0000 0000 0000 0000 0000 0000 0100 0000"
        "0100 0200 0000 0000 0000 0000 0000 0000"
        "0000 0000 0000 0000 0000 0000 0000 0000"
        "0000 803f 0000 0040 0000 80bf 0000 003f")
    assert frame[:80] == expected
    assert frame[80:] == struct.pack("<Q", xxhash.xxh64_intdigest(frame[:80]))
