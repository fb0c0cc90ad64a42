"""Induced background load for profiling: CPU burner processes, bounded in time, always stopped.

``LoadGenerator(intensity)`` keeps ``intensity`` CPU cores' worth of work busy in
``ceil(intensity)`` child processes, each running a duty cycle (busy ``duty * 20 ms``, then asleep
for the rest of the period; ``duty = intensity / ceil(intensity)``). It is a context manager::

    with LoadGenerator(1.0, max_seconds=120):
        ...  # steps measured here compete with one busy core

Safety: every child exits on its own at ``max_seconds`` after the start, or as soon as its parent
is gone; :meth:`LoadGenerator.stop` terminates (then kills) the children and is called by
``__exit__`` and at interpreter exit. Children are plain Python (no torch), started with
``subprocess`` (no fork of a process holding OpenMP threads).
"""

from __future__ import annotations

import atexit
import math
import os
import subprocess
import sys
import time

_BURNER = """
import os, sys, time
duty, deadline, parent = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
period = 0.02
busy, rest = duty * period, (1.0 - duty) * period
while time.time() < deadline and os.getppid() == parent:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < busy:
        pass
    if rest > 0:
        time.sleep(rest)
"""


class LoadGenerator:
    """Busy background processes worth ``intensity`` CPU cores (0 starts nothing).

    Args:
        intensity: cores' worth of busy work (``0.5``: one process at 50% duty; ``2``: two busy
            processes). May exceed the core count (oversubscription).
        max_seconds: hard bound on the children's lifetime, enforced by the children themselves.
    """

    def __init__(self, intensity: float, max_seconds: float = 300.0) -> None:
        if intensity < 0:
            raise ValueError(f"load intensity must be >= 0, got {intensity}")
        if max_seconds <= 0:
            raise ValueError("max_seconds must be positive")
        self.intensity = float(intensity)
        self.max_seconds = float(max_seconds)
        self._procs: list[subprocess.Popen] = []

    @property
    def processes(self) -> int:
        return math.ceil(self.intensity - 1e-9) if self.intensity > 0 else 0

    @property
    def running(self) -> bool:
        return any(p.poll() is None for p in self._procs)

    def start(self) -> "LoadGenerator":
        if self._procs:
            raise RuntimeError("load generator already started")
        n = self.processes
        if n == 0:
            return self
        duty = min(1.0, self.intensity / n)
        deadline = time.time() + self.max_seconds
        atexit.register(self.stop)
        for _ in range(n):
            self._procs.append(subprocess.Popen(
                [sys.executable, "-c", _BURNER, repr(duty), repr(deadline), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def stop(self) -> None:
        """Terminates every child (kill after 2 s); safe to call twice."""
        procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover
            pass

    def __enter__(self) -> "LoadGenerator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
