"""The responses the device service keeps, for OpenAI's Responses API
(:mod:`sparkv.asks.responses`): ``GET /v1/responses/{id}``, its input items, and a later
request's ``previous_response_id``, which continues its conversation.

A response is kept for the app that asked it (another app's id is as unknown as one never
made), in the service's memory (and on its flash, below) until the app deletes it or room is
made:
the store holds at most ``max_responses`` responses and ``max_bytes`` bytes (each response
counted with the whole conversation it continues, a safe bound: a conversation's items are
shared by the responses along it). Room is made by evicting the least recently used response of
the app that holds the most (bytes when bytes overflow, responses when the count does), so one
busy app cannot push out a quiet app's conversation. A response bigger than the whole store is
not kept. A response made more than ``ttl_s`` ago (default 30 days, as OpenAI keeps them) is
forgotten: when asked for, when read back, and in a sweep at most once a minute as responses
are kept, so a conversation left on the flash does not stay there for good.

With ``files`` (:class:`~sparkv.asks.respfiles.ResponseFiles`: the service's flash), each kept
response is also a file, written before it is answered (:meth:`ResponseStore.persist`, from a
thread) and removed with it, and :meth:`ResponseStore.load` reads them back at the start.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

__all__ = ["ResponseStore", "StoredResponse", "ResponseFilesLike", "stored_response",
           "DEFAULT_MAX_RESPONSES", "DEFAULT_MAX_MB", "DEFAULT_TTL_S", "SWEEP_S"]

#: the responses kept by default (``sparkv device serve --responses-kept``)
DEFAULT_MAX_RESPONSES = 256
#: the megabytes they hold at most by default (``--responses-kept-mb``)
DEFAULT_MAX_MB = 16.0
#: how long a response is kept at most by default (``--responses-ttl-hours``: 30 days, as
#: OpenAI keeps them)
DEFAULT_TTL_S = 30 * 24 * 3600.0
#: how often a store looks for expired responses when one is kept (s)
SWEEP_S = 60.0


@dataclass(frozen=True)
class StoredResponse:
    """One kept response: the ``response`` object as it was answered, the input ``items`` it
    answered (a previous response's conversation first), each with an id, and its ``output``
    as input items; ``conversation_bytes``: the items' size, ``nbytes``: with the response."""

    response: dict[str, Any]
    items: tuple[Any, ...]
    output: tuple[Any, ...]
    conversation_bytes: int
    nbytes: int

    def conversation(self) -> tuple[Any, ...]:
        """What a response continuing this one comes after: its input, then its output."""
        return self.items + self.output


def stored_response(response: dict[str, Any], items: tuple[Any, ...],
                    output: tuple[Any, ...]) -> StoredResponse:
    """The :class:`StoredResponse` of ``response``, its input ``items`` and its ``output``
    (pydantic items), its bytes counted as their JSON."""
    size = sum(len(i.model_dump_json()) for i in items + output)
    return StoredResponse(response, items, output, size, size + len(json.dumps(response)))


class ResponseFilesLike(Protocol):
    """Where a store's responses are files (:class:`~sparkv.asks.respfiles.ResponseFiles`)."""

    def write(self, app: str, rid: str, kept: StoredResponse) -> bool: ...

    def remove(self, rid: str) -> None: ...

    def read_all(self, max_bytes: int) -> Iterator[tuple[str, str, StoredResponse]]: ...


@dataclass
class _Shelf:
    """One app's kept responses, least recently used first."""

    responses: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    nbytes: int = 0


class ResponseStore:
    """The kept responses of every app, bounded in count and bytes (module docstring)."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES,
                 max_bytes: int = int(DEFAULT_MAX_MB * 1e6),
                 files: ResponseFilesLike | None = None, ttl_s: float | None = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError(f"a store of {max_responses} responses and {max_bytes} bytes")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self.files = files if max_responses > 0 and max_bytes > 0 else None
        self.ttl_s, self.clock = (ttl_s or None), clock
        self._shelves: dict[str, _Shelf] = {}
        self._count = self._bytes = self.evicted = self.too_big = self.expired = 0
        self._swept = float("-inf")
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether any response can be kept."""
        return self.max_responses > 0 and self.max_bytes > 0

    def persist(self, caller: str, rid: str, kept: StoredResponse) -> bool:
        """Writes ``kept``'s file (blocking: call it from a thread before :meth:`put`);
        ``False`` when there are no files, it cannot fit, or the write failed."""
        if self.files is None or kept.nbytes > self.max_bytes:
            return False
        return self.files.write(caller, rid, kept)

    def load(self) -> int:
        """Reads the files back (oldest first, within the bounds); returns how many were
        kept."""
        if self.files is None:
            return 0
        for caller, rid, kept in self.files.read_all(self.max_bytes):
            self.put(caller, rid, kept)
        return self.stats()["responses"]

    def put(self, caller: str, rid: str, kept: StoredResponse) -> bool:
        """Keeps ``kept`` as ``caller``'s response ``rid``; ``False`` when it cannot fit."""
        if not self.enabled:
            return False
        with self._lock:
            self._sweep()
            if self._expired(kept):                 # read back past its time
                self.expired += 1
                self._unlink(rid)
                return False
            if kept.nbytes > self.max_bytes:
                self.too_big += 1
                self._unlink(rid)
                return False
            self._drop(caller, rid)
            shelf = self._shelves.setdefault(caller, _Shelf())
            shelf.responses[rid] = kept
            shelf.nbytes += kept.nbytes
            self._count += 1
            self._bytes += kept.nbytes
            self._make_room()
        return True

    def get(self, caller: str, rid: str) -> StoredResponse | None:
        """``caller``'s response ``rid`` (``None``: none such, or another app's)."""
        with self._lock:
            shelf = self._shelves.get(caller)
            kept = shelf.responses.get(rid) if shelf else None
            if shelf is None or kept is None:
                return None
            if self._expired(kept):
                self._forget(caller, rid)
                return None
            shelf.responses.move_to_end(rid)
            return kept

    def delete(self, caller: str, rid: str) -> bool:
        """Forgets ``caller``'s response ``rid``; ``False`` when there was none."""
        with self._lock:
            if self._drop(caller, rid) is None:
                return False
            self._unlink(rid)
            return True

    def stats(self) -> dict[str, int]:
        """How many responses are kept, their bytes, and how many were evicted or too big."""
        with self._lock:
            return {"responses": self._count, "bytes": self._bytes, "evicted": self.evicted,
                    "too_big": self.too_big, "expired": self.expired,
                    "apps": len(self._shelves)}

    def _drop(self, caller: str, rid: str) -> StoredResponse | None:
        """Takes ``caller``'s response ``rid`` out of memory (its file stays)."""
        shelf = self._shelves.get(caller)
        kept = shelf.responses.pop(rid, None) if shelf else None
        if shelf is None or kept is None:
            return None
        shelf.nbytes -= kept.nbytes
        self._count -= 1
        self._bytes -= kept.nbytes
        if not shelf.responses:
            del self._shelves[caller]
        return kept

    def _expired(self, kept: StoredResponse) -> bool:
        """Whether ``kept`` was made more than the time to live ago."""
        made = kept.response.get("created_at")
        return (self.ttl_s is not None and isinstance(made, (int, float))
                and self.clock() - made > self.ttl_s)

    def _forget(self, caller: str, rid: str) -> None:
        """Drops an expired response, its file too."""
        self._drop(caller, rid)
        self._unlink(rid)
        self.expired += 1

    def _sweep(self) -> None:
        """Forgets the expired responses, at most once every :data:`SWEEP_S`."""
        now = self.clock()
        if self.ttl_s is None or now - self._swept < SWEEP_S:
            return
        self._swept = now
        for caller, shelf in list(self._shelves.items()):
            for rid in [r for r, kept in shelf.responses.items() if self._expired(kept)]:
                self._forget(caller, rid)

    def _unlink(self, rid: str) -> None:
        if self.files is not None:
            self.files.remove(rid)

    def _make_room(self) -> None:
        while self._bytes > self.max_bytes or self._count > self.max_responses:
            by_bytes = self._bytes > self.max_bytes
            caller = max(self._shelves, key=lambda c: (self._shelves[c].nbytes if by_bytes
                                                      else len(self._shelves[c].responses)))
            oldest = next(iter(self._shelves[caller].responses))
            self._drop(caller, oldest)
            self._unlink(oldest)
            self.evicted += 1
