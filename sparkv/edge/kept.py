"""Asks answered from the on-device context service, and loads kept there: :class:`KeptAsks`.

``EdgeSession(context_service=...)`` with ``ask(..., keep=True)`` keeps a loaded cache in the
service as a managed context, labelled by the server and the context id, and a later question
about the same context is answered from the service (no manifest, no plan, no load): chunks the
service evicted entirely may come back from the server's stream (docs/device-service.md, "SparKV
joins").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

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

    def keep(self, context_id: str, tokens: list[int], kv: ContextKV,
             turn: AppendedTurn | None = None) -> str | None:
        """Keeps a loaded cache in the service, and the ask's ``turn`` with it (for the next
        question of the same conversation); returns its id there (``None``: not kept)."""
        svc = self.service()
        sid = svc.import_context(tokens, kv, label=self.label(context_id))
        if sid is not None and turn is not None:
            svc.keep_turns(sid, *turn)
        return sid

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
                       joined=res.joined)
        return AskResult(res.text, res.tokens, bd, None, None, None, None, res.context_tokens,
                         sid, question_tokens=len(suffix))
