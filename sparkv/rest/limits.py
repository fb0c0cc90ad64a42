"""The limits of an HTTP request, shared by both apps (importable without the ``server`` extra:
the CLI's parsers show the defaults)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""A larger request body is 413 ``body_too_large``."""
DEFAULT_BODY_TIMEOUT_S = 10.0
"""A body must be complete this long after its request's headers, else 408 ``body_timeout``."""
DEFAULT_HEADER_TIMEOUT_S = 10.0
"""A request's headers must be complete this long after its first byte (of the connection, for
its first request), else the connection is closed (after a 408 ``header_timeout`` when part of
a request arrived)."""


@dataclass(frozen=True)
class BodyLimits:
    """What a request body may be: at most ``max_body_bytes`` bytes, complete within
    ``body_timeout_s`` seconds of the request's headers."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
