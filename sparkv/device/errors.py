"""Errors of the context service, each with the HTTP status the local REST service answers."""

from __future__ import annotations

from sparkv.errors import SparkvError


class DeviceError(SparkvError):
    """A request the context service cannot serve as asked (HTTP 400)."""

    status = 400
    code = "bad_request"


class UnknownContext(DeviceError):
    """No context with this id (never made, or deleted)."""

    status = 404
    code = "unknown_context"


class ContextBusy(DeviceError):
    """The context is locked by a call that is still running."""

    status = 409
    code = "context_busy"


class PromptTooLong(DeviceError):
    """The context plus the prompt plus the answer would exceed the longest context allowed."""

    status = 413
    code = "prompt_too_long"


class BudgetTooSmall(DeviceError):
    """The memory budget cannot hold this context while it runs (its chunks, the working memory
    and the new tokens), even with every other context swapped out."""

    status = 507
    code = "budget_too_small"
