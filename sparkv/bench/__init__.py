"""``sparkv bench NAME``: benchmarks that print a table and, with ``--json``, write JSON under
``bench/results/`` (never without ``--json`` or ``--out``; a ``--quick`` run never over a full
run's file).

Each benchmark is a module exposing ``register(subparsers)`` (like the top-level commands). The JSON
contract shared by every benchmark is documented in docs/benchmarks.md and written by
:func:`sparkv.bench.common.write_result`.
"""

from __future__ import annotations

import argparse
import importlib

# One line per benchmark module.
BENCH_MODULES: list[str] = [
    "sparkv.bench.prefill",
    "sparkv.bench.attention",
    "sparkv.bench.codec",
    "sparkv.bench.scheduler",
    "sparkv.bench.predictor",
    "sparkv.bench.server",
    "sparkv.bench.ttft",
    "sparkv.bench.decode",
    "sparkv.bench.dynakv",
    "sparkv.bench.quality",
    "sparkv.bench.contexts",
    "sparkv.bench.cluster",
    "sparkv.bench.presses",
    "sparkv.bench.sparsecal",
    "sparkv.bench.concurrency",
    "sparkv.bench.layerprec",
    "sparkv.bench.compute",
]


def register(sub: "argparse._SubParsersAction") -> None:
    parser = sub.add_parser("bench", help="run a benchmark (prints a table; --json writes JSON)")
    bench_sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and name.startswith(exc.name):
                continue  # not written yet
            raise
        module.register(bench_sub)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
