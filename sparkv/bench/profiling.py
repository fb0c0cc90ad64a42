"""Where a call's time goes: one run under ``torch.profiler``, the kernels that took most of it.

On a GPU the kernels by device time (the summed time is the GPU's busy time, at most: kernels
of several streams may overlap); on a CPU the operators by self CPU time. The wall time beside
the busy time says how launch- or host-bound the call is (docs/gpu.md).
"""

from __future__ import annotations

import time
from operator import attrgetter
from typing import Any, Callable

import torch

#: operator names that are not kernels on a GPU (their kernels are counted under their names)
_NOT_KERNELS = ("aten::", "cuda", "Memcpy", "Memset")


def profile_kernels(fn: Callable[[], Any], device: torch.device, top: int = 15
                    ) -> dict[str, Any]:
    """Runs ``fn`` once more under the profiler (after one untimed run: compilation and caches)
    and returns ``{wall_s, kernel_busy_s, kernel_launches, top_kernels: [{kernel, calls, ms}]}``.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    spent = attrgetter("device_time_total" if cuda else "self_cpu_time_total")
    events = [e for e in prof.key_averages()
              if not cuda or (e.device_time_total > 0 and not e.key.startswith(_NOT_KERNELS))]
    kernels = sorted(events, key=spent, reverse=True)
    return {"wall_s": wall, "kernel_busy_s": sum(spent(e) for e in kernels) / 1e6,
            "kernel_launches": sum(e.count for e in kernels),
            "top_kernels": [{"kernel": e.key[:120], "calls": e.count, "ms": spent(e) / 1e3}
                            for e in kernels[:top]]}


def kernel_table(prof: dict[str, Any], width: int = 70) -> list[list[Any]]:
    """The rows ``[kernel, calls, ms]`` of :func:`profile_kernels`' top kernels."""
    return [[t["kernel"][:width], t["calls"], t["ms"]] for t in prof["top_kernels"]]
