"""Zero-filled tensors whose memory the operating system gives page by page, on first write.

``torch.zeros`` writes every byte of a new tensor, so a context's KV arena (one ``[1, H,
capacity, D]`` tensor per layer for K and for V: 94 MB for SmolLM2 at 2K tokens) takes all its
memory the moment it is made, although its chunks arrive over seconds (streamed from the
server, computed, or never, when the ask is cancelled). :func:`zeros` maps a large CPU tensor
on a private anonymous mapping instead: it reads as zeros (the kernel's zero page), and a page
becomes the process's memory only when something is written into it. An ask waiting for its
share of the link or the cores then holds the chunks it has, not its whole context, and the
memory goes back to the system the moment the tensor is freed (``munmap``, not a heap that may
keep it).

The page faults are not free: a 4K-token switch's working memory, made and filled at once by
four reader threads, took 1.55x longer with lazy arenas than with ``torch.zeros`` (217 against
140 ms: ``python bench/switch_ab.py OLD NEW --with-alloc``,
bench/results/switch_lazy_arena_all.json), so only a memory filled over seconds takes them
(``ContextKV(..., lazy=True)``: the edge's ask, whose chunks arrive as the link and the cores
give them; the switch again 0.97x, switch_lazy_arena_asks_only.json).

Smaller tensors (under :data:`LAZY_MIN_BYTES`), tensors off the CPU and platforms without
anonymous private mappings get ``torch.zeros``. The result is an ordinary tensor (views, copies,
in-place writes); its storage cannot be resized.
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["zeros", "LAZY_MIN_BYTES"]

#: below this size a tensor is made by ``torch.zeros`` (a mapping per small tensor costs more
#: than the memory it saves)
LAZY_MIN_BYTES = 256 * 1024

_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def zeros(shape: tuple[int, ...], dtype: torch.dtype,
          device: torch.device | str = "cpu") -> torch.Tensor:
    """A zero-filled tensor of ``shape``; a large CPU one takes memory only where written
    (module docstring)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if (torch.device(device).type != "cpu" or nbytes < LAZY_MIN_BYTES
            or not hasattr(mmap, "MAP_ANONYMOUS")):
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=_FLAGS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)
