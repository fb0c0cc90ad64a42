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

Output: ``-v``/``-q`` and ``--no-progress`` on ``sparkv`` itself set up logging once for every
command (:mod:`sparkv.logs`). Every option is stored under its own name (``--flash-dir`` into
``args.flash_dir``), but for ``sparkv --no-progress`` (see :func:`add_output_args`), and
spelled in full: no parser takes an abbreviation (``demo --out`` is not ``demo --out-dir``).

``docs/cli.md`` is generated from these parsers (:mod:`sparkv.clidoc`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from typing import Iterator, NoReturn, Sequence, TextIO

from sparkv.errors import SparkvError
from sparkv.extras import as_missing_extra
from sparkv.logs import disable_progress_bars, setup_logging

# Subcommand modules, in the order `sparkv --help` lists them. Add one line per new module.
COMMAND_MODULES: list[str] = [
    "sparkv.predictor.describe",
    "sparkv.server.commands",
    "sparkv.edge.commands",
    "sparkv.edge.context_commands",
    "sparkv.device.commands",
    "sparkv.asks.commands",       # extends `device serve` (after sparkv.device.commands)
    "sparkv.demo",
    "sparkv.predictor.commands",
    "sparkv.bench",
    "sparkv.warm",
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


class Parser(argparse.ArgumentParser):
    """Argparse's parser, whose usage error is one line (``sparkv ask: error: argument
    --context: ...``, exit status 2) that names ``--help`` instead of printing the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Every command's parser. Building it imports no heavy module (torch, transformers, the
    server's FastAPI): a command module imports those in the function that runs the command,
    so ``--help``, ``--version`` and a usage error cost no model load (tests/test_cli.py)."""
    parser = Parser(
        prog="sparkv", description="Cloud-edge KV-cache streaming for on-device LLMs.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    add_output_args(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for _, p in walk_parsers(parser):
        p.formatter_class = HelpFormatter
        p.allow_abbrev = False       # a flag is spelled in full: no second spelling of it
    return parser


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """``-v``/``-q`` and ``--no-progress``: what every command shows (:mod:`sparkv.logs`).

    ``sparkv --no-progress`` is stored as ``no_progress_bars``, the one option whose ``dest``
    is not its flag's name: a command's own ``--no-progress`` (``args.no_progress``) has a
    default, and argparse copies a subcommand's defaults over its parent's values."""
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("-v", "--verbose", action="count", default=None,
                      help="also print debug lines and transformers' own warnings (by default: "
                           "notes, no debug lines)")
    loud.add_argument("-q", "--quiet", action="store_true",
                      help="print only answers, tables, progress bars, warnings and errors (no "
                           "notes such as 'loading the model', no breakdown under ask's answer)")
    parser.add_argument("--no-progress", action="store_true", dest="no_progress_bars",
                        help="no progress bars, in any command (also: COMMAND --no-progress "
                             "where a command has it)")


def verbosity(args: argparse.Namespace) -> int:
    """-1 with ``-q``, the count of ``-v``, else 0 (:func:`sparkv.logs.level_for`)."""
    return -1 if getattr(args, "quiet", False) else int(getattr(args, "verbose", 0) or 0)


@contextlib.contextmanager
def _output(args: argparse.Namespace) -> Iterator[None]:
    """Logging and progress bars as ``args`` say, for the duration of one command (the
    environment is restored after it: :func:`main` may run several times in one process)."""
    saved = dict(os.environ)
    shown = warnings.showwarning
    args.verbosity = verbosity(args)
    setup_logging(args.verbosity)
    warnings.showwarning = one_line_warning
    if args.no_progress_bars:
        disable_progress_bars()
        if hasattr(args, "no_progress"):      # the command's own --no-progress
            args.no_progress = True
    try:
        yield
    finally:
        warnings.showwarning = shown
        os.environ.clear()
        os.environ.update(saved)


def one_line_warning(message: Warning | str, category: type[Warning], filename: str,
                     lineno: int, file: TextIO | None = None, line: str | None = None) -> None:
    """How a command shows a warning: sparkv's own (a press that fails the quality table, ...)
    as one line, ``sparkv: warning: ...``, without Python's source path and line of code;
    another library's as Python shows it."""
    if category.__module__.startswith("sparkv"):
        text = "sparkv: warning: " + " ".join(str(message).split()) + "\n"
    else:
        text = warnings.formatwarning(message, category, filename, lineno, line)
    (file or sys.stderr).write(text)


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


def passive_openmp_waits() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it; call it before torch loads.

    The edge and the device service run PyTorch from several threads (layer steps, frame
    decoding, generation). GNU OpenMP gives every calling thread its own team whose workers
    busy-wait after each parallel region; on a small CPU those spinning teams take the cores from
    whichever thread works next (measured here: the question prefill after a stream-only load
    took 2.5 s instead of 0.15 s). Passive waiting removes that. With it, ``GOMP_SPINCOUNT``
    (unless the environment sets it) lets a team's workers spin :data:`SPIN_COUNT` rounds (about
    0.3 ms) before they sleep: the parallel regions of one layer call follow each other within
    microseconds, and a worker woken from sleep for each of them made a whole load 1.17-1.19x
    slower on LTE (local 1.05-1.10 s against 0.91-0.93, sparkv 1.25 against 1.03-1.07;
    session 69, docs/edge.md "Threads and OpenMP"). OpenMP reads both once, when torch loads
    it: :func:`main` sets them before it builds the parsers (the command modules import torch),
    and the processes a command starts (server, workers, the device service) inherit them."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))


#: GNU OpenMP's spin rounds before a worker sleeps (:func:`passive_openmp_waits`; its default
#: without a policy is 300,000, about 3 ms, and 0 with ``PASSIVE``)
SPIN_COUNT = 30_000


def gil_switch_interval() -> None:
    """``SPARKV_SWITCH_INTERVAL_US``: the GIL's switch interval in microseconds (CPython's
    default is 5,000), inherited by the processes a command starts; unset, CPython's default.
    On a host-bound GPU each kernel launch gives up the GIL and, beside a busy Python thread
    (the plan, the frames' receiving), waits up to this interval to take it back (the H200's
    run 3, docs/gpu.md; ``bench/gil_convoy.py``): the GPU check's ``ttftswitch`` phase measures
    the whole ask with a shorter one. Raises :class:`SparkvError` for a value that is not a
    positive number."""
    value = os.environ.get("SPARKV_SWITCH_INTERVAL_US", "").strip()
    if not value:
        return
    try:
        us = float(value)
    except ValueError:
        us = float("nan")
    if not 0 < us < 1e7:
        raise SparkvError(f"SPARKV_SWITCH_INTERVAL_US={value!r}: give microseconds, a "
                          "positive number (CPython's default is 5000)")
    sys.setswitchinterval(us / 1e6)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; ``argv`` ``None``: this process's own arguments, and the process is
    the command's (:func:`sparkv.runtime.heap.own_process`)."""
    passive_openmp_waits()
    try:
        gil_switch_interval()
    except SparkvError as exc:
        print(f"sparkv: error: {exc}", file=sys.stderr)
        return 2
    if argv is None:
        from sparkv.runtime.heap import own_process

        own_process()
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
        with _output(args):
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
