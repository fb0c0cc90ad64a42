"""The frame: one encoded KV chunk. Layout byte by byte in docs/wire-format.md.

    frame = header (header_len bytes) | payload (payload_len bytes) | xxh64 (8 bytes)

Everything is little-endian. :func:`encode` writes frames, :func:`decode` / :func:`decode_into`
read them, :func:`peek_header` parses and validates a header alone. Every problem with a frame
raises :class:`~sparkv.codec.errors.CodecError`; sizes are validated against the buffer and
against :data:`MAX_TENSOR_VALUES` before anything is allocated.
"""

from __future__ import annotations

import struct
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from sparkv.codec import huffman, quant
from sparkv.codec.chunk import KVChunk
from sparkv.codec.errors import CodecError
from sparkv.codec.levels import DEFAULT_LEVEL, LEVELS_BY_CODE, Level, get_level
from sparkv.layout import KVChunkId

MAGIC = b"SPKV"
VERSION = 2
"""Frame format version. 2: decoded quantized values are clamped to the chunk dtype's finite
range (version 1 frames, whose decoders did not clamp, are rejected)."""
FIXED_LEN = 40
DESC_LEN = 12
HEADER_MIN = FIXED_LEN + 2 * DESC_LEN  # 64
TRAILER_LEN = 8

MAX_TENSOR_VALUES = 1 << 22
"""Most values one K (or V) tensor of a frame may hold: 4 Mi (16 MiB as float32)."""
MAX_STREAMS = 64
SINK_TOKENS = 1
"""The context's first tokens (attention sinks) are stored exactly in quantized levels."""

DTYPE_CODES: dict[int, tuple[torch.dtype, str]] = {
    1: (torch.float32, "<f4"),
    2: (torch.float16, "<f2"),
    3: (torch.bfloat16, "<u2"),  # stored as its 16-bit pattern
}
CODE_OF_DTYPE = {dt: code for code, (dt, _) in DTYPE_CODES.items()}
FINITE_MAX: dict[torch.dtype, float] = {
    torch.float32: float(torch.finfo(torch.float32).max),
    torch.float16: float(torch.finfo(torch.float16).max),    # 65504
    torch.bfloat16: float(torch.finfo(torch.bfloat16).max),  # 0x7F7F, exact in float32
}
"""Decoded quantized values are clamped to ``[-FINITE_MAX, FINITE_MAX]`` of the chunk dtype."""

CODING_PLAIN = 0
CODING_HUFFMAN = 1
CODING_CONSTANT = 2
PRED_NONE = 0
PRED_CHANNEL = 1

_LITTLE_ENDIAN = sys.byteorder == "little"
_FIXED = struct.Struct("<4sBBBBIIIHHIIHHHH")
_DESC = struct.Struct("<BBBBBBBBHH")
assert _FIXED.size == FIXED_LEN and _DESC.size == DESC_LEN


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


# ------------------------------------------------------------------------------------------------
# Header types
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class TensorHeader:
    """How one tensor (K or V) of a frame is coded (see docs/wire-format.md, "descriptor").

    Attributes:
        bits: quantization bits (0: lossless).
        axis: ``quant.AXIS_TOKEN`` / ``quant.AXIS_CHANNEL`` (0: lossless).
        param_dtype: ``quant.PARAM_FP16`` / ``quant.PARAM_FP32`` (0: none).
        coding: ``CODING_PLAIN`` (lossless values), ``CODING_HUFFMAN`` or ``CODING_CONSTANT``.
        predictor: ``PRED_NONE`` or ``PRED_CHANNEL`` (per-column prediction along the tokens,
            see :mod:`sparkv.codec.quant`).
        values_per_symbol: b-bit values packed in one coded byte symbol.
        const_symbol: the symbol of a constant tensor (``CODING_CONSTANT``).
        exact_tokens: the first tokens of the chunk stored losslessly (attention sinks).
        num_streams: Huffman sub-streams.
        mins, steps: quantization parameters (float32 copies), ``[H, N - E]`` or ``[H, D]``.
        alpha, center: ``uint8 [H, D]`` channel-predictor parameters (``PRED_CHANNEL`` only).
        code_lengths: ``uint8 [2**(bits*values_per_symbol)]`` (Huffman only).
        stream_bytes: ``int64 [num_streams]`` byte length of each sub-stream.
        payload_offset: where this tensor's section starts in the payload.
        payload_bytes: its length (exact block, padding and streams).
    """

    bits: int
    axis: int
    param_dtype: int
    coding: int
    predictor: int
    values_per_symbol: int
    const_symbol: int
    exact_tokens: int
    num_streams: int
    mins: np.ndarray | None
    steps: np.ndarray | None
    alpha: np.ndarray | None
    center: np.ndarray | None
    code_lengths: np.ndarray | None
    stream_bytes: np.ndarray | None
    payload_offset: int
    payload_bytes: int

    @property
    def lossless(self) -> bool:
        return self.bits == 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorHeader):
            return NotImplemented
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class FrameHeader:
    """A parsed, validated frame header.

    Attributes:
        chunk_id: ``(t, l, g)``.
        token_start: absolute position of the first token; ``num_tokens`` tokens follow.
        num_heads, head_dim: with ``num_tokens``, the ``[H, N, D]`` shape of K and of V.
        num_layers: decoder layers of the model (0 in ``raw`` frames that did not know it).
        dtype: the chunk's dtype (the dtype :func:`decode` returns).
        level: the level's name.
        header_len, payload_len: byte lengths; the frame is ``frame_len`` bytes in total.
        k, v: per-tensor coding details.
    """

    version: int
    chunk_id: KVChunkId
    token_start: int
    num_tokens: int
    num_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype
    level: str
    header_len: int
    payload_len: int
    k: TensorHeader
    v: TensorHeader

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.num_heads, self.num_tokens, self.head_dim

    @property
    def token_range(self) -> tuple[int, int]:
        return self.token_start, self.token_start + self.num_tokens

    @property
    def frame_len(self) -> int:
        return self.header_len + self.payload_len + TRAILER_LEN

    @property
    def num_values(self) -> int:
        return 2 * self.num_heads * self.num_tokens * self.head_dim

    @property
    def k_bits(self) -> int:
        return self.k.bits

    @property
    def v_bits(self) -> int:
        return self.v.bits


# ------------------------------------------------------------------------------------------------
# Parsing
# ------------------------------------------------------------------------------------------------
def _as_bytes_view(data: Any) -> memoryview:
    try:
        mv = memoryview(data)
    except TypeError:
        raise CodecError(f"expected bytes, got {type(data).__name__}") from None
    if mv.ndim != 1 or mv.itemsize != 1 or mv.format not in ("B", "b", "c"):
        try:
            mv = mv.cast("B")
        except (TypeError, ValueError):
            raise CodecError("frame buffer must be a contiguous byte buffer") from None
    elif mv.format != "B":
        mv = mv.cast("B")
    return mv


class _Reader:
    """Bounded reads from the header area ``[0, limit)``."""

    def __init__(self, mv: memoryview, pos: int, limit: int) -> None:
        self.mv, self.pos, self.limit = mv, pos, limit

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.limit:
            raise CodecError(f"header truncated while reading {what}")
        out = self.mv[self.pos:self.pos + n]
        self.pos += n
        return out


def _parse_tensor(r: _Reader, desc: tuple[int, ...], which: str, level: Level, layer: int,
                  num_layers: int, shape: tuple[int, int, int], itemsize: int,
                  payload_offset: int) -> TensorHeader:
    bits, axis, pdtype, coding, pred, per, const, reserved, exact, nstreams = desc
    h, n, d = shape
    if reserved:
        raise CodecError(f"{which}: reserved descriptor byte is not zero")
    if level.lossless:
        if (bits, axis, pdtype, coding, pred, per, const, exact, nstreams) != (0,) * 9:
            raise CodecError(f"{which}: a raw frame's descriptor must be all zero")
        nbytes = _pad8(h * n * d * itemsize)
        return TensorHeader(0, 0, 0, CODING_PLAIN, 0, 0, 0, 0, 0, None, None, None, None, None,
                            None, payload_offset, nbytes)
    want = level.bits(layer, num_layers)[0 if which == "K" else 1]
    if bits != want:
        raise CodecError(f"{which}: {bits} bits, but level {level.name} gives layer {layer} of "
                         f"{num_layers} {want} bits")
    if axis not in quant.AXIS_NAMES:
        raise CodecError(f"{which}: unknown quantization axis {axis}")
    if pdtype not in quant.PARAM_DTYPES:
        raise CodecError(f"{which}: unknown parameter dtype {pdtype}")
    if coding not in (CODING_HUFFMAN, CODING_CONSTANT):
        raise CodecError(f"{which}: unknown coding {coding}")
    if pred not in (PRED_NONE, PRED_CHANNEL):
        raise CodecError(f"{which}: unknown predictor {pred}")
    if per != quant.values_per_symbol(bits):
        raise CodecError(f"{which}: {per} values per symbol is wrong for {bits} bits")
    if exact > n:
        raise CodecError(f"{which}: {exact} exact tokens in a chunk of {n}")
    nq = h * (n - exact) * d
    alphabet = 1 << (bits * per)
    exact_bytes = _pad8(h * exact * d * itemsize)
    mins = steps = lengths = stream_bytes = None
    if nq == 0:
        if coding != CODING_CONSTANT or const or nstreams or pred:
            raise CodecError(f"{which}: no quantized tokens, but coded data is declared")
        return TensorHeader(bits, axis, pdtype, coding, pred, per, 0, exact, 0, None, None, None,
                            None, None, None, payload_offset, exact_bytes)
    groups = h * (n - exact) if axis == quant.AXIS_TOKEN else h * d
    pdt = quant.PARAM_DTYPES[pdtype]
    raw_mins = r.take(groups * pdt.itemsize, f"{which} minimums")
    raw_steps = r.take(groups * pdt.itemsize, f"{which} steps")
    gshape = (h, n - exact) if axis == quant.AXIS_TOKEN else (h, d)
    mins = np.frombuffer(raw_mins, dtype=pdt).astype(np.float32).reshape(gshape)
    steps = np.frombuffer(raw_steps, dtype=pdt).astype(np.float32).reshape(gshape)
    if not quant.params_valid(mins.reshape(-1), steps.reshape(-1)):
        raise CodecError(f"{which}: quantization parameters are not finite and non-negative")
    alpha = center = None
    if pred == PRED_CHANNEL:
        alpha = np.frombuffer(r.take(h * d, f"{which} predictor weights"), dtype=np.uint8)
        center = np.frombuffer(r.take(h * d, f"{which} predictor centres"), dtype=np.uint8)
        if alpha.max() > 4 or center.max() >= (1 << bits):
            raise CodecError(f"{which}: predictor parameters out of range")
        alpha, center = alpha.reshape(h, d), center.reshape(h, d)
    num_syms = -(-nq // per)
    streams_total = 0
    if coding == CODING_CONSTANT:
        if nstreams:
            raise CodecError(f"{which}: a constant tensor has no streams")
        if const >= alphabet:
            raise CodecError(f"{which}: constant symbol {const} outside the alphabet")
    else:
        if const:
            raise CodecError(f"{which}: const_symbol must be 0 with Huffman coding")
        if not 1 <= nstreams <= min(MAX_STREAMS, num_syms):
            raise CodecError(f"{which}: {nstreams} streams for {num_syms} symbols")
        lengths = np.frombuffer(r.take(alphabet, f"{which} code lengths"), dtype=np.uint8)
        why = huffman.check_lengths(lengths)
        if why:
            raise CodecError(f"{which}: {why}")
        stream_bytes = np.frombuffer(r.take(4 * nstreams, f"{which} stream lengths"),
                                     dtype="<u4").astype(np.int64)
        # Each symbol takes 1 .. MAX_CODE_LEN bits: a cheap bound before decoding anything.
        if not huffman.streams_fit(stream_bytes, num_syms):
            raise CodecError(f"{which}: stream lengths do not fit the symbol counts")
        streams_total = int(stream_bytes.sum())
    return TensorHeader(bits, axis, pdtype, coding, pred, per, const, exact, nstreams, mins,
                        steps, alpha, center, lengths, stream_bytes, payload_offset,
                        exact_bytes + streams_total)


def _parse(mv: memoryview) -> FrameHeader:
    if len(mv) < HEADER_MIN:
        raise CodecError(f"frame truncated: {len(mv)} bytes, a header alone is {HEADER_MIN}")
    (magic, version, dtype_code, level_code, flags, header_len, payload_len, t, layer, g,
     token_start, n, h, d, num_layers, reserved) = _FIXED.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError("not a sparkv frame (bad magic)")
    if version != VERSION:
        raise CodecError(f"unsupported frame version {version} (this decoder reads version "
                         f"{VERSION} only; re-encode the chunk)")
    if dtype_code not in DTYPE_CODES:
        raise CodecError(f"unknown dtype code {dtype_code}")
    if level_code not in LEVELS_BY_CODE:
        raise CodecError(f"unknown level code {level_code}")
    if flags or reserved:
        raise CodecError("reserved header fields are not zero")
    if header_len < HEADER_MIN or header_len % 8:
        raise CodecError(f"bad header length {header_len}")
    if header_len > len(mv):
        raise CodecError(f"frame truncated: header of {header_len} bytes, {len(mv)} given")
    if n < 1 or h < 1 or d < 1:
        raise CodecError(f"empty chunk shape ({h}, {n}, {d})")
    if h * n * d > MAX_TENSOR_VALUES:
        raise CodecError(f"chunk of {h}x{n}x{d} values exceeds the limit {MAX_TENSOR_VALUES}")
    if token_start + n > 0xFFFFFFFF:
        raise CodecError("token range overflows 32 bits")
    level = LEVELS_BY_CODE[level_code]
    if not level.lossless and not 0 <= layer < num_layers:
        raise CodecError(f"layer {layer} out of range for {num_layers} layers")
    if level.lossless and num_layers and layer >= num_layers:
        raise CodecError(f"layer {layer} out of range for {num_layers} layers")
    dtype, storage = DTYPE_CODES[dtype_code]
    itemsize = np.dtype(storage).itemsize
    shape = (h, n, d)
    r = _Reader(mv, HEADER_MIN, header_len)
    k_desc = _DESC.unpack_from(mv, FIXED_LEN)
    v_desc = _DESC.unpack_from(mv, FIXED_LEN + DESC_LEN)
    k = _parse_tensor(r, k_desc, "K", level, layer, num_layers, shape, itemsize, 0)
    v = _parse_tensor(r, v_desc, "V", level, layer, num_layers, shape, itemsize, k.payload_bytes)
    if _pad8(r.pos) != header_len:
        raise CodecError(f"header length {header_len} does not match its contents ({r.pos})")
    if any(mv[r.pos:header_len]):
        raise CodecError("header padding is not zero")
    if k.payload_bytes + v.payload_bytes != payload_len:
        raise CodecError(f"payload length {payload_len} does not match the header "
                         f"({k.payload_bytes + v.payload_bytes})")
    return FrameHeader(version, KVChunkId(t, layer, g), token_start, n, h, d, num_layers, dtype,
                       level.name, header_len, payload_len, k, v)


def peek_header(data: Any) -> FrameHeader:
    """Parses and validates a frame's header without decoding (or checksumming) its payload.

    ``data`` may be the whole frame or only its first ``header_len`` bytes.
    """
    return _parse(_as_bytes_view(data))


def _check_frame(mv: memoryview) -> FrameHeader:
    hdr = _parse(mv)
    if len(mv) != hdr.frame_len:
        raise CodecError(f"frame is {len(mv)} bytes, its header says {hdr.frame_len}")
    body = hdr.header_len + hdr.payload_len
    (stored,) = struct.unpack_from("<Q", mv, body)
    if xxhash.xxh64_intdigest(mv[:body]) != stored:
        raise CodecError("checksum mismatch: the frame is corrupted")
    return hdr


# ------------------------------------------------------------------------------------------------
# Decoding
# ------------------------------------------------------------------------------------------------
def _itemsize(dtype: torch.dtype) -> int:
    return 4 if dtype == torch.float32 else 2


def _num_symbols(hdr: FrameHeader, th: TensorHeader) -> tuple[int, int]:
    """``(quantized values, coded symbols)`` of a quantized tensor."""
    nq = hdr.num_heads * (hdr.num_tokens - th.exact_tokens) * hdr.head_dim
    return nq, -(-nq // th.values_per_symbol)


def _decode_symbols(mv: memoryview, hdr: FrameHeader, parallel: bool
                    ) -> list[np.ndarray | None]:
    """The packed symbols of each quantized tensor, K then V (``None``: lossless or empty)."""
    tensors = (hdr.k, hdr.v)
    out: list[np.ndarray | None] = [None, None]
    coded = []
    for i, th in enumerate(tensors):
        if th.lossless:
            continue
        _, nsym = _num_symbols(hdr, th)
        if th.coding == CODING_CONSTANT and nsym:
            out[i] = np.full(nsym, th.const_symbol, dtype=np.uint8)
        elif th.coding == CODING_HUFFMAN:
            coded.append(i)
    if not coded:
        return out
    words = np.frombuffer(mv, dtype="<u4", count=hdr.payload_len // 4, offset=hdr.header_len)
    if not words.flags.aligned or words.dtype != np.dtype("=u4"):
        words = words.astype(np.uint32)  # numba wants aligned, native-order words
    words.setflags(write=False)  # one numba specialisation whether the frame is bytes or not
    total_streams = sum(tensors[i].num_streams for i in coded)
    bounds = np.empty((4, total_streams), dtype=np.int64)  # word start/end, symbol start/end
    tables = np.empty((len(coded), 1 << huffman.TABLE_BITS), dtype=np.uint32)
    lengths = np.zeros((len(coded), 256), dtype=np.uint8)
    spans = []
    sym_base = 0
    first = 0
    for j, i in enumerate(coded):
        th = tensors[i]
        _, nsym = _num_symbols(hdr, th)
        assert th.stream_bytes is not None       # every Huffman tensor has its stream lengths
        exact_bytes = _pad8(hdr.num_heads * th.exact_tokens * hdr.head_dim
                            * _itemsize(hdr.dtype))
        huffman.stream_layout(th.stream_bytes, (th.payload_offset + exact_bytes) // 4, sym_base,
                              nsym, bounds, first)
        spans.append((i, sym_base, sym_base + nsym))
        sym_base += nsym
        first += th.num_streams
        assert th.code_lengths is not None       # every Huffman tensor has its code lengths
        lengths[j, :th.code_lengths.size] = th.code_lengths
        huffman.build_decode_table(lengths[j], tables[j])
    symbols = np.empty(sym_base, dtype=np.uint8)
    errors = huffman.decode_streams(
        words, bounds[0], bounds[1], tables, lengths, symbols, bounds[2], bounds[3],
        huffman.plan_groups(tuple(tensors[i].num_streams for i in coded)), parallel)
    if errors.any():
        raise CodecError(f"{int(errors.sum())} Huffman stream(s) do not decode to their length")
    for i, a, b in spans:
        out[i] = symbols[a:b]
    return out


def _raw_values(mv: memoryview, hdr: FrameHeader, offset: int, count: int) -> torch.Tensor:
    """``count`` lossless values of the chunk's dtype at payload ``offset``: a read-only view of
    the frame on little-endian hosts (callers only copy from it), a fresh tensor otherwise."""
    start = hdr.header_len + offset
    if _LITTLE_ENDIAN:
        with warnings.catch_warnings():  # torch warns that the frame's buffer is read-only
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=hdr.dtype, count=count, offset=start)
    _, storage = DTYPE_CODES[CODE_OF_DTYPE[hdr.dtype]]
    arr = np.frombuffer(mv, dtype=storage, count=count, offset=start)
    if hdr.dtype == torch.bfloat16:
        return torch.from_numpy(arr.astype(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr.astype(arr.dtype.newbyteorder("=")))


def _check_out(t: Any, shape: tuple[int, int, int], which: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CodecError(f"{which} output must be a torch.Tensor")
    if tuple(t.shape) != shape:
        raise CodecError(f"{which} output has shape {tuple(t.shape)}, the frame holds {shape}")
    if not t.is_floating_point() or t.device.type != "cpu":
        raise CodecError(f"{which} output must be a floating-point CPU tensor")
    return t


def _finite_limit(hdr: FrameHeader, out_dtype: torch.dtype) -> float:
    """The largest magnitude a decoded value may have: the chunk dtype's largest finite value, or
    the output's where that is smaller (a float32 frame decoded into float16)."""
    return min(FINITE_MAX[hdr.dtype], FINITE_MAX.get(out_dtype, FINITE_MAX[hdr.dtype]))


def _check_finite(mv: memoryview, hdr: FrameHeader, th: TensorHeader, out_dtype: torch.dtype,
                  which: str) -> None:
    """For a finite decode: the values the codec passes through unbounded (a raw tensor, a
    quantized tensor's exact rows) must be finite and fit ``out_dtype``. Quantized values need
    no check: they are clamped to :func:`_finite_limit`."""
    h, n, d = hdr.shape
    rows = n if th.lossless else th.exact_tokens
    if not rows:
        return
    vals = _raw_values(mv, hdr, th.payload_offset, h * rows * d)
    peak = float(vals.abs().amax())             # NaN if any value is NaN
    if not peak <= _finite_limit(hdr, out_dtype):
        what = "NaN" if peak != peak else "an infinity" if peak == float("inf") else (
            f"a magnitude of {peak:.4g}, past {str(out_dtype).replace('torch.', '')}'s range")
        raise CodecError(f"{which} holds non-finite values ({what} in its "
                         f"{'raw values' if th.lossless else 'exact rows'})")


def _write_tensor(mv: memoryview, hdr: FrameHeader, th: TensorHeader,
                  symbols: np.ndarray | None, out: torch.Tensor) -> None:
    h, n, d = hdr.shape
    if th.lossless:
        out.copy_(_raw_values(mv, hdr, th.payload_offset, h * n * d).reshape(h, n, d))
        return
    e = th.exact_tokens
    direct = out.dtype == torch.float32
    target = out.detach().numpy() if direct else np.empty((h, n, d), dtype=np.float32)
    if e:
        exact = _raw_values(mv, hdr, th.payload_offset, h * e * d).reshape(h, e, d)
        target[:, :e, :] = exact.to(torch.float32).numpy()
    if symbols is not None:
        assert th.mins is not None and th.steps is not None  # quantized tokens have parameters
        quant.reconstruct(symbols, th.bits, th.mins, th.steps, th.axis, target[:, e:, :],
                          th.alpha, th.center, _finite_limit(hdr, out.dtype))
    if not direct:
        out.copy_(torch.from_numpy(target))
        if e and out.dtype == hdr.dtype:  # the exact block bit for bit (NaN payloads too)
            out[:, :e, :].copy_(exact)


def decode_into(data: Any, k_out: torch.Tensor, v_out: torch.Tensor, *,
                parallel: bool = False, finite: bool = False) -> FrameHeader:
    """Decodes a frame into preallocated ``[H, N, D]`` tensors (any float dtype, any strides;
    views into a larger cache are fine). Nothing is written unless the whole frame is valid.
    Lossless values (the raw level, a quantized level's exact rows) reach an output of the
    chunk's dtype bit for bit, NaN payloads included; another dtype gets them converted.
    Quantized values are clamped to the largest finite value of the chunk's and the output's
    dtype, so they never decode to an infinity.

    Args:
        parallel: decode the Huffman streams on every core (otherwise in the calling thread).
        finite: refuse (:class:`CodecError`) a frame whose lossless values hold a NaN or an
            infinity, or a value past the output dtype's range: what a consumer that attends
            over the KV asks for (the format itself carries any value losslessly).

    Returns:
        The frame's header.
    """
    mv = _as_bytes_view(data)
    hdr = _check_frame(mv)
    _check_out(k_out, hdr.shape, "K")
    _check_out(v_out, hdr.shape, "V")
    if finite:
        _check_finite(mv, hdr, hdr.k, k_out.dtype, "K")
        _check_finite(mv, hdr, hdr.v, v_out.dtype, "V")
    symbols = _decode_symbols(mv, hdr, parallel)
    _write_tensor(mv, hdr, hdr.k, symbols[0], k_out)
    _write_tensor(mv, hdr, hdr.v, symbols[1], v_out)
    return hdr


def decode(data: Any, *, parallel: bool = False, finite: bool = False,
           dtype: torch.dtype | None = None) -> KVChunk:
    """Decodes a frame into a new :class:`KVChunk` (tensors of ``dtype``, by default the
    frame's; ``parallel`` and ``finite`` as in :func:`decode_into`)."""
    mv = _as_bytes_view(data)
    hdr = _check_frame(mv)
    k = torch.empty(hdr.shape, dtype=dtype or hdr.dtype)
    v = torch.empty(hdr.shape, dtype=dtype or hdr.dtype)
    _check_out(k, hdr.shape, "K")
    if finite:
        _check_finite(mv, hdr, hdr.k, k.dtype, "K")
        _check_finite(mv, hdr, hdr.v, v.dtype, "V")
    symbols = _decode_symbols(mv, hdr, parallel)
    _write_tensor(mv, hdr, hdr.k, symbols[0], k)
    _write_tensor(mv, hdr, hdr.v, symbols[1], v)
    return KVChunk(hdr.chunk_id, hdr.token_start, k, v, hdr.num_layers)


# ------------------------------------------------------------------------------------------------
# Encoding
# ------------------------------------------------------------------------------------------------
def default_streams(num_symbols: int) -> int:
    """Sub-streams per tensor: 1 for small tensors, then 4 per 256 Ki symbols (at most 16)."""
    if num_symbols < 16384:
        return 1
    return 4 * min(4, max(1, num_symbols // 262144))


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().astype("<i2").tobytes()
    _, storage = DTYPE_CODES[CODE_OF_DTYPE[t.dtype]]
    return t.numpy().astype(storage).tobytes()


def _pad_to8(b: bytes) -> bytes:
    return b + bytes(_pad8(len(b)) - len(b))


@dataclass
class _EncodedTensor:
    desc: bytes
    sections: bytes
    payload: bytes


def _encode_raw(t: torch.Tensor) -> _EncodedTensor:
    return _EncodedTensor(_DESC.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0), b"", _pad_to8(_tensor_bytes(t)))


def _encode_quant(t: torch.Tensor, bits: int, axis: int, exact: int, predictor: str,
                  streams: int | None, which: str) -> _EncodedTensor:
    h, n, d = t.shape
    per = quant.values_per_symbol(bits)
    exact_payload = _pad_to8(_tensor_bytes(t[:, :exact, :])) if exact else b""
    if exact == n:
        desc = _DESC.pack(bits, axis, quant.PARAM_FP16, CODING_CONSTANT, PRED_NONE, per, 0, 0,
                          exact, 0)
        return _EncodedTensor(desc, b"", exact_payload)
    x = t[:, exact:, :].detach().to(torch.float32).contiguous().numpy()
    if not np.isfinite(x).all():
        raise CodecError(f"{which} holds non-finite values: only the raw level can code them")
    try:
        mins, steps, pdtype = quant.quant_params(x, bits, axis)
    except ValueError as exc:
        raise CodecError(f"{which}: {exc}") from None
    q = quant.quantize(x, mins, steps, bits, axis)
    params = mins.tobytes() + steps.tobytes()  # already little-endian fp16 / fp32
    candidates = {"none": [PRED_NONE], "channel": [PRED_CHANNEL],
                  "auto": [PRED_NONE, PRED_CHANNEL]}[predictor]
    best = None
    for pred in candidates:
        pred_params = b""
        values = q
        if pred == PRED_CHANNEL:
            alpha, center = quant.choose_prediction(q, bits)
            values = quant.apply_prediction(q, bits, alpha, center)
            pred_params = alpha.tobytes() + center.tobytes()
        syms = quant.pack(values.reshape(-1), bits)
        hist = np.bincount(syms, minlength=256)
        if np.count_nonzero(hist) == 1:
            lengths, cost = None, 0
        else:
            lengths = huffman.code_lengths(hist)
            cost = int(np.dot(hist, lengths.astype(np.int64)))
        cost += 8 * len(pred_params)
        if best is None or cost < best[0]:
            best = (cost, pred, pred_params, syms, hist, lengths)
    assert best is not None                      # one candidate at least
    _, pred, pred_params, syms, hist, lengths = best
    params += pred_params
    if lengths is None:
        desc = _DESC.pack(bits, axis, pdtype, CODING_CONSTANT, pred, per, int(np.flatnonzero(
            hist)[0]), 0, exact, 0)
        return _EncodedTensor(desc, params, exact_payload)
    nstreams = min(streams or default_streams(syms.size), MAX_STREAMS, syms.size)
    words, words_per_stream = huffman.encode_streams(syms, lengths, nstreams)
    alphabet = 1 << (bits * per)
    sections = (params + lengths[:alphabet].tobytes()
                + (4 * words_per_stream).astype("<u4").tobytes())
    desc = _DESC.pack(bits, axis, pdtype, CODING_HUFFMAN, pred, per, 0, 0, exact, nstreams)
    return _EncodedTensor(desc, sections, exact_payload + words.astype("<u4").tobytes())


def _check_chunk(chunk: Any) -> None:
    if not isinstance(chunk, KVChunk):
        raise CodecError(f"expected a KVChunk, got {type(chunk).__name__}")
    k, v = chunk.k, chunk.v
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise CodecError("K and V must be torch tensors")
    if k.dim() != 3 or tuple(k.shape) != tuple(v.shape):
        raise CodecError(f"K and V must both be [heads, tokens, head_dim], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.dtype != v.dtype or k.dtype not in CODE_OF_DTYPE:
        raise CodecError(f"K and V must share a dtype among float32, float16, bfloat16; got "
                         f"{k.dtype} and {v.dtype}")
    if k.device.type != "cpu" or v.device.type != "cpu":
        raise CodecError("K and V must be CPU tensors")
    h, n, d = k.shape
    if min(h, n, d) < 1 or h > 0xFFFF or d > 0xFFFF:
        raise CodecError(f"bad chunk shape {tuple(k.shape)}")
    if h * n * d > MAX_TENSOR_VALUES:
        raise CodecError(f"chunk of {h}x{n}x{d} values exceeds the limit {MAX_TENSOR_VALUES}")
    t, layer, g = chunk.id
    if not (0 <= t <= 0xFFFFFFFF and 0 <= layer <= 0xFFFF and 0 <= g <= 0xFFFF):
        raise CodecError(f"chunk id {chunk.id} out of the frame's range")
    if not 0 <= chunk.token_start or chunk.token_start + n > 0xFFFFFFFF:
        raise CodecError(f"token range [{chunk.token_start}, {chunk.token_start + n}) out of range")
    if not 0 <= chunk.num_layers <= 0xFFFF:
        raise CodecError(f"num_layers {chunk.num_layers} out of range")


def encode(chunk: KVChunk, level: str | Level = DEFAULT_LEVEL, *, streams: int | None = None,
           sink_tokens: int = SINK_TOKENS, k_axis: int = quant.AXIS_CHANNEL,
           v_axis: int = quant.AXIS_CHANNEL, predictor: str = "auto") -> bytes:
    """Encodes one KV chunk at a level into a frame.

    Args:
        chunk: K and V ``[H, N, D]`` (float32, float16 or bfloat16, CPU). Quantized levels need
            ``chunk.num_layers`` (the bit allocation depends on the layer's depth).
        level: a name from :data:`~sparkv.codec.levels.LEVELS` (``raw`` is lossless).
        streams: Huffman sub-streams per tensor (default: :func:`default_streams`).
        sink_tokens: the context's first tokens kept exact in quantized levels.
        k_axis, v_axis: quantization scale axis (``quant.AXIS_CHANNEL`` or ``AXIS_TOKEN``).
        predictor: ``"auto"`` (the smaller of plain and channel-predicted coding), ``"none"``,
            ``"channel"``.

    Raises:
        CodecError: bad chunk, unknown level, or non-finite values at a quantized level.
    """
    _check_chunk(chunk)
    lvl = get_level(level)
    if predictor not in ("auto", "none", "channel"):
        raise CodecError(f"unknown predictor {predictor!r}")
    if k_axis not in quant.AXIS_NAMES or v_axis not in quant.AXIS_NAMES:
        raise CodecError("unknown quantization axis")
    if streams is not None and not 1 <= streams <= MAX_STREAMS:
        raise CodecError(f"streams must be in [1, {MAX_STREAMS}]")
    h, n, d = chunk.k.shape
    t, layer, g = chunk.id
    if lvl.lossless:
        if chunk.num_layers and layer >= chunk.num_layers:
            raise CodecError(f"layer {layer} out of range for {chunk.num_layers} layers")
        parts = [_encode_raw(chunk.k), _encode_raw(chunk.v)]
    else:
        if chunk.num_layers < 1:
            raise CodecError(f"level {lvl.name} needs chunk.num_layers (the model's depth)")
        k_bits, v_bits = lvl.bits(layer, chunk.num_layers)
        exact = max(0, min(n, sink_tokens - chunk.token_start))
        parts = [_encode_quant(chunk.k, k_bits, k_axis, exact, predictor, streams, "K"),
                 _encode_quant(chunk.v, v_bits, v_axis, exact, predictor, streams, "V")]
    sections = parts[0].sections + parts[1].sections
    header_len = _pad8(HEADER_MIN + len(sections))
    payload = parts[0].payload + parts[1].payload
    fixed = _FIXED.pack(MAGIC, VERSION, CODE_OF_DTYPE[chunk.k.dtype], lvl.code, 0, header_len,
                        len(payload), t, layer, g, chunk.token_start, n, h, d, chunk.num_layers,
                        0)
    header = fixed + parts[0].desc + parts[1].desc + sections
    body = header + bytes(header_len - len(header)) + payload
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


# ------------------------------------------------------------------------------------------------
# Introspection (benchmarks, tests)
# ------------------------------------------------------------------------------------------------
def coded_symbols(data: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The byte symbols a frame Huffman-codes for K and for V (after packing and prediction;
    ``None`` for lossless tensors)."""
    mv = _as_bytes_view(data)
    hdr = _check_frame(mv)
    syms = _decode_symbols(mv, hdr, False)
    return syms[0], syms[1]


def quantized_values(data: Any) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The b-bit quantization values of K and of V (``uint8``, flat C order of
    ``[H, N - exact_tokens, D]``; ``None`` for lossless tensors): what entropy is measured on."""
    mv = _as_bytes_view(data)
    hdr = _check_frame(mv)
    syms = _decode_symbols(mv, hdr, False)
    out: list[np.ndarray | None] = [None, None]
    for i, th in enumerate((hdr.k, hdr.v)):
        coded = syms[i]
        if coded is None:
            continue
        nq, _ = _num_symbols(hdr, th)
        values = quant.unpack(coded, th.bits, nq).copy()
        if th.predictor == PRED_CHANNEL:
            assert th.alpha is not None and th.center is not None  # parsed with the predictor
            quant.undo_prediction(values.reshape(hdr.num_heads, hdr.num_tokens - th.exact_tokens,
                                                 hdr.head_dim), th.bits, th.alpha, th.center)
        out[i] = values
    return out[0], out[1]
