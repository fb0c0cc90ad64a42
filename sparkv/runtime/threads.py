"""Intra-op thread counts per Python thread, set without a race.

PyTorch keeps one process-wide thread count (written by every ``torch.set_num_threads`` call, from
any thread) and, per OS thread, the OpenMP count its kernels use. A thread's OpenMP count is
initialised lazily, at its first parallel kernel (or its first ``torch.get_num_threads``), *from
the process-wide value at that moment*, and that lazy initialisation overrides whatever
``set_num_threads`` the thread called before it. So a thread that calls ``set_num_threads(2)``
and then waits (for a lock, for another thread) before its first kernel silently runs with
whatever another thread set in the meantime: measured here, the edge engine's compute thread ran
a whole 4K load on one thread (TTFT 9.5 s instead of 7.0 s) whenever the decode worker (which
sets 1) started while the compute thread was waiting for the prelude's last step.

:func:`use_threads` initialises the calling thread first, then sets its count: later calls in
other threads no longer change it. It also writes the process-wide value, so a thread that sets
1 (the edge's frame decoders) leaves 1 for every thread started after it: a long-lived service
therefore fixes its count once, when it is made, and sets it on every thread it computes on
(:class:`~sparkv.device.service.ContextService`'s calls, each ask of
:class:`~sparkv.asks.service.AskService`), never ``use_threads(torch.get_num_threads())`` on a
new thread (session 119: every ask after the first streaming one computed on one thread).

**Idle OpenMP teams slow the running one** (:func:`release_pool`). GNU OpenMP (libgomp: torch's
copy, and the system's that numba's ``omp`` layer loads) keeps, per thread that ran a parallel
region, a pool of worker threads, and counts every pool's threads, idle or not. While they
outnumber the CPUs it stops spinning between regions (100 spins, then a futex sleep) and every
region pays a wake-up: on the 2-core CPU an answer token computed on a second thread while the
main thread's 2-thread pool sat idle took 1.35x (``mixed-mlp``) to 1.8x
(``mixed-mlp-int4-decode``) its time on the main thread, and as fast once that pool was freed.
A service whose compute moves between threads (each ask on its own; the main thread loaded the
model) therefore frees a thread's pool when it is done computing for now (the core gate after
each unit, device serve's main thread before it serves, the context service after each call).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

#: ``omp_pause_soft``: free the calling thread's pool (OpenMP 5.0)
_PAUSE_SOFT = 1
#: seconds between two looks for loaded libgomp copies
RESCAN_S = 5.0
_libs: list | None = None
_scanned = 0.0
_libs_lock = threading.Lock()


def use_threads(n: int) -> int:
    """Sets the calling thread's intra-op thread count to ``n`` (>= 1) for good; returns it.

    Call it first thing in every thread that runs PyTorch kernels with a count of its own (the
    process-wide value it also writes only affects threads that have not run a kernel yet)."""
    import torch

    n = max(1, int(n))
    torch.get_num_threads()   # the thread's lazy initialisation happens now, not later
    torch.set_num_threads(n)
    return n


def _openmp_libs() -> list:
    """The pause functions of the libgomp copies loaded in this process (looked for again
    every :data:`RESCAN_S`: numba's copy loads at its first parallel kernel)."""
    global _libs, _scanned
    now = time.monotonic()
    if _libs is not None and now - _scanned < RESCAN_S:
        return _libs
    with _libs_lock:
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({line.split()[-1] for line in maps if "libgomp" in line})
        except OSError:
            paths = []
        found = []
        for path in paths:
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
                fn = lib.omp_pause_resource_all
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            found.append(fn)
        _libs, _scanned = found, now
        return found


def release_pool() -> int:
    """Frees the calling thread's idle OpenMP worker threads in every libgomp loaded (module
    docstring); the thread's next parallel region makes them again (a few tens of
    microseconds). Returns how many libgomp copies were asked (0: none loaded, or another
    OpenMP runtime: nothing to do); a thread inside a parallel region is refused by each."""
    return sum(1 for pause in _openmp_libs() if pause(_PAUSE_SOFT) == 0)
