"""Hands the C heap's free memory back to the operating system.

A long-running process whose threads come and go (the device service runs each ask on a thread
of its own) grows glibc's per-thread malloc arenas; what an ended ask freed stays mapped in them
(its RSS), and a later ask on another thread may not reuse it. :func:`trim_heap` asks glibc to
return the free pages of every arena (``malloc_trim(0)``, which since glibc 2.8 also releases
free pages inside the heaps, not only at their tops). Elsewhere (musl, macOS) it does nothing.

:func:`freeze_heap` takes what a long-running process holds for good (the model, torch's and
transformers' modules: ~465,000 objects in the device service) out of Python's full collections,
which otherwise walk all of it with the interpreter's lock held. Measured in the device service
(SmolLM2, 1,024-token asks, a loaded 2-core CPU): 19 full collections of 80-905 ms, 11.2 s in
all, over six asks, each a stall of every other ask's thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any, Sequence

from sparkv.kernels import CODEC, warm_kernels

__all__ = ["freeze_heap", "keep_freed_memory", "own_process", "owns_process", "settle",
           "trim_heap"]

#: ``mallopt`` parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: allocations up to this size come from the heap, where a freed one is reused
MMAP_THRESHOLD = 32 << 20
#: free memory at a heap's top kept for reuse up to this much (``trim_heap`` still returns all)
TRIM_THRESHOLD = 512 << 20


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError, TypeError):
        return None
    return libc


def trim_heap() -> bool:
    """Returns the C heap's free pages to the system; ``True`` where something was released
    (``False`` also where the C library has no ``malloc_trim``)."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def keep_freed_memory() -> bool:
    """Makes the C heap keep what a switch frees for the next one: a working memory's layers
    (a 4K context's: 60 tensors of 3.2 MB) and a page pool's tensors come from the heap and a
    freed one's pages are reused, already faulted in, instead of being mapped afresh and
    faulted in again (a new page costs ~2.5 us on this VM: a 4K working memory made and filled
    took ~85 ms with fresh pages against ~20 ms in reused ones). glibc moves its thresholds by
    what the process happened to free before (a 2 MiB buffer freed raises them), so without
    this a switch's speed depended on the process's history. Returns ``False`` where the C
    library has no ``mallopt``."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def freeze_heap() -> int:
    """Collects once, then moves every object alive now into the collector's permanent
    generation (``gc.freeze``): later collections walk only what was made after, so they cost
    what the work since made, not what the process holds for good. Call it once the long-lived
    state exists (the model loaded, the modules imported); an object frozen stays until the
    process ends unless its references drop to zero (frozen cycles are never collected).
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


#: whether this process is a command's own (:func:`own_process`): only then does
#: :func:`settle` freeze anything
_OWN_PROCESS = False


def own_process() -> None:
    """Marks this process as a command's own: the CLI calls it when it is the process's entry
    point (``sparkv ...``, ``python -m sparkv.cli``), not when a library user or a test calls
    :func:`sparkv.cli.main` with arguments inside a process of its own."""
    global _OWN_PROCESS
    _OWN_PROCESS = True


def owns_process() -> bool:
    """Whether :func:`own_process` marked this process as a command's own."""
    return _OWN_PROCESS


def settle(families: Sequence[str] = (CODEC,)) -> int:
    """What a command that holds one model for the process's whole life runs once the model is
    loaded, before its first ask: the compiled kernels of ``families`` once
    (:func:`sparkv.kernels.warm_kernels`; default the codec's, whose first call imports and
    compiles; a device service runs every family, its first context switch otherwise paid the
    dense fill's), then :func:`freeze_heap`. Does nothing (returns 0) unless the process is the
    command's own (:func:`own_process`): a frozen object in a reference cycle is never freed,
    which a process that goes on after the command (a test run) cannot afford; nor does it
    change the C heap's thresholds (:func:`keep_freed_memory`), which it does for the command's
    process. Returns how many objects are frozen."""
    if not owns_process():
        return 0
    warm_kernels(families)
    keep_freed_memory()
    return freeze_heap()
