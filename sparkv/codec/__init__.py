"""The KV-chunk codec: quantization, canonical Huffman coding and a checksummed frame format.

    frame = encode(KVChunk(KVChunkId(t, l, g), token_start, k, v, num_layers), "q5")
    chunk = decode(frame)                 # or decode_into(frame, k_out, v_out)
    header = peek_header(frame)           # parse + validate, no payload work

Levels (``raw`` lossless; ``q8``/``q6``/``q5``/``q4``/``q3``/``q2``) live in
:mod:`sparkv.codec.levels`; the frame layout is documented in docs/wire-format.md and the design
and measurements in docs/codec.md. Every malformed input raises :class:`CodecError`.

The numeric constants of the wire format (docs/wire-format.md, "Constants") are exported here too:
the descriptor's ``AXIS_*``, ``PARAM_*``, ``CODING_*`` and ``PRED_*`` codes, the chunk dtype codes
(:data:`DTYPE_CODES`), :data:`MAGIC`, :data:`VERSION` and the decoder's limits.
"""

from sparkv.codec.chunk import KVChunk
from sparkv.codec.errors import CodecError
from sparkv.codec.frame import (
    CODING_CONSTANT, CODING_HUFFMAN, CODING_PLAIN, DTYPE_CODES, MAGIC, MAX_STREAMS,
    MAX_TENSOR_VALUES, PRED_CHANNEL, PRED_NONE, SINK_TOKENS, VERSION, FrameHeader, TensorHeader,
    decode, decode_into, encode, peek_header,
)
from sparkv.codec.huffman import MAX_CODE_LEN
from sparkv.codec.levels import (
    DEFAULT_LEVEL, LEVEL_ORDER, LEVELS, QUANTIZED_LEVELS, Level, get_level,
)
from sparkv.codec.quant import AXIS_CHANNEL, AXIS_TOKEN, PARAM_FP16, PARAM_FP32

__all__ = [
    "KVChunk", "CodecError", "FrameHeader", "TensorHeader", "encode", "decode", "decode_into",
    "peek_header", "MAX_TENSOR_VALUES", "SINK_TOKENS", "Level", "LEVELS", "LEVEL_ORDER",
    "QUANTIZED_LEVELS", "DEFAULT_LEVEL", "get_level",
    # wire-format constants (docs/wire-format.md, "Constants")
    "MAGIC", "VERSION", "DTYPE_CODES", "AXIS_TOKEN", "AXIS_CHANNEL", "PARAM_FP16", "PARAM_FP32",
    "CODING_PLAIN", "CODING_HUFFMAN", "CODING_CONSTANT", "PRED_NONE", "PRED_CHANNEL",
    "MAX_STREAMS", "MAX_CODE_LEN",
]
