"""The clusters' upkeep off the token's critical path: :class:`Upkeep`.

After a layer has attended a step, its new entries still have to join their clusters (Welford
updates, inline, delayed and overflow splits, the write buffers) and the step's reads go to the
cache (offers, reservations). That upkeep (``LayerState._end_step``) runs here, on one worker
thread, while the main thread goes on with the next layers and the next token. The attention of
a step uses the clusters as they are; entries not yet clustered are in the always-resident
window (the last ``recent`` positions), so every entry is attended either way.

**The lag bound.** A layer's upkeep of step ``n`` is settled (waited for, and its error raised)
before that layer is touched again: before the prefetcher plans the layer's reads (at the
previous layer of step ``n + 1``) and before the layer selects at step ``n + 1``. So at most one
step per layer is pending, and a layer never selects over clusters that miss more than the
entries of its last step, which are in the window (``recent`` >= 1 and a step's entries are
always attended by that step). Everything that reads the whole memory (``check``, ``flush``, the
stats, ``close``) settles every layer first.

**Errors.** An error of the upkeep is raised by the next settle of any layer (as
:class:`UpkeepError`, the original as its cause) and by every later one: the memory is no longer
consistent, so the session cannot decode further. **Closing** cancels the jobs not started,
waits for the running one and ends the thread.

With ``enabled=False`` a job runs at once, in the caller (the previous behaviour, and the
reference: the clusters after each step are then independent of thread timing).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch


class UpkeepError(RuntimeError):
    """The clusters' upkeep failed on its thread (the cause is the original error)."""


class Upkeep:
    """One worker thread for the per-layer upkeep jobs of a clustered memory (module
    docstring). ``work_s``: seconds the jobs ran; ``wait_s``: seconds the main thread waited
    for them (in :meth:`settle`); ``jobs``; ``pending_peak``: most layers pending at once."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dynakv-upkeep") if enabled \
            else None
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.work_s = 0.0
        self.wait_s = 0.0
        self.jobs = 0
        self.pending_peak = 0

    def submit(self, layer: int, job: Callable[..., Any], *args: Any) -> None:
        """Runs ``job(*args)`` for ``layer``: on the thread, after the layer's previous job has
        been settled (so at most one is pending per layer); at once when disabled."""
        self._raise_if_failed()
        self.jobs += 1
        if self._pool is None:
            t0 = time.perf_counter()
            job(*args)
            self.work_s += time.perf_counter() - t0
            return
        self.settle(layer)
        self._pending[layer] = self._pool.submit(self._run, job, args)
        self.pending_peak = max(self.pending_peak, len(self._pending))

    def _run(self, job: Callable[..., Any], args: tuple) -> None:
        if self.error is not None:         # a job failed: the memory is inconsistent, stop
            return
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                job(*args)
        except BaseException as e:  # noqa: BLE001 - raised by the next settle
            self.error = e
        finally:
            with self._lock:
                self.work_s += time.perf_counter() - t0

    def pending(self, layer: int) -> bool:
        """Whether ``layer`` has a job not yet settled."""
        return layer in self._pending

    def settle(self, layer: int) -> None:
        """Waits for ``layer``'s pending job; raises :class:`UpkeepError` if any job failed
        (the jobs after a failed one do not run)."""
        fut = self._pending.pop(layer, None)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()                   # _run keeps a job's error in self.error
            self.wait_s += time.perf_counter() - t0
        self._raise_if_failed()

    def settle_all(self) -> None:
        for layer in list(self._pending):
            self.settle(layer)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise UpkeepError(f"the clusters' upkeep failed on its thread: {self.error!r}; "
                              "this memory cannot decode further") from self.error

    def close(self) -> None:
        """Cancels the jobs not started, waits for the running one (its error is dropped: the
        memory is being closed) and ends the thread."""
        for fut in self._pending.values():
            fut.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
