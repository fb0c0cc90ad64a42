"""One ask as its app asks it (:class:`AskRequest`) and, submitted, as it sees it: :class:`AskTicket`, its events (``queued``, ``token``
..., then ``done`` or ``error``), its cancellation and its outcome (docs/asks.md).

The runner thread of :class:`~sparkv.asks.service.AskService` puts the events; one consumer
reads them, synchronously (:meth:`AskTicket.events`) or from an event loop
(:meth:`AskTicket.aevents`, woken by the runner through ``call_soon_threadsafe``).

State: the event queue (thread-safe), the answer's tokens so far (the runner's), the wake-up
callback (under its own lock).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Callable, Iterator, Sequence

from sparkv.edge.options import AskOptions
from sparkv.runtime.stops import StopStrings
from sparkv.runtime.textstream import TextStream

if TYPE_CHECKING:
    from sparkv.asks.admission import Place
    from sparkv.asks.choicecopy import ChoicesCopy
    from sparkv.asks.cores import AskLane
    from sparkv.runtime.promptscore import PromptScorer
    from sparkv.runtime.sampling import TokenLogprobs
    from sparkv.runtime.turns import Conversation, TokenPrompt

__all__ = ["AskRequest", "AskTicket", "prompt_entries"]


@dataclass(frozen=True)
class AskRequest:
    """One question about a server context, as an app asks it.

    Attributes:
        server: the server's URL (``http://host:port``).
        context_id: the context's id on the server.
        question: the question (a chat turn unless ``options.chat`` is off), or the app's
            conversation whose last turn is the question (chat turns).
        api_key: the server's API key for this context (``None``: none).
        options: the policy (:class:`~sparkv.edge.options.AskOptions`; the service keeps the
            loaded context unless ``keep`` is off).
        share: the apps a context this ask keeps is shared with (``"*"``: every app).
        logprobs: ``None``: the token events carry no log-probabilities; else each carries its
            token's (``logprob``) and that many most likely alternatives (``top_logprobs``).
        prompt_logprobs: ``None``: the question is not scored; else the ``done`` event's
            ``prompt`` lists each question token with its log-probability after what comes
            before it and that many alternatives (:mod:`sparkv.runtime.promptscore`).
    """

    server: str
    context_id: str
    question: str | Conversation | TokenPrompt
    api_key: str | None = None
    options: AskOptions = field(default_factory=lambda: AskOptions(keep=True))
    share: Sequence[str] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None


class AskTicket:
    """One submitted ask: its events, its cancellation, its outcome (module docstring).

    Events are dicts (``{"type": "token", ...}``), put by the runner thread and read by one
    consumer, synchronously (:meth:`events`) or from an event loop (:meth:`aevents`)."""

    def __init__(self, ask_id: str, app: str, request: AskRequest, place: Place,
                 detokenize: Callable[[list[int]], str]) -> None:
        self.id, self.app, self.request, self.place = ask_id, app, request, place
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_s: float | None = None     # from submit to the first token
        self.outcome: dict[str, Any] | None = None  # the done or error event
        self.lane: AskLane | None = None
        self.started: int | None = None              # its rank among the asks that ran
        self.copy: ChoicesCopy | None = None         # its group's shared copy (keep off)
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._wake: Callable[[], None] | None = None
        self._wake_lock = threading.Lock()
        self._answer = TextStream(detokenize)
        self.scorer: PromptScorer | None = None      # its question's, when it asks for them
        self._tokens: list[int] = []
        self._text = ""
        self._stops = StopStrings(request.options.stop if request is not None else ())

    # ---- the runner's side -----------------------------------------------------------------
    def put(self, event: dict[str, Any]) -> None:
        self._events.put(event)
        with self._wake_lock:
            wake = self._wake
        if wake is not None:
            wake()

    def token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        """An answer token was generated: a ``token`` event with the text it adds (empty while
        it ends inside a character, or in what may begin a stop string: the ``done`` event's
        text is the answer's, cut before its stop string), and its ``logprob`` and
        ``top_logprobs`` (``[{token, logprob}]``) when given; the first token's carries the
        question's scores (``prompt``: :func:`prompt_entries`) when the ask has them."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter() - self.submitted
        self._tokens.append(token_id)
        self._answer.add(token_id)
        text = self._answer.text
        if self._stops:
            text = self._stops.shown(text)
        delta = ""
        if text.startswith(self._text) and not text.endswith("\ufffd"):
            delta, self._text = text[len(self._text):], text
        event: dict[str, Any] = {"type": "token", "token": token_id, "text": delta}
        if logprobs is not None:
            event["logprob"] = logprobs.logprob
            event["top_logprobs"] = [{"token": t, "logprob": v} for t, v in logprobs.top]
        if len(self._tokens) == 1 and self.scorer is not None:
            event["prompt"] = prompt_entries(self.scorer)
        self.put(event)

    @property
    def streamed(self) -> list[int]:
        return list(self._tokens)

    @property
    def streamed_text(self) -> str:
        return self._text

    def finish(self, event: dict[str, Any]) -> None:
        """The last event (``done`` or ``error``)."""
        self.outcome = event
        self.put(event)
        self.finished.set()

    # ---- the consumer's side ---------------------------------------------------------------
    def cancel(self) -> None:
        """Cancels the ask (a no-op once it finished): waiting, it leaves the queue; running, it
        stops at its next unit of compute."""
        self.cancelled.set()
        lane = self.lane
        if lane is not None:
            lane.cancel()

    def events(self, timeout_s: float | None = None) -> Iterator[dict[str, Any]]:
        """The events, ending with ``done`` or ``error`` (blocking)."""
        while True:
            event = self._events.get(timeout=timeout_s)
            yield event
            if event["type"] in ("done", "error"):
                return

    async def aevents(self) -> AsyncGenerator[dict[str, Any], None]:
        """:meth:`events` for an event loop."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            loop.call_soon_threadsafe(ready.set)

        with self._wake_lock:
            self._wake = wake
        try:
            while True:
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    await ready.wait()
                    ready.clear()
                    continue
                yield event
                if event["type"] in ("done", "error"):
                    return
        finally:
            with self._wake_lock:
                self._wake = None

    def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The outcome (the ``done`` or ``error`` event), once finished."""
        if not self.finished.wait(timeout_s):
            raise TimeoutError(f"ask {self.id} did not finish in {timeout_s} s")
        assert self.outcome is not None
        return self.outcome


def prompt_entries(scorer: PromptScorer) -> list[dict[str, Any]] | None:
    """A scored question as events carry it: each token, its log-probability (``None`` for the
    first, after a context whose last position did not run here) and its alternatives; ``None``
    while it is not scored."""
    if scorer.scores is None:
        return None
    return [{"token": t, "logprob": None if s is None else s.logprob,
             "top_logprobs": None if s is None else [{"token": a, "logprob": v}
                                                     for a, v in s.top]}
            for t, s in zip(scorer.prompt, scorer.scores)]
