"""The context service's contexts: their records, their ids, their locks and the logical clock.

No I/O: a :class:`DeviceContext` holds its flash tier (made by
:class:`~sparkv.device.swap.SwapStore`) and its KV memory, but nothing here reads or writes them.

Locks (the service's whole discipline, stated once):

* each context's ``lock`` is held by a call on it for the whole call (switch in, run, fold back,
  swap out ahead of time), by ``delete``, ``swap_out``, ``drop_flash`` and ``locked``; the
  eviction never touches a context whose lock is held (it tests ``lock.locked()``, never waits);
* the registry's ``lock`` (an ``RLock``) guards the registry's dict and clock, every context's
  ``memory`` and ``hot`` fields and the budget's working memories; it is held only for
  bookkeeping and for a reclaim (:meth:`~sparkv.device.budget.MemoryBudget.reserve`), never across
  a load or a model run;
* order: a context's lock, then the registry's lock (never the reverse).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import torch

from sparkv.cache import ContextKV
from sparkv.device.density import DensityRecorder
from sparkv.device.errors import UnknownContext
from sparkv.device.flashio import ServiceFlash

#: a context id: the service makes 16 hex digits; a name outside this pattern (``.``, ``..``, a
#: path) is never taken for a context's directory or journal record
CONTEXT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class DeviceContext:
    """One context of the service: its token ids (kept: recomputation needs them), its KV memory
    (``memory``: chunks at levels, or a whole arena for the baselines), the per-token attention
    statistics its chunks' levels come from, and its kept working memory (``hot``).

    State guarded by the registry's lock: ``memory``, ``hot``; the rest is written only by the
    holder of ``lock`` (or before the context is registered)."""

    def __init__(self, ctx_id: str, tokens: list[int], system_prompt: str | None,
                 tier: ServiceFlash) -> None:
        self.id = ctx_id
        self.tokens = list(tokens)
        self.pending: list[int] = []      # decoded, not yet run through the model
        self.system_prompt = system_prompt
        self.memory: ContextKV | None = None
        self.mass = torch.zeros(0, dtype=torch.float64)
        self.rows = torch.zeros(0, dtype=torch.float64)
        self.levels: list[str] = []       # the level of each token chunk
        self.modified: set[int] = set()   # token chunks whose flash copy is stale or missing
        self.last_used = 0
        self.created_unix = time.time()
        self.calls = 0
        self.lock = threading.Lock()
        self.deleted = False
        self.tier = tier
        self.label: str | None = None     # a caller's name for it (the edge: server + context id)
        self.hot: ContextKV | None = None  # its last working memory, kept while it fits

    def add_density(self, rec: DensityRecorder, upto: int) -> None:
        """Adds a call's recorded attention statistics of the first ``upto`` tokens."""
        if self.mass.numel() < upto:
            extra = upto - self.mass.numel()
            self.mass = torch.cat([self.mass, torch.zeros(extra, dtype=torch.float64)])
            self.rows = torch.cat([self.rows, torch.zeros(extra, dtype=torch.float64)])
        m = min(upto, rec.mass.numel())
        self.mass[:m] += rec.mass[:m]
        self.rows[:m] += rec.rows[:m]

    def record(self, fingerprint: str) -> dict[str, Any]:
        """Its journal record (:mod:`sparkv.device.journal`)."""
        return {"tokens": self.tokens, "pending": self.pending,
                "system_prompt": self.system_prompt,
                "chunk_tokens": (self.memory.geometry.chunk_tokens if self.memory is not None
                                 else None),
                "levels": self.levels, "mass": [round(float(x), 9) for x in self.mass.tolist()],
                "rows": self.rows.tolist(), "calls": self.calls, "last_used": self.last_used,
                "created_unix": self.created_unix, "label": self.label, "model": fingerprint}

    @classmethod
    def from_record(cls, doc: dict[str, Any], tier: ServiceFlash) -> "DeviceContext":
        """The context a journal record describes, without its memory."""
        ctx = cls(doc["id"], [int(x) for x in doc.get("tokens", [])], doc.get("system_prompt"),
                  tier)
        ctx.pending = [int(x) for x in doc.get("pending", [])]
        ctx.levels = list(doc.get("levels", []))
        ctx.mass = torch.tensor(doc.get("mass", []), dtype=torch.float64)
        ctx.rows = torch.tensor(doc.get("rows", []), dtype=torch.float64)
        ctx.calls = int(doc.get("calls", 0))
        ctx.label = doc.get("label")
        ctx.created_unix = float(doc.get("created_unix", time.time()))
        ctx.last_used = int(doc.get("last_used", 0))
        return ctx


class ContextRegistry:
    """The contexts by id and the logical clock their ``last_used`` comes from.

    State: ``contexts`` (id -> :class:`DeviceContext`), ``clock``. Lock: ``lock`` (module
    docstring) guards both."""

    def __init__(self) -> None:
        self.contexts: dict[str, DeviceContext] = {}
        self.lock = threading.RLock()
        self.clock = 0

    def get(self, ctx_id: str) -> DeviceContext:
        """The live context ``ctx_id``; :class:`UnknownContext` if none (or deleted)."""
        with self.lock:
            ctx = self.contexts.get(ctx_id)
        if ctx is None or ctx.deleted:
            raise UnknownContext(f"no context {ctx_id!r}")
        return ctx

    def add(self, ctx: DeviceContext) -> None:
        with self.lock:
            self.contexts[ctx.id] = ctx
            self.clock = max(self.clock, ctx.last_used)

    def remove(self, ctx_id: str) -> None:
        with self.lock:
            self.contexts.pop(ctx_id, None)

    def tick(self) -> int:
        """The next instant of the clock (a context's ``last_used``)."""
        with self.lock:
            self.clock += 1
            return self.clock

    def live(self) -> list[DeviceContext]:
        with self.lock:
            return [c for c in self.contexts.values() if not c.deleted]

    def find(self, label: str) -> DeviceContext | None:
        """The most recently used live context labelled ``label``."""
        found = [c for c in self.live() if c.label == label]
        return max(found, key=lambda c: c.last_used) if found else None

    def evictable(self, active: DeviceContext) -> list[DeviceContext]:
        """Contexts whose memory may be reclaimed for ``active``: live, holding memory, and not
        locked (a call holds it, or someone locked it: never evicted)."""
        with self.lock:
            return [c for c in self.contexts.values()
                    if c is not active and c.memory is not None and not c.deleted
                    and not c.lock.locked()]

    def hot(self, active: DeviceContext) -> list[DeviceContext]:
        """Unlocked contexts other than ``active`` keeping a working memory, least recently used
        first."""
        with self.lock:
            return sorted((c for c in self.contexts.values()
                           if c.hot is not None and c is not active and not c.lock.locked()),
                          key=lambda c: c.last_used)
