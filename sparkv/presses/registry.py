"""The press registry: one name per press class, and ``NAME:BUDGET`` specs (``adakv:0.2``,
``snapkv:20%``, ``dynamickv:256t``) as ``sparkv ask --press`` and the benchmark take them."""

from __future__ import annotations

from typing import Any, Callable

from sparkv.presses.adakv import AdaKVPress, AdaPyramidPress
from sparkv.presses.base import Budget, Press, PressError
from sparkv.presses.baselines import RandomPress, StreamingLLMPress
from sparkv.presses.dynamickv import DynamicKVPress
from sparkv.presses.knorm import KnormPress
from sparkv.presses.snapkv import PyramidKVPress, SnapKVPress

PRESSES: dict[str, Callable[..., Press]] = {
    "snapkv": SnapKVPress,
    "pyramidkv": PyramidKVPress,
    "dynamickv": DynamicKVPress,
    "adakv": AdaKVPress,                              # Ada-SnapKV
    "adapyramid": AdaPyramidPress,
    "ada-dynamickv": lambda **kw: AdaKVPress(DynamicKVPress(**kw)),
    "random": RandomPress,
    "streamingllm": StreamingLLMPress,
    "knorm": KnormPress,
}
"""Every press by name (one line per press)."""


def make_press(name: str, **kwargs: Any) -> Press:
    """The press called ``name`` (see :data:`PRESSES`), built with ``kwargs``."""
    key = str(name).strip().lower()
    if key not in PRESSES:
        raise PressError(f"unknown press {name!r}; known: {', '.join(PRESSES)}")
    try:
        return PRESSES[key](**kwargs)
    except TypeError as e:
        raise PressError(f"press {name!r}: {e}") from None


def parse_press(spec: str) -> tuple[Press, Budget]:
    """``"NAME:BUDGET[@WINDOW]"`` -> the press and its budget (``BUDGET``: a kept ratio ``0.2``, a
    percentage ``20%`` or tokens per head ``256t``): every spec the server and ``sparkv ask
    --press`` take. A window (``@repeat``) is checked, then left out: :func:`split_spec` returns
    it too."""
    press, budget, _ = split_spec(spec)
    return press, budget


PROBES: dict[str, str] = {"repeat": "Repeat the text above."}
"""Fixed probe questions a server may use as a question-agnostic window (``NAME:BUDGET@repeat``):
known before any question, the same for every context (KVzip's context-reconstruction idea)."""

WINDOWS = ("end", *PROBES)
"""Question-agnostic windows: ``end`` (the context's last tokens, kept by every head; the
default) or a probe of :data:`PROBES` (run after the context, nothing forced)."""


def split_spec(spec: str) -> tuple[Press, Budget, str]:
    """``"NAME:BUDGET[@WINDOW]"`` -> the press, its budget and the window name (``end`` when
    none is given; see :data:`WINDOWS`)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise PressError(f"a press spec is NAME:BUDGET[@WINDOW] (e.g. adakv:0.2), got {spec!r}")
    base, _, window = spec.partition("@")
    name, _, budget_text = base.partition(":")
    press, budget = make_press(name), Budget.parse(budget_text)
    window = window.strip().lower() or "end"
    if window not in WINDOWS:
        raise PressError(f"unknown window {window!r}; known: {', '.join(WINDOWS)}")
    return press, budget, window


def canonical_spec(spec: str) -> str:
    """The one spelling of a press spec (``"AdaKV:50%"`` -> ``"adakv:0.5"``,
    ``"snapkv:0.2@Repeat"`` -> ``"snapkv:0.2@repeat"``; the default window ``end`` is not
    written): what a server's context id and manifest name. Raises :class:`PressError`."""
    _, budget, window = split_spec(spec)
    name = spec.partition(":")[0].strip().lower()
    return f"{name}:{budget}" + ("" if window == "end" else f"@{window}")
