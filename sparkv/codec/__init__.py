"""The KV-chunk codec: quantization, canonical Huffman coding and a checksummed frame format.

    frame = encode(KVChunk(KVChunkId(t, l, g), token_start, k, v, num_layers), "q5")
    chunk = decode(frame)                 # or decode_into(frame, k_out, v_out)
    header = peek_header(frame)           # parse + validate, no payload work

Levels (``raw`` lossless; ``q8``/``q6``/``q5``/``q4``/``q3``/``q2``) live in
:mod:`sparkv.codec.levels`; the frame layout is documented in docs/wire-format.md and the design
and measurements in docs/codec.md. Every malformed input raises :class:`CodecError`.
"""

from sparkv.codec.chunk import KVChunk
from sparkv.codec.errors import CodecError
from sparkv.codec.frame import (
    MAX_TENSOR_VALUES, SINK_TOKENS, FrameHeader, TensorHeader, decode, decode_into, encode,
    peek_header,
)
from sparkv.codec.levels import (
    DEFAULT_LEVEL, LEVEL_ORDER, LEVELS, QUANTIZED_LEVELS, Level, get_level,
)

__all__ = [
    "KVChunk", "CodecError", "FrameHeader", "TensorHeader", "encode", "decode", "decode_into",
    "peek_header", "MAX_TENSOR_VALUES", "SINK_TOKENS", "Level", "LEVELS", "LEVEL_ORDER",
    "QUANTIZED_LEVELS", "DEFAULT_LEVEL", "get_level",
]
