"""Whether the host may read and write a memory's tensors in place (numpy views, numba kernels).

The device's KV memory lives where the model runs: on the CPU its pages and arenas are host memory,
and the bulk operations take host shortcuts (flash records copied straight into the pages' rows,
quantized rows dequantized by a numba kernel straight into an arena, resident attention by the
fused numba kernel). On a GPU they are device memory: the same operations run as torch ops on the
device, with one host-to-device copy of what comes from flash (docs/kv-memory.md, "On a GPU").

:func:`host_addressable` is the one test of which path runs. ``SPARKV_GENERIC_KV=1`` makes it
false on the CPU too, so that the device-generic paths (what a GPU runs) can be tested on a
machine without one (tests/test_device_kv_generic.py).
"""

from __future__ import annotations

import os

import torch

#: the variable that forces the device-generic paths on the CPU (tests)
GENERIC_ENV = "SPARKV_GENERIC_KV"


def generic_forced() -> bool:
    """Whether ``SPARKV_GENERIC_KV`` forces the device-generic paths."""
    return os.environ.get(GENERIC_ENV, "").strip().lower() in ("1", "true", "yes")


def host_addressable(where: torch.Tensor | torch.device | str) -> bool:
    """Whether a tensor (or a device) is host memory the CPU's kernels may read and write in
    place: the CPU, unless :func:`generic_forced`."""
    device = where.device if isinstance(where, torch.Tensor) else torch.device(where)
    return device.type == "cpu" and not generic_forced()


def staging(n: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor to fill before one copy to ``device``: pinned where the device is a GPU (the
    copy then runs without a bounce buffer), plain otherwise."""
    pin = device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(n, dtype=dtype, pin_memory=pin)
