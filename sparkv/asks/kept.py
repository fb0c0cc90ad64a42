"""One app's view of the service's kept contexts: what an ask's
:class:`~sparkv.edge.session.EdgeSession` is given as its ``context_service``.

An ask keeps the context it loaded (``keep``, the default through the service) as a context of
the service's :class:`~sparkv.device.service.ContextService`, under the LLMS budget, so that the
next question about it is answered from memory. Through :class:`AppContexts`:

* a kept context is the asking app's (:class:`~sparkv.device.owners.ContextOwners`), shared with
  the apps the ask named (``share``);
* ``find`` sees only contexts the app may see (its own, those shared with it): another app's
  copy of the same server context is not found, and that app loads its own;
* **one load per context at a time**: while one ask of an app loads a context, another ask of the
  same app about it waits for that load (:class:`KeepingTable`), then is answered from the kept
  copy; if the first ask fails or is cancelled, one of the waiting asks loads it instead;
* **kept early when awaited**: when other asks of the app wait for the context the ask loaded
  (the other choices of its request, say), it keeps it at its answer's first token rather than
  after the answer (:meth:`AppContexts.awaited`), so they read the kept copy while it answers
  from its own cache: they start one answer sooner (``KeepingTable(early=False)``: always
  after);
* a context that cannot be kept (the budget, the flash) does not fail the ask that loaded it: the
  answer stands, ``kept_id`` is ``None`` and :attr:`AppContexts.not_kept` says why.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Callable, Sequence

from sparkv.device.errors import DeviceError
from sparkv.device.owners import ContextOwners
from sparkv.device.service import ContextService
from sparkv.edge.lane import AskCancelled

if TYPE_CHECKING:
    from sparkv.asks.choicecopy import ChoicesCopy
    from sparkv.cache import ContextKV, LayerKV
    from sparkv.device.calls import CallResult
    from sparkv.device.remote import RemoteSource
    from sparkv.device.tails import Rows
    from sparkv.runtime.sampling import Sampling

__all__ = ["AppContexts", "KeepingTable"]

WAIT_S = 0.05


class KeepingTable:
    """Which kept contexts are being loaded now, by which ask: ``(app, label) -> AppContexts``,
    and how many asks wait for each. One condition variable; a waiting ask looks at its
    cancellation every :data:`WAIT_S`. ``early``: a loader that others wait for keeps the
    context at its answer's first token (module docstring)."""

    def __init__(self, early: bool = True) -> None:
        self.cv = threading.Condition()
        self.early = early
        self.loading: dict[tuple[str, str], AppContexts] = {}
        self.waiting: Counter[tuple[str, str]] = Counter()


class AppContexts:
    """The context service as one ask of ``app`` sees it (module docstring).

    Args:
        service: the device's context service.
        owners: whose each context is.
        app: the asking app.
        share: the apps a context this ask keeps is shared with.
        table: the loads under way (shared by every ask of the service).
        cancelled: the ask's cancellation (a wait for another ask's load ends with it).
        copy: the ask is a choice of a request that keeps nothing: it keeps and finds under
            its group's own label, never shared, and the group deletes what it kept at its
            end (:mod:`sparkv.asks.choicecopy`).

    ``streams_nothing`` (set by the service, ``None`` by default) is called when :meth:`find`
    begins to wait for another ask's load and when it finds the context kept: the service's
    link plan then hears that this ask streams nothing (sparkv.asks.linkplan: an ask not heard
    from holds the later asks off the link for a while).
    """

    def __init__(self, service: ContextService, owners: ContextOwners, app: str,
                 share: Sequence[str], table: KeepingTable, cancelled: threading.Event, *,
                 copy: ChoicesCopy | None = None) -> None:
        self.service, self.owners, self.app = service, owners, app
        self.share = list(share) if copy is None else []
        self.copy = copy
        self._table, self._cancelled = table, cancelled
        self._leading: tuple[str, str] | None = None
        self.not_kept: str | None = None
        self.lm = service.lm
        self.streams_nothing: Callable[[], object] | None = None

    # ---- what EdgeSession uses -------------------------------------------------------------
    def find(self, label: str) -> str | None:
        """The id of the app's (most recently used) context labelled ``label``; ``None`` when
        there is none, after waiting for another ask of the app that is loading it now. A
        ``None`` makes this ask the one loading it (until it keeps it, or ends)."""
        label = self._label(label)
        key = (self.app, label)
        table = self._table
        with table.cv:
            counted = False
            try:
                while True:
                    found = self._visible(label)
                    if found is not None:
                        self._say_streams_nothing()
                        return found
                    leader = table.loading.get(key)
                    if leader is None or leader is self:
                        table.loading[key] = self
                        self._leading = key
                        return None
                    if self._cancelled.is_set():
                        raise AskCancelled("the ask was cancelled")
                    if not counted:
                        table.waiting[key] += 1
                        counted = True
                        self._say_streams_nothing()
                    table.cv.wait(WAIT_S)
            finally:
                if counted:
                    table.waiting -= Counter({key: 1})

    def _say_streams_nothing(self) -> None:
        if self.streams_nothing is not None:
            self.streams_nothing()

    def awaited(self, label: str) -> bool:
        """Whether other asks of the app wait for the context labelled ``label`` that this ask
        loads (then it keeps it at its first token, unless the table says ``early=False``)."""
        with self._table.cv:
            return self._table.early and self._table.waiting[(self.app, self._label(label))] > 0

    def _label(self, label: str) -> str:
        return label if self.copy is None else self.copy.label(label)

    def _visible(self, label: str) -> str | None:
        # the ids only (a waiting ask looks every WAIT_S: describing every context, as
        # ``list`` does, starved the loader of the lock and the cores with three asks waiting)
        return next((c for c in self.service.labelled(label)
                     if self.owners.visible(c, self.app)), None)

    def import_context(self, token_ids: Sequence[int], layers: ContextKV | LayerKV, *,
                       label: str | None = None,
                       turn: tuple[Sequence[int], Rows] | None = None) -> str | None:
        """Keeps the loaded cache as the app's context (shared as the ask said), and ``turn``
        as the app's; ``None`` when the service cannot keep it now (:attr:`not_kept` says
        why)."""
        try:
            cid = self.service.import_context(
                token_ids, layers, label=None if label is None else self._label(label),
                turn=turn, turn_scope=self.app, ahead=self.copy is None)
        except DeviceError as e:
            self.not_kept = f"{e.code}: {e}"
            return None
        self.owners.claim(cid, self.app, self.share)
        if self.copy is not None:
            self.copy.kept(cid)
        self.done()
        return cid

    def call(self, ctx_id: str, *, prompt_ids: Sequence[int], max_new_tokens: int, grow: bool,
             stop_at_eos: bool, remote: RemoteSource | None, stop: Sequence[str] = (),
             sampling: Sampling | None = None) -> CallResult:
        return self.service.call(ctx_id, prompt_ids=prompt_ids, max_new_tokens=max_new_tokens,
                                 grow=grow, stop_at_eos=stop_at_eos, remote=remote, stop=stop,
                                 turn_scope=self.app, sampling=sampling)

    def keep_turns(self, ctx_id: str, token_ids: Sequence[int], rows: Rows) -> bool:
        return self.service.keep_turns(ctx_id, token_ids, rows, turn_scope=self.app)

    # ---- the ask's end ---------------------------------------------------------------------
    def done(self) -> None:
        """This ask no longer loads a context (kept, failed or cancelled): an ask waiting for
        it looks again."""
        with self._table.cv:
            if self._leading is not None and self._table.loading.get(self._leading) is self:
                del self._table.loading[self._leading]
            self._leading = None
            self._table.cv.notify_all()
