"""HTTP details of chunk responses: ETag matching (RFC 9110 13.1) and single byte ranges (14.1)."""

from __future__ import annotations

from sparkv.server.errors import ApiError


def _tags(header: str) -> list[str]:
    return [t.strip() for t in header.split(",") if t.strip()]


def none_match(if_none_match: str | None, etag: str) -> bool:
    """True when ``If-None-Match`` matches ``etag`` (weak comparison, ``*`` matches)."""
    if not if_none_match:
        return False
    plain = etag.removeprefix("W/")
    for tag in _tags(if_none_match):
        if tag == "*" or tag.removeprefix("W/") == plain:
            return True
    return False


def not_modified_etag(if_none_match: str | None, etag: str) -> str | None:
    """The ETag a 304 should carry when ``If-None-Match`` matches ``etag``, else ``None``.

    The client's own form of the tag is echoed: a ``W/`` tag came from a gzip-compressed 200
    (:class:`~sparkv.server.middleware.GZipMiddleware` weakens the tag of what it compresses), so
    the 304 confirms that weak tag; ``*`` or the strong tag get the strong tag.
    """
    if not if_none_match:
        return None
    plain = etag.removeprefix("W/")
    for tag in _tags(if_none_match):
        if tag == "*":
            return etag
        if tag.removeprefix("W/") == plain:
            return tag
    return None


def if_range_allows(if_range: str | None, etag: str) -> bool:
    """``If-Range``: the range applies only if the validator is this strong ETag (a date or a
    weak tag never matches: the ETag is the only validator these responses carry)."""
    if not if_range:
        return True
    tag = if_range.strip()
    return not tag.startswith("W/") and tag == etag


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The byte range ``[start, end)`` a ``Range`` header asks of a ``size``-byte body.

    Returns ``None`` when the whole body should be sent: no header, another unit, a syntax error,
    or several ranges (allowed by RFC 9110: a server may ignore Range). Raises
    ``ApiError(416)`` when the single range is unsatisfiable.
    """
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or not spec or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash:
        return None
    first, last = first.strip(), last.strip()
    try:
        if first == "":
            if not last.isdigit():
                return None
            n = int(last)
            if n == 0 or size == 0:
                raise _unsatisfiable(size)
            return max(0, size - n), size
        if not first.isdigit() or (last and not last.isdigit()):
            return None
        start = int(first)
        end = int(last) + 1 if last else size
    except ValueError:
        return None
    if last and end <= start:
        return None  # "5-3" is invalid syntax: ignore the header
    if start >= size:
        raise _unsatisfiable(size)
    return start, min(end, size)


def _unsatisfiable(size: int) -> ApiError:
    return ApiError(416, "range_not_satisfiable",
                    f"the requested range is outside the frame's {size} bytes",
                    headers={"Content-Range": f"bytes */{size}"}, size=size)
