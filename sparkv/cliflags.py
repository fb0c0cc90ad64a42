"""What every command's parser shares and that must import nothing heavy.

The command modules of every layer read :data:`PRESS_METAVAR` from here while ``sparkv --help``
is built; :mod:`sparkv.clidoc` asks :func:`is_hidden` which options the page leaves out. Every
option is stored under its own name (``--encryption-key`` into ``args.encryption_key``):
``tests/test_cli.py`` fails on an option whose ``dest`` differs from its flag.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable

#: the ``--press`` spec: a press name, a budget (kept fraction ``0.2``, percentage ``20%`` or
#: tokens per KV head ``256t``) and an optional question-agnostic window (docs/presses.md)
PRESS_METAVAR = "NAME:RATIO|PCT%|Nt[@repeat]"


def is_hidden(action: argparse.Action) -> bool:
    """Whether ``--help`` leaves ``action`` out (a suppressed option)."""
    return action.help == argparse.SUPPRESS


#: ``ask``/``demo``/``device ask --strategy``: the edge's strategies (the keys of
#: :data:`sparkv.edge.planning.STRATEGIES`, kept equal by tests/test_cli.py)
STRATEGY_NAMES: tuple[str, ...] = ("hybrid", "local", "sparkv", "stream")

#: ``--trace NAME``: the bundled link traces (the keys of
#: :data:`sparkv.scheduler.trace.SAMPLE_TRACES`, kept equal by tests/test_cli.py)
TRACE_NAMES: tuple[str, ...] = ("wifi", "lte", "deep-fade", "fade-start")


def add_device_args(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` on a command that runs the model."""
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda[:N] or auto (CUDA when available)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bf16 on CUDA; on the CPU a bf16 configuration with "
                             "AVX512-BF16/AMX where the model's quality table passes it, else "
                             "fp32), float32 (forces fp32), bfloat16, float16, or a compute "
                             "configuration: mixed, mixed-attn, mixed-mlp, mixed-layers, "
                             "bf16-weights, int8, int4, int4-kernel, int4-decode, "
                             "mixed-mlp-int4-decode (docs/dtypes.md)")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-p``, ``--top-k``, ``--seed``, the penalties, ``--logit-bias``
    and the answer's JSON form on a command that answers
    (:class:`sparkv.runtime.sampling.Sampling`; the defaults are greedy, any text)."""
    parser.add_argument("--temperature", type=_in_range(0.0, 2.0), default=0.0,
                        help="0: greedy (each token the most likely, what the quality tables "
                             "measure); else the answer is sampled at this temperature (<= 2)")
    parser.add_argument("--top-p", type=_in_range(0.0, 1.0), default=1.0,
                        help="sampling: draw from the most likely tokens whose probability "
                             "reaches this")
    parser.add_argument("--top-k", type=non_negative_int, default=0,
                        help="sampling: draw from this many most likely tokens (0: all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling: the draws' seed, for a repeatable answer (default: one "
                             "drawn and reported)")
    parser.add_argument("--frequency-penalty", type=_in_range(-2.0, 2.0), default=0.0,
                        help="taken off a token's logit once per time the answer holds it")
    parser.add_argument("--presence-penalty", type=_in_range(-2.0, 2.0), default=0.0,
                        help="taken off a token's logit once the answer holds it")
    parser.add_argument("--logit-bias", type=logit_bias_pair, action="append", default=[],
                        metavar="ID=BIAS",
                        help="add BIAS (-100..100; -100: never) to token ID's logit; repeat "
                             "for more tokens")
    form = parser.add_mutually_exclusive_group()
    form.add_argument("--json-object", action="store_true",
                      help="the answer is a JSON object (OpenAI's json_object response format)")
    form.add_argument("--json-schema", type=json_schema_file, metavar="FILE", default=None,
                      help="the answer is JSON following this JSON Schema (a file, - for "
                           "stdin; its top level an object; docs/asks.md, 'JSON answers')")


def sampling_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags' values, as the ask's and the call's fields take them (the form
    apart: :func:`response_format`)."""
    bias = dict(args.logit_bias)
    if len(bias) != len(args.logit_bias):
        from sparkv.errors import SparkvError

        raise SparkvError("--logit-bias names a token twice")
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "seed": args.seed, "frequency_penalty": args.frequency_penalty,
            "presence_penalty": args.presence_penalty, "logit_bias": bias}


def logit_bias_pair(text: str) -> tuple[int, float]:
    """``ID=BIAS``: a token id and the bias added to its logit (-100..100)."""
    tid, eq, bias = text.partition("=")
    if not eq:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=BIAS (a token id, = and a bias)")
    return (_checked(tid, int, lambda v: v >= 0, "a token id (a whole number >= 0)"),
            _checked(bias, float, lambda v: -100 <= v <= 100, "a bias in [-100, 100]"))


def response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """The answer's format the sampling flags give, as OpenAI's ``response_format`` (``None``:
    any text)."""
    if getattr(args, "json_schema", None) is not None:
        return {"type": "json_schema", "json_schema": {"name": "cli", "schema": args.json_schema}}
    if getattr(args, "json_object", False):
        return {"type": "json_object"}
    return None


def json_schema_file(path: str) -> dict[str, Any]:
    """A JSON Schema read from a file (``-``: stdin): a JSON object."""
    import json
    import sys

    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
        schema = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{path}: a JSON Schema is a JSON object")
    return schema


# ---- argparse types: a bad value is a usage error (one line, exit 2) before anything loads ----
CONTEXT_ID = re.compile(r"[0-9a-f]{32}")
#: what the device service's ask schema accepts too: http(s), an ASCII host (an IDN in its
#: punycode form), an optional path
SERVER_URL = re.compile(r"https?://[A-Za-z0-9._~%:@\[\]-]+(/[A-Za-z0-9._~%!$&'()*+,;=:@/-]*)?")


def context_id(text: str) -> str:
    """A server context's id: 32 lowercase hex digits (as ``sparkv context list`` prints)."""
    if not CONTEXT_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a context id (32 lowercase hex "
                                         "digits, as `sparkv context list` prints them)")
    return text


def context_name(text: str) -> str:
    """A context's label: 1-100 characters, none a control character (the server's rule)."""
    if not 1 <= len(text) <= 100 or any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise argparse.ArgumentTypeError(f"{text[:120]!r} is not a context name (1-100 "
                                         "characters, no control character)")
    return text


def server_url(text: str) -> str:
    """A server's URL: ``http://`` or ``https://``, an ASCII host, an optional port and path."""
    if len(text) > 2048 or not SERVER_URL.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a server URL (e.g. "
                                         "http://127.0.0.1:8080)")
    return text.rstrip("/")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _checked(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _checked(text, float, lambda v: 0 < v < float("inf"), "a positive number")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _checked(text, float, lambda v: 0 <= v < float("inf"), "a number >= 0")


def non_negative_int(text: str) -> int:
    """A whole number >= 0."""
    return _checked(text, int, lambda v: v >= 0, "a whole number >= 0")


def _in_range(lo: float, hi: float) -> Callable[[str], float]:
    """The type of a number in ``[lo, hi]``."""
    def parse(text: str) -> float:
        return _checked(text, float, lambda v: lo <= v <= hi, f"a number in [{lo:g}, {hi:g}]")
    parse.__name__ = f"number in [{lo:g}, {hi:g}]"
    return parse


def _checked(text: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], what: str) -> Any:
    """``cast(text)`` if ``ok`` holds for it; else argparse's error, ``text`` "is not" ``what``
    (or not a number at all)."""
    try:
        value = cast(text)
    except ValueError:
        kind = "an integer" if cast is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value
