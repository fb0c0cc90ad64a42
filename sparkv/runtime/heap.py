"""Hands the C heap's free memory back to the operating system.

A long-running process whose threads come and go (the device service runs each ask on a thread
of its own) grows glibc's per-thread malloc arenas; what an ended ask freed stays mapped in them
(its RSS), and a later ask on another thread may not reuse it. :func:`trim_heap` asks glibc to
return the free pages of every arena (``malloc_trim(0)``, which since glibc 2.8 also releases
free pages inside the heaps, not only at their tops). Elsewhere (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["trim_heap"]


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
