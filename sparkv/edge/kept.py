"""Asks answered from the on-device context service, and loads kept there: :class:`KeptAsks`.

``EdgeSession(context_service=...)`` with ``ask(..., keep=True)`` keeps a loaded cache in the
service as a managed context, labelled by the server and the context id, and a later question
about the same context is answered from the service (no manifest, no plan, no load): chunks the
service evicted entirely may come back from the server's stream (docs/device-service.md, "SparKV
joins").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from sparkv.cache import KVMemoryError
from sparkv.device.tails import Rows
from sparkv.edge.answer import AskResult, Breakdown
from sparkv.edge.client import EdgeClient
from sparkv.edge.options import AskOptions
from sparkv.edge.planning import AskError

if TYPE_CHECKING:
    from sparkv.cache import ContextKV
    from sparkv.device.contract import KeptContexts


#: what an ask appended after its context: its ids (the question and the answer less its last
#: token) and their KV (:data:`sparkv.device.tails.Rows`)
AppendedTurn = tuple[list[int], Rows]


def appended_turn(kv: ContextKV, suffix: Sequence[int], answer: Sequence[int]
                  ) -> AppendedTurn | None:
    """The KV ``kv`` holds appended after its context (``suffix``, then ``answer`` less its last
    token), and ``kv`` truncated to its context; ``None`` when it holds anything else."""
    try:
        ids = [*suffix, *answer[:-1]]
        count = min(kv.positions) - kv.geometry.num_tokens
        return (ids, kv.appended(count)) if answer and count == len(ids) else None
    finally:
        kv.truncate()


def question_turn(kv: ContextKV, suffix: Sequence[int]) -> AppendedTurn | None:
    """The KV of ``suffix`` (a question) that ``kv`` holds appended after its context, copied
    (``kv`` stays as it is); ``None`` when it holds anything else or ``suffix`` is empty (the
    context is then kept without it: no failure of the ask)."""
    count = min(kv.positions) - kv.geometry.num_tokens
    if not suffix or count != len(suffix):
        return None
    try:
        return list(suffix), kv.appended(count)
    except KVMemoryError:                 # a head that does not hold every appended token
        return None


class KeptAsks:
    """The kept contexts of one server (``client``) in ``service`` (``None``: no service; then
    every use raises :class:`AskError`)."""

    def __init__(self, client: EdgeClient, service: KeptContexts | None) -> None:
        self.client = client
        self._service = service

    def label(self, context_id: str) -> str:
        """The service's label of the server's context ``context_id``."""
        return f"{self.client.base_url}#{context_id}"

    def service(self) -> KeptContexts:
        if self._service is None:
            raise AskError("keep=True needs a context service (EdgeSession(context_service=...))")
        return self._service

    def awaited(self, context_id: str) -> bool:
        """Whether other asks wait for the server's context ``context_id`` that this ask loads
        (then it is kept at the answer's first token: :meth:`KeptContexts.awaited
        <sparkv.device.contract.KeptContexts.awaited>`)."""
        return self.service().awaited(self.label(context_id))

    def keep(self, context_id: str, tokens: list[int], kv: ContextKV,
             turn: AppendedTurn | None = None) -> str | None:
        """Keeps a loaded cache in the service, and the ask's ``turn`` with it (for the next
        question of the same conversation); returns its id there (``None``: not kept)."""
        return self.service().import_context(tokens, kv, label=self.label(context_id),
                                             turn=turn)

    def keep_turn(self, kept_id: str, turn: AppendedTurn) -> None:
        """Keeps the ask's ``turn`` after the context it kept as ``kept_id``."""
        self.service().keep_turns(kept_id, *turn)

    def answer(self, fingerprint: str, context_id: str, suffix: Sequence[int],
               options: AskOptions, t_start: float) -> AskResult | None:
        """The answer from the service if it holds the context (else ``None``); TTFT counts
        from ``t_start`` (``perf_counter()`` at the ask). Raises :class:`AskError` when the
        service runs another model (``fingerprint``: the session's)."""
        from sparkv.device.remote import server_stream

        svc = self.service()
        if svc.lm.fingerprint != fingerprint:
            raise AskError("the context service runs another model than this session")
        sid = svc.find(self.label(context_id))
        if sid is None:
            return None
        # chunks the service evicted entirely may come back from the server (made lazily: a
        # resident context fetches nothing)
        remote = server_stream(self.client, context_id)
        res = svc.call(sid, prompt_ids=list(suffix), max_new_tokens=options.max_new_tokens,
                       grow=False, stop_at_eos=options.stop_at_eos, remote=remote,
                       stop=options.stop, sampling=options.sampling)
        ttft = (time.perf_counter() - t_start) - (res.total_s - res.first_token_s)
        load = res.load
        streamed = load.streamed_chunks if load is not None else 0
        bd = Breakdown("kept", ttft, loading_s=res.switch_s,
                       question_prefill_s=res.first_token_s - res.switch_s,
                       chunks_computed=load.recomputed_chunks if load is not None else 0,
                       chunks_streamed=streamed,
                       bytes_streamed=remote.stats.bytes if streamed else 0,
                       turn_tokens_reused=res.turn_tokens_reused, seed=options.seed,
                       joined=res.joined,
                       memory_sources=dict(load.sources) if load is not None else {})
        return AskResult(res.text, res.tokens, bd, None, None, None, None, res.context_tokens,
                         sid, question_tokens=len(suffix))


@dataclass
class AskKeeping:
    """One ask's keeping of the cache it loaded: at its answer's first token when other asks
    wait for the context (:meth:`early`, :meth:`KeptAsks.awaited`: they then read the kept copy
    while this ask answers from its own cache), else after the answer, with its turn
    (:meth:`end`)."""

    kept: KeptAsks
    context_id: str
    kept_id: str | None = None
    #: the seconds the keeping took at the first token; ``None``: kept after the answer
    early_s: float | None = None

    def early(self, tokens: list[int], kv: ContextKV, suffix: Sequence[int] = ()) -> None:
        """At the answer's first token (``kv`` holds the context, then ``suffix``, the
        question): keeps the context now if other asks wait for it, and the question's KV as
        the app's turn after it (:func:`question_turn`): a waiting ask of the same question
        (another choice of the request) runs only its last token."""
        if self.early_s is not None or not self.kept.awaited(self.context_id):
            return
        t0 = time.perf_counter()
        self.kept_id = self.kept.keep(self.context_id, tokens, kv, question_turn(kv, suffix))
        self.early_s = time.perf_counter() - t0

    def end(self, tokens: list[int], kv: ContextKV, turn: AppendedTurn | None) -> str | None:
        """After the answer: keeps the context (unless kept early) and the answer's ``turn``;
        the kept id (``None``: not kept)."""
        if self.early_s is None:
            self.kept_id = self.kept.keep(self.context_id, tokens, kv, turn)
        elif self.kept_id is not None and turn is not None:
            self.kept.keep_turn(self.kept_id, turn)
        return self.kept_id
