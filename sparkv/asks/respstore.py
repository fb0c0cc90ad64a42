"""The responses the device service keeps, for OpenAI's Responses API
(:mod:`sparkv.asks.responses`): ``GET /v1/responses/{id}``, its input items, and a later
request's ``previous_response_id``, which continues its conversation.

A response is kept for the app that asked it (another app's id is as unknown as one never
made), in the service's memory (and on its flash, below) until the app deletes it or room is
made. **A conversation is held once:** each response holds only the items its own request added
and its output, and a link to the response it continued (:attr:`StoredResponse.earlier`), so a
conversation of n turns costs its n turns' bytes, not n whole conversations. A response that is
deleted, or past its time, while later kept responses continue it is *held*: no longer found by
its id, it stays (its bytes counted) until the last response continuing it goes.

The store holds at most ``max_responses`` responses (held ones too) and ``max_bytes`` bytes.
Room is made from the app that holds the most (bytes when bytes overflow, responses when the
count does), so one busy app cannot push out a quiet app's conversation: its least recently used
response that no other continues is evicted (a conversation's last turn before its earlier ones,
so every eviction frees bytes and no kept response loses its conversation). A response bigger
than the whole store is not kept. A response made more than ``ttl_s`` ago (default 30 days, as
OpenAI keeps them) is forgotten: when asked for, when read back, and in a sweep at most once a
minute as responses are kept, so a conversation left on the flash does not stay there for good.

With ``files`` (:class:`~sparkv.asks.respfiles.ResponseFiles`: the service's flash), each kept
response is also a file, written before it is answered (:meth:`ResponseStore.persist`, from a
thread, after :meth:`ResponseStore.put`), held or removed with it, and
:meth:`ResponseStore.load` reads them back at the start, each linked to the one it continues.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, NamedTuple, Protocol

log = logging.getLogger("sparkv.asks")

__all__ = ["ResponseStore", "StoredResponse", "ResponseFilesLike", "KeptFile",
           "stored_response", "DEFAULT_MAX_RESPONSES", "DEFAULT_MAX_MB", "DEFAULT_TTL_S",
           "SWEEP_S"]

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
    """One kept response: the ``response`` object as it was answered, the input ``items`` its
    own request added (each with an id), its ``output`` as input items, ``nbytes``: their size
    with the response's, and ``earlier``: the kept response it continued (``None``: none)."""

    response: dict[str, Any]
    items: tuple[Any, ...]
    output: tuple[Any, ...]
    nbytes: int
    earlier: StoredResponse | None = field(default=None, repr=False, compare=False)

    @property
    def previous_id(self) -> str | None:
        """The id of the response it continued (``None``: none)."""
        return self.earlier.response.get("id") if self.earlier is not None else None

    def chain(self) -> list[StoredResponse]:
        """The responses of its conversation, the first first, this one last."""
        out: list[StoredResponse] = []
        r: StoredResponse | None = self
        while r is not None:
            out.append(r)
            r = r.earlier
        out.reverse()
        return out

    def input_items(self) -> tuple[Any, ...]:
        """The input it answered: the conversation it continued, then its own items."""
        out: list[Any] = []
        for r in self.chain():
            out += r.items
            if r is not self:
                out += r.output
        return tuple(out)

    def conversation(self) -> tuple[Any, ...]:
        """What a response continuing this one comes after: its input, then its output."""
        return self.input_items() + self.output

    def flattened(self) -> StoredResponse:
        """This response holding its whole conversation itself, continuing none."""
        return stored_response(self.response, self.input_items(), self.output)


def stored_response(response: dict[str, Any], items: tuple[Any, ...], output: tuple[Any, ...],
                    earlier: StoredResponse | None = None) -> StoredResponse:
    """The :class:`StoredResponse` of ``response``, the input ``items`` its request added and
    its ``output`` (pydantic items), continuing ``earlier``; its bytes counted as their
    JSON."""
    size = sum(len(i.model_dump_json()) for i in items + output)
    return StoredResponse(response, items, output, size + len(json.dumps(response)), earlier)


class KeptFile(NamedTuple):
    """A kept response as read back from its file: ``kept`` continues none yet; the store
    links it to the response ``previous`` names. ``held``: it had been deleted or expired
    while others continued it."""

    app: str
    rid: str
    previous: str | None
    held: bool
    kept: StoredResponse


class ResponseFilesLike(Protocol):
    """Where a store's responses are files (:class:`~sparkv.asks.respfiles.ResponseFiles`)."""

    def write(self, app: str, rid: str, kept: StoredResponse) -> bool: ...

    def hold(self, rid: str) -> None: ...

    def remove(self, rid: str) -> None: ...

    def read_all(self, max_bytes: int) -> Iterator[KeptFile]: ...


@dataclass
class _Entry:
    """A kept response in the store: whose, how many kept responses continue it, and whether
    it is held (found by no id, kept for those)."""

    app: str
    kept: StoredResponse
    children: int = 0
    held: bool = False


@dataclass
class _Shelf:
    """One app's kept responses (held ones too), least recently used first."""

    rids: OrderedDict[str, None] = field(default_factory=OrderedDict)
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
        self._entries: dict[str, _Entry] = {}
        self._shelves: dict[str, _Shelf] = {}
        self._bytes = self.evicted = self.too_big = self.expired = self.kept_whole = 0
        self._swept = float("-inf")
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether any response can be kept."""
        return self.max_responses > 0 and self.max_bytes > 0

    def put(self, caller: str, rid: str, kept: StoredResponse) -> StoredResponse | None:
        """Keeps ``kept`` as ``caller``'s response ``rid`` (in place of one of that id);
        returns what is kept (``kept`` itself, or holding its whole conversation when the
        response it continued is no longer kept, or its conversation has more responses or
        bytes than the store holds), ``None`` when it cannot be kept."""
        if not self.enabled:
            return None
        with self._lock:
            self._sweep()
            old = self._entries.get(rid)
            if old is not None and old.app != caller:
                return None
            kept = self._fitted(self._linked(caller, kept))
            if self._refused(kept):
                self._delete(rid)
                return None
            self._insert(caller, rid, kept)
            self._make_room(protect={rid} | {r.response.get("id") for r in kept.chain()})
            return kept

    def persist(self, caller: str, rid: str, kept: StoredResponse) -> bool:
        """Writes the file of ``kept`` (as :meth:`put` returned it; blocking: call it from a
        thread); ``False`` when there are no files or the write failed. A response deleted or
        held meanwhile has its file removed or held."""
        if self.files is None:
            return False
        written = self.files.write(caller, rid, kept)
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None:
                self.files.remove(rid)
            elif entry.held:
                self.files.hold(rid)
        return written

    def load(self) -> int:
        """Reads the files back, each linked to the one it continues (within the bounds and
        the time to live); returns how many responses can be found again."""
        if self.files is None:
            return 0
        files: dict[str, KeptFile] = {}
        for f in self.files.read_all(self.max_bytes):     # held if either of two files is
            files[f.rid] = f._replace(held=f.held or (f.rid in files and files[f.rid].held))
        with self._lock:
            broken: set[str] = set()
            for rid in files:
                self._link_file(rid, files, broken)
            for rid in [r for r, e in self._entries.items() if e.held and not e.children]:
                self._drop(rid)                      # held for responses no longer kept
            self._swept = float("-inf")
            self._sweep()
            self._make_room()
        return self.stats()["responses"]

    def get(self, caller: str, rid: str) -> StoredResponse | None:
        """``caller``'s response ``rid`` (``None``: none such, another app's, or held)."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.app != caller or entry.held:
                return None
            if self._expired(entry.kept):
                self._forget(rid)
                return None
            self._shelves[caller].rids.move_to_end(rid)
            return entry.kept

    def delete(self, caller: str, rid: str) -> bool:
        """Forgets ``caller``'s response ``rid`` (held while others continue it); ``False``
        when there was none."""
        with self._lock:
            entry = self._entries.get(rid)
            if entry is None or entry.app != caller or entry.held:
                return False
            self._delete(rid)
            return True

    def stats(self) -> dict[str, int]:
        """How many responses can be found and are held, their bytes, and how many were
        evicted, too big, expired, or kept holding their whole conversation."""
        with self._lock:
            held = sum(e.held for e in self._entries.values())
            return {"responses": len(self._entries) - held, "held": held, "bytes": self._bytes,
                    "evicted": self.evicted, "too_big": self.too_big,
                    "expired": self.expired, "kept_whole": self.kept_whole,
                    "apps": len(self._shelves)}

    # ---- under the lock ------------------------------------------------------------------
    def _linked(self, caller: str, kept: StoredResponse) -> StoredResponse:
        """``kept``, or holding its whole conversation when what it continued is gone."""
        earlier = kept.earlier
        entry = self._entries.get(kept.previous_id or "") if earlier is not None else None
        if earlier is None or (entry is not None and entry.kept is earlier
                               and entry.app == caller):
            return kept
        self.kept_whole += 1
        return kept.flattened()

    def _refused(self, kept: StoredResponse) -> bool:
        """Whether ``kept`` is past its time or bigger than the store (counted so)."""
        if self._expired(kept):
            self.expired += 1
            return True
        if kept.nbytes > self.max_bytes:
            self.too_big += 1
            return True
        return False

    def _fitted(self, kept: StoredResponse) -> StoredResponse:
        """``kept``, or holding its whole conversation when the responses of its conversation
        are more than the store holds (so a long conversation goes on, kept whole)."""
        if kept.earlier is None:
            return kept
        chain = kept.chain()
        if (len(chain) <= self.max_responses
                and sum(r.nbytes for r in chain) <= self.max_bytes):
            return kept
        self.kept_whole += 1
        return kept.flattened()

    def _insert(self, app: str, rid: str, kept: StoredResponse, held: bool = False) -> None:
        """Adds ``kept`` (linked: what it continues is kept) in place of any of its id."""
        if kept.earlier is not None:
            self._entries[kept.previous_id or ""].children += 1
        old = self._entries.get(rid)
        entry = _Entry(app, kept, held=held)
        if old is not None:
            entry.children, entry.held = old.children, old.held or held
            self._take_out(rid)
        self._entries[rid] = entry
        shelf = self._shelves.setdefault(app, _Shelf())
        shelf.rids[rid] = None
        shelf.nbytes += kept.nbytes
        self._bytes += kept.nbytes

    def _take_out(self, rid: str) -> str | None:
        """Takes ``rid`` out of memory; returns the held response it continued when nothing
        else continues that one now."""
        entry = self._entries.pop(rid)
        shelf = self._shelves[entry.app]
        del shelf.rids[rid]
        shelf.nbytes -= entry.kept.nbytes
        self._bytes -= entry.kept.nbytes
        if not shelf.rids:
            del self._shelves[entry.app]
        parent = self._entries.get(entry.kept.previous_id or "")
        if entry.kept.earlier is None or parent is None:
            return None
        parent.children -= 1
        return entry.kept.previous_id if parent.held and not parent.children else None

    def _drop(self, rid: str | None) -> None:
        """Takes ``rid`` out with its file, then each held one it continued that nothing
        else continues."""
        while rid is not None and rid in self._entries:
            nxt = self._take_out(rid)
            self._unlink(rid)
            rid = nxt

    def _delete(self, rid: str) -> None:
        """Forgets ``rid``: held while others continue it, else dropped."""
        entry = self._entries.get(rid)
        if entry is None:
            return
        if not entry.children:
            self._drop(rid)
        elif not entry.held:
            entry.held = True
            if self.files is not None:
                self.files.hold(rid)

    def _link_file(self, rid: str, files: dict[str, KeptFile], broken: set[str]) -> None:
        """Keeps the file ``rid`` read back, after those it continues (a file continuing one
        that cannot be read, or another app's, is removed)."""
        chain: list[KeptFile] = []
        seen: set[str] = set()
        r: str | None = rid
        while r is not None and r not in self._entries:
            f = files.get(r)
            if f is None or r in broken or r in seen:
                break
            chain.append(f)
            seen.add(r)
            r = f.previous
        parent = self._entries.get(r) if r is not None else None
        apps = {f.app for f in chain} | ({parent.app} if parent is not None else set())
        if (r is not None and parent is None) or len(apps) > 1:
            for f in chain:
                broken.add(f.rid)
                self._unlink(f.rid)
                log.warning("kept response file %s is removed: it continues %s, which cannot "
                            "be read back", f.rid, f.previous)
            return
        earlier = parent.kept if parent is not None else None
        for f in reversed(chain):
            earlier = dataclasses.replace(f.kept, earlier=earlier)
            self._insert(f.app, f.rid, earlier, held=f.held)

    def _expired(self, kept: StoredResponse) -> bool:
        """Whether ``kept`` was made more than the time to live ago."""
        made = kept.response.get("created_at")
        return (self.ttl_s is not None and isinstance(made, (int, float))
                and self.clock() - made > self.ttl_s)

    def _forget(self, rid: str) -> None:
        """Forgets an expired response."""
        self._delete(rid)
        self.expired += 1

    def _sweep(self) -> None:
        """Forgets the expired responses, at most once every :data:`SWEEP_S`."""
        now = self.clock()
        if self.ttl_s is None or now - self._swept < SWEEP_S:
            return
        self._swept = now
        for rid, entry in list(self._entries.items()):
            if rid in self._entries and not entry.held and self._expired(entry.kept):
                self._forget(rid)

    def _unlink(self, rid: str) -> None:
        if self.files is not None:
            self.files.remove(rid)

    def _make_room(self, protect: Collection[Any] = ()) -> None:
        """Evicts, from the app holding the most, its least recently used response that no
        other continues (none of ``protect``: the response just kept and its conversation),
        until the store is within its bounds."""
        while self._bytes > self.max_bytes or len(self._entries) > self.max_responses:
            by_bytes = self._bytes > self.max_bytes
            leaf = self._victim(by_bytes, protect)
            if leaf is None:                 # cannot be: what is protected fits
                log.error("kept responses: nothing to evict")
                return
            self._drop(leaf)
            self.evicted += 1

    def _victim(self, by_bytes: bool, protect: Collection[Any]) -> str | None:
        """The least recently used response no other continues, outside ``protect``, of the
        app holding the most (bytes or responses) that has one."""
        apps = sorted(self._shelves, key=lambda a: (self._shelves[a].nbytes if by_bytes
                                                   else len(self._shelves[a].rids)),
                      reverse=True)
        for app in apps:
            for r in self._shelves[app].rids:
                if not self._entries[r].children and r not in protect:
                    return r
        return None
