"""``POST /v1/contexts/{id}/stream`` requests: the JSON body parsed and validated, then turned into
a plan (frames, sizes, total bytes) under the server's limits.

Both steps are CPU work proportional to the items (up to ``max_stream_items``, 65,536 by default:
a 1.7 MB body) and run in a worker thread (``anyio.to_thread``), never on the event loop. A fast
path checks the common shape (plain ints, known level names) in one pass; anything else goes
through the pydantic model :class:`~sparkv.server.schemas.StreamRequest`, which accepts the same
documents and words the errors (422 ``invalid_request``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sparkv.extras import SERVER_MODULES, require_all

require_all(SERVER_MODULES, feature="the REST server (sparkv.server.stream_request)")

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from sparkv.codec import DEFAULT_LEVEL
from sparkv.protocol.stream import stream_length
from sparkv.server import schemas
from sparkv.server.deps import chunk_entry
from sparkv.server.errors import ApiError
from sparkv.server.state import ParsedManifest
from sparkv.server.stores import ChunkKey

Item = tuple[int, int, int, str]
"""``(t, l, g, level)`` of one requested frame (the request's level filled in)."""
Batch = list[tuple[ChunkKey, int]]
"""Consecutive frames of a stream read from the store in one call, with their sizes."""

_TOP_KEYS = frozenset({"chunks", "level"})
_ITEM_KEYS = frozenset({"t", "l", "g", "level"})


@dataclass(frozen=True)
class ResponseCap:
    """How large a stream response may be: at most ``max_bytes`` (``max_stream_bytes``), and at
    most ``amplification`` bytes per byte of the request body (``max_stream_amplification``),
    though always one frame, so that a small request cannot ask for a large response (items may
    repeat)."""

    max_bytes: int
    amplification: int

    def check(self, total: int, body_bytes: int, largest: int) -> None:
        """Raises 413 ``response_too_large`` when a ``total``-byte response (whose largest
        record is ``largest`` bytes) to a ``body_bytes``-byte request is over either cap."""
        if total > self.max_bytes:
            raise ApiError(413, "response_too_large",
                           f"the requested frames make a {total}-byte response; this server "
                           f"sends at most {self.max_bytes} bytes per stream request (split it)",
                           limit=self.max_bytes, bytes=total)
        limit = max(self.amplification * body_bytes, largest)
        if total > limit:
            raise ApiError(413, "response_too_large",
                           f"the requested frames make a {total}-byte response to a "
                           f"{body_bytes}-byte request; this server sends at most "
                           f"{self.amplification} bytes per byte of request (and always one "
                           "frame): name fewer frames, or each frame once",
                           limit=limit, bytes=total)


@dataclass(frozen=True)
class StreamPlan:
    """The frames of one stream response, in order, with their stored sizes, cut into the
    batches the response reads."""

    batches: list[Batch]
    num_frames: int
    total_bytes: int
    """The response's exact ``Content-Length`` (4-byte prefixes included)."""


def batches(frames: list[tuple[ChunkKey, int]], limit: int) -> list[Batch]:
    """``frames`` cut into consecutive batches of at most ``limit`` bytes (a larger frame is a
    batch of its own)."""
    out: list[Batch] = [[]]
    size = 0
    for item in frames:
        if out[-1] and size + item[1] > limit:
            out.append([])
            size = 0
        out[-1].append(item)
        size += item[1]
    return out


def malformed_json(exc: Exception) -> ApiError:
    """400 ``malformed_json`` for a body that is not JSON (the parser's reason in the message)."""
    return ApiError(400, "malformed_json", f"the request body is not valid JSON: {exc}")


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/*+json`` (parameters ignored)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/")
                                            and media.endswith("+json"))


def _schema_error(loc: tuple[Any, ...], msg: str, type_: str) -> RequestValidationError:
    return RequestValidationError([{"loc": loc, "msg": msg, "type": type_}])


def _fast_items(doc: Any) -> list[Item] | None:
    """The items of a well-formed request in its common shape, else ``None`` (then pydantic
    decides). Accepts only what :class:`~sparkv.server.schemas.StreamRequest` accepts, with the
    same result."""
    if type(doc) is not dict or not doc.keys() <= _TOP_KEYS:
        return None
    chunks = doc.get("chunks")
    default = doc.get("level", DEFAULT_LEVEL)
    if type(chunks) is not list or not chunks or type(default) is not str \
            or default not in schemas.LEVEL_NAMES:
        return None
    top = schemas.MAX_INDEX
    levels = schemas.LEVEL_NAMES
    out: list[Item] = []
    append = out.append
    for it in chunks:
        if type(it) is not dict or not it.keys() <= _ITEM_KEYS:
            return None
        t = it.get("t")
        l = it.get("l")  # noqa: E741
        g = it.get("g", 0)
        if type(t) is not int or type(l) is not int or type(g) is not int \
                or not (0 <= t <= top and 0 <= l <= top and 0 <= g <= top):
            return None
        lv = it.get("level")
        if lv is None:
            lv = default
        elif type(lv) is not str or lv not in levels:
            return None
        append((t, l, g, lv))
    return out


def parse_stream_request(body: bytes, content_type: str | None, max_items: int) -> list[Item]:
    """The requested frames of a stream request body, in order (runs in a worker thread).

    Raises:
        ApiError: 400 ``malformed_json`` (not JSON), 400 ``too_many_items`` (over
            ``max_items``: checked before the items are validated).
        RequestValidationError: the body does not match the schema (rendered as 422
            ``invalid_request`` with ``details``).
    """
    if not body:
        raise _schema_error(("body",), "Field required", "missing")
    if not is_json_media_type(content_type):
        raise _schema_error(("body",), "the body must be sent as application/json",
                            "content_type")
    try:
        doc = json.loads(body)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        raise malformed_json(exc) from None
    except RecursionError:  # e.g. 60 KB of "[": nested deeper than the parser recurses
        raise malformed_json(ValueError("arrays or objects nested too deeply")) from None
    if isinstance(doc, dict) and isinstance(doc.get("chunks"), list) \
            and len(doc["chunks"]) > max_items:
        raise ApiError(400, "too_many_items", f"{len(doc['chunks'])} items; at most "
                       f"{max_items} per stream request", limit=max_items)
    items = _fast_items(doc)
    if items is not None:
        return items
    try:
        req = schemas.StreamRequest.model_validate(doc)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors()]
        raise RequestValidationError(errors) from None
    return [(it.t, it.l, it.g, it.level or req.level) for it in req.chunks]


def build_plan(parsed: ParsedManifest, items: list[Item], cap: ResponseCap, body_bytes: int,
               batch_bytes: int) -> StreamPlan:
    """The frames and sizes of ``items`` (from a ``body_bytes``-byte request) in ``parsed``, in
    batches of about ``batch_bytes`` (runs in a worker thread).

    Raises:
        ApiError: 404 naming the first item this context does not have (``chunk_out_of_range``,
            ``level_not_available``, with its ``index``: the status ``GET .../chunks/...`` gives
            the same chunk); 413 ``response_too_large`` when the
            response would be larger than ``cap`` allows.
    """
    index = parsed.index
    frames: list[tuple[ChunkKey, int]] = []
    append = frames.append
    for i, (t, l, g, lv) in enumerate(items):  # noqa: E741
        entry = index.get((t, l, g, lv))
        if entry is None:
            try:
                entry = chunk_entry(parsed, t, l, g, lv)
            except ApiError as exc:
                raise ApiError(404, exc.code, f"chunks[{i}]: {exc.message}", index=i,
                               **exc.details) from None
        append((ChunkKey(t, l, g, lv), entry.size))
    total = stream_length(size for _, size in frames)
    cap.check(total, body_bytes, stream_length([max(size for _, size in frames)]))
    return StreamPlan(batches(frames, batch_bytes), len(frames), total)
