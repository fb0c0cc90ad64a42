"""What the edge needs from the on-device context service: :class:`KeptContexts`.

``EdgeSession(context_service=...)`` keeps a loaded cache there (``ask(keep=True)``) and answers a
later question about the same context from it (docs/device-service.md, "SparKV joins"): it
imports the cache under a label, finds it by that label, and calls it with the question's token
ids, a server copy (a :class:`~sparkv.device.remote.RemoteSource`) to restore missing chunks
from, and ``grow=False``. The answer is a :class:`~sparkv.device.calls.CallResult`, whose
``load`` (:class:`~sparkv.device.loader.LoadStats`) says what was restored and whose
``context_tokens`` is the context's length.

:class:`~sparkv.device.service.ContextService` implements it (mypy checks the service against it
where the CLI and the demo give a session one); the session depends on nothing else of the
service.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    from sparkv.cache import ContextKV, LayerKV
    from sparkv.device.calls import CallResult
    from sparkv.device.remote import RemoteSource
    from sparkv.device.tails import Rows
    from sparkv.runtime.model import LoadedModel
    from sparkv.runtime.sampling import Sampling


class KeptContexts(Protocol):
    """The contexts a device service keeps, as the edge uses them (module docstring)."""

    @property
    def lm(self) -> LoadedModel:
        """The service's model (a session keeps contexts only in a service of its own model)."""
        ...

    def import_context(self, token_ids: Sequence[int], layers: ContextKV | LayerKV, *,
                       label: str | None = None,
                       turn: tuple[Sequence[int], Rows] | None = None) -> str | None:
        """Adopts a context whose KV was loaded elsewhere; returns its id (``None``: a view
        that cannot keep it now, as an app's view in :mod:`sparkv.asks` under a full budget:
        the answer stands, ``AskResult.kept_id`` is ``None``). ``turn``: ids and their KV
        computed after it, kept as :meth:`keep_turns` keeps them before any call can find
        the context (the question of the ask that loaded it, for the other choices of its
        request)."""
        ...

    def find(self, label: str) -> str | None:
        """The id of the context imported with ``label``, or ``None``."""
        ...

    def awaited(self, label: str) -> bool:
        """Whether other asks wait for the context labelled ``label`` that this one loads: then
        the session imports it at the answer's first token rather than after the answer, so
        that they read it while this ask answers from its own cache."""
        ...

    def call(self, ctx_id: str, *, prompt_ids: Sequence[int], max_new_tokens: int, grow: bool,
             stop_at_eos: bool, remote: RemoteSource | None, stop: Sequence[str] = (),
             sampling: Sampling | None = None) -> CallResult:
        """Answers ``prompt_ids`` in context ``ctx_id`` (restoring its missing chunks from
        flash, by recomputation or from ``remote``; each answer token chosen as ``sampling``
        says, default greedy)."""
        ...

    def keep_turns(self, ctx_id: str, token_ids: Sequence[int], rows: Rows) -> bool:
        """Keeps ``rows``, the KV of ``token_ids`` computed after context ``ctx_id`` (the ask
        that kept it: its question and answer), for the next call of the same conversation
        (:mod:`sparkv.device.tails`); returns whether they are kept."""
        ...


__all__ = ["KeptContexts"]
