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
