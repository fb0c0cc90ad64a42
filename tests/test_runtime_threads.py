"""Per-thread intra-op thread counts (sparkv.runtime.threads): a count set with use_threads
survives another thread's set_num_threads made before this thread's first kernel."""

from __future__ import annotations

import threading

import torch

from sparkv.runtime.threads import use_threads


def _count_after_interference(setter) -> int:
    """A thread sets 2 with ``setter``, waits while another thread sets 1, then reads its count."""
    set_done, other_done = threading.Event(), threading.Event()
    out: list[int] = []

    def a() -> None:
        setter(2)
        set_done.set()
        other_done.wait(30)
        out.append(torch.get_num_threads())

    def b() -> None:
        set_done.wait(30)
        torch.set_num_threads(1)
        other_done.set()

    before = torch.get_num_threads()
    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start(), tb.start()
    ta.join(), tb.join()
    torch.set_num_threads(before)
    return out[0]


def test_plain_set_num_threads_is_undone_by_the_lazy_init():
    """The PyTorch behaviour use_threads exists for: if this ever starts failing, PyTorch fixed
    it (and use_threads is merely harmless)."""
    assert _count_after_interference(torch.set_num_threads) == 1


def test_use_threads_holds_against_another_thread():
    assert _count_after_interference(use_threads) == 2


def test_use_threads_clamps_to_one():
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(use_threads(0)))
    t.start(), t.join()
    assert out == [1]


def test_trim_heap_returns_what_ended_threads_freed():
    """Threads that allocate and free many small tensors leave glibc's per-thread arenas full of
    free pages (the device service's RSS rose across asks that freed everything); trim_heap
    hands them back. Counted in RSS, not time."""
    import ctypes.util
    import threading

    import pytest
    import torch

    from sparkv.runtime.heap import trim_heap

    if "libc.so" not in str(ctypes.util.find_library("c")):
        pytest.skip("not glibc")

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

    def work() -> None:
        xs = [torch.ones(64, 1000) for _ in range(1000)]    # ~250 MB in 256 KB tensors
        del xs[::2]                                          # holes: nothing at a heap's top
        keep.append(xs[-1])

    keep: list = []
    threads = [threading.Thread(target=work) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    before = rss_mb()
    trim_heap()
    assert before - rss_mb() > 100, (before, rss_mb())


_POOL_SCRIPT = r"""
import json, numba, torch
torch.set_num_threads(1)
from sparkv.decode.kmeans import kmeans
from sparkv.runtime.q41 import quantize_q41
from sparkv.runtime.q41kernel import pack_blocks, q41_matmul
seen = {}
q41_matmul(torch.randn(1, 64), *pack_blocks(quantize_q41(torch.randn(8, 64))))
seen["int4 row kernel"] = (torch.get_num_threads(), numba.get_num_threads())
kmeans(torch.randn(2, 40, 8), 4)
seen["kmeans"] = (torch.get_num_threads(), numba.get_num_threads())
torch.set_num_threads(2)
kmeans(torch.randn(2, 40, 8), 4, seed=1)
seen["kmeans at 2"] = (torch.get_num_threads(), numba.get_num_threads())
from sparkv.cache.qattend import warm_up    # the paged attention's kernel, after kmeans's 2
torch.set_num_threads(1)
warm_up()
seen["paged attention"] = (torch.get_num_threads(), numba.get_num_threads())
print(json.dumps({"cores": numba.config.NUMBA_NUM_THREADS, "seen": seen}))
"""


def test_numbas_thread_pool_leaves_torchs_count_and_follows_it():
    """Starting numba's OpenMP pool (the first parallel kernel of a process) set the starting
    thread's torch count to every core: a process set to one thread computed on all of them
    after its first int4 answer token. Now torch's count stays, and the kernels follow it (the
    int4 rows, DynaKV's clustering, the paged attention)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _POOL_SCRIPT], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    two = min(2, doc["cores"])
    assert doc["seen"] == {"int4 row kernel": [1, 1], "kmeans": [1, 1],
                           "kmeans at 2": [2, two], "paged attention": [1, 1]}


def test_release_pool_ends_the_calling_threads_idle_openmp_workers():
    """A thread that ran a parallel region on 2 threads keeps an idle OpenMP worker (libgomp
    counts it, and stops spinning while such workers outnumber the CPUs); ``release_pool``
    ends it, and the next region makes it again."""
    import os
    import time

    import pytest

    from sparkv.runtime.threads import _openmp_libs, release_pool

    x = torch.ones(1 << 22)
    x.mul_(2.0)                                   # torch's OpenMP runtime is loaded now
    if not _openmp_libs():
        pytest.skip("no libgomp with omp_pause_resource_all in this process")

    def tasks() -> int:
        return len(os.listdir("/proc/self/task"))

    def settled(want, guard_s: float = 30.0) -> int:      # a guard, not a timing
        end = time.monotonic() + guard_s
        while not want(tasks()) and time.monotonic() < end:
            time.sleep(0.01)
        return tasks()

    seen: dict[str, int] = {}

    def work() -> None:
        use_threads(2)
        seen["alone"] = tasks()
        x.mul_(1.0)                               # a parallel region: one worker made
        seen["ran"] = tasks()
        assert release_pool() >= 1
        seen["released"] = settled(lambda n: n < seen["ran"])
        x.mul_(1.0)
        seen["again"] = tasks()
        release_pool()

    t = threading.Thread(target=work)
    t.start()
    t.join(60)
    assert seen["ran"] > seen["alone"] and seen["released"] < seen["ran"], seen
    assert seen["again"] > seen["released"], seen
