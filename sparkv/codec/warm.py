"""Runs the codec's compiled kernels once, so a long-running process pays their start-up first.

The Huffman coder's kernels are numba functions: the first call in a process compiles them, or
loads them from numba's cache, and imports numba's typing machinery (about a hundred modules,
tens of thousands of objects). A service that answers many asks calls :func:`warm_up` before it
takes the first, then moves what it holds for good out of the collector's full collections
(:func:`sparkv.runtime.heap.freeze_heap`): otherwise the first ask pays for the compile and every
later full collection walks what it left.
"""

from __future__ import annotations

from typing import Sequence

import torch

from sparkv.codec.chunk import KVChunk
from sparkv.codec.frame import decode, decode_into, encode, quantized_values
from sparkv.layout import KVChunkId

__all__ = ["warm_up"]

#: the levels whose coding paths the warm-up runs: lossless and two quantized bit widths
WARM_LEVELS = ("raw", "q8", "q5")
#: both coding paths of a quantized tensor (a lossless one has none)
PREDICTORS = ("none", "channel")


def warm_up(levels: Sequence[str] = WARM_LEVELS) -> None:
    """Encodes and decodes (both ways: into new tensors and into given ones) a small random
    chunk at each of ``levels``, with and without the channel predictor, from a read-only
    frame (``bytes``, as the wire delivers it) and from a writable one (a buffer read from
    flash): each is a kernel signature of its own. Raises
    :class:`~sparkv.codec.errors.CodecError` if a round trip fails."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 64, 16, generator=gen)
    chunk = KVChunk(KVChunkId(0, 1, 0), 0, k, torch.randn(2, 64, 16, generator=gen),
                    num_layers=2)
    for level in levels:
        for predictor in PREDICTORS:
            frame = encode(chunk, level, predictor=predictor)
            for data in (frame, bytearray(frame)):
                decode(data, finite=True)
                decode_into(data, torch.empty_like(k), torch.empty_like(k), finite=True)
            quantized_values(frame)            # the values' entropy (benchmarks, analysis)
