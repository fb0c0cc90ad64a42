"""Asks through the device service: many apps ask about server contexts, one model answers
(docs/device-service.md, "Asks").

    asks = AskService(contexts, owners, slots=2, queue=16, shaper=LinkShaper.constant(20))
    ticket = asks.submit("app:notes", AskRequest(server_url, context_id, "What is it about?"))
    for event in ticket.events():        # token events as they are generated, then done/error
        ...

An ask is an :meth:`EdgeSession.ask <sparkv.edge.session.EdgeSession.ask>` run by the service
for an app, on the service's one model, its one link and its kept contexts:

* **admission** (:mod:`sparkv.asks.admission`): ``slots`` asks run at once, ``queue`` more wait
  in arrival order; past that :meth:`AskService.submit` raises ``QueueFull`` (429 with
  ``Retry-After``);
* **the cores** (:mod:`sparkv.asks.cores`): every unit of an ask's compute (layer steps, the
  question's and each answer token's forward pass) goes through the service's
  :class:`~sparkv.asks.cores.CoreGate`, one at a time, in turn;
* **the plan knows the others**: an unplanned ask plans with the device's learned speed times
  the asks running now (its compute share) and with the link's estimated rate over the asks on
  it (its link share); every ask's controller follows the load as asks come and go
  (:attr:`ComputeEstimator.load <sparkv.scheduler.estimators.ComputeEstimator.load>`);
* **the link's plan across asks** (:mod:`sparkv.asks.linkplan`): a planned ask (SparKV's, under
  the default ``oldest`` policy) sends requests only on its turn, and starts from a plan with
  the link's whole rate and the device's whole speed (as if alone); its controller then plans
  with the bytes of the asks ranked before it and with the share of the cores the asks before
  it measurably took (:meth:`CoreGate.busy_load <sparkv.asks.cores.CoreGate.busy_load>`), and
  computes what waiting for the link would delay: the device-wide split;
* **one link**: every server client of the service reads through one
  :class:`~sparkv.edge.shaper.LinkShaper` (an emulated link when the service was given one);
* **kept contexts** (:mod:`sparkv.asks.kept`): a loaded context is kept for the asking app (by
  default), under the service's memory budget; the next ask about it, from that app or one it
  shared it with, is answered from memory;
* **events** (:class:`AskTicket`): ``queued`` (its place when it waits), ``token`` (each answer
  token as generated: its id and the text it adds), then ``done`` (``text``, ``tokens``, ``stats``)
  or ``error`` (status, code, message). :meth:`AskTicket.cancel` (the route calls it when the
  client goes away) stops the ask within one unit of compute and frees its memory.

State: the tickets running (each owned by its runner thread), the server clients (one per server
and key), the shared priors; one lock guards the tables.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import threading
import time
from typing import Any, Sequence

from sparkv.asks import forward
from sparkv.asks.admission import Admission, Place
from sparkv.asks.choicecopy import ChoicesCopy, drop_leftovers
from sparkv.asks.cores import BATCH_STEPS, DECODE_BATCH, CoreGate
from sparkv.asks.kept import AppContexts, KeepingTable
from sparkv.asks.linkplan import LinkPlan, LinkSeat
from sparkv.asks.orders import DEFAULT_ORDER
from sparkv.asks.tickets import AskRequest, AskTicket, prompt_entries
from sparkv.device.errors import DeviceError
from sparkv.device.owners import ContextOwners
from sparkv.device.service import ContextService
from sparkv.edge.lane import AskCancelled
from sparkv.edge.shaper import LinkShaper
from sparkv.protocol.errors import ApiError, ManifestError, ServerUnavailable
from sparkv.runtime import promptscore
from sparkv.runtime.heap import trim_heap
from sparkv.runtime.promptscore import PromptScorer

__all__ = ["AskService", "BadServerUrl", "ask_error"]

log = logging.getLogger("sparkv.asks")

#: how long a closing service waits for its asks' threads
CLOSE_WAIT_S = 30.0


def _cancelled(exc: BaseException | None) -> bool:
    """Whether ``exc`` is, or was caused by, an :class:`AskCancelled` (the engine reports a
    cancelled load as its own error, caused by it)."""
    while exc is not None:
        if isinstance(exc, AskCancelled):
            return True
        exc = exc.__cause__
    return False


class BadServerUrl(DeviceError, status=400, code="bad_server_url"):
    """The ask's server URL is not one a client can reach (its host or port is invalid)."""


def ask_error(exc: BaseException) -> tuple[int, str, str]:
    """``(status, code, message)`` of an ask that failed with ``exc``."""
    if _cancelled(exc):
        return 499, "cancelled", "the ask was cancelled (its client went away)"
    if isinstance(exc, DeviceError):
        return exc.status, exc.code, str(exc)
    if isinstance(exc, ApiError):
        return exc.status, exc.code, f"the server answered: {exc.message}"
    if isinstance(exc, ServerUnavailable):
        return 502, "server_unavailable", str(exc)
    if isinstance(exc, ManifestError):
        return 502, "bad_manifest", str(exc)
    from sparkv.edge.planning import AskError

    if isinstance(exc, AskError):
        cause = exc.__cause__
        if isinstance(cause, (ServerUnavailable, ApiError)):
            return 502, "server_unavailable", str(exc)
        return 400, "bad_ask", str(exc)
    return 500, "internal_error", f"{type(exc).__name__}: {exc}"


class PromptNotScored(DeviceError, status=500, code="prompt_not_scored"):
    """The ask's answer path ran its question without the pass that scores it."""


def _prompt_entries(scorer: PromptScorer) -> list[dict[str, Any]]:
    """The ``done`` event's ``prompt`` (:func:`~sparkv.asks.tickets.prompt_entries`);
    :class:`PromptNotScored` when the ask's path did not score it."""
    entries = prompt_entries(scorer)
    if entries is None:
        raise PromptNotScored("the question's log-probabilities were not computed on this "
                              "ask's path")
    return entries


class _LinkShare:
    """The link's estimated rate, shared by plan: an ask plans with the rate over the asks on
    the link now (itself included). The estimate is each finished ask's own measured rate times
    the asks it shared the link with (a moving average)."""

    def __init__(self) -> None:
        self.total_Bps: float | None = None

    def plan_Bps(self, sharers: int) -> float | None:
        return self.total_Bps / max(1, sharers) if self.total_Bps else None

    def learn(self, own_Bps: float | None, sharers: float) -> None:
        if not own_Bps or not math.isfinite(own_Bps):
            return
        total = own_Bps * max(1.0, sharers)
        self.total_Bps = total if self.total_Bps is None else 0.5 * self.total_Bps + 0.5 * total


class AskService:
    """Asks for many apps over one model, one link and one KV memory (module docstring).

    Args:
        contexts: the device's context service (its model answers; its budget keeps).
        owners: whose each kept context is.
        slots: asks running at once; queue: asks waiting beyond them.
        shaper: the link every server client reads through (``None``: unshaped).
        timeout_s: each server request's timeout.
        engine_config: the engines' knobs (``None``: their defaults).
        default_server, default_api_key: for asks that name no server or key.
        core_order: the order the cores are granted in (:data:`~sparkv.asks.cores.GRANT_ORDERS`).
        link_plan: how the asks share the link (:data:`~sparkv.asks.linkplan.LINK_PLANS`).
        batch: run the layer steps asks wait with at the same layer as one call
            (:class:`~sparkv.asks.cores.CoreGate`, up to :data:`~sparkv.asks.cores.BATCH_STEPS`).
        decode_batch: the most answer tokens (one per ask) one forward pass runs (1: each its
            own; :data:`~sparkv.asks.cores.DECODE_BATCH`).
        early_keep: an ask that loaded a context other asks of its app wait for keeps it at its
            answer's first token, so that they start one answer sooner (:mod:`sparkv.asks.kept`);
            ``False``: after.
    """

    def __init__(self, contexts: ContextService, owners: ContextOwners, *, slots: int = 2,
                 queue: int = 16, shaper: LinkShaper | None = None, timeout_s: float = 10.0,
                 engine_config: Any = None, default_server: str | None = None,
                 default_api_key: str | None = None, core_order: str = DEFAULT_ORDER,
                 link_plan: str = "oldest", batch: bool = False,
                 decode_batch: int = DECODE_BATCH, early_keep: bool = True) -> None:
        from sparkv.edge.session import Priors

        self.contexts, self.owners = contexts, owners
        self.lm = contexts.lm
        self.admission = Admission(slots, queue)
        self.gate = CoreGate(order=core_order, batch=BATCH_STEPS if batch else 1,
                             decode_batch=decode_batch)
        self.link_plan = LinkPlan(link_plan)
        self.shaper = shaper or LinkShaper.unlimited()
        self.timeout_s = timeout_s
        self.engine_config = engine_config
        self.default_server, self.default_api_key = default_server, default_api_key
        self.priors = Priors()
        self._link = _LinkShare()
        self._keeping = KeepingTable(early=early_keep)
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str | None], Any] = {}
        self._tickets: dict[str, AskTicket] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._ids = itertools.count(1)
        self._started = itertools.count(1)
        self.counters = {"asks": 0, "done": 0, "failed": 0, "cancelled": 0}

        self.eos = self.lm.eos_ids
        forward.install(self.lm.model)
        try:
            promptscore.install(self.lm.model)
        except TypeError as e:           # an ask with prompt_logprobs then fails, saying why
            log.warning("prompts cannot be scored: %s", e)
        drop_leftovers(contexts, owners)             # choices' copies a crash left

    def warm(self) -> float:
        """Makes now, at the service's start, what its first ask would otherwise make inside its
        time to the first token (docs/asks.md, "A fresh service's first ask"): the edge's
        step-cost model of the service's model (:func:`~sparkv.edge.planning.device_cost_model`,
        made once per process: the model's steps measured when no ``sparkv profile`` matches,
        ~0.8 s on a 2-core CPU), the tokenizer's compiled chat template (~45 ms) and the client
        of the default server (``--ask-server``; ~35 ms, most of it the process's one TLS
        context, :func:`~sparkv.edge.bounds.tls_context`, which a client of another server then
        shares) and the vocabulary's texts that a JSON answer's chooser reads
        (:func:`~sparkv.runtime.guided.vocabulary`; ~0.13 s for SmolLM2's 49,152 tokens).
        Returns the seconds it took."""
        from sparkv.edge.bounds import tls_context
        from sparkv.edge.planning import device_cost_model
        from sparkv.edge.prompts import question_suffix
        from sparkv.runtime.guided import vocabulary

        t0 = time.perf_counter()
        device_cost_model(self.lm)
        question_suffix(self.lm, "?")
        if self.lm.tokenizer is not None:
            vocabulary(self.lm)
        tls_context()
        if self.default_server is not None:
            self._client(self.default_server, self.default_api_key)
        return time.perf_counter() - t0

    # ---- the API ---------------------------------------------------------------------------
    def submit(self, app: str, request: AskRequest) -> AskTicket:
        """Starts an ask for ``app`` (running, or waiting for a slot); raises ``QueueFull`` when
        the queue is full, ``ShuttingDown`` once closing."""
        return self._start(app, request, self.admission.enter())

    def submit_group(self, app: str, requests: Sequence[AskRequest]) -> list[AskTicket]:
        """Starts the asks of one request's choices for ``app``: they share one slot (or one
        place in the queue: :meth:`Admission.enter_group
        <sparkv.asks.admission.Admission.enter_group>`) and start together. A group that keeps
        nothing (``keep`` off) still loads the context once: its choices share a copy deleted
        at the group's end (:mod:`sparkv.asks.choicecopy`)."""
        places = self.admission.enter_group(len(requests))
        copy = None
        if len(requests) > 1 and not any(r.options.keep for r in requests):
            copy = ChoicesCopy(len(requests))
            requests = [dataclasses.replace(r, options=dataclasses.replace(r.options, keep=True),
                                            share=()) for r in requests]
        return [self._start(app, r, p, copy) for r, p in zip(requests, places)]

    def _start(self, app: str, request: AskRequest, place: Place,
               copy: ChoicesCopy | None = None) -> AskTicket:
        with self._lock:
            ask_id = f"ask-{next(self._ids)}"
            ticket = AskTicket(ask_id, app, request, place, self._detokenize)
            ticket.copy = copy
            thread = threading.Thread(target=self._run, args=(ticket,), daemon=True,
                                      name=f"sparkv-{ask_id}")
            self._tickets[ask_id] = ticket
            self._threads[ask_id] = thread
            self.counters["asks"] += 1
        thread.start()
        return ticket

    def ask(self, app: str, request: AskRequest, timeout_s: float | None = None
            ) -> dict[str, Any]:
        """:meth:`submit` and wait: the ``done`` or ``error`` event."""
        return self.submit(app, request).wait(timeout_s)

    def stats(self) -> dict[str, Any]:
        """The admission's counts, the cores' (lanes, load, units, the KV memories the asks
        hold), the counters, the link's estimated rate (bytes/s, ``None`` before any stream),
        the bytes it carried and its plan's (:meth:`LinkPlan.stats
        <sparkv.asks.linkplan.LinkPlan.stats>`)."""
        with self._lock:
            counters = dict(self.counters)
        return {**self.admission.stats(), "cores": self.gate.stats(), **counters,
                "link_Bps": self._link.total_Bps, "link_bytes": self.shaper.bytes_taken,
                "link_plan": self.link_plan.stats()}

    def close(self) -> None:
        """Takes no new ask, cancels the running ones and waits for their threads (at most
        :data:`CLOSE_WAIT_S`); closes the server clients."""
        self.admission.close()
        with self._lock:
            tickets = list(self._tickets.values())
            threads = list(self._threads.values())
        for t in tickets:
            t.cancel()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            c.close()

    # ---- one ask ---------------------------------------------------------------------------
    def _run(self, ticket: AskTicket) -> None:
        kept: AppContexts | None = None
        try:
            if not ticket.place.running:
                ticket.put({"type": "queued", "position": ticket.place.position()})
            if not ticket.place.wait(ticket.cancelled):
                raise AskCancelled("cancelled while queued")
            ticket.started = next(self._started)
            kept = AppContexts(self.contexts, self.owners, ticket.app, ticket.request.share,
                               self._keeping, ticket.cancelled, copy=ticket.copy)
            done = self._answer(ticket, kept)
            self._leave_copy(ticket)        # gone before the request's last answer is out
            ticket.finish(done)
            self._count("done")
        except BaseException as e:  # noqa: BLE001 - every failure is the ask's error event
            self._leave_copy(ticket)
            status, code, message = ask_error(AskCancelled() if ticket.cancelled.is_set() else e)
            if status == 500:
                log.error("ask %s failed", ticket.id, exc_info=True)
            ticket.finish({"type": "error", "error": {"status": status, "code": code,
                                                      "message": message}})
            self._count("cancelled" if status == 499 else "failed")
        finally:
            if kept is not None:
                kept.done()
            self._leave_copy(ticket)
            ticket.place.leave()
            with self._lock:
                self._tickets.pop(ticket.id, None)
                self._threads.pop(ticket.id, None)
            _free_now()

    def _leave_copy(self, ticket: AskTicket) -> None:
        """The ask leaves its group's copy (once): the last to leave deletes it."""
        copy, ticket.copy = ticket.copy, None
        if copy is not None:
            try:
                copy.leave(self.contexts, self.owners)
            except Exception:  # noqa: BLE001 - the answer stands; the next start drops it
                log.error("the choices' copy of ask %s was not deleted", ticket.id,
                          exc_info=True)

    def _answer(self, ticket: AskTicket, kept: AppContexts) -> dict[str, Any]:
        """Runs the ask on a lane; the ``done`` event."""
        from sparkv.edge.session import EdgeSession
        from sparkv.runtime.threads import use_threads

        req = ticket.request
        # the service's count, not this new thread's: frame decoders leave the process-wide
        # count at 1 (sparkv.runtime.threads)
        use_threads(self.contexts.threads)
        lane = ticket.lane = self.gate.lane()
        seat = lane.seat = self.link_plan.seat(lane.id, req.options.strategy)
        kept.streams_nothing = lambda: seat.turn(0.0)   # it waits for a load, or reads a kept one
        if ticket.cancelled.is_set():
            lane.cancel()
        sharers = self.admission.stats()["running"]
        session = EdgeSession(self._client(req.server, req.api_key), self.lm,
                              priors=self._plan_priors(sharers, seat),
                              engine_config=self.engine_config, context_service=kept)
        scorer = ticket.scorer = self._scorer(req)
        t0 = time.perf_counter()
        try:
            with forward.bound(lane, ticket.token, req.logprobs), promptscore.scoring(scorer):
                res = session.ask(req.context_id, req.question, req.options, lane=lane)
        finally:
            lane.close()
            seat.close()
        # a planned ask streamed on its turn, the link mostly its own: its rate is the link's
        self._learn(session, res, 1.0 if seat.planned
                    else (sharers + self.admission.stats()["running"]) / 2)
        return {"type": "done", "id": ticket.id, "text": res.text, "tokens": res.tokens,
                "stats": res.stats,
                # a group's copy is no keeping of the app's: deleted at the end, never reported
                "kept_id": res.kept_id if ticket.copy is None else None,
                "not_kept": kept.not_kept if ticket.copy is None else None,
                "started": ticket.started,
                "queued_s": t0 - ticket.submitted, "first_token_s": ticket.first_token_s,
                "total_s": time.perf_counter() - ticket.submitted,
                "lane": {"units": lane.units, "waited_s": lane.waited_s},
                "prompt": None if scorer is None else _prompt_entries(scorer)}

    def _scorer(self, req: AskRequest) -> PromptScorer | None:
        """The scorer of the ask's question tokens, when it asks for them."""
        from sparkv.edge.prompts import question_suffix

        if req.prompt_logprobs is None:
            return None
        ids = question_suffix(self.lm, req.question, req.options.chat)
        return PromptScorer(tuple(ids), req.prompt_logprobs)

    def _plan_priors(self, sharers: int, seat: LinkSeat) -> Any:
        """This ask's starting point: the device's priors, its compute share (the learned
        speed times the asks running now) and its link share (an even one). A planned ask
        (``seat``) plans as if alone, with the link's whole rate and the device's speed: the
        bytes of the asks before it on the link and their share of the cores come to its
        controller as they change (:meth:`AskLane.load <sparkv.asks.cores.AskLane.load>`: the
        cores' measured busy time; its estimator's ratio is then the device's speed against
        an unshared prediction)."""
        from sparkv.edge.session import Priors

        p = self.priors
        share = 1 if seat.planned else max(1, sharers)
        return Priors(bandwidth_Bps=self._link.plan_Bps(1 if seat.planned else sharers)
                      or p.bandwidth_Bps,
                      compute_scale=p.compute_scale * share,
                      question_prefill_s=p.question_prefill_s,
                      stream_tax_s=p.stream_tax_s, receive_tax=p.receive_tax,
                      decode_scale=p.decode_scale)

    def _learn(self, session: Any, res: Any, sharers: float) -> None:
        """Folds what the ask measured into the device's priors: the compute speed (its steps'
        own times exclude the waits for the cores, so the session's learned scale is the
        device's), the link's rate over its sharers, the question's prefill, and what
        streaming costs the compute path (the stream and receive taxes: a load that shared
        the cores with other asks says nothing of them, :class:`~sparkv.edge.session.Priors`;
        nor of the frames' decoding)."""
        load = res.load
        if load is not None and load.compute_samples >= 4:
            self.priors.compute_scale = session.priors.compute_scale
        self.priors.stream_tax_s = session.priors.stream_tax_s
        self.priors.receive_tax = session.priors.receive_tax
        self.priors.decode_scale = session.priors.decode_scale
        if load is not None:
            self._link.learn(load.link_estimate_Bps, sharers)
        if session.priors.question_prefill_s is not None:
            self.priors.question_prefill_s = session.priors.question_prefill_s

    def context_tokens(self, app: str, ask: AskRequest, strict: bool = False) -> int | None:
        """The tokens of the context ``ask`` is about: its kept copy's that ``app`` may use,
        else its manifest's (fetched unless this service's client has it); ``None`` when it
        cannot be known now (the ask will say why when it runs), or with ``strict`` the
        fetch's error raised. Blocking."""
        client = self._client(ask.server, ask.api_key)
        label = f"{client.base_url}#{ask.context_id}"
        kept = [c for c in self.contexts.list()
                if c.label == label and self.owners.visible(c.id, app)]
        if kept:
            return kept[0].tokens
        manifest = client.known_manifest(ask.context_id)
        if manifest is None:
            try:
                manifest = client.manifest(ask.context_id)
            except Exception as e:        # any failure: the ask meets it and says it
                if strict:
                    raise
                log.info("the tokens of context %s are not known now (%s)",
                         ask.context_id, e)
                return None
        return manifest.num_tokens

    def _client(self, server: str, api_key: str | None) -> Any:
        """The server's client for ``api_key`` (one per server and key; every one reads through
        the service's link)."""
        from sparkv.edge.client import EdgeClient

        key = (server.rstrip("/"), api_key)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                try:
                    client = EdgeClient(key[0], api_key, shaper=self.shaper,
                                        timeout_s=self.timeout_s)
                except ValueError as e:
                    raise BadServerUrl(str(e)) from None
                self._clients[key] = client
            return client

    def _detokenize(self, tokens: list[int]) -> str:
        return self.lm.decode_tokens([t for t in tokens if t not in self.eos])

    def _count(self, what: str) -> None:
        with self._lock:
            self.counters[what] += 1

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Whether every ask finished within ``timeout_s`` (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._threads:
                    return True
            time.sleep(0.02)
        return False


def _free_now() -> None:
    """Frees what an ended ask held, now: its engine and KV memory sit in reference cycles (a
    failed load's traceback, the engine's threads), which Python's collector reaches only at
    some later full collection, and what its thread freed stays in glibc's arenas. Measured
    (SmolLM2, 1,024-token contexts, asks one after another): the service's RSS grew ~50 MB per
    SparKV ask (1,147 -> 1,392 MB over six batches) without it, and stays at 1,100-1,200 MB."""
    gc.collect()
    trim_heap()
