"""Frames: lossless and quantized round trips, error bounds, decode_into, headers, levels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkv.codec import (
    DEFAULT_LEVEL, LEVELS, QUANTIZED_LEVELS, CodecError, KVChunk, decode, decode_into, encode,
    get_level, peek_header,
)
from sparkv.codec import levels, quant
from sparkv.codec.frame import MAX_TENSOR_VALUES, SINK_TOKENS
from sparkv.layout import KVChunkId

L = 12  # layers of the pretend model


def kv_like(h: int = 3, n: int = 96, d: int = 64, seed: int = 0, dtype=torch.float32
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K with a few outlier channels and a drifting mean, V roughly Gaussian."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, n, d, generator=g)
    k[:, :, :4] *= 8.0
    k += torch.linspace(-1, 1, n)[None, :, None]
    v = torch.randn(h, n, d, generator=g) * 0.5
    return k.to(dtype), v.to(dtype)


def chunk(t: int = 1, layer: int = 5, n: int = 96, dtype=torch.float32, seed: int = 0,
          token_start: int | None = None, h: int = 3, d: int = 64) -> KVChunk:
    k, v = kv_like(h, n, d, seed, dtype)
    start = t * n if token_start is None else token_start
    return KVChunk(KVChunkId(t, layer, 0), start, k, v, L)


def bits_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == torch.float32 else x.view(torch.int16)


def error_bound(frame: bytes, which: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-element documented bound: step/2, plus float32 rounding of min + q*step, plus half an
    ulp of the output dtype (fp16/bf16 chunks)."""
    hdr = peek_header(frame)
    th = hdr.k if which == "K" else hdr.v
    h, n, d = hdr.shape
    e = th.exact_tokens
    bound = torch.zeros(h, n, d, dtype=torch.float64)
    steps = torch.from_numpy(th.steps.astype(np.float64))
    mins = torch.from_numpy(th.mins.astype(np.float64))
    if th.axis == quant.AXIS_CHANNEL:
        step = steps[:, None, :].expand(h, n - e, d)
        top = (mins.abs() + steps * ((1 << th.bits) - 1))[:, None, :].expand(h, n - e, d)
    else:
        step = steps[:, :, None].expand(h, n - e, d)
        top = (mins.abs() + steps * ((1 << th.bits) - 1))[:, :, None].expand(h, n - e, d)
    b = step / 2 + top * 2.0 ** -22
    if dtype == torch.float16:
        b = b + top * 2.0 ** -11 + 2.0 ** -25
    elif dtype == torch.bfloat16:
        b = b + top * 2.0 ** -8
    bound[:, e:, :] = b
    return bound


# ---- lossless --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_raw_is_bit_exact(dtype):
    c = chunk(dtype=dtype)
    # awkward values too: signed zeros, infinities, NaN payloads, subnormals
    c.k[0, 0, :5] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")],
                                 dtype=dtype)
    c.v[0, 1, 0] = torch.finfo(dtype).tiny / 4
    frame = encode(c, "raw")
    out = decode(frame)
    assert out.k.dtype == dtype and out.v.dtype == dtype
    assert torch.equal(bits_view(out.k), bits_view(c.k))
    assert torch.equal(bits_view(out.v), bits_view(c.v))
    assert out.id == c.id and out.token_start == c.token_start and out.num_layers == L


def test_raw_without_num_layers():
    c = chunk()
    c.num_layers = 0
    out = decode(encode(c, "raw"))
    assert torch.equal(out.k, c.k)


# ---- quantized: error bounds -----------------------------------------------------------------
@pytest.mark.parametrize("level", QUANTIZED_LEVELS)
@pytest.mark.parametrize("layer", [0, 11])
def test_levels_within_half_a_step(level, layer):
    c = chunk(layer=layer)
    frame = encode(c, level)
    hdr = peek_header(frame)
    assert (hdr.k_bits, hdr.v_bits) == get_level(level).bits(layer, L)
    out = decode(frame)
    for which, x, y in (("K", c.k, out.k), ("V", c.v, out.v)):
        err = (y.double() - x.double()).abs()
        assert torch.all(err <= error_bound(frame, which, torch.float32)), (level, which)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_chunks_within_bound(dtype):
    c = chunk(dtype=dtype, layer=3)
    frame = encode(c, "q4")
    out = decode(frame)
    assert out.k.dtype == dtype
    for which, x, y in (("K", c.k, out.k), ("V", c.v, out.v)):
        err = (y.double() - x.double()).abs()
        assert torch.all(err <= error_bound(frame, which, dtype))


@pytest.mark.parametrize("axis", [quant.AXIS_TOKEN, quant.AXIS_CHANNEL])
@pytest.mark.parametrize("predictor", ["none", "channel"])
def test_axes_and_predictors_roundtrip_within_bound(axis, predictor):
    c = chunk(n=40)
    frame = encode(c, "q3", k_axis=axis, v_axis=axis, predictor=predictor)
    hdr = peek_header(frame)
    assert hdr.k.axis == axis and hdr.k.predictor == (1 if predictor == "channel" else 0)
    out = decode(frame)
    for which, x, y in (("K", c.k, out.k), ("V", c.v, out.v)):
        assert torch.all((y.double() - x.double()).abs() <= error_bound(frame, which,
                                                                          torch.float32))


def test_more_bits_less_error_and_more_bytes():
    c = chunk(layer=8)
    sizes, errors = [], []
    for level in ["q2", "q3", "q4", "q5", "q6", "q8"]:
        frame = encode(c, level)
        out = decode(frame)
        sizes.append(len(frame))
        errors.append(float((out.k - c.k).norm() / c.k.norm()))
    assert sizes == sorted(sizes)
    assert errors == sorted(errors, reverse=True)


def test_sink_tokens_are_exact():
    c = chunk(t=0, token_start=0, n=50)
    out = decode(encode(c, "q3"))
    assert torch.equal(out.k[:, :SINK_TOKENS], c.k[:, :SINK_TOKENS])
    assert torch.equal(out.v[:, :SINK_TOKENS], c.v[:, :SINK_TOKENS])
    assert not torch.equal(out.k[:, SINK_TOKENS:], c.k[:, SINK_TOKENS:])
    # a later chunk keeps nothing exact
    assert peek_header(encode(chunk(t=1), "q3")).k.exact_tokens == 0


def test_chunk_of_only_sink_tokens():
    c = chunk(t=0, token_start=0, n=1)
    out = decode(encode(c, "q5"))
    assert torch.equal(out.k, c.k) and torch.equal(out.v, c.v)


def test_constant_chunk_costs_almost_nothing():
    c = chunk()
    c.k.zero_()
    c.v.fill_(0.25)
    frame = encode(c, "q5")
    out = decode(frame)
    assert torch.equal(out.k, c.k) and torch.equal(out.v, c.v)
    assert len(frame) < 2000  # parameters only: no coded payload


def test_streams_option_and_large_chunk():
    k, v = kv_like(4, 1024, 64, seed=3)
    c = KVChunk(KVChunkId(2, 9, 1), 2048, k, v, L)
    f1 = encode(c, "q5", streams=1)
    f16 = encode(c, "q5", streams=16)
    assert peek_header(f16).k.num_streams == 16
    a, b = decode(f1), decode(f16, parallel=True)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    assert len(f16) - len(f1) < 16 * 8 + 16 * 4 * 2  # stream padding and lengths only


def test_non_finite_values_need_raw():
    c = chunk()
    c.v[0, 0, 0] = float("nan")
    with pytest.raises(CodecError, match="raw"):
        encode(c, "q5")
    out = decode(encode(c, "raw"))
    assert torch.isnan(out.v[0, 0, 0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("level,where", [("raw", (1, 40, 7)), ("q5", (2, 0, 3))])
@pytest.mark.parametrize("tensor", ["k", "v"])
def test_finite_decode_refuses_non_finite_lossless_values(bad, level, where, tensor):
    """What the codec passes through unbounded (raw values; a quantized level's exact sink
    rows) is checked when a consumer asks for finite KV; nothing is written then."""
    c = chunk(t=0)                                # the context's first chunk: its sink is exact
    getattr(c, tensor)[where] = bad
    frame = encode(c, level)
    assert not torch.isfinite(getattr(decode(frame), tensor)[where])   # the format keeps it
    with pytest.raises(CodecError, match=f"{tensor.upper()} holds non-finite values"):
        decode(frame, finite=True)
    k_out, v_out = torch.full((3, 96, 64), 7.0), torch.full((3, 96, 64), 7.0)
    with pytest.raises(CodecError, match="non-finite"):
        decode_into(frame, k_out, v_out, finite=True)
    assert torch.all(k_out == 7.0) and torch.all(v_out == 7.0)


@pytest.mark.parametrize("level", ["raw", "q8", "q5"])
def test_finite_decode_of_a_finite_frame_is_the_plain_decode(level):
    frame = encode(chunk(), level)
    plain, checked = decode(frame), decode(frame, finite=True)
    assert torch.equal(plain.k, checked.k) and torch.equal(plain.v, checked.v)


def test_finite_decode_bounds_values_by_the_output_dtype():
    """A float32 frame read into float16: a raw value past 65504 would become an infinity, so
    a finite decode refuses it; quantized values are clamped to float16's range."""
    c = chunk()
    c.k[0, 5, 0] = 1e6
    with pytest.raises(CodecError, match="past float16's range"):
        decode(encode(c, "raw"), finite=True, dtype=torch.float16)
    decode(encode(c, "raw"), finite=True)                       # fine in float32
    c = chunk()
    c.k[:, 1:, :] *= 1e5                                          # quantized rows, huge
    out = decode(encode(c, "q8"), finite=True, dtype=torch.float16)
    assert torch.isfinite(out.k).all() and out.k.dtype == torch.float16
    assert float(out.k.abs().max()) == float(torch.finfo(torch.float16).max)


def test_decode_into_a_dtype_that_is_not_floating_is_refused():
    with pytest.raises(CodecError, match="floating-point"):
        decode(encode(chunk(), "raw"), dtype=torch.int32)


def test_huge_values_switch_parameters_to_fp32():
    c = chunk()
    c.k *= 1e6  # beyond float16's range
    frame = encode(c, "q8")
    assert peek_header(frame).k.param_dtype == quant.PARAM_FP32
    assert peek_header(frame).v.param_dtype == quant.PARAM_FP16
    out = decode(frame)
    assert torch.all((out.k.double() - c.k.double()).abs()
                     <= error_bound(frame, "K", torch.float32))


# ---- decode_into -----------------------------------------------------------------------------
def test_decode_into_strided_views_of_a_cache():
    c = chunk(t=1, n=32)
    cache_k = torch.full((1, 6, 128, 64), 7.0)
    cache_v = torch.full((1, 6, 128, 64), 7.0)
    kv, vv = cache_k[0, 3:6, 32:64], cache_v[0, 3:6, 32:64]
    for level in ("raw", "q5"):
        frame = encode(c, level)
        hdr = decode_into(frame, kv, vv)
        ref = decode(frame)
        assert hdr.chunk_id == c.id
        assert torch.equal(kv, ref.k) and torch.equal(vv, ref.v)
    assert torch.all(cache_k[0, :3] == 7.0) and torch.all(cache_k[0, :, :32] == 7.0)
    assert torch.all(cache_k[0, :, 64:] == 7.0)


def test_decode_into_other_dtype():
    c = chunk(n=16)
    frame = encode(c, "q6")
    k16 = torch.empty(3, 16, 64, dtype=torch.float16)
    v16 = torch.empty(3, 16, 64, dtype=torch.float16)
    decode_into(frame, k16, v16)
    ref = decode(frame)
    assert torch.equal(k16, ref.k.half()) and torch.equal(v16, ref.v.half())


def test_decode_into_rejects_wrong_shapes_and_leaves_outputs_alone():
    c = chunk(n=16)
    frame = encode(c, "q5")
    k = torch.zeros(3, 16, 64)
    with pytest.raises(CodecError, match="shape"):
        decode_into(frame, torch.zeros(3, 17, 64), torch.zeros(3, 16, 64))
    with pytest.raises(CodecError):
        decode_into(frame, k, torch.zeros(3, 16, 64, dtype=torch.int32))
    bad = bytearray(frame)
    bad[-20] ^= 1
    with pytest.raises(CodecError, match="checksum"):
        decode_into(bytes(bad), k, torch.zeros(3, 16, 64))
    assert torch.all(k == 0)


# ---- headers ---------------------------------------------------------------------------------
def test_peek_header_fields_and_prefix():
    c = chunk(t=3, layer=7, n=48, dtype=torch.float16)
    frame = encode(c, "q4")
    hdr = peek_header(frame)
    assert hdr.chunk_id == KVChunkId(3, 7, 0)
    assert hdr.token_range == (144, 192)
    assert hdr.shape == (3, 48, 64)
    assert hdr.dtype == torch.float16 and hdr.level == "q4" and hdr.num_layers == L
    assert hdr.frame_len == len(frame)
    assert peek_header(frame[:hdr.header_len]) == hdr  # the header alone is enough
    with pytest.raises(CodecError, match="truncated"):
        peek_header(frame[:hdr.header_len - 1])
    assert peek_header(memoryview(frame)) == hdr
    assert peek_header(bytearray(frame)) == hdr


def test_decode_accepts_bytearray_and_memoryview():
    c = chunk(n=20)
    frame = encode(c, "q5")
    a = decode(frame)
    b = decode(bytearray(frame))
    cc = decode(memoryview(frame))
    assert torch.equal(a.k, b.k) and torch.equal(a.k, cc.k)


# ---- encoder input validation ----------------------------------------------------------------
def test_encode_rejects_bad_chunks():
    c = chunk()
    with pytest.raises(CodecError, match="unknown level"):
        encode(c, "q9")
    with pytest.raises(CodecError, match="num_layers"):
        encode(KVChunk(c.id, c.token_start, c.k, c.v, 0), "q5")
    with pytest.raises(CodecError):
        encode(KVChunk(c.id, c.token_start, c.k, c.v[:, :10]), "raw")
    with pytest.raises(CodecError):
        encode(KVChunk(c.id, c.token_start, c.k.double(), c.v.double(), L), "raw")
    with pytest.raises(CodecError):
        encode(KVChunk(c.id, c.token_start, c.k[0], c.v[0], L), "raw")
    with pytest.raises(CodecError):
        encode(KVChunk(KVChunkId(0, L, 0), 0, c.k, c.v, L), "q5")  # layer out of range
    with pytest.raises(CodecError):
        encode("not a chunk", "raw")  # type: ignore[arg-type]
    big = torch.zeros(1, MAX_TENSOR_VALUES + 1, 1)
    with pytest.raises(CodecError, match="limit"):
        encode(KVChunk(c.id, 0, big, big, L), "raw")


# ---- levels ----------------------------------------------------------------------------------
def test_level_registry():
    assert DEFAULT_LEVEL == "q5" and "raw" in LEVELS
    assert len(QUANTIZED_LEVELS) >= 5
    q5 = get_level("q5")
    # SmolLM2 (30 layers): the sensitivity profile, offsets -1..+2 around 5 bits
    assert q5.k_bits_per_layer(30) == [5 + o for o in levels.PROFILE_K]
    assert q5.v_bits_per_layer(30) == [5 + o for o in levels.PROFILE_V]
    assert q5.bits(17, 30) == (7, 5) and q5.bits(18, 30) == (7, 6) and q5.bits(29, 30) == (4, 4)
    assert get_level("q8").k_bits_per_layer(30) == [8] * 30
    assert get_level("q8").v_bits_per_layer(32) == [8] * 32
    assert get_level("raw").bits(3, 30) == (0, 0)
    with pytest.raises(CodecError):
        get_level("nope")
    with pytest.raises(CodecError):
        q5.bits(30, 30)


@pytest.mark.parametrize("num_layers", [1, 2, 5, 16, 24, 30, 32, 40, 80])
def test_levels_keep_their_mean_bits_at_every_depth(num_layers):
    """Every quantized level spends its base bits + 0.2 on average at depth 30 (the profile's),
    stays within 2..8 bits and within -1..+2 of its base at any depth, and never gives a layer
    fewer bits than the next lower level."""
    order = ["q8", "q6", "q5", "q4", "q3", "q2"]
    for name in order:
        lvl = get_level(name)
        for layer in range(num_layers):
            k, v = lvl.bits(layer, num_layers)
            for b in (k, v):
                assert 2 <= b <= 8 and lvl.base_bits - 1 <= b <= lvl.base_bits + 2
        if name != "q8":
            assert lvl.mean_bits(30) == pytest.approx(lvl.base_bits + 0.2)
    for hi, lo in zip(order, order[1:]):
        for layer in range(num_layers):
            a, b = get_level(hi).bits(layer, num_layers), get_level(lo).bits(layer, num_layers)
            assert a[0] >= b[0] and a[1] >= b[1]


def test_estimate_bytes_is_sane():
    c = chunk(n=1024, layer=8, seed=5)
    raw = get_level("raw").estimate_bytes(3, 1024, 64, 8, L, dtype_bytes=4)
    assert raw == len(encode(c, "raw"))
    prev = raw
    for level in ["q8", "q6", "q5", "q4", "q3", "q2"]:
        est = get_level(level).estimate_bytes(3, 1024, 64, 8, L)
        assert est < prev
        prev = est


# ---- prediction ------------------------------------------------------------------------------
def test_auto_predictor_never_worse_and_used_on_correlated_data():
    g = torch.Generator().manual_seed(7)
    walk = torch.cumsum(torch.randn(2, 256, 16, generator=g) * 0.1, dim=1)  # token-correlated
    c = KVChunk(KVChunkId(1, 6, 0), 256, walk, torch.randn(2, 256, 16, generator=g), L)
    sizes = {p: len(encode(c, "q5", predictor=p)) for p in ("auto", "none", "channel")}
    assert sizes["auto"] <= min(sizes["none"], sizes["channel"]) + 16
    hdr = peek_header(encode(c, "q5"))
    assert hdr.k.predictor == 1  # the random walk is predictable
    assert sizes["channel"] < sizes["none"]


def _entropy_bits(values: np.ndarray) -> float:
    counts = np.bincount(values).astype(np.float64)
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / values.size)).sum())


@pytest.mark.parametrize("bits", [2, 3, 5, 8])
def test_each_channel_gets_the_predictor_of_lowest_entropy(bits):
    """The chosen ``a`` is the one whose residuals have the lowest empirical entropy (the
    smaller ``a`` on a tie), as a plain reference measures it, and the centre the rounded
    mean symbol."""
    rng = np.random.default_rng(bits)
    x = np.cumsum(rng.standard_normal((2, 97, 12)), axis=1) * rng.uniform(0.05, 1.0, (2, 1, 12))
    x = x.astype(np.float32)
    mins, steps, _ = quant.quant_params(x, bits, quant.AXIS_CHANNEL)
    q = quant.quantize(x, mins, steps, bits, quant.AXIS_CHANNEL)
    alpha, center = quant.choose_prediction(q, bits)
    mask = (1 << bits) - 1
    for h in range(2):
        for d in range(12):
            col = q[h, :, d].astype(np.int64)
            c = (int(col.sum()) + col.size // 2) // col.size
            prev = np.concatenate([[c], col[:-1]])
            costs = []
            for a in range(5):
                pred = np.where(np.arange(col.size) == 0, c, (a * prev + (4 - a) * c + 2) >> 2)
                costs.append(_entropy_bits((col - pred) & mask))
            best = min(range(5), key=lambda a: (round(costs[a], 6), a))
            assert (alpha[h, d], center[h, d]) == (best, c)


@pytest.mark.parametrize("predictor", ["none", "channel"])
def test_quantized_values_are_the_quantizer_output(predictor):
    from sparkv.codec.frame import quantized_values

    c = chunk(n=64, layer=2)
    frame = encode(c, "q4", predictor=predictor)
    hdr = peek_header(frame)
    kq, vq = quantized_values(frame)
    for x, q, bits in ((c.k, kq, hdr.k_bits), (c.v, vq, hdr.v_bits)):
        x = np.ascontiguousarray(x.numpy())
        mins, steps, _ = quant.quant_params(x, bits, quant.AXIS_CHANNEL)
        np.testing.assert_array_equal(q, quant.quantize(x, mins, steps, bits,
                                                        quant.AXIS_CHANNEL).reshape(-1))
