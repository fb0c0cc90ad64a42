"""A thread's sink for the column sums of the attention weights a layer computes.

An attention over a dense prefix that makes its softmax weights explicitly
(:class:`~sparkv.cache.qattend.PrefixAttention`) hands them to the calling thread's sink, if one
is set, before it multiplies them by the values. The device service's density recording
(:mod:`sparkv.device.density`) sets one: a pass over a fork then costs its density one column
sum of weights already made, not a second product of its queries with every key and a second
softmax. Threads with no sink (every other caller) pay one thread-local lookup.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

#: what a sink is handed: the weights ``[..., rows, keys]`` (each row sums to 1 over its keys)
ColumnSink = Callable[[torch.Tensor], None]

_local = threading.local()


def set_sink(sink: ColumnSink | None) -> ColumnSink | None:
    """Sets this thread's sink (``None``: none); returns the one it replaces."""
    previous: ColumnSink | None = getattr(_local, "sink", None)
    _local.sink = sink
    return previous


def offer_weights(weights: torch.Tensor) -> None:
    """Hands ``weights`` (``[..., rows, keys]``, softmax rows) to this thread's sink, if any."""
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink(weights)
