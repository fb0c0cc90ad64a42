"""The start-up overlap: compute the context's first layer steps while the manifest and the plan
are on their way.

Before loading can begin, the edge waits for the context's manifest (one round trip, far longer
when the link starts in a fade: 0.3-0.8 s on the adversarial traces) and then plans. When the
device already holds the context's tokens, its compute thread need not wait: every plan that
computes anything computes the first token chunk, layer after layer, first. :class:`Prelude`
runs those steps (then the next token chunk's, in local-prefill order) on a background thread
from the moment the question is asked until the plan is ready. The steps it finished, and the
one it is finishing, are handed to the planner as free (their predicted time is ~zero) and to the
engine as done (the :class:`~sparkv.scheduler.controller.Controller` takes them out of both
queues), so nothing is computed twice and the stepper's buffers carry the work over. The engine's
link starts at once; its compute thread first waits for the prelude's last step. Steps the plan would have streamed
instead cost at most the compute thread's idle time.

A prelude whose geometry turns out to differ from the manifest's (a guessed chunk size), or whose
stepper could not be built, is discarded: the load starts from a fresh stepper, as without it. A
step that fails inside the prelude is not done: the engine computes what is missing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from sparkv.layout import ChunkGeometry, StepId
from sparkv.runtime.stepper import LayerStepper
from sparkv.runtime.threads import use_threads


@dataclass
class PreludeResult:
    """What the prelude did: the steps it completed (in order), their busy time, any error."""

    steps: list[StepId] = field(default_factory=list)
    busy_s: float = 0.0
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Prelude:
    """Builds a :class:`LayerStepper` and runs its layer steps in local-prefill order on a
    background thread until told to stop (:meth:`request_stop`, then :meth:`join`).

    The stepper (its KV buffers are the context's whole cache: allocating them takes a while) is
    made on that thread too, so the caller's manifest request leaves at once. ``geometry`` is the
    one ``make_stepper`` will produce (known before it runs, for the caller's reuse check)."""

    def __init__(self, make_stepper: Callable[[], LayerStepper], geometry: ChunkGeometry,
                 tokens: Sequence[int], threads: int | None = None) -> None:
        self._make = make_stepper
        self.geometry = geometry
        self.tokens = list(tokens)   # the context's token ids (the stepper's)
        self.stepper: LayerStepper | None = None
        self._threads = threads
        self._lock = threading.Lock()
        self._built = threading.Event()
        self._stop = False
        self._min_steps = 0         # steps to finish before stopping (request_stop's promise)
        self._running: StepId | None = None
        self._result = PreludeResult()
        self._thread: threading.Thread | None = None

    def start(self) -> "Prelude":
        import torch

        if self._threads is None:
            self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._main, name="sparkv-prelude", daemon=True)
        self._thread.start()
        return self

    def _order(self, g: ChunkGeometry) -> list[StepId]:
        return [StepId(t, l) for t in range(g.num_token_chunks)  # noqa: E741
                for l in range(g.num_layers)]

    def _main(self) -> None:
        use_threads(int(self._threads or 1))
        try:
            try:
                self.stepper = self._make()
            finally:
                self._built.set()
            for step in self._order(self.stepper.geometry):
                with self._lock:
                    if self._stop and len(self._result.steps) >= self._min_steps:
                        return
                    self._running = step
                t0 = time.perf_counter()
                self.stepper.run_step(step)
                with self._lock:
                    self._result.busy_s += time.perf_counter() - t0
                    self._result.steps.append(step)
                    self._running = None
        except BaseException as e:  # noqa: BLE001 - reported by join()
            with self._lock:
                self._result.error = e
                self._running = None

    def request_stop(self, promise_first: bool = True) -> frozenset[StepId]:
        """Stops after the step in progress; returns the steps that will then be done (those
        completed and the one running: the step that fails instead is reported by
        :meth:`join`). Asked before any step began (the stepper still being built), it promises
        the first step (unless ``promise_first`` is false: a discarded prelude): the plan need
        not wait for the build, and the compute thread, which waits for the prelude anyway,
        does not lose the start-up overlap."""
        with self._lock:
            if self._stop:
                return frozenset(self._result.steps) | (
                    {self._running} if self._running is not None else set())
            self._stop = True
            out = set(self._result.steps)
            if self._running is not None:
                out.add(self._running)
            elif promise_first and not out and self._result.error is None:
                self._min_steps = 1
                out.add(self._order(self.geometry)[0])
        return frozenset(out)

    def wait_stepper(self) -> LayerStepper | None:
        """The stepper, once built (``None`` when building it failed)."""
        self._built.wait()
        return self.stepper

    def join(self) -> PreludeResult:
        """Stops the prelude, waits for its thread and returns what it did."""
        self.request_stop(promise_first=False)
        if self._thread is not None:
            self._thread.join()
        return self._result
