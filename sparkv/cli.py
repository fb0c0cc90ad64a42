"""The ``sparkv`` console command.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module adds a parser
whose ``func`` attribute takes the parsed ``argparse.Namespace`` and returns an exit code. Benchmarks
register themselves under ``sparkv bench`` the same way (see ``sparkv.bench``). Modules are imported
lazily by name so that a subcommand's heavy imports (torch, FastAPI) load only when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from sparkv.errors import SparkvError

# Subcommand modules, in the order `sparkv --help` lists them. Add one line per new module.
COMMAND_MODULES: list[str] = [
    "sparkv.runtime.commands",
    "sparkv.server.commands",
    "sparkv.edge.commands",
    "sparkv.device.commands",
    "sparkv.demo",
    "sparkv.predictor.commands",
    "sparkv.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparkv", description="Cloud-edge KV-cache streaming for on-device LLMs.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a module not written yet must not break the others
            if exc.name and name.startswith(exc.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from sparkv import __version__
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SparkvError as exc:  # clear, expected errors: no traceback
        print(f"sparkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
