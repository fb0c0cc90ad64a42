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
the argument types production passes (:data:`sparkv.kernels.FAMILIES`); a kernel already in
the cache loads.
"""

from __future__ import annotations

import argparse

from sparkv.kernels import warm_kernels

__all__ = ["register"]


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("warm", help="compile every numba kernel into numba's cache (once per "
                                    "machine; deploy/setup.sh runs it)")
    p.set_defaults(func=_warm)


def _warm(args: argparse.Namespace) -> int:
    def report(family: str, seconds: float) -> None:
        print(f"warm: {family:<46} {seconds:6.1f} s", flush=True)

    took = warm_kernels(report=report)
    print(f"warm: every kernel is in numba's cache ({sum(took.values()):.1f} s)")
    return 0
