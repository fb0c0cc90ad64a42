"""Whose each context of the device service is, and whom it is shared with (docs/device-service.md,
"Apps").

A context belongs to the app that made it (``POST /v1/contexts``) or kept it (an ask through the
service, :mod:`sparkv.asks`); apps are named as :mod:`sparkv.device.identity` says. An app sees,
calls and describes only its own contexts and those shared with it; only the owner deletes or
shares one. A context with no record (made through the Python API, or before apps were told
apart) is the service user's (:data:`~sparkv.device.identity.USER`).

The records are one small JSON file, ``<flash dir>/owners.json`` (``0600``, replaced atomically
on every change), so a restarted service keeps them with its contexts::

    {"format": "sparkv-device-owners/1",
     "contexts": {"<id>": {"owner": "app:notes", "shared": ["app:mail"]}}}

State: the table and its file. Lock: one, held for every read and change (the file is written
under it).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

from sparkv.device.identity import EVERY_APP, USER
from sparkv.device.private import FILE_MODE
from sparkv.fileio import atomic_write

__all__ = ["ContextOwners", "OWNERS_FILE"]

OWNERS_FILE = "owners.json"
_FORMAT = "sparkv-device-owners/1"


class ContextOwners:
    """The owner and the share list of every context (module docstring)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._table: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        table = data.get("contexts") if isinstance(data, dict) else None
        if data.get("format") != _FORMAT or not isinstance(table, dict):
            return {}
        return {cid: {"owner": str(e.get("owner", USER)),
                      "shared": [str(a) for a in e.get("shared", [])]}
                for cid, e in table.items() if isinstance(e, dict)}

    def _write(self) -> None:
        if self.path is not None:
            body = json.dumps({"format": _FORMAT, "contexts": self._table}, sort_keys=True)
            atomic_write(self.path, body.encode(), mode=FILE_MODE)

    # ---- questions -------------------------------------------------------------------------
    def owner(self, ctx_id: str) -> str:
        """The app that owns the context (:data:`USER` when none was recorded)."""
        with self._lock:
            return str(self._table.get(ctx_id, {}).get("owner", USER))

    def shared_with(self, ctx_id: str) -> list[str]:
        with self._lock:
            return list(self._table.get(ctx_id, {}).get("shared", []))

    def visible(self, ctx_id: str, app: str) -> bool:
        """Whether ``app`` may see and call the context: its owner, or shared with it."""
        with self._lock:
            entry = self._table.get(ctx_id, {"owner": USER, "shared": []})
            shared = entry["shared"]
            return entry["owner"] == app or EVERY_APP in shared or app in shared

    def describe(self, ctx_id: str) -> dict[str, Any]:
        """``{"owner", "shared_with"}`` (what the REST API adds to a context's description)."""
        with self._lock:
            entry = self._table.get(ctx_id, {"owner": USER, "shared": []})
            return {"owner": entry["owner"], "shared_with": list(entry["shared"])}

    # ---- changes ---------------------------------------------------------------------------
    def claim(self, ctx_id: str, app: str, shared: Iterable[str] = ()) -> None:
        """``app`` owns the (new) context, shared with ``shared``."""
        with self._lock:
            self._table[ctx_id] = {"owner": app, "shared": sorted(set(shared))}
            self._write()

    def share(self, ctx_id: str, apps: Iterable[str]) -> None:
        """The context is shared with ``apps`` from now on (replacing its share list;
        :data:`EVERY_APP`: every app)."""
        with self._lock:
            entry = self._table.setdefault(ctx_id, {"owner": USER, "shared": []})
            entry["shared"] = sorted(set(apps))
            self._write()

    def forget(self, ctx_id: str) -> None:
        """The context was deleted."""
        with self._lock:
            if self._table.pop(ctx_id, None) is not None:
                self._write()
