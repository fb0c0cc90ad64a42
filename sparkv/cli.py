"""The ``sparkv`` console command.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module adds a parser
whose ``func`` attribute takes the parsed ``argparse.Namespace`` and returns an exit code. Benchmarks
register themselves under ``sparkv bench`` the same way (see ``sparkv.bench``). Modules are imported
lazily by name so that a subcommand's heavy imports (torch, FastAPI) load only when it runs.

Errors: :func:`main` is the one place that turns an expected failure into one line on stderr and
exit status 2, for every command (:func:`error_message`): a :class:`~sparkv.errors.SparkvError`
(:class:`~sparkv.extras.MissingExtra` among them: a dependency of another install profile),
a server or service that cannot be reached, or ``raise SystemExit("message")``. Argparse's own
usage errors exit 2 as well. Anything else is a bug and keeps its traceback.

``docs/cli.md`` is generated from these parsers (:mod:`sparkv.clidoc`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterator, Sequence

from sparkv.errors import SparkvError
from sparkv.extras import as_missing_extra

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

#: option names whose default must never be printed (it may come from a secret in the environment)
SECRET_DESTS = ("api_key", "ssl_keyfile_password")


class HelpFormatter(argparse.HelpFormatter):
    """Argparse's formatter, adding ``(default: X)`` to an option's help unless the help already
    states its default (it says "default"), the option has none (``None``, a flag's ``False``),
    is required or positional, or may hold a secret (:data:`SECRET_DESTS`)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not stated_default(action) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def stated_default(action: argparse.Action) -> bool:
    """Whether an option's default is worth printing (see :class:`HelpFormatter`)."""
    default = action.default
    return not (default is None or default is False or default == argparse.SUPPRESS
                or action.required or not action.option_strings or action.dest in SECRET_DESTS
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction)))


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
    for _, p in walk_parsers(parser):
        p.formatter_class = HelpFormatter
    return parser


def walk_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("sparkv",)
                 ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(command path, parser)`` for ``parser`` and every subcommand under it, depth first in
    the order ``--help`` lists them: ``(("sparkv",), top), (("sparkv", "serve"), serve), ...``."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk_parsers(child, (*path, name))


def error_message(exc: BaseException) -> str | None:
    """The one-line message of an expected failure, or ``None`` for a bug (see the module
    docstring)."""
    if isinstance(exc, SparkvError):
        return str(exc)
    missing = as_missing_extra(exc)    # an optional dependency of another install profile
    if missing is not None:
        return str(missing)
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, str) else None
    httpx = sys.modules.get("httpx")   # loaded only by the commands that talk to a server
    if httpx is not None and isinstance(exc, httpx.TransportError):
        try:
            where = f" {exc.request.url}"
        except RuntimeError:           # an error raised without its request
            where = ""
        return f"cannot reach{where} ({exc or type(exc).__name__}): is the service running?"
    if isinstance(exc, ConnectionError):
        return f"cannot connect ({exc}): is the service running?"
    return None


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
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - re-raised unless expected
        message = error_message(exc)
        if message is None:
            raise
        print(f"sparkv: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
