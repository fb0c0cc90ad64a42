"""A clustered memory built on a thread: :class:`BackgroundBuild`.

The session (:class:`~sparkv.decode.session.DecodeSession`) answers the question's first token,
and decodes its first ``full_steps`` steps over the full KV, while this thread clusters the
prompt's entries and places them on flash (:meth:`ClusteredKV.build
<sparkv.decode.policy.ClusteredKV.build>`); the step after them takes the built memory
(:meth:`BackgroundBuild.wait`). Closing the session before that stops the build at its next layer
(:meth:`BackgroundBuild.stop`).
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import torch

from sparkv.cache.layer import HeadEntries
from sparkv.decode.policy import ClusteredKV


class BackgroundBuild:
    """Builds ``kv`` (made with ``deferred=True``) from ``entries`` and ``queries`` on a thread,
    started at once. The entries must not change while it runs (the session's appends go past
    them)."""

    def __init__(self, kv: ClusteredKV, entries: Sequence[Sequence[HeadEntries]],
                 queries: Sequence[torch.Tensor | None] | None) -> None:
        self.kv = kv
        self.error: BaseException | None = None
        self.wait_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(entries, queries),
                                        name="dynakv-build", daemon=True)
        self._thread.start()

    def _run(self, entries: Sequence[Sequence[HeadEntries]],
             queries: Sequence[torch.Tensor | None] | None) -> None:
        try:
            with torch.inference_mode():
                self.kv.build(entries, queries, self._stop)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> ClusteredKV:
        """The built memory, once the build has ended (the time waited is added to
        :attr:`wait_s`); the build's error is raised here (the memory is closed then)."""
        t0 = time.perf_counter()
        self._thread.join()
        self.wait_s += time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        return self.kv

    def stop(self) -> None:
        """Stops the build at its next layer, waits for the thread and closes the memory."""
        self._stop.set()
        self._thread.join()
        if self.error is None:
            self.kv.close()       # built (a failed or stopped build closed it already)
