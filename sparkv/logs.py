"""The one logging setup of the ``sparkv`` command (docs/cli.md, "Output").

Modules log through ``logging.getLogger("sparkv.<module>")``; only an entry point configures
what is shown, with :func:`setup_logging`:

=========  ===========  ==========================================================
verbosity  sparkv level  shown
=========  ===========  ==========================================================
``-q``     WARNING      answers, tables, progress bars, warnings and errors
(none)     INFO         the above and one-line notes (loading, listening, wrote X)
``-v``     DEBUG        the above, debug lines, and transformers' own warnings
=========  ===========  ==========================================================

Answers and tables are printed to stdout and never go through logging; notes go to stderr.
Progress bars (tqdm) stay unless ``--no-progress`` (:func:`disable_progress_bars`). Used as a
library, sparkv configures nothing: its notes stay silent and its warnings reach Python's
last-resort handler.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Callable, TextIO

LOGGER = "sparkv"

PLAIN = "%(message)s"
"""Interactive commands: the note as it is."""
STAMPED = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Long-running services (``serve``, ``worker``): timestamped, with the logger's name."""

_LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (a test's capture, a
    redirected stream), not the one it was created with."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler.__init__ assigns it
        pass


def level_for(verbosity: int) -> int:
    """``-q`` (-1) -> WARNING, default (0) -> INFO, ``-v`` (1 or more) -> DEBUG."""
    return _LEVELS[max(-1, min(1, verbosity))]


def setup_logging(verbosity: int = 0, level: str | int | None = None,
                  fmt: str = PLAIN) -> None:
    """Shows sparkv's log records at ``level`` (a name such as ``"info"``, or a number; from
    ``verbosity`` when ``None``) on stderr, once: a second call replaces the first's handler.
    Other libraries' records (uvicorn, httpx) are shown at WARNING and above; transformers'
    warnings only with ``-v`` (sparkv passes it nothing deprecated: sparkv.runtime.hfcache)."""
    if level is None:
        lvl = level_for(verbosity)
    elif isinstance(level, str):
        lvl = logging.getLevelName(level.upper())
        if not isinstance(lvl, int):
            raise ValueError(f"unknown log level {level!r}")
    else:
        lvl = level
    logger = logging.getLogger(LOGGER)
    for h in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(h)
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(lvl)
    logger.propagate = False
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "info" if verbosity > 0 else "error")


def disable_progress_bars() -> None:
    """No progress bar from tqdm's defaults, transformers or huggingface_hub in this process
    (``--no-progress``)."""
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


#: seconds between a bar's redraws when stderr is not a terminal (a pipe, a log file): a
#: two-minute run writes a few lines, not one per update
PIPED_BAR_INTERVAL_S = 30.0


def progress_bar(iterable: Any = None, **kwargs: Any) -> Any:
    """A tqdm progress bar on stderr, as every sparkv command draws one: none after
    ``--no-progress`` (:func:`disable_progress_bars`; read here, whenever tqdm was imported) or with
    ``disable=True``; redrawn at most every :data:`PIPED_BAR_INTERVAL_S` into a pipe or a log."""
    from tqdm import tqdm

    kwargs.setdefault("file", sys.stderr)
    disable = kwargs.pop("disable", False)
    kwargs["disable"] = bool(disable) or bars_disabled()
    stream = kwargs["file"]
    if not (hasattr(stream, "isatty") and stream.isatty()):
        kwargs.setdefault("mininterval", PIPED_BAR_INTERVAL_S)
        kwargs.setdefault("maxinterval", max(PIPED_BAR_INTERVAL_S, kwargs["mininterval"]))
    return tqdm(iterable, **kwargs)


def phase_progress(bar: Any) -> Callable[[str, int, int], None]:
    """A ``progress(phase, done, total)`` callback drawing on ``bar`` (one of
    :func:`progress_bar`): the phase is the bar's description, ``total`` may change between
    phases. A disabled bar (``--no-progress``) draws nothing and keeps none of tqdm's state."""

    shown = [getattr(bar, "desc", None)]

    def progress(phase: str, done: int, total: int) -> None:
        if bar.disable:
            return
        if bar.total != total:
            bar.total = total
        if shown[0] != phase:  # tqdm keeps the description as "phase: "
            bar.set_description(phase, refresh=False)
            shown[0] = phase
        bar.update(done - bar.n)  # tqdm rate-limits the redraws

    return progress


def bars_disabled() -> bool:
    """Whether progress bars are off in this process (``--no-progress``, ``TQDM_DISABLE``)."""
    return os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes")
