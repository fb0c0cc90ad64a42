"""``sparkv warm``: every numba kernel sparkv runs, compiled once per machine into numba's cache.

sparkv's kernels (the codec's quantizer and Huffman coder, the paged attention over quantized
pages, the dense fill of the device's working memory, DynaKV's clustering and fused attention)
are numba functions with ``cache=True``: the first process to call one compiles it (seconds to
tens of seconds each on a 2-core machine; the paged attention alone about 25 s) and writes it to
numba's cache (``__pycache__`` beside the source, or ``NUMBA_CACHE_DIR``), from where every
later process loads it in a fraction of a second. Until then each process that calls a kernel
first compiles it again, and processes that start together (a device service's first asks, a
test suite's workers) compile the same kernel side by side.

``deploy/setup.sh`` runs ``sparkv warm`` once after installing, so no ask pays a compile; run it
yourself after ``pip install`` or an upgrade. Each kernel family's warm-up is a small call with
the argument types production passes (:data:`FAMILIES`); a kernel already in the cache loads.
"""

from __future__ import annotations

import argparse
import importlib
import time
from typing import Callable

__all__ = ["FAMILIES", "compile_kernels", "register"]

#: kernel family -> the module whose ``warm_up()`` compiles it (the order ``sparkv warm`` runs)
FAMILIES: dict[str, str] = {
    "codec (quantize, Huffman)": "sparkv.codec.warm",
    "paged attention (fp, int8, int4, int2 pages)": "sparkv.cache.qattend",
    "dense fill (device working memory)": "sparkv.device.dequant",
    "DynaKV clustering": "sparkv.decode.kmeans",
    "DynaKV fused attention": "sparkv.decode.fused",
}


def compile_kernels(report: Callable[[str, float], None] | None = None) -> dict[str, float]:
    """Compiles (or loads from numba's cache) every family of :data:`FAMILIES`, in order;
    returns each family's seconds and calls ``report(family, seconds)`` after each."""
    took: dict[str, float] = {}
    for family, module in FAMILIES.items():
        t0 = time.perf_counter()
        importlib.import_module(module).warm_up()
        took[family] = time.perf_counter() - t0
        if report is not None:
            report(family, took[family])
    return took


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("warm", help="compile every numba kernel into numba's cache (once per "
                                    "machine; deploy/setup.sh runs it)")
    p.set_defaults(func=_warm)


def _warm(args: argparse.Namespace) -> int:
    def report(family: str, seconds: float) -> None:
        print(f"warm: {family:<46} {seconds:6.1f} s", flush=True)

    took = compile_kernels(report)
    print(f"warm: every kernel is in numba's cache ({sum(took.values()):.1f} s)")
    return 0
