"""The codec's one exception type."""

from __future__ import annotations

from sparkv.errors import SparkvError


class CodecError(SparkvError):
    """A frame is malformed (truncated, corrupted, inconsistent, over a limit) or a chunk cannot
    be encoded at the requested level. Every failure of :mod:`sparkv.codec` on bad input is this
    type."""
