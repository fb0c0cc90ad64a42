"""The copy a request's choices share when the request keeps nothing (``keep`` off).

The ``n`` sampled choices of one request are asks of their own (docs/asks.md). With ``keep``
on, the first to load the context keeps it and the others read the kept copy
(:mod:`sparkv.asks.kept`): one load. With ``keep`` off each loaded the context for itself: ``n``
times the link's bytes and the local compute for one context. A :class:`ChoicesCopy` gives the
group the same single load without keeping anything past the request:

* every choice keeps under a label of the group's own (:meth:`ChoicesCopy.label`), so no other
  request, not even the app's next one, finds the copy, and it is the app's alone (never
  shared);
* the loader keeps it as a kept ask does (at its first token when the others wait), the others
  read it; it is never written to flash ahead of time (``import_context(ahead=False)``: only
  if memory runs short), since it is deleted within seconds;
* when the group's last ask ends (done, failed or cancelled), the copy is deleted
  (:meth:`ChoicesCopy.leave`): memory, flash files, journal record, owner;
* a copy a crash left behind is deleted when the next ask service starts
  (:func:`drop_leftovers`: its label carries :data:`MARK`).

The asks' ``done`` events say ``kept_id: null``, as with ``keep`` off before.
"""

from __future__ import annotations

import logging
import secrets
import threading

from sparkv.device.errors import DeviceError
from sparkv.device.owners import ContextOwners
from sparkv.device.service import ContextService

__all__ = ["MARK", "ChoicesCopy", "drop_leftovers"]

log = logging.getLogger("sparkv.asks")

#: what a group's label ends with (before the group's own part)
MARK = "@choices-"


class ChoicesCopy:
    """The shared, unkept copy of one group of ``asks`` choices (module docstring)."""

    def __init__(self, asks: int) -> None:
        self.scope = f"{MARK}{secrets.token_hex(6)}"
        self._left = int(asks)
        self._kept: list[str] = []
        self._lock = threading.Lock()

    def label(self, label: str) -> str:
        """The group's own label for the kept-context label ``label``."""
        return f"{label}{self.scope}"

    def kept(self, ctx_id: str) -> None:
        """A choice kept the copy as ``ctx_id`` (deleted at the group's end)."""
        with self._lock:
            self._kept.append(ctx_id)

    def leave(self, contexts: ContextService, owners: ContextOwners) -> list[str]:
        """One ask of the group ended; at the last, deletes what the group kept. Returns the
        ids deleted (empty until the last)."""
        with self._lock:
            self._left -= 1
            if self._left > 0:
                return []
            ids, self._kept = self._kept, []
        for ctx_id in ids:
            _drop(contexts, owners, ctx_id)
        return ids


def _drop(contexts: ContextService, owners: ContextOwners, ctx_id: str) -> None:
    """Deletes a group's copy (waits for a read turn still ending on it); one already gone is
    no error."""
    try:
        contexts.delete(ctx_id)
    except DeviceError as e:
        log.info("the choices' copy %s was not deleted: %s", ctx_id, e)
    owners.forget(ctx_id)


def drop_leftovers(contexts: ContextService, owners: ContextOwners) -> list[str]:
    """Deletes the groups' copies a crash left (their labels carry :data:`MARK`); their ids."""
    ids = [s.id for s in contexts.list() if s.label and MARK in s.label]
    for ctx_id in ids:
        _drop(contexts, owners, ctx_id)
    return ids
