"""sparkv's numba kernel families, and running them once so that a process pays their start-up
before its first request.

Each family's module has a ``warm_up()``: a small call with the argument types production
passes, which compiles the family's kernels (seconds to tens of seconds each on a 2-core
machine) or, once ``sparkv warm`` has put them in numba's cache, loads them (a fraction of a
second: measured here, the dense fill 0.34 s, the paged attention 0.07 s). The modules are named,
not imported, so this module sits below every layer that has kernels (``tests/test_layers.py``).

**Their threads.** A parallel kernel runs on as many numba threads as torch's intra-op count of
the calling thread (:func:`use_torch_threads`, called before each parallel kernel): a process
that runs torch on fewer threads than cores (``--threads``, a shared machine, a test worker)
runs its kernels on as few. And starting numba's thread pool never changes that count
(:func:`start_pool`): numba's OpenMP pool sets the OpenMP thread count of the thread that starts
it - the count torch's kernels in that thread then use - to every core. Measured here, a test
worker set to one thread ran on two after its first ``int4`` answer token, and the suite's later
model tests in that worker took 2-5x their CPU time.
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Callable, Iterable

__all__ = ["CODEC", "FAMILIES", "start_pool", "use_torch_threads", "warm_kernels"]

#: the codec's family: the one an edge command runs (its frames' coding)
CODEC = "codec (quantize, Huffman)"

#: kernel family -> the module whose ``warm_up()`` runs it (the order ``sparkv warm`` runs)
FAMILIES: dict[str, str] = {
    CODEC: "sparkv.codec.warm",
    "paged attention (fp, int8, int4, int2, k8v4 pages; a dense prefix)": "sparkv.cache.qattend",
    "dense fill (device working memory)": "sparkv.device.dequant",
    "DynaKV clustering": "sparkv.decode.kmeans",
    "DynaKV fused attention": "sparkv.decode.fused",
    "Q4_1 product (int4's answer tokens)": "sparkv.runtime.q41kernel",
    "Q8_0 product (int4's LM head)": "sparkv.runtime.q80",
    "RoPE of an answer token's q and k": "sparkv.runtime.ropekernel",
    "one-query attention (int4's answer tokens)": "sparkv.runtime.decodeattn",
}


def warm_kernels(families: Iterable[str] | None = None,
                 report: Callable[[str, float], None] | None = None) -> dict[str, float]:
    """Runs the ``warm_up()`` of each of ``families`` (``None``: every family of
    :data:`FAMILIES`), in order: compiled, or loaded from numba's cache. Returns each family's
    seconds and calls ``report(family, seconds)`` after each. Raises ``KeyError`` for a family
    that is not one of :data:`FAMILIES`."""
    took: dict[str, float] = {}
    start_pool()
    for family in (FAMILIES if families is None else families):
        module = FAMILIES[family]
        t0 = time.perf_counter()
        importlib.import_module(module).warm_up()
        took[family] = time.perf_counter() - t0
        if report is not None:
            report(family, took[family])
    return took


#: whether numba's thread pool has been started (by :func:`start_pool`, once per process)
_started = False
_start_lock = threading.Lock()
#: numba's thread pool size (``set_num_threads`` takes at most this), known once it started
_pool_threads = 1
#: per Python thread, the numba thread count :func:`use_torch_threads` last made sure of
_set_here = threading.local()


def start_pool() -> None:
    """Starts numba's thread pool (once per process; numba would start it at the first parallel
    kernel) and gives the calling thread back its torch intra-op count, which starting an OpenMP
    pool sets to the pool's size. Only the starting thread's count changes, so starting it here
    covers every thread."""
    global _started, _pool_threads
    if _started:
        return
    with _start_lock:
        if _started:
            return
        import numba
        import torch

        threads = torch.get_num_threads()
        numba.get_num_threads()         # starts the pool
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        _pool_threads = int(getattr(numba.config, "NUMBA_NUM_THREADS", 1))
        _started = True


def use_torch_threads() -> int:
    """Sets numba's thread count for this thread to torch's (at most numba's pool size) and
    returns it: a parallel loop's barrier waits for every thread, and an oversubscribed one is
    not scheduled. The count this thread last set is remembered (this function is the only
    place that sets numba's count): asking numba costs ~3.5 us, and an answer token asks ~120
    times."""
    import torch

    if not _started:
        start_pool()
    threads = max(1, min(torch.get_num_threads(), _pool_threads))
    if getattr(_set_here, "threads", None) != threads:
        import numba

        if numba.get_num_threads() != threads:
            numba.set_num_threads(threads)
        _set_here.threads = threads
    return threads
