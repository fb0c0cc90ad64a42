"""The kept responses on the device's flash (:mod:`sparkv.asks.respstore`): one file each, so a
restarted service still gives back, lists and continues the responses it kept.

``<flash dir>/responses/<id>.json`` (the directory ``0700``, the files ``0600``, as the service's
other files: :mod:`sparkv.device.private`), written atomically and synced before the response's
last event or its JSON is sent, removed when the response is deleted or evicted::

    {"format": "sparkv-kept-response/2", "app": "app:notes", "id": "resp_...",
     "previous": "resp_..." or null, "response": {...}, "items": [...], "output": [...]}

Each file holds its own request's input ``items`` and its ``output``, and names the response it
continued (``previous``), so a conversation is written once: its n turns' files hold n turns. A
response deleted (or past its time) while later ones continue it is *held*: its file renamed
``<id>.held.json``, it is read back for them only, and removed with the last of them. Files of
the first format (``sparkv-kept-response/1``: each holding its whole conversation) are read as
responses continuing none.

At the start every file is read (past the page cache), and the store links each to the one it
continues (a file continuing one that cannot be read is removed), within its bounds. A
background response written ``queued`` that never ended is read back ``failed`` (``error.code``
``service_stopped``). A file that cannot be read as one (damaged, another format, a name that is
no response id, bigger than the store) is removed, with a warning, as are the temporary files of
a write a crash cut short.

No state beyond the folder's path; the store calls it under its lock or from one thread per
response.
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

from sparkv.asks.respschemas import as_input
from sparkv.asks.respstore import KeptFile, StoredResponse, stored_response
from sparkv.device.private import FILE_MODE, private_dir
from sparkv.fileio import FlashIO, atomic_write, read_back

log = logging.getLogger("sparkv.asks")

__all__ = ["ResponseFiles", "RESPONSES_DIR", "RESPONSE_ID", "FORMAT", "STOPPED"]

#: the folder of the flash dir the kept responses are written in
RESPONSES_DIR = "responses"
FORMAT = "sparkv-kept-response/2"
#: the first format: each file holds its whole conversation (read, no longer written)
FORMAT_WHOLE = "sparkv-kept-response/1"
#: the statuses of a background response that has not ended
_UNFINISHED = ("queued", "in_progress")
#: the error of a background response the service stopped before it ended
STOPPED = {"code": "service_stopped",
           "message": "the service stopped before this background response was answered"}
#: the ids a file may be named by (the service makes them: ``resp_`` and 32 hex digits)
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")
#: a kept response's file name: its id, ``.held`` when it is held, ``.json``
_NAME = re.compile(r"(resp_[0-9a-f]{32})(\.held)?\.json")


class ResponseFiles:
    """The kept responses' files in ``folder`` (module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = private_dir(folder)
        self.io = FlashIO(self.folder)          # reads past the page cache

    def _path(self, rid: str, held: bool = False) -> Path | None:
        if not RESPONSE_ID.fullmatch(rid):
            return None
        return self.folder / (f"{rid}.held.json" if held else f"{rid}.json")

    def write(self, app: str, rid: str, kept: StoredResponse) -> bool:
        """Writes ``app``'s response ``rid``; ``False`` (said in the log) when it cannot be
        (an id the service did not make, a full or failing disk)."""
        path = self._path(rid)
        if path is None:
            return False
        doc = {"format": FORMAT, "app": app, "id": rid, "previous": kept.previous_id,
               "response": kept.response,
               "items": [_dumped(i) for i in kept.items],
               "output": [_dumped(i) for i in kept.output]}
        try:
            atomic_write(path, json.dumps(doc).encode(), mode=FILE_MODE)
        except OSError as e:
            log.warning("kept response %s is in memory only: its file could not be written "
                        "(%s)", rid, e)
            return False
        return True

    def hold(self, rid: str) -> None:
        """Marks the file of response ``rid`` held (renamed ``<id>.held.json``)."""
        path, held = self._path(rid), self._path(rid, held=True)
        if path is not None and held is not None:
            with contextlib.suppress(OSError):
                path.replace(held)

    def remove(self, rid: str) -> None:
        """Removes the file of response ``rid``, held or not (none is fine)."""
        for held in (False, True):
            path = self._path(rid, held)
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()

    def read_all(self, max_bytes: int) -> Iterator[KeptFile]:
        """Every readable file, oldest first; the unreadable ones (and those over
        ``max_bytes``) removed."""
        return read_back(self.folder, "*.json", lambda path: self._read(path, max_bytes))

    def _read(self, path: Path, max_bytes: int) -> KeptFile | None:
        name = _NAME.fullmatch(path.name)
        try:
            if name is None or path.stat().st_size > 2 * max_bytes + 4096:
                raise ValueError("no response id, or bigger than the store")
            rid = name.group(1)
            doc = json.loads(self.io.read_file(path))
            if doc.get("format") not in (FORMAT, FORMAT_WHOLE) or doc.get("id") != rid:
                raise ValueError(f"not {FORMAT} of {rid}")
            kept = stored_response(_response(doc), tuple(as_input(doc["items"])),
                                   tuple(as_input(doc["output"])))
            app, earlier = doc["app"], doc.get("previous")
            if not isinstance(app, str) or not (earlier is None or isinstance(earlier, str)):
                raise ValueError("no app, or a previous that is no id")
        except (OSError, ValueError, ValidationError, KeyError, TypeError,
                AttributeError) as e:
            log.warning("kept response file %s is removed: it cannot be read (%s)", path, e)
            return None
        return KeptFile(app, rid, earlier, name.group(2) is not None, kept)


def _dumped(item: Any) -> dict[str, Any]:
    return item.model_dump(mode="json", exclude_none=True)


def _response(doc: dict[str, Any]) -> dict[str, Any]:
    """The file's response; a background one the service stopped before it ended, failed."""
    response = doc["response"]
    if not isinstance(response, dict) or response.get("id") != doc["id"]:
        raise ValueError("no response object of its id")
    if response.get("status") in _UNFINISHED:
        response = {**response, "status": "failed", "error": STOPPED}
    return response
