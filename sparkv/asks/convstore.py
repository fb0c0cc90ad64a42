"""The conversations of OpenAI's Conversations API (docs/asks.md, "Conversations"): an app makes
one (``POST /v1/conversations``, its first items and ``metadata``), names it in each response
(``conversation``), and the service keeps its items: the response comes after them, and once
answered its input and output items are added (:mod:`sparkv.asks.convroutes`).

A conversation is its app's alone (another app's id is as unknown as one never made), held in
the service's memory (and on its flash, below) until the app deletes it or room is made: the
store holds at most ``max_conversations`` conversations and ``max_bytes`` bytes of items. Room
is made by evicting the least recently used conversation of the app holding the most (bytes when
bytes overflow, conversations when the count does), never the one being written. A conversation
that alone would outgrow the store loses its oldest items until it fits (counted in
``items_dropped`` and said in the log), as ``truncation: "auto"`` drops the oldest turns.

With ``files`` (:class:`~sparkv.asks.convfiles.ConversationFiles`), each conversation is also a
file on the flash, written as it changes (appended and synced, from the caller's thread; after
a failed write, such as a full flash, the whole conversation is written again atomically at its
next change, so a torn line is never followed) and read back by :meth:`ConversationStore.load`
at the start.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Protocol

log = logging.getLogger("sparkv.asks")

__all__ = ["ConversationStore", "KeptConversation", "Snapshot", "ConversationFilesLike",
           "DEFAULT_MAX_CONVERSATIONS", "DEFAULT_MAX_MB", "MAX_ITEMS_ADDED", "new_id", "dumped"]

#: the conversations kept by default (``sparkv device serve --conversations-kept``)
DEFAULT_MAX_CONVERSATIONS = 64
#: the megabytes of items they hold at most by default (``--conversations-kept-mb``)
DEFAULT_MAX_MB = 16.0
#: the items an app may add at once (as OpenAI's API)
MAX_ITEMS_ADDED = 20


def new_id() -> str:
    """A new conversation id: ``conv_`` and 48 hex digits."""
    return f"conv_{secrets.token_hex(24)}"


@dataclass
class KeptConversation:
    """One conversation: whose, when made, its ``metadata`` and its ``items`` (pydantic input
    items, each with an id), ``nbytes`` their JSON's size."""

    id: str
    app: str
    created_at: int
    metadata: dict[str, str]
    items: list[Any] = field(default_factory=list)
    nbytes: int = 0

    def info(self) -> dict[str, Any]:
        """The API's ``conversation`` object."""
        return {"id": self.id, "object": "conversation", "created_at": self.created_at,
                "metadata": dict(self.metadata)}

    def extend(self, items: list[Any]) -> None:
        self.items += items
        self.nbytes += _bytes(items)

    def drop(self, n: int) -> None:
        """Drops the oldest ``n`` items."""
        self.nbytes -= _bytes(self.items[:n])
        del self.items[:n]

    def remove(self, item_id: str) -> bool:
        """Removes the item ``item_id`` (``False``: none such)."""
        for k, item in enumerate(self.items):
            if item.id == item_id:
                self.nbytes -= _bytes([item])
                del self.items[k]
                return True
        return False


class Snapshot(NamedTuple):
    """A conversation as it stands: its ``info`` object and its ``items``."""

    info: dict[str, Any]
    items: tuple[Any, ...]


def _bytes(items: list[Any]) -> int:
    return sum(len(i.model_dump_json()) for i in items)


class ConversationFilesLike(Protocol):
    """Where a store's conversations are files
    (:class:`~sparkv.asks.convfiles.ConversationFiles`)."""

    def create(self, conv: KeptConversation) -> bool: ...

    def append(self, cid: str, record: dict[str, Any]) -> bool: ...

    def remove(self, cid: str) -> None: ...

    def read_all(self, max_bytes: int) -> Iterator[KeptConversation]: ...


class ConversationStore:
    """The conversations of every app, bounded in count and bytes (module docstring)."""

    def __init__(self, max_conversations: int = DEFAULT_MAX_CONVERSATIONS,
                 max_bytes: int = int(DEFAULT_MAX_MB * 1e6),
                 files: ConversationFilesLike | None = None) -> None:
        if max_conversations < 0 or max_bytes < 0:
            raise ValueError(f"a store of {max_conversations} conversations and {max_bytes} "
                             "bytes")
        self.max_conversations, self.max_bytes = max_conversations, max_bytes
        self.files = files if self.enabled else None
        self._convs: OrderedDict[str, KeptConversation] = OrderedDict()   # least recent first
        self._bytes = self.evicted = self.items_dropped = 0
        self._unsaved: set[str] = set()      # conversations whose file must be written whole
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether any conversation can be kept."""
        return self.max_conversations > 0 and self.max_bytes > 0

    def create(self, app: str, items: list[Any], metadata: dict[str, str] | None) -> Snapshot:
        """A new conversation of ``app`` with its first ``items`` (each with an id)."""
        conv = KeptConversation(new_id(), app, int(time.time()), dict(metadata or {}))
        with self._lock:
            self._convs[conv.id] = conv
            self._grow(conv, items)
            if self.files is not None and not self.files.create(conv):
                self._unsaved.add(conv.id)
            self._make_room(conv.id)
            return self._snapshot(conv)

    def get(self, app: str, cid: str) -> Snapshot | None:
        """``app``'s conversation ``cid`` as it stands (``None``: none such)."""
        with self._lock:
            conv = self._touch(app, cid)
            return self._snapshot(conv) if conv is not None else None

    def add(self, app: str, cid: str, items: list[Any]) -> Snapshot | None:
        """Adds ``items`` (each with an id) to ``app``'s conversation ``cid``; ``None`` when
        there is none such (deleted or evicted meanwhile)."""
        with self._lock:
            conv = self._touch(app, cid)
            if conv is None:
                return None
            dropped = self._grow(conv, items)
            self._write(cid, {"add": dumped(items)})
            if dropped:
                self._write(cid, {"drop_oldest": dropped})
            self._make_room(cid)
            return self._snapshot(conv)

    def update(self, app: str, cid: str, metadata: dict[str, str]) -> Snapshot | None:
        """Sets the ``metadata`` of ``app``'s conversation ``cid``."""
        with self._lock:
            conv = self._touch(app, cid)
            if conv is None:
                return None
            conv.metadata = dict(metadata)
            self._write(cid, {"metadata": conv.metadata})
            return self._snapshot(conv)

    def remove_item(self, app: str, cid: str, item_id: str) -> tuple[Snapshot | None, bool]:
        """Removes the item ``item_id`` of ``app``'s conversation ``cid``: the conversation
        (``None``: none such) and whether the item was there."""
        with self._lock:
            conv = self._touch(app, cid)
            if conv is None:
                return None, False
            before = conv.nbytes
            found = conv.remove(item_id)
            if found:
                self._bytes -= before - conv.nbytes
                self._write(cid, {"delete": item_id})
            return self._snapshot(conv), found

    def delete(self, app: str, cid: str) -> bool:
        """Forgets ``app``'s conversation ``cid``; ``False`` when there was none."""
        with self._lock:
            if self._touch(app, cid) is None:
                return False
            self._drop(cid)
            return True

    def load(self) -> int:
        """Reads the files back (within the bounds); returns how many conversations are
        kept."""
        if self.files is None:
            return 0
        for conv in self.files.read_all(self.max_bytes):
            with self._lock:
                self._convs[conv.id] = conv
                self._bytes += conv.nbytes
                self._make_room(conv.id)
        return len(self._convs)

    def stats(self) -> dict[str, int]:
        """How many conversations are kept, their items' bytes, and how many were evicted or
        lost items for room."""
        with self._lock:
            return {"conversations": len(self._convs), "bytes": self._bytes,
                    "apps": len({c.app for c in self._convs.values()}),
                    "evicted": self.evicted, "items_dropped": self.items_dropped}

    # ---- under the lock ------------------------------------------------------------------
    def _touch(self, app: str, cid: str) -> KeptConversation | None:
        conv = self._convs.get(cid)
        if conv is None or conv.app != app:
            return None
        self._convs.move_to_end(cid)
        return conv

    @staticmethod
    def _snapshot(conv: KeptConversation) -> Snapshot:
        return Snapshot(conv.info(), tuple(conv.items))

    def _grow(self, conv: KeptConversation, items: list[Any]) -> int:
        """Adds ``items`` to ``conv``; returns how many of its oldest items went for room."""
        before = conv.nbytes
        conv.extend(items)
        dropped = 0
        while conv.nbytes > self.max_bytes and conv.items:
            conv.drop(1)
            dropped += 1
        if dropped:
            self.items_dropped += dropped
            log.warning("conversation %s outgrew the store (%d bytes): its oldest %d items "
                        "went", conv.id, self.max_bytes, dropped)
        self._bytes += conv.nbytes - before
        return dropped

    def _write(self, cid: str, record: dict[str, Any]) -> None:
        """Appends the change ``record`` to the file of ``cid``; after a failed write (its
        file may end in a torn line), the whole conversation is written again instead."""
        if self.files is None:
            return
        if cid in self._unsaved or not self.files.append(cid, record):
            if self.files.create(self._convs[cid]):
                self._unsaved.discard(cid)
            else:
                self._unsaved.add(cid)

    def _drop(self, cid: str) -> None:
        conv = self._convs.pop(cid)
        self._unsaved.discard(cid)
        self._bytes -= conv.nbytes
        if self.files is not None:
            self.files.remove(cid)

    def _make_room(self, keep: str) -> None:
        """Evicts, from the app holding the most, its least recently used conversation (not
        ``keep``), until the store is within its bounds."""
        while self._bytes > self.max_bytes or len(self._convs) > self.max_conversations:
            by_bytes = self._bytes > self.max_bytes
            held: dict[str, list[int]] = {}
            for c in self._convs.values():
                if c.id != keep:
                    n = held.setdefault(c.app, [0, 0])
                    n[0], n[1] = n[0] + c.nbytes, n[1] + 1
            if not held:
                return
            app = max(held, key=lambda a: held[a][0 if by_bytes else 1])
            oldest = next(c.id for c in self._convs.values() if c.app == app and c.id != keep)
            self._drop(oldest)
            self.evicted += 1


def dumped(items: list[Any]) -> list[dict[str, Any]]:
    """``items`` as the JSON a file holds."""
    return [i.model_dump(mode="json", exclude_none=True) for i in items]
