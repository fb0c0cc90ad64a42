"""sparkv's numba kernel families, and running them once so that a process pays their start-up
before its first request.

Each family's module has a ``warm_up()``: a small call with the argument types production
passes, which compiles the family's kernels (seconds to tens of seconds each on a 2-core
machine) or, once ``sparkv warm`` has put them in numba's cache, loads them (a fraction of a
second: measured here, the dense fill 0.34 s, the paged attention 0.07 s). The modules are named,
not imported, so this module sits below every layer that has kernels (``tests/test_layers.py``).
"""

from __future__ import annotations

import importlib
import time
from typing import Callable, Iterable

__all__ = ["CODEC", "FAMILIES", "warm_kernels"]

#: the codec's family: the one an edge command runs (its frames' coding)
CODEC = "codec (quantize, Huffman)"

#: kernel family -> the module whose ``warm_up()`` runs it (the order ``sparkv warm`` runs)
FAMILIES: dict[str, str] = {
    CODEC: "sparkv.codec.warm",
    "paged attention (fp, int8, int4, int2 pages; a dense prefix)": "sparkv.cache.qattend",
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
    for family in (FAMILIES if families is None else families):
        module = FAMILIES[family]
        t0 = time.perf_counter()
        importlib.import_module(module).warm_up()
        took[family] = time.perf_counter() - t0
        if report is not None:
            report(family, took[family])
    return took
