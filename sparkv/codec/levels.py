"""Named bitrate levels: a bit width per layer for K and for V, and a size estimate.

A level ``qB`` quantizes K and V with ``B`` bits in most layers and ``B + 1`` bits in the early
layers, as CacheGen does (CacheGen gives K layers 0-9 and V layers 0-1 of 32 layers more bins):

* K: layers ``0 .. ceil(L/3) - 1`` get ``B + 1`` bits (10 of 30 layers for SmolLM2, 11 of 32);
* V: layers ``0 .. ceil(L/16) - 1`` get ``B + 1`` bits (2 of 30, 2 of 32);
* never more than 8 bits.

``raw`` is lossless: the chunk's values, bit for bit, in its dtype.

Other modules (scheduler, server, edge) import :data:`LEVELS`, :func:`get_level`,
:data:`DEFAULT_LEVEL` and :meth:`Level.estimate_bytes`; the codec writes :attr:`Level.code` into
every frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparkv.codec.errors import CodecError

MAX_BITS = 8

# Bytes per value (x8) of one coded tensor - Huffman streams, parameters, predictor, code table,
# descriptor, exact sink tokens - by bit width, measured on SmolLM2-135M K/V of a 4K-token
# natural-text context in 1024-token chunks of 3 heads x 64 channels (per-channel scales, predictor
# chosen per tensor; see docs/codec.md).
# Used only for estimates: a frame's real size is known once it is encoded. Columns: K, V.
CODED_BITS_PER_VALUE: dict[int, tuple[float, float]] = {
    2: (1.389, 1.285),
    3: (2.191, 2.207),
    4: (3.188, 3.201),
    5: (4.218, 4.232),
    6: (5.235, 5.248),
    7: (6.247, 6.260),
    8: (7.261, 7.272),
}

FRAME_OVERHEAD_BYTES = 40 + 8
"""Fixed header (40) and checksum (8); each tensor adds its 12-byte descriptor and sections."""


@dataclass(frozen=True)
class Level:
    """A bitrate level.

    Attributes:
        name: ``raw``, ``q8``, ``q6``, ``q5``, ``q4``, ``q3`` or ``q2``.
        code: the byte written in frames (the base bit width; 0 for ``raw``).
        base_bits: bits of K and V in the late layers (0 for ``raw``).
        early_bonus: extra bits in the early layers (see the module docstring).
    """

    name: str
    code: int
    base_bits: int
    early_bonus: int = 1

    @property
    def lossless(self) -> bool:
        return self.base_bits == 0

    def bits(self, layer: int, num_layers: int) -> tuple[int, int]:
        """``(k_bits, v_bits)`` of layer ``layer`` (0-based) in a model of ``num_layers``;
        ``(0, 0)`` for ``raw``."""
        if num_layers < 1 or not 0 <= layer < num_layers:
            raise CodecError(f"layer {layer} out of range for a model of {num_layers} layers")
        if self.lossless:
            return 0, 0
        k_early = math.ceil(num_layers / 3)
        v_early = math.ceil(num_layers / 16)
        k = self.base_bits + (self.early_bonus if layer < k_early else 0)
        v = self.base_bits + (self.early_bonus if layer < v_early else 0)
        return min(k, MAX_BITS), min(v, MAX_BITS)

    def k_bits_per_layer(self, num_layers: int) -> list[int]:
        return [self.bits(layer, num_layers)[0] for layer in range(num_layers)]

    def v_bits_per_layer(self, num_layers: int) -> list[int]:
        return [self.bits(layer, num_layers)[1] for layer in range(num_layers)]

    def mean_bits(self, num_layers: int) -> float:
        """Nominal quantization bits per value averaged over layers, K and V (raw: 0)."""
        return sum(sum(self.bits(layer, num_layers)) for layer in range(num_layers)) / (
            2 * num_layers)

    def estimate_bytes(self, num_heads: int, num_tokens: int, head_dim: int, layer: int,
                       num_layers: int, dtype_bytes: int = 4) -> int:
        """Expected frame size in bytes of one chunk ``[num_heads, num_tokens, head_dim]``.

        Exact for ``raw`` (``dtype_bytes`` per value); for quantized levels an estimate from
        :data:`CODED_BITS_PER_VALUE` (which includes parameters and tables).
        """
        n = num_heads * num_tokens * head_dim
        if self.lossless:
            return FRAME_OVERHEAD_BYTES + 2 * (12 + _pad8(n * dtype_bytes))
        total = FRAME_OVERHEAD_BYTES
        for which, bits in enumerate(self.bits(layer, num_layers)):
            total += math.ceil(n * CODED_BITS_PER_VALUE[bits][which] / 8)
        return int(total)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


RAW = Level("raw", 0, 0, 0)
LEVELS: dict[str, Level] = {
    lvl.name: lvl
    for lvl in (
        RAW,
        Level("q8", 8, 8),
        Level("q6", 6, 6),
        Level("q5", 5, 5),
        Level("q4", 4, 4),
        Level("q3", 3, 3),
        Level("q2", 2, 2),
    )
}
"""Every level by name, from the best quality to the fewest bytes."""

LEVEL_ORDER: list[str] = list(LEVELS)
QUANTIZED_LEVELS: list[str] = [name for name in LEVEL_ORDER if not LEVELS[name].lossless]
DEFAULT_LEVEL = "q5"
LEVELS_BY_CODE: dict[int, Level] = {lvl.code: lvl for lvl in LEVELS.values()}


def get_level(level: str | Level) -> Level:
    """The :class:`Level` called ``level`` (a ``Level`` passes through)."""
    if isinstance(level, Level):
        return level
    try:
        return LEVELS[level]
    except (KeyError, TypeError):
        raise CodecError(f"unknown level {level!r}; known: {', '.join(LEVEL_ORDER)}") from None
