"""A thread's sink for the column sums of the attention weights a layer computes.

An attention over a dense prefix that makes its softmax weights
(:class:`~sparkv.cache.qattend.PrefixAttention`) hands their column sums to the calling
thread's sink, if one is set: its torch ops sum the weights before multiplying them by the
values (:func:`offer_weights`), its numba kernel sums them inside the same call
(:func:`wants_sums`, :func:`offer_sums`). The device service's density recording
(:mod:`sparkv.device.density`) sets one: a pass over a fork then costs its density one column
sum of weights already made, not a second product of its queries with every key and a second
softmax. Threads with no sink (every other caller) pay one thread-local lookup.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

#: what a sink is handed: the column sums ``[keys]`` of softmax weights (each row sums to 1 over
#: its keys) and how many (head, query) rows they sum
ColumnSink = Callable[[torch.Tensor, int], None]

_local = threading.local()


def set_sink(sink: ColumnSink | None) -> ColumnSink | None:
    """Sets this thread's sink (``None``: none); returns the one it replaces."""
    previous: ColumnSink | None = getattr(_local, "sink", None)
    _local.sink = sink
    return previous


def wants_sums() -> bool:
    """Whether this thread has a sink (a kernel that can sum its weights' columns asks first)."""
    return getattr(_local, "sink", None) is not None


def offer_sums(colsum: torch.Tensor, rows: int) -> None:
    """Hands the column sums ``colsum [keys]`` of ``rows`` softmax rows to this thread's sink."""
    sink = getattr(_local, "sink", None)
    if sink is not None:
        sink(colsum, rows)


def offer_weights(weights: torch.Tensor) -> None:
    """Hands the column sums of ``weights`` (``[..., rows, keys]``, softmax rows) to this
    thread's sink, if any (one reduction; none without a sink)."""
    sink = getattr(_local, "sink", None)
    if sink is not None:
        keys = int(weights.shape[-1])
        sink(weights.reshape(-1, keys).sum(0), int(weights.numel()) // max(keys, 1))
