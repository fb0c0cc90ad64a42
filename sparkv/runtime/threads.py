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
"""

from __future__ import annotations


def use_threads(n: int) -> int:
    """Sets the calling thread's intra-op thread count to ``n`` (>= 1) for good; returns it.

    Call it first thing in every thread that runs PyTorch kernels with a count of its own (the
    process-wide value it also writes only affects threads that have not run a kernel yet)."""
    import torch

    n = max(1, int(n))
    torch.get_num_threads()   # the thread's lazy initialisation happens now, not later
    torch.set_num_threads(n)
    return n
