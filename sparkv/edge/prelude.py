"""The start-up overlap: compute the context's first layer steps while the manifest and the plan
are on their way.

Before loading can begin, the edge waits for the context's manifest (one round trip, far longer
when the link starts in a fade: 0.3-0.8 s on the adversarial traces) and then plans. When the
device already holds the context's tokens, its compute path need not wait: every plan that
computes anything computes the lowest layers of the first token chunks first. :class:`Prelude`
runs them from the moment the question is asked until the plan is ready, in local-prefill
order: layer by layer over a block of token chunks (at most :data:`SPAN_TOKENS` tokens), each
layer of the block one span (one call: one set of GEMMs over the block), block after block
(:func:`prelude_units`). The session runs it on the asking thread (:meth:`Prelude.run`) while
another thread fetches the manifest and plans (sparkv.edge.session). The steps it finished, and
those of the span it is finishing, are handed to the planner as free (their predicted time is
~zero) and to the engine as done (the :class:`~sparkv.scheduler.controller.Controller` takes
them out of both queues), so nothing is computed twice and the stepper's buffers carry the work
over. Steps the plan would have streamed instead cost at most one span of the compute path's
time.

Until session 70 it ran token chunk 0's layers one 512-token step at a time on a thread of its
own; on the 2-core CPU such steps took 2.2x their time alone (an OpenMP team led by a thread
other than the initial one, and a call's fixed cost paid per step), and where the manifest took
0.3-0.8 s sparkv reached 1.3-1.6x local prefill (docs/edge.md, "The start-up overlap").

A prelude whose geometry turns out to differ from the manifest's (a guessed chunk size), or whose
stepper could not be built, is discarded: the load starts from a fresh stepper, as without it. A
span that fails inside the prelude is not done: the engine computes what is missing.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from sparkv.layout import ChunkGeometry, StepId
from sparkv.runtime.stepper import LayerStepper
from sparkv.runtime.threads import use_threads

#: the most tokens one prelude call spans (one layer over a block of consecutive token chunks): a
#: 2K or 4K context is one block; a longer one is done block after block, and the plan, which
#: stops the prelude after its span in progress, waits at most one span (~60 ms at 4K tokens on
#: the 2-core CPU)
SPAN_TOKENS = 4096


def prelude_units(g: ChunkGeometry) -> list[tuple[StepId, ...]]:
    """The prelude's calls in order: blocks of at most :data:`SPAN_TOKENS` tokens, each layer
    by layer, one span a layer (:meth:`ChunkGeometry.layer_spans
    <sparkv.layout.ChunkGeometry.layer_spans>`)."""
    return g.layer_spans(SPAN_TOKENS)


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
    """Builds a :class:`LayerStepper` and runs its layer steps (:func:`prelude_units`) until told
    to stop (:meth:`request_stop`, from another thread), on the calling thread (:meth:`run`) or
    on a background thread (:meth:`start`, then :meth:`join`: the engine waits for a prelude
    still finishing its span beside the link).

    The stepper (its KV buffers are the context's whole cache: allocating them takes a while) is
    made by the thread that runs the steps, so the manifest request leaves at once. ``geometry``
    is the one ``make_stepper`` will produce (known before it runs, for the caller's reuse
    check)."""

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
        self._running: tuple[StepId, ...] = ()
        self._result = PreludeResult()
        self._thread: threading.Thread | None = None

    def start(self) -> "Prelude":
        """Runs the steps on a thread of its own (``sparkv-prelude``) with the caller's OpenMP
        thread count; returns at once."""
        import torch

        if self._threads is None:
            self._threads = torch.get_num_threads()
        self._thread = threading.Thread(target=self._main, name="sparkv-prelude", daemon=True)
        self._thread.start()
        return self

    def run(self) -> PreludeResult:
        """Runs the steps on the calling thread until :meth:`request_stop` (from another
        thread: the one fetching the manifest and planning) or the last step; returns what it
        did (as :meth:`join` does). A ``KeyboardInterrupt`` or ``SystemExit`` is raised again
        once recorded."""
        self._main()
        error = self._result.error
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise error
        return self._result

    def _main(self) -> None:
        if self._threads is not None:
            use_threads(int(self._threads))
        try:
            try:
                self.stepper = self._make()
            finally:
                self._built.set()
            for unit in prelude_units(self.stepper.geometry):
                with self._lock:
                    if self._stop and len(self._result.steps) >= self._min_steps:
                        return
                    self._running = unit
                t0 = time.perf_counter()
                self.stepper.run_span(unit[0].t, unit[-1].t + 1, unit[0].l)
                with self._lock:
                    self._result.busy_s += time.perf_counter() - t0
                    self._result.steps.extend(unit)
                    self._running = ()
        except BaseException as e:  # noqa: BLE001 - reported by join()
            with self._lock:
                self._result.error = e
                self._running = ()

    def request_stop(self, promise_first: bool = True) -> frozenset[StepId]:
        """Stops after the span in progress; returns the steps that will then be done (those
        completed and the running span's: a span that fails instead is reported by
        :meth:`join`). Asked before any span began (the stepper still being built), it promises
        the first span (unless ``promise_first`` is false: a discarded prelude): the plan need
        not wait for the build, and the compute thread, which waits for the prelude anyway,
        does not lose the start-up overlap."""
        with self._lock:
            if self._stop:
                return frozenset(self._result.steps) | frozenset(self._running)
            self._stop = True
            out = set(self._result.steps) | set(self._running)
            if not out and promise_first and self._result.error is None:
                first = prelude_units(self.geometry)[0]
                self._min_steps = len(first)
                out.update(first)
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
