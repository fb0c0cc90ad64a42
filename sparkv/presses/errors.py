"""The presses' one exception type."""

from sparkv.errors import SparkvError


class PressError(SparkvError, ValueError):
    """A press, a budget or a press spec that does not fit (bad name, ratio, token count)."""
