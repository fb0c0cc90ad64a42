"""docs/cli.md, generated from the ``sparkv`` command's argparse definitions.

    python -m sparkv.clidoc            # rewrites docs/cli.md
    python -m sparkv.clidoc --check    # exit 1 when docs/cli.md differs from the parsers

The page lists every command (depth first, in ``--help``'s order) with its usage and a table of
its arguments: the name, the default and the help text. It is rendered as if no ``SPARKV_*``
variable were set (``serve`` and ``worker`` take defaults from them) and for a 100-column
terminal, so it is the same on every machine; ``tests/test_cli.py`` fails when it is stale.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

from sparkv.cli import build_parser, stated_default, walk_parsers
from sparkv.cliflags import PRESS_METAVAR, is_hidden

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "cli.md"

INTRO = """\
# The `sparkv` command line

Generated from the argparse definitions by `python -m sparkv.clidoc`: do not edit this page by
hand (`tests/test_cli.py` fails when it differs from the parsers). `sparkv COMMAND --help` prints
the same. Defaults are shown as they are with no `SPARKV_*` variable set: `serve` and `worker`
read the variable named in brackets.

Errors: a usage error or any expected failure (a bad option value, a server or device service
that cannot be reached, an unknown context) is one line on stderr, `sparkv: error: ...`, and exit
status 2. A flag is spelled in full: no command takes an abbreviation of one.

Units: MB is 10^6 bytes and MiB 2^20 bytes (every `--*-mb` option takes MB); Mbit/s is 10^6 bits
per second. Chunk sizes (`--chunk-tokens`, T) differ per command on purpose:
[architecture.md](architecture.md#conventions) says why.

Output: answers and tables go to stdout; one-line notes ("loading the model", "listening on",
"wrote X") go to stderr. `sparkv -q COMMAND` hides the notes (and `ask`'s breakdown table under
its answer) and keeps answers, tables, progress bars, warnings and errors; `sparkv -v COMMAND`
adds debug lines and transformers' own warnings (hidden by default). A warning of sparkv's own
(a press that fails the model's quality table) is one line, `sparkv: warning: ...`. Progress
bars stay unless `sparkv --no-progress COMMAND` (or the command's own `--no-progress` where it
has one); into a pipe or a log file a bar is redrawn at most every 30 s. `serve` and `worker` log
with timestamps at `--log-level` (`-v`/`-q` override it). A usage error (an unknown flag, a
malformed value such as a `--context` that is not 32 hex digits, `--mbps 0`) is caught before
anything loads.
"""

NAMES = f"""## One name per idea

Every command spells a concept the same way:

| concept | flag | where |
|---|---|---|
| torch threads | `--threads N` | every command that runs the model (`serve`, `worker`, `encode` too) |
| answer length | `--max-new-tokens N` | `ask`, `device call`, `demo`, every benchmark that generates |
| a KV press | `--press {PRESS_METAVAR.replace('|', chr(92) + '|')}` | `encode`, `ask`, `demo`, `bench ttft` |
| memory budgets, MB | `--memory-budget-mb` (the device service), `--keep-budget-mb` (`ask --keep`'s kept contexts) | |
| decode-time KV budget | `--decode-budget` (`ask`), `--decode-budgets` (`bench dynakv`) | beside `--decode POLICY` |
| the flash tier's directory | `--flash-dir DIR` | `device serve`, `bench decode`, `bench dynakv` (`ask --keep` has `--keep-dir`) |
| keys | `--api-key` (the tenant's bearer key), `--encryption-key` (a context's frame key) | `ask` |
| a time | `--*-s` / `--*-ms`, the unit in the name | `--deadline-s`, `--duration-s`, `--rtt-ms`, ... |
| output | `--out FILE`, `--out-dir DIR` (`demo`), `--json` | see below |

A press spec is `NAME:BUDGET[@WINDOW]`: `adakv:0.2` keeps 20% of the entries (also `adakv:20%`),
`dynamickv:256t` keeps 256 tokens per KV head, and `@repeat` uses a fixed probe question as the
question-agnostic window ([presses.md](presses.md)).

Two spellings mean different things on purpose: `--json` prints the result as JSON in `encode`,
`ask`, `context ...` and `device call|list|describe`, but writes `bench/results/NAME.json` in a
benchmark (`--out FILE` writes it elsewhere); `--server` is the sparkv server's URL (`ask`,
`context ...`), `--url` the device service's (`device ...`). A context's `--name` (`context
create`, `encode`) labels a context on the server; a `--label` (`device create`) one in the
device service. `encode --model` and `serve`'s config name a model of the server's
config; elsewhere `--model` is a local checkpoint.
"""


@contextlib.contextmanager
def _reproducible_env() -> Iterator[None]:
    """No ``SPARKV_*`` variables and ``COLUMNS=100`` while the parsers are built and rendered."""
    saved = dict(os.environ)
    for name in [n for n in os.environ if n.startswith("SPARKV_")]:
        del os.environ[name]
    os.environ["COLUMNS"] = "100"
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def render() -> str:
    """The Markdown of docs/cli.md."""
    with _reproducible_env():
        parser = build_parser()
        helps = _subcommand_helps(parser)
        parts = [INTRO, NAMES]
        for path, p in walk_parsers(parser):
            parts.append(_section(path, p, helps.get(path)))
    return "\n".join(parts)


def _subcommand_helps(parser: argparse.ArgumentParser) -> dict[tuple[str, ...], str]:
    """command path -> the one-line help its parent lists it with."""
    out: dict[tuple[str, ...], str] = {}
    for path, p in walk_parsers(parser):
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    out[path + (choice.dest,)] = choice.help or ""
    return out


def _section(path: tuple[str, ...], p: argparse.ArgumentParser, summary: str | None) -> str:
    """One command: heading, summary, description, usage and the argument table."""
    lines = [f"## `{' '.join(path)}`", ""]
    for text in (summary, p.description):
        if text and text not in lines:
            lines += [text, ""]
    lines += ["```text", p.format_usage().strip(), "```", ""]
    rows = [_row(p, a) for a in p._actions
            if not isinstance(a, argparse._HelpAction) and not is_hidden(a)]
    if rows:
        lines += ["| argument | default | meaning |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


def _row(p: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One table row: the argument as ``--help`` writes it, its default, its help text."""
    formatter = p._get_formatter()
    if isinstance(action, argparse._SubParsersAction):
        name = "COMMAND: " + ", ".join(f"`{c}`" for c in action.choices)
    else:
        name = f"`{formatter._format_action_invocation(action)}`"
    if action.required and action.option_strings:
        default = "required"
    elif stated_default(action):
        default = f"`{action.default}`"
    else:
        default = ""
    text = _cell(action.help % _params(action) if action.help else "")
    return f"| {name} | {_cell(default)} | {text} |"


def _params(action: argparse.Action) -> dict[str, object]:
    """The ``%(name)s`` values argparse offers a help string."""
    params = dict(vars(action), prog="sparkv")
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return params


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparkv.clidoc", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 when docs/cli.md differs from the parsers (write nothing)")
    ap.add_argument("--out", default=str(DOC_PATH), help="the page to write or check")
    args = ap.parse_args(argv)
    text = render()
    out = Path(args.out)
    if args.check:
        if not out.is_file() or out.read_text() != text:
            print(f"{out} is stale: run python -m sparkv.clidoc", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
