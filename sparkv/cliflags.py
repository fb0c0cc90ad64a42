"""One name per idea on the command line: the flags that were renamed, kept as hidden aliases.

Every subcommand of ``sparkv`` spells a concept the same way (docs/cli.md's header lists them).
A flag renamed for that keeps its old spelling for one release: :func:`add_hidden_aliases`
gives the new flag's action, in each parser that has it, the old spelling as a second option
string that ``--help`` does not show (``sparkv.cli.HelpFormatter``)::

    RENAMED = [Renamed("--threads", "--torch-threads"), ...]
    add_hidden_aliases(parser, ("sparkv", "serve"))   # serve --torch-threads 4 still works

This module imports nothing heavy: the command modules of every layer read
:data:`PRESS_METAVAR` from it while ``sparkv --help`` is built.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

#: the ``--press`` spec: a press name, a budget (kept fraction ``0.2``, percentage ``20%`` or
#: tokens per KV head ``256t``) and an optional question-agnostic window (docs/presses.md)
PRESS_METAVAR = "NAME:RATIO|PCT%|Nt[@repeat]"


@dataclass(frozen=True)
class Renamed:
    """``old`` is now spelled ``new`` in the commands whose path starts with ``scope`` (every
    command when ``scope`` is empty)."""

    new: str
    old: str
    scope: tuple[str, ...] = ()
    why: str = ""


RENAMED: list[Renamed] = [
    Renamed("--threads", "--torch-threads", why="torch threads, in every command"),
    Renamed("--max-new-tokens", "--new-tokens",
            why="answer length in tokens, in every command (transformers' name)"),
    Renamed("--memory-budget-mb", "--budget-mb",
            why="the device service's KV memory budget, MB (ask's is --keep-budget-mb)"),
    Renamed("--memory-budget-fraction", "--budget-fraction",
            why="the same budget as a share, beside --memory-budget-mb"),
    Renamed("--decode-budget", "--ram-budget",
            why="the decode-time KV policy's budget, beside --decode POLICY"),
    Renamed("--decode-budgets", "--budgets", ("sparkv", "bench", "dynakv"),
            why="the decode-time KV policy's budgets compared"),
    Renamed("--time-budget-s", "--budget", ("sparkv", "bench", "predictor"),
            why="a time, in seconds: not a memory budget"),
    Renamed("--encryption-key", "--key",
            why="the frames' encryption key, never to be confused with --api-key"),
    Renamed("--flash-dir", "--swap-dir", ("sparkv", "device", "serve"),
            why="the flash tier's directory, as in bench decode and bench dynakv"),
    Renamed("--out-dir", "--out", ("sparkv", "demo"),
            why="a directory; --out is a file in every other command"),
    Renamed("--sizes", "--tokens", ("sparkv", "bench", "ttft"),
            why="the list of context sizes a benchmark sweeps, as in the other benchmarks"),
    Renamed("--duration-s", "--duration", why="a time, with its unit, like --deadline-s"),
    Renamed("--milp-time-limit-s", "--milp-time-limit",
            why="a time, with its unit, like --deadline-s"),
]


def add_hidden_aliases(parser: argparse.ArgumentParser, path: tuple[str, ...],
                       renamed: list[Renamed] | None = None) -> list[str]:
    """Adds the old spelling of every renamed flag ``parser`` (the command ``path``) has;
    returns the old spellings added."""
    added = []
    for r in RENAMED if renamed is None else renamed:
        if path[:len(r.scope)] != r.scope or r.old in parser._option_string_actions:
            continue
        action = parser._option_string_actions.get(r.new)
        if action is not None:
            add_alias(parser, action, r.old)
            added.append(r.old)
    return added


def add_alias(parser: argparse.ArgumentParser, action: argparse.Action, old: str) -> None:
    """``old`` becomes a second option string of ``action`` itself (so a required flag stays
    satisfied, and a value given either way lands in the same dest), listed in
    ``action.hidden_aliases``: :func:`shown_option_strings` leaves it out of ``--help``."""
    action.option_strings.append(old)
    action.hidden_aliases = (*hidden_aliases(action), old)  # type: ignore[attr-defined]
    parser._option_string_actions[old] = action


def hidden_aliases(action: argparse.Action) -> tuple[str, ...]:
    """The old spellings :func:`add_alias` gave ``action``."""
    return getattr(action, "hidden_aliases", ())


def shown_option_strings(action: argparse.Action) -> list[str]:
    """``action``'s option strings as ``--help`` shows them: without its hidden aliases."""
    hidden = hidden_aliases(action)
    return [s for s in action.option_strings if s not in hidden]


def metavars_follow_names(parser: argparse.ArgumentParser) -> None:
    """An option that keeps an older ``dest`` (``--max-new-tokens`` into ``args.new_tokens``)
    shows its own name in ``--help`` (``MAX_NEW_TOKENS``), not the dest's."""
    for action in parser._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if not longs or action.metavar is not None or action.nargs == 0 or is_hidden(action):
            continue
        name = longs[0][2:].replace("-", "_")
        if name != action.dest:
            action.metavar = name.upper()


def is_hidden(action: argparse.Action) -> bool:
    """Whether ``--help`` leaves ``action`` out (a suppressed option)."""
    return action.help == argparse.SUPPRESS
