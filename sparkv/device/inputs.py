"""The checks every input of the context service passes before it reaches the model: token ids
within the model's vocabulary, text that is valid Unicode, a finite and bounded lock timeout.

A failed check is a :class:`~sparkv.device.errors.DeviceError` (HTTP 400) naming what is wrong;
the HTTP app's schemas (:mod:`sparkv.device.schemas`) run :func:`text_problem` and the timeout
bounds first, so a bad body is a 422 before the service sees it. Never a 500: an id past the
embedding table, ``timeout_s=1e308`` (past what a lock can wait) or a lone surrogate (which no
tokenizer encodes) used to reach the model or the lock and fail there.

No state, no locks (functions).
"""

from __future__ import annotations

import math
import operator
import threading
from typing import TYPE_CHECKING, Any, Sequence

from sparkv.device.errors import DeviceError, PromptTooLong

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

#: the longest a call may wait for a busy context's lock (seconds; ``None`` waits for ever)
MAX_TIMEOUT_S = 86400.0


def vocab_size(lm: LoadedModel) -> int:
    """The number of token ids ``lm`` can embed (its input embedding's rows)."""
    emb = lm.model.get_input_embeddings() if hasattr(lm.model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    return int(rows if rows is not None else lm.config.vocab_size)


def check_token_ids(ids: Sequence[Any], vocab: int, what: str = "token ids") -> list[int]:
    """``ids`` as a list of ints, each in ``[0, vocab)``; :class:`DeviceError` otherwise."""
    try:
        out = [operator.index(x) for x in ids]
    except TypeError as e:
        raise DeviceError(f"{what} must be integers") from e
    for i, x in enumerate(out):
        if not 0 <= x < vocab:
            raise DeviceError(f"{what}[{i}] = {x} is not a token id of this model "
                              f"(0 to {vocab - 1})")
    return out


def text_problem(text: str) -> str | None:
    """What makes ``text`` unusable as a prompt (a lone surrogate: not encodable as UTF-8),
    or ``None``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode (a lone surrogate at character {e.start})"
    return None


def check_text(text: str | None, what: str = "the prompt") -> None:
    """:class:`DeviceError` if ``text`` is not valid Unicode (:func:`text_problem`)."""
    problem = text_problem(text) if text is not None else None
    if problem is not None:
        raise DeviceError(f"{what} {problem}")


def check_timeout(timeout_s: float | None) -> float | None:
    """A lock timeout: ``None`` (wait), or a finite number of seconds in
    ``[0, MAX_TIMEOUT_S]``; :class:`DeviceError` otherwise."""
    if timeout_s is None:
        return None
    try:
        t = float(timeout_s)
    except (TypeError, ValueError, OverflowError):
        t = math.nan
    if not math.isfinite(t) or not 0.0 <= t <= min(MAX_TIMEOUT_S, threading.TIMEOUT_MAX):
        raise DeviceError(f"timeout_s must be a number of seconds from 0 to {MAX_TIMEOUT_S:g} "
                          f"(or none, to wait), not {timeout_s!r}")
    return t


def check_call(prompt: str | None, prompt_ids: Sequence[Any] | None, max_new_tokens: int,
               timeout_s: float | None, *, vocab: int, most: int
               ) -> tuple[list[int] | None, float | None]:
    """A call's arguments checked: ``prompt`` valid Unicode, ``prompt_ids`` token ids of the
    model (returned as ints), ``max_new_tokens`` in ``[0, most]``, the lock timeout
    (:func:`check_timeout`, returned as a float); :class:`DeviceError` otherwise."""
    if max_new_tokens < 0 or max_new_tokens > most:
        raise DeviceError(f"max_new_tokens must be in [0, {most}]")
    check_text(prompt)
    ids = check_token_ids(prompt_ids, vocab, "prompt_ids") if prompt_ids is not None else None
    return ids, check_timeout(timeout_s)


def check_length(held: int, more: int, longest: int, what: str) -> None:
    """:class:`PromptTooLong` if ``what``, holding ``held`` tokens, would exceed the longest
    context allowed (``longest`` tokens) with ``more``."""
    if held + more > longest:
        raise PromptTooLong(f"{what} would hold {held + more} tokens; contexts hold at most "
                            f"{longest}")
