"""Errors of the context service, each with the HTTP status the local REST service answers."""

from __future__ import annotations

from typing import Any

from sparkv.errors import SparkvError


class DeviceError(SparkvError):
    """A request the context service cannot serve as asked (HTTP 400).

    A subclass names its status and code in its class line:
    ``class UnknownContext(DeviceError, status=404, code="unknown_context")``.
    """

    status = 400
    code = "bad_request"

    def __init_subclass__(cls, *, status: int, code: str, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        cls.status = status
        cls.code = code


class UnknownContext(DeviceError, status=404, code="unknown_context"):
    """No context with this id (never made, or deleted)."""


class ContextBusy(DeviceError, status=409, code="context_busy"):
    """The context is locked by a call that is still running."""


class PromptTooLong(DeviceError, status=413, code="prompt_too_long"):
    """The context plus the prompt plus the answer would exceed the longest context allowed."""


class BudgetTooSmall(DeviceError, status=507, code="budget_too_small"):
    """The memory budget cannot hold this context while it runs (its chunks, the working memory
    and the new tokens), even with every other context swapped out."""


class ContextDamaged(DeviceError, status=409, code="context_damaged"):
    """The context could not be reopened (its journal record or its files are damaged): it takes
    no call; deleting it removes what is left of it."""
