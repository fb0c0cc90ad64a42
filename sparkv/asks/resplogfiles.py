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
cost a flush): the response's own file (:mod:`sparkv.asks.respfiles`) is what is synced, and the
end mark says a log is whole. At the start each file is read back (past the page cache), its
events numbered in order; a log cut short (no end mark) is kept only for a response the service
stopped before it ended (read back ``failed``, ``service_stopped``): its ``response.failed`` event
is then added, with the end mark, so a reader coming back reads on to the failure. Any other file
(damaged, another format, a name that is no response id, an event out of order, a log a crash cut
short of a response that ended) is removed, with a warning.

No state beyond the folder's path and each running log's open file; the service's event loop
calls it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from sparkv.asks.respfiles import RESPONSE_ID
from sparkv.device.private import FILE_MODE, private_dir
from sparkv.fileio import FlashIO, atomic_write_parts, read_back

log = logging.getLogger("sparkv.asks")

__all__ = ["EventFile", "EventFiles", "ReadLog", "RESPONSE_EVENTS_DIR", "FORMAT", "failed_event"]

#: the folder of the flash dir the events are written in
RESPONSE_EVENTS_DIR = "response_events"
FORMAT = "sparkv-response-events/1"
#: the end mark: a comment of the event stream, in the file only
END = b": end\n\n"
_SUFFIX = ".events"


class ReadLog(NamedTuple):
    """One log read back: its app, its response's id, its events and whether it ended."""

    app: str
    rid: str
    events: list[bytes]
    ended: bool


class EventFile:
    """One running log's file: its events appended as they come (module docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def add(self, event: bytes) -> bool:
        """Appends ``event``; ``False`` (said in the log, the file removed) when it cannot."""
        return self._write(event)

    def end(self) -> bool:
        """The log ended in the service: the end mark, and the file closed."""
        whole = self._write(END)
        self._close()
        return whole

    def stop(self) -> None:
        """The service stops while the response runs: the file closed as it stands (read back
        as a log cut short)."""
        self._close()

    def remove(self) -> None:
        self._close()
        with contextlib.suppress(OSError):
            self.path.unlink()

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


class EventFiles:
    """The logs' files in ``folder`` (module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = private_dir(folder)
        self.io = FlashIO(self.folder)          # reads past the page cache

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
        file = EventFile(path, fd)
        return file if file.add(_head(app, rid)) else None

    def rewrite(self, app: str, rid: str, events: list[bytes]) -> None:
        """Writes the log of a file read back cut short again whole: ``events`` (its failure
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


def failed_event(number: int, response: dict[str, Any]) -> bytes:
    """The ``response.failed`` event numbered ``number`` for ``response`` (read back
    ``failed``)."""
    data = {"type": "response.failed", "sequence_number": number, "response": response}
    return f"event: response.failed\ndata: {json.dumps(data)}\n\n".encode()
