"""The conversations on the device's flash (:mod:`sparkv.asks.convstore`): one file each, so a
restarted service still has every app's conversations.

``<flash dir>/conversations/<id>.jsonl`` (the directory ``0700``, the files ``0600``, as the
service's other files: :mod:`sparkv.device.private`): one JSON record a line, the first its
header, then each change as it was made, appended and synced before the request that made it
is answered, so a turn costs its own items, not the whole conversation::

    {"format": "sparkv-conversation/1", "app": "app:notes", "id": "conv_...",
     "created_at": 1764800000, "metadata": {}}
    {"add": [{"type": "message", "role": "user", "content": "...", "id": "msg_..."}, ...]}
    {"delete": "msg_..."}
    {"metadata": {"topic": "..."}}
    {"drop_oldest": 2}

At the start each file is read back (past the page cache) by replaying its records, then, unless
it already is its header and one ``add``, written again so (atomically, its time kept), so the
deleted items leave the flash. A last line a crash cut short is left out; a file whose header
cannot be read (damaged, another format, a name that is no conversation id, bigger than the
store) is removed, with a warning; a damaged record further on keeps the conversation as it
stood before it, with a warning.

No state beyond the folder's path; the store calls it under its lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator

from pydantic import ValidationError

from sparkv.asks.convstore import KeptConversation, dumped
from sparkv.asks.respschemas import as_input
from sparkv.device.private import FILE_MODE, private_dir
from sparkv.fileio import FlashIO, atomic_write, oldest_first

log = logging.getLogger("sparkv.asks")

__all__ = ["ConversationFiles", "CONVERSATIONS_DIR", "FORMAT"]

#: the folder of the flash dir the conversations are written in
CONVERSATIONS_DIR = "conversations"
FORMAT = "sparkv-conversation/1"
#: the ids a file may be named by (the service makes them: ``conv_`` and 48 hex digits)
_ID = re.compile(r"conv_[0-9a-f]{48}")
#: what a record may read: its errors
_BAD = (ValueError, ValidationError, KeyError, TypeError, AttributeError)


class ConversationFiles:
    """The conversations' files in ``folder`` (module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = private_dir(folder)
        self.io = FlashIO(self.folder)          # reads past the page cache

    def _path(self, cid: str) -> Path | None:
        return self.folder / f"{cid}.jsonl" if _ID.fullmatch(cid) else None

    def create(self, conv: KeptConversation) -> bool:
        """Writes ``conv`` whole (its header and its items); ``False`` (said in the log) when
        it cannot be."""
        path = self._path(conv.id)
        if path is None:
            return False
        head = {"format": FORMAT, "app": conv.app, "id": conv.id,
                "created_at": conv.created_at, "metadata": conv.metadata}
        lines = [head] + ([{"add": dumped(conv.items)}] if conv.items else [])
        try:
            atomic_write(path, "".join(json.dumps(x) + "\n" for x in lines).encode(),
                         mode=FILE_MODE)
        except OSError as e:
            log.warning("conversation %s is in memory only: its file could not be written "
                        "(%s)", conv.id, e)
            return False
        return True

    def append(self, cid: str, record: dict[str, Any]) -> bool:
        """Appends ``record`` to the file of ``cid`` and syncs it; ``False`` (said in the log)
        when it cannot be (no file: the conversation is in memory only)."""
        path = self._path(cid)
        if path is None:
            return False
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)   # no file: it stays in memory only
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("conversation %s: a change is in memory only (%s)", cid, e)
            return False
        return True

    def remove(self, cid: str) -> None:
        """Removes the file of ``cid`` (none is fine)."""
        path = self._path(cid)
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()

    def read_all(self, max_bytes: int) -> Iterator[KeptConversation]:
        """Every readable conversation, oldest first (one holding more than its header and one
        ``add`` written again compacted, its time kept); the unreadable files removed."""
        for path in oldest_first(self.folder, "*.jsonl"):
            got = self._read(path, max_bytes)
            if got is None:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            conv, compact = got
            if not compact:
                self._compact(path, conv)
            yield conv

    def _compact(self, path: Path, conv: KeptConversation) -> None:
        """Writes ``conv`` whole in place of its records, with the file's time (the order
        the conversations are read in)."""
        with contextlib.suppress(OSError):
            st = path.stat()
            if self.create(conv):
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))

    def _read(self, path: Path, max_bytes: int) -> tuple[KeptConversation, bool] | None:
        """The conversation ``path`` holds, and whether it is compact (its header and at most
        one ``add``, every line read)."""
        try:
            if not _ID.fullmatch(path.stem) or path.stat().st_size > 4 * max_bytes + 4096:
                raise ValueError("no conversation id, or bigger than the store")
            lines = self.io.read_file(path).split(b"\n")
            conv = _header(json.loads(lines[0]), path.stem)
        except (OSError, *_BAD) as e:
            log.warning("conversation file %s is removed: it cannot be read (%s)", path, e)
            return None
        records: list[bytes] = []
        for k, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            records.append(line)
            try:
                _replay(conv, json.loads(line))
            except _BAD as e:
                if k < len(lines):                 # not a last line a crash cut short
                    log.warning("conversation file %s: line %d cannot be read (%s); the "
                                "conversation is kept as it stood before it", path, k, e)
                return conv, False
        return conv, not records or (len(records) == 1 and records[0].startswith(b'{"add"'))


def _header(doc: Any, cid: str) -> KeptConversation:
    if doc.get("format") != FORMAT or doc.get("id") != cid:
        raise ValueError(f"not {FORMAT} of {cid}")
    app, made, meta = doc["app"], doc["created_at"], doc.get("metadata") or {}
    if not (isinstance(app, str) and isinstance(made, int) and isinstance(meta, dict)):
        raise ValueError("no app, time or metadata")
    return KeptConversation(cid, app, made, {str(k): str(v) for k, v in meta.items()})


def _replay(conv: KeptConversation, record: dict[str, Any]) -> None:
    """Makes the change ``record`` says to ``conv``."""
    if "add" in record:
        conv.extend(list(as_input(record["add"])))
    elif "delete" in record:
        conv.remove(str(record["delete"]))
    elif "metadata" in record:
        conv.metadata = {str(k): str(v) for k, v in dict(record["metadata"]).items()}
    elif "drop_oldest" in record:
        conv.drop(int(record["drop_oldest"]))
    else:
        raise ValueError(f"no change: {sorted(record)}")
