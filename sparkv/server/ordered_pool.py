"""An ordered, bounded parallel map: the encoder codes a context's frames on several threads.

The codec's heavy parts (quantization, the channel predictor, Huffman packing) are numba
functions compiled ``nogil`` and numpy calls that release the GIL, so threads code frames in
parallel. :func:`ordered_map` yields the results in the items' order (the manifest lists frames in
encoding order, whatever finished first), keeps at most ``window`` items in flight (memory stays
bounded whatever the context's length), and never leaves work running behind its consumer: when
the consumer stops early (an error, a cancelled job, ``close()``), the items not yet started are
cancelled and the running ones are waited for, so nothing writes to the store after the caller
cleaned up.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

#: the most threads ``encode_threads: 0`` (auto) gives one encode job
AUTO_MAX_THREADS = 8


def auto_threads(setting: int, jobs: int = 1) -> int:
    """The threads one encode job codes on: ``setting`` when it is positive, else (``0``, auto)
    the machine's cores shared among ``jobs`` concurrent jobs, at least 1 and at most
    :data:`AUTO_MAX_THREADS`."""
    if setting > 0:
        return setting
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(AUTO_MAX_THREADS, (cores or 1) // max(1, jobs)))


def ordered_map(fn: Callable[[T], R], items: Iterable[T], threads: int,
                window: int | None = None) -> Generator[R, None, None]:
    """``fn(item)`` for each item, in order, computed on ``threads`` threads with at most
    ``window`` (default ``2 * threads``) submitted and not yet consumed.

    ``threads <= 1`` runs every call in the consumer's thread (no pool). An exception raised by
    ``fn`` is raised by the generator at that item's turn; the items after it are cancelled or
    waited for first (see the module docstring)."""
    if threads <= 1:
        for item in items:
            yield fn(item)
        return
    window = max(1, window or 2 * threads)
    pending: deque[Future[R]] = deque()
    source = iter(items)
    with ThreadPoolExecutor(threads, thread_name_prefix="sparkv-frames") as pool:
        try:
            for item in source:
                pending.append(pool.submit(fn, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for fut in pending:   # stopped early: nothing new starts; the pool's exit waits
                fut.cancel()      # for the calls already running
