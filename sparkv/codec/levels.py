"""Named bitrate levels: a bit width per layer for K and for V, and a size estimate.

A level ``qB`` quantizes K and V with ``B`` bits plus a per-layer offset (-1, 0, +1 or +2) taken
from a *sensitivity profile* (:data:`PROFILE_K`, :data:`PROFILE_V`): the layers whose K or V
noise moves the model's output most get more bits, the least sensitive ones fewer, at the same
mean (``B + 0.2`` bits, as CacheGen's rule that it replaces). The profile was measured on
SmolLM2-135M (30 layers): the empirical Fisher information of the next-token loss with respect
to each layer's K and V, times the noise of 4-bit quantization, on two kinds of context
(natural text with the bench questions, and pass-key retrieval), normalised and summed; the offsets
are the greedy integer allocation that minimises the predicted loss increase at the mean of
``B + 0.2`` bits (:func:`allocate_offsets`; docs/codec.md, "Layer-wise bits"). ``sparkv bench
codec --measure-profile`` re-measures it and prints these tables. A model of another depth ``L``
uses the profile by relative depth: layer ``l`` takes the offsets of profile layer
``floor(l * 30 / L)``. Bits are clamped to 2..8. ``q8`` is 8 bits everywhere (the
quality-preserving level).

``raw`` is lossless: the chunk's values, bit for bit, in its dtype.

Other modules (scheduler, server, edge) import :data:`LEVELS`, :func:`get_level`,
:data:`DEFAULT_LEVEL` and :meth:`Level.estimate_bytes`; the codec writes :attr:`Level.code` into
every frame (and a decoder checks each tensor's bits against :meth:`Level.bits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from sparkv.codec.errors import CodecError

MIN_BITS = 2
MAX_BITS = 8

PROFILE_LAYERS = 30
"""Depth of the model the profile was measured on (SmolLM2-135M)."""
PROFILE_SENSITIVITY_K: tuple[float, ...] = (
    0.01491, 0.0957, 0.01693, 0.02499, 0.02318, 0.03338,
    0.01927, 0.1227, 0.05654, 0.02565, 0.03488, 0.0377,
    0.007558, 0.006921, 0.02835, 0.01977, 0.01003, 0.2462,
    0.539, 0.007604, 0.05396, 0.01172, 0.006362, 0.09389,
    0.03221, 0.001302, 0.03654, 0.000539, 0.006223, 0.002547)
"""Measured sensitivity of each layer's K (share of the expected loss increase under 4-bit noise;
natural-text and pass-key contexts, each normalised to 1, summed): ``sparkv bench codec
--measure-profile`` (bench/results/codec_profile.json), rounded to 4 digits."""
PROFILE_SENSITIVITY_V: tuple[float, ...] = (
    0.001343, 0.009901, 0.006657, 0.05193, 0.05702, 0.03019,
    0.02512, 0.04316, 0.03961, 0.02184, 0.01232, 0.007358,
    0.003282, 0.003634, 0.004461, 0.00245, 0.001251, 0.007141,
    0.02681, 0.001531, 0.004778, 0.002512, 0.001212, 0.008081,
    0.004953, 0.0002607, 0.003202, 0.0002385, 0.0008985, 0.0002988)
"""The same for V."""
PROFILE_K: tuple[int, ...] = (
    0, +2, 0, +1, +1, +1, 0, +2, +1, +1,
    +1, +1, 0, 0, +1, +1, 0, +2, +2, 0,
    +1, 0, 0, +2, +1, -1, +1, -1, 0, -1)
"""K bits over the level's base bits, per profile layer (mean +0.63): the first 30 of
``allocate_offsets(PROFILE_SENSITIVITY_K + PROFILE_SENSITIVITY_V, PROFILE_BUDGET, -1, 2)``."""
PROFILE_V: tuple[int, ...] = (
    -1, 0, 0, +1, +1, +1, +1, +1, +1, +1,
    0, 0, -1, -1, -1, -1, -1, 0, +1, -1,
    -1, -1, -1, 0, 0, -1, -1, -1, -1, -1)
"""V bits over the level's base bits, per profile layer (mean -0.23): the last 30."""
PROFILE_K_FLOOR: tuple[int, ...] = (
    0, +1, 0, 0, 0, 0, 0, +1, +1, 0,
    0, 0, 0, 0, 0, 0, 0, +2, +2, 0,
    +1, 0, 0, +1, 0, 0, 0, 0, 0, 0)
"""K offsets of a level at the 2-bit floor (``q2``), which cannot take a bit from any layer: the
same allocation with offsets 0..+2 at the same budget."""
PROFILE_V_FLOOR: tuple[int, ...] = (
    0, 0, 0, +1, +1, 0, 0, +1, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
"""V offsets of ``q2`` (see :data:`PROFILE_K_FLOOR`)."""
PROFILE_BUDGET = 12
"""Sum of the offsets over K and V of the 30 profile layers: a mean of +0.2 bits."""
for _k, _v in ((PROFILE_K, PROFILE_V), (PROFILE_K_FLOOR, PROFILE_V_FLOOR)):
    assert len(_k) == len(_v) == PROFILE_LAYERS
    assert sum(_k) + sum(_v) == PROFILE_BUDGET


def allocate_offsets(sensitivity: Sequence[float], total: int, lo: int = -1, hi: int = 2
                     ) -> tuple[int, ...]:
    """Integer bit offsets, one per tensor, in ``lo..hi`` and summing to ``total``, that minimise
    the predicted loss increase ``sum_i s_i * 4**-o_i`` (uniform quantization noise falls 4x per
    bit; ``s_i``: the tensor's measured sensitivity at the base bits).

    Greedy: start every tensor at ``lo`` and give the next bit to the tensor whose predicted loss
    falls most (ties: the lowest index). Optimal, since each tensor's gains shrink with every bit.
    This is how :data:`PROFILE_K` / :data:`PROFILE_V` (``lo=-1, hi=2``, K tensors then V, total
    :data:`PROFILE_BUDGET`) and the floor profiles (``lo=0``) were made; ``sparkv bench codec
    --measure-profile`` measures the sensitivities and prints the result.

    Raises:
        CodecError: ``lo > hi``, a negative or non-finite sensitivity, or a ``total`` outside
            ``[lo * n, hi * n]``.
    """
    n = len(sensitivity)
    if lo > hi:
        raise CodecError(f"offset range {lo}..{hi} is empty")
    if not lo * n <= total <= hi * n:
        raise CodecError(f"cannot spread {total} offset bits over {n} tensors in {lo}..{hi}")
    s = [float(x) for x in sensitivity]
    if any(not math.isfinite(x) or x < 0 for x in s):
        raise CodecError("sensitivities must be finite and non-negative")
    offsets = [lo] * n
    for _ in range(total - lo * n):
        best, gain = -1, -1.0
        for i in range(n):
            if offsets[i] < hi:
                g = s[i] * 4.0 ** -offsets[i]
                if g > gain:
                    best, gain = i, g
        offsets[best] += 1
    return tuple(offsets)


def predicted_loss(sensitivity: Sequence[float], offsets: Sequence[int]) -> float:
    """``sum_i s_i * 4**-o_i``: the loss increase the sensitivities predict for these offsets,
    relative to every tensor at the base bits (offsets all zero: ``sum s_i``)."""
    if len(sensitivity) != len(offsets):
        raise CodecError("one offset per sensitivity")
    return float(sum(float(s) * 4.0 ** -int(o) for s, o in zip(sensitivity, offsets)))

# Bytes per value (x8) of one coded tensor - Huffman streams, parameters, predictor, code table,
# descriptor, exact sink tokens - by bit width, measured on SmolLM2-135M K/V of a 4K-token
# natural-text context in 1024-token chunks of 3 heads x 64 channels (per-channel scales, predictor
# chosen per tensor, the levels' per-layer bits; see docs/codec.md).
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
        base_bits: bits of K and V before the layer's offset (0 for ``raw``).
        k_offsets, v_offsets: bits over ``base_bits`` per profile layer (:data:`PROFILE_K`
            and :data:`PROFILE_V`, or the floor profile for ``q2``); empty: ``base_bits`` in
            every layer (``q8``).
    """

    name: str
    code: int
    base_bits: int
    k_offsets: tuple[int, ...] = PROFILE_K
    v_offsets: tuple[int, ...] = PROFILE_V

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
        if not self.k_offsets:
            return self.base_bits, self.base_bits
        p = layer * PROFILE_LAYERS // num_layers
        k = self.base_bits + self.k_offsets[p]
        v = self.base_bits + self.v_offsets[p]
        return min(max(k, MIN_BITS), MAX_BITS), min(max(v, MIN_BITS), MAX_BITS)

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


RAW = Level("raw", 0, 0, (), ())
LEVELS: dict[str, Level] = {
    lvl.name: lvl
    for lvl in (
        RAW,
        Level("q8", 8, 8, (), ()),
        Level("q6", 6, 6),
        Level("q5", 5, 5),
        Level("q4", 4, 4),
        Level("q3", 3, 3),
        Level("q2", 2, 2, PROFILE_K_FLOOR, PROFILE_V_FLOOR),
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
