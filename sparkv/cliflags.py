"""What every command's parser shares and that must import nothing heavy.

The command modules of every layer read :data:`PRESS_METAVAR` from here while ``sparkv --help``
is built; :mod:`sparkv.clidoc` asks :func:`is_hidden` which options the page leaves out. Every
option is stored under its own name (``--encryption-key`` into ``args.encryption_key``):
``tests/test_cli.py`` fails on an option whose ``dest`` differs from its flag.
"""

from __future__ import annotations

import argparse

#: the ``--press`` spec: a press name, a budget (kept fraction ``0.2``, percentage ``20%`` or
#: tokens per KV head ``256t``) and an optional question-agnostic window (docs/presses.md)
PRESS_METAVAR = "NAME:RATIO|PCT%|Nt[@repeat]"


def is_hidden(action: argparse.Action) -> bool:
    """Whether ``--help`` leaves ``action`` out (a suppressed option)."""
    return action.help == argparse.SUPPRESS
