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

    @property
    def headers(self) -> dict[str, str]:
        """The HTTP headers its answer carries (``Retry-After`` for :class:`BudgetBusy`)."""
        return {}


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


class BudgetBusy(DeviceError, status=503, code="budget_busy"):
    """The context fits the budget, but not now: the memory it needs is held by contexts that
    are in use (a running call, a ``locked`` context). Try again after ``retry_after_s``
    (the ``Retry-After`` header)."""

    retry_after_s = 1

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class FlashFull(DeviceError, status=507, code="flash_full"):
    """The flash file system holding the service's flash dir has no room left (``ENOSPC`` or a
    quota): what the request would have kept was not kept, and nothing already kept was lost."""


class FlashInUse(DeviceError, status=409, code="flash_in_use"):
    """Another process holds the flash dir's lock: one service per flash dir."""
