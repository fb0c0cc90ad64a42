"""The events of streamed background responses on the device's flash (:mod:`sparkv.asks.resplog`),
so a restarted service still streams them again, and one the service stopped before it ended
reads on to its failure.

``<flash dir>/response_events/<id>.events`` (the directory ``0700``, the files ``0600``, as the
service's other files: :mod:`sparkv.device.private`): a header line, then the response's
server-sent events as they were sent, each appended as it comes, then, once the response ended
in the service, an end mark (a comment of the event stream, never sent)::

    {"format": "sparkv-response-events/1", "app": "app:notes", "id": "resp_..."}
    event: response.created
    data: {"type": "response.created", "sequence_number": 0, ...}

    ...
    : end

The events are written through the page cache, not synced one by one (a token's event would
cost a flush). They reach the disk in groups, off the event loop (a thread syncs a duplicate of
the file's descriptor): a running log's at least every :data:`SYNC_S` seconds, an ended log's
(its end mark) and a stopped one's at once, the folder's entry with the first. A power cut so
loses at most the last :data:`SYNC_S` seconds of a running log, and of an ended one only what the
next sync would have kept.

At the start each file is read back (past the page cache), its events numbered in order. A log
cut short (no end mark: the service stopped, or a power cut took its tail) is kept for a response
still kept, and ends as its response ended: the event its status ends a stream with
(``response.completed``, ``response.incomplete`` or ``response.failed``: :func:`end_event`,
numbered after the last kept) is added with the end mark, so a reader coming back reads on to
the response as it was answered (a stopped one's ``failed``, ``service_stopped``). Any other file
(damaged, another format, a name that is no response id, an event out of order) is removed, with
a warning.

No state beyond the folder's path, each running log's open file and the syncing thread; the
service's event loop calls it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from sparkv.asks.respfiles import RESPONSE_ID
from sparkv.device.private import FILE_MODE, private_dir
from sparkv.fileio import FlashIO, atomic_write_parts, fsync_dir, read_back

log = logging.getLogger("sparkv.asks")

__all__ = ["EventFile", "EventFiles", "ReadLog", "RESPONSE_EVENTS_DIR", "FORMAT", "SYNC_S",
           "end_event", "ends_stream"]

#: the folder of the flash dir the events are written in
RESPONSE_EVENTS_DIR = "response_events"
FORMAT = "sparkv-response-events/1"
#: the end mark: a comment of the event stream, in the file only
END = b": end\n\n"
#: a running log's events reach the disk at least this often (seconds)
SYNC_S = 1.0
_SUFFIX = ".events"
#: the status a response ended with: the event a stream ends with for it
_END_KINDS = {"completed": "response.completed", "incomplete": "response.incomplete",
              "failed": "response.failed"}
_END_PREFIXES = tuple(f"event: {kind}\n".encode() for kind in _END_KINDS.values())


class ReadLog(NamedTuple):
    """One log read back: its app, its response's id, its events and whether it ended."""

    app: str
    rid: str
    events: list[bytes]
    ended: bool


class EventFile:
    """One running log's file: its events appended as they come, synced by ``syncs`` in groups
    (module docstring)."""

    def __init__(self, path: Path, fd: int, syncs: "_Syncs") -> None:
        self.path, self._fd, self._syncs = path, fd, syncs
        self._synced = syncs.clock()
        self._named = False                 # its folder's entry synced

    def add(self, event: bytes) -> bool:
        """Appends ``event`` (the file synced when :data:`SYNC_S` passed since it last was);
        ``False`` (said in the log, the file removed) when it cannot."""
        if not self._write(event):
            return False
        if self._syncs.clock() - self._synced >= SYNC_S:
            self._sync()
        return True

    def end(self) -> bool:
        """The log ended in the service: the end mark, the file synced and closed."""
        whole = self._write(END)
        self.stop()
        return whole

    def stop(self) -> None:
        """The service stops while the response runs: the file synced and closed as it stands
        (read back as a log cut short)."""
        if self._fd >= 0:
            self._sync()
        self._close()

    def remove(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _sync(self) -> None:
        self._synced = self._syncs.clock()
        self._syncs.sync(self._fd, None if self._named else self.path.parent, self.path.stem)
        self._named = True

    def _write(self, data: bytes) -> bool:
        if self._fd < 0:
            return False
        try:
            os.write(self._fd, data)
        except OSError as e:
            log.warning("the events of %s are in memory only: its file could not be written "
                        "(%s)", self.path.stem, e)
            self.remove()
            return False
        return True

    def _close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1


class _Syncs:
    """The thread the logs' files are synced in, off the event loop: each sync is of a duplicate
    of a file's descriptor (closed there), so the file may be closed meanwhile."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._pool: ThreadPoolExecutor | None = None

    def sync(self, fd: int, folder: Path | None, rid: str) -> None:
        """Syncs the file ``fd`` is open on (and ``folder``'s entries), soon."""
        try:
            dup = os.dup(fd)
        except OSError as e:
            log.warning("the events of %s may not all reach the disk (%s)", rid, e)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkv-events-sync")
        self._pool.submit(_sync, dup, folder, rid)

    def wait(self) -> None:
        """Returns once every sync asked before has ended."""
        if self._pool is not None:
            done: Future[None] = self._pool.submit(lambda: None)
            done.result()

    def close(self) -> None:
        """Ends the thread once every sync asked has ended."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _sync(fd: int, folder: Path | None, rid: str) -> None:
    try:
        os.fdatasync(fd)
        if folder is not None:
            fsync_dir(folder, strict=True)
    except OSError as e:
        log.warning("the events of %s may not all reach the disk (%s)", rid, e)
    finally:
        os.close(fd)


class EventFiles:
    """The logs' files in ``folder`` (module docstring)."""

    def __init__(self, folder: str | os.PathLike[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.folder = private_dir(folder)
        self.io = FlashIO(self.folder)          # reads past the page cache
        self.syncs = _Syncs(clock)

    def _path(self, rid: str) -> Path | None:
        return self.folder / f"{rid}{_SUFFIX}" if RESPONSE_ID.fullmatch(rid) else None

    def open(self, app: str, rid: str) -> EventFile | None:
        """A new file for ``app``'s response ``rid``, its header written; ``None`` (said in the
        log) when it cannot be."""
        path = self._path(rid)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, FILE_MODE)
        except OSError as e:
            log.warning("the events of %s are in memory only (%s)", rid, e)
            return None
        file = EventFile(path, fd, self.syncs)
        return file if file.add(_head(app, rid)) else None

    def close(self) -> None:
        """The service stops: returns once every sync asked has ended."""
        self.syncs.close()

    def rewrite(self, app: str, rid: str, events: list[bytes]) -> None:
        """Writes the log of a file read back cut short again whole: ``events`` (its end
        added, a torn last event left out) and the end mark, atomically, its time kept (the
        order the logs are read in)."""
        path = self._path(rid)
        if path is None:
            return
        try:
            st = path.stat()
            atomic_write_parts(path, [_head(app, rid), *events, END], mode=FILE_MODE)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        except OSError as e:
            log.warning("the events of %s: their end is in memory only (%s)", rid, e)

    def remove(self, rid: str) -> None:
        """Removes the file of ``rid`` (none is fine)."""
        path = self._path(rid)
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    def read_all(self, max_bytes: int) -> Iterator[ReadLog]:
        """Every readable log, oldest first; the unreadable files (and those over
        ``max_bytes``) removed."""
        return read_back(self.folder, f"*{_SUFFIX}", lambda path: self._read(path, max_bytes))

    def _read(self, path: Path, max_bytes: int) -> ReadLog | None:
        try:
            rid = path.name.removesuffix(_SUFFIX)
            if not RESPONSE_ID.fullmatch(rid) or path.stat().st_size > max_bytes + 4096:
                raise ValueError("no response id, or bigger than the logs are kept")
            head, _, body = self.io.read_file(path).partition(b"\n")
            doc = json.loads(head)
            if doc.get("format") != FORMAT or doc.get("id") != rid:
                raise ValueError(f"not {FORMAT} of {rid}")
            if not isinstance(doc.get("app"), str):
                raise ValueError("no app")
            events, ended = _events(body)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("response events file %s is removed: it cannot be read (%s)", path, e)
            return None
        return ReadLog(doc["app"], rid, events, ended)


def _head(app: str, rid: str) -> bytes:
    return json.dumps({"format": FORMAT, "app": app, "id": rid}).encode() + b"\n"


def _events(body: bytes) -> tuple[list[bytes], bool]:
    """The events ``body`` holds, in order (one a crash cut short left out), and whether its end
    mark closes it."""
    ended = body.endswith(END)
    if ended:
        body = body[:-len(END)]
    parts = body.split(b"\n\n")
    whole = parts[:-1] if not parts[-1] else parts[:-1] if not ended else None
    if whole is None:
        raise ValueError("text after the last event of a log that ended")
    events = [p + b"\n\n" for p in whole]
    for k, event in enumerate(events):
        if _number(event) != k:
            raise ValueError(f"event {k} is out of order")
    return events, ended


def _number(event: bytes) -> int:
    kind, _, data = event.partition(b"\n")
    if not (kind.startswith(b"event: ") and data.startswith(b"data: ")):
        raise ValueError("not a server-sent event")
    n = json.loads(data[len(b"data: "):]).get("sequence_number")
    return n if isinstance(n, int) else -1


def end_event(number: int, response: dict[str, Any]) -> bytes | None:
    """The event numbered ``number`` a stream of ``response`` ends with, as it was answered
    (``response.completed``, ``response.incomplete`` or ``response.failed``); ``None`` for a
    response that ended otherwise (``cancelled``: its stream just ends)."""
    kind = _END_KINDS.get(response.get("status", ""))
    if kind is None:
        return None
    data = {"type": kind, "sequence_number": number, "response": response}
    return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def ends_stream(event: bytes) -> bool:
    """Whether ``event`` is one a stream ends with (:func:`end_event`)."""
    return event.startswith(_END_PREFIXES)
