"""The context service's contexts: their records, their ids, their locks, the logical clock and
the contexts that could not be reopened.

No I/O: a :class:`DeviceContext` holds its flash tier (made by
:class:`~sparkv.device.swap.SwapStore`) and its KV memory, but nothing here reads or writes them.

One owner per field of a :class:`DeviceContext`: ``memory``, ``hot``, ``levels`` and ``modified``
are the keeper's (:mod:`~sparkv.device.keeper`: only a keeper changes them); ``tokens``,
``pending``, the densities, ``calls`` and ``last_used`` change through this module's methods,
called by the service in the order of a call.

Locks (the service's whole discipline, stated once):

* each context's ``lock`` is held by a call on it for the whole call (switch in, run, fold back,
  swap out ahead of time), by ``delete``, ``swap_out``, ``drop_flash`` and ``locked``; the
  eviction never touches a context whose lock is held (it tests ``lock.locked()``, never waits),
  unless the holder is a call ``waiting`` for the model (:meth:`ContextRegistry.running`: every
  eviction runs under the model's run lock, while such a call reads only its tokens);
* the registry's ``lock`` (an ``RLock``) guards the registry's dict and clock, every context's
  ``memory``, ``hot`` and ``waiting`` fields and the budget's working memories; it is held only for
  bookkeeping and for a reclaim (:meth:`~sparkv.device.budget.MemoryBudget.reserve`), never across
  a load or a model run;
* order: a context's lock, then the registry's lock (never the reverse).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

from sparkv.cache import ContextKV
from sparkv.device.density import DensityRecorder
from sparkv.device.errors import ContextBusy, ContextDamaged, UnknownContext
from sparkv.device.flashio import ServiceFlash

#: a context id: the service makes 16 hex digits; a name outside this pattern (``.``, ``..``, a
#: path) is never taken for a context's directory or journal record
CONTEXT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class DamagedContext:
    """A context the service could not reopen, and why."""

    id: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "state": "damaged", "reason": self.reason}


@dataclass(frozen=True)
class ResidencyCounts:
    """A context's token chunks by residency: every layer resident, some layer absent (neither
    in RAM nor on flash), else on flash."""

    resident: int
    flash: int
    absent: int


@dataclass(frozen=True)
class ContextSummary:
    """One context as the service describes it (``GET /v1/contexts/{id}``: :meth:`to_dict`).

    Attributes:
        tokens: tokens in the context; ``bytes``: its KV memory's bytes in RAM.
        chunks: its token chunks by residency; ``levels``: token chunks per level.
        last_used: the service's clock at its last use; ``busy``: a call holds its lock;
            ``hot``: its working memory from the last call is kept.
        created_unix: when it was made (seconds since the epoch; kept by the journal).
    """

    id: str
    tokens: int
    calls: int
    bytes: int
    chunks: ResidencyCounts
    levels: dict[str, int]
    last_used: int
    busy: bool
    hot: bool
    system_prompt: str | None
    label: str | None
    created_unix: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class DeviceContext:
    """One context of the service: its token ids (kept: recomputation needs them), its KV memory
    (``memory``: chunks at levels, or a whole arena for the baselines), the per-token attention
    statistics its chunks' levels come from, and its kept working memory (``hot``).

    Owners (module docstring): ``memory``, ``hot``, ``levels``, ``modified`` are the keeper's.
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
        self.waiting = False              # a call holds its lock, not running the model now
        # its modified chunks written ahead of time after each call; False: only when reclaimed
        # (a copy that lives for one request: sparkv.asks.choicecopy)
        self.ahead = True

    def grow(self, added: list[int], pending: list[int]) -> None:
        """A call kept its prompt and answer: ``added`` ids now hold KV, ``pending`` are decoded
        but not yet run through the model."""
        self.tokens = self.tokens + added
        self.pending = pending

    def set_density(self, mass: torch.Tensor, rows: torch.Tensor) -> None:
        """Per-token attention statistics measured elsewhere (an imported context)."""
        n = len(self.tokens)
        self.mass = mass.double()[:n].clone()
        self.rows = rows.double()[:n].clone()

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
        """The context a journal record describes, without its memory (its keeper's
        ``reopen`` attaches it)."""
        ctx = cls(doc["id"], [], doc.get("system_prompt"), tier)
        ctx.restore(doc)
        return ctx

    def restore(self, doc: dict[str, Any]) -> None:
        """Its tokens, densities, calls and names as journal record ``doc`` has them (a new
        context from a record, or one put back to its last record); ``levels`` and the memory
        are its keeper's."""
        self.tokens = [int(x) for x in doc.get("tokens", [])]
        self.pending = [int(x) for x in doc.get("pending", [])]
        self.mass = torch.tensor(doc.get("mass", []), dtype=torch.float64)
        self.rows = torch.tensor(doc.get("rows", []), dtype=torch.float64)
        self.calls = int(doc.get("calls", 0))
        self.label = doc.get("label")
        self.created_unix = float(doc.get("created_unix", time.time()))
        self.last_used = int(doc.get("last_used", 0))

    def describe(self) -> ContextSummary:
        """What the context holds now (``GET /v1/contexts/{id}``)."""
        C = self.memory
        # the table's column at once (per chunk it took ~190 ms a 2,048-token context)
        res, fl, ab = C.token_residency() if C is not None else (0, 0, 0)
        mix: dict[str, int] = {}
        for lv in self.levels:
            mix[lv] = mix.get(lv, 0) + 1
        return ContextSummary(self.id, len(self.tokens), self.calls,
                              C.nbytes if C is not None else 0, ResidencyCounts(res, fl, ab),
                              mix, self.last_used, self.lock.locked(), self.hot is not None,
                              self.system_prompt, self.label, self.created_unix)


class ContextRegistry:
    """The contexts by id, the logical clock their ``last_used`` comes from, and the contexts
    that could not be reopened.

    State: ``contexts`` (id -> :class:`DeviceContext`), ``clock``, ``damaged`` (id ->
    :class:`DamagedContext`). Lock: ``lock`` (module docstring) guards all three."""

    def __init__(self) -> None:
        self.contexts: dict[str, DeviceContext] = {}
        self.damaged: dict[str, DamagedContext] = {}
        self.lock = threading.RLock()
        self.clock = 0

    def get(self, ctx_id: str) -> DeviceContext:
        """The live context ``ctx_id``: :class:`ContextDamaged` if it could not be reopened,
        :class:`UnknownContext` if there is none (or it was deleted)."""
        with self.lock:
            ctx = self.contexts.get(ctx_id)
            damaged = self.damaged.get(ctx_id)
        if damaged is not None:
            raise ContextDamaged(f"context {ctx_id} could not be reopened: {damaged.reason}; "
                                 "delete it")
        if ctx is None or ctx.deleted:
            raise UnknownContext(f"no context {ctx_id!r}")
        return ctx

    def add(self, ctx: DeviceContext) -> None:
        with self.lock:
            self.contexts[ctx.id] = ctx
            self.clock = max(self.clock, ctx.last_used)

    def remove(self, ctx_id: str) -> None:
        with self.lock:
            ctx = self.contexts.pop(ctx_id, None)
            if ctx is not None:
                ctx.deleted = True

    def add_damaged(self, found: list[DamagedContext]) -> None:
        with self.lock:
            self.damaged.update((d.id, d) for d in found)

    def pop_damaged(self, ctx_id: str) -> bool:
        """Forgets damaged context ``ctx_id``; whether there was one."""
        with self.lock:
            return self.damaged.pop(ctx_id, None) is not None

    def damaged_list(self) -> list[DamagedContext]:
        with self.lock:
            return list(self.damaged.values())

    @contextlib.contextmanager
    def holding(self, ctx: DeviceContext, timeout_s: float | None, held: bool = False
                ) -> Iterator[DeviceContext]:
        """Holds ``ctx``'s lock for the block (waiting at most ``timeout_s``, ``None``: for
        ever; ``held``: the caller took it already): :class:`ContextBusy` if it could not be
        had, :class:`UnknownContext` if ``ctx`` was deleted meanwhile."""
        if not held and not ctx.lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise ContextBusy(f"context {ctx.id} is running another call")
        try:
            if ctx.deleted:
                raise UnknownContext(f"no context {ctx.id!r}")
            self._waiting(ctx, True)
            yield ctx
        finally:
            self._waiting(ctx, False)
            ctx.lock.release()

    @contextlib.contextmanager
    def running(self, ctx: DeviceContext, run: threading.Lock) -> Iterator[None]:
        """Holds ``run`` (the service's model) for the block, for a call :meth:`holding`
        ``ctx``. Until it has ``run``, and once it gives it back, the call is ``waiting``: it
        reads its context's tokens but not its memory, so the reservation of the call that runs
        meanwhile (every reservation runs under ``run``) may reclaim it (:meth:`evictable`).
        Within the block the call may give ``run`` back for its turn (the model over its own
        working memory): ``ctx`` stays in use then, never reclaimed."""
        run.acquire()
        self._waiting(ctx, False)
        try:
            yield
        finally:
            self._waiting(ctx, True)
            run.release()

    @contextlib.contextmanager
    def waiting_for(self, ctx: DeviceContext | None) -> Iterator[None]:
        """``ctx``, held by a call that has the model (:meth:`running`), waits for the block (the
        model given back): reclaimable meanwhile, as a call waiting for the model. ``None``:
        nothing to mark."""
        if ctx is not None:
            self._waiting(ctx, True)
        try:
            yield
        finally:
            if ctx is not None:
                self._waiting(ctx, False)

    def _waiting(self, ctx: DeviceContext, waiting: bool) -> None:
        with self.lock:
            ctx.waiting = waiting

    def tick(self) -> int:
        """The next instant of the clock (a context's ``last_used``)."""
        with self.lock:
            self.clock += 1
            return self.clock

    def touch(self, ctx: DeviceContext, called: bool = True) -> None:
        """``ctx`` was just used: the most recently used (and one more call, if ``called``;
        calls reading one working memory count at once: :mod:`~sparkv.device.readturns`)."""
        with self.lock:
            if called:
                ctx.calls += 1
            ctx.last_used = self.tick()

    def live(self) -> list[DeviceContext]:
        with self.lock:
            return [c for c in self.contexts.values() if not c.deleted]

    def labelled(self, label: str) -> list[DeviceContext]:
        """The live contexts labelled ``label``, the most recently used first."""
        return sorted((c for c in self.live() if c.label == label), key=lambda c: -c.last_used)

    def evictable(self, active: DeviceContext) -> list[DeviceContext]:
        """Contexts whose memory may be reclaimed for ``active``: live, holding memory, and not
        in use (unlocked, or locked by a call waiting for the model: :meth:`running`; a running
        call, or a context someone locked, is never evicted)."""
        with self.lock:
            return [c for c in self.contexts.values()
                    if c is not active and c.memory is not None and not c.deleted
                    and not _in_use(c)]

    def in_use(self, active: DeviceContext) -> list[DeviceContext]:
        """Contexts other than ``active`` whose memory may not be reclaimed now (in use)."""
        with self.lock:
            return [c for c in self.contexts.values() if c is not active and _in_use(c)]

    def hot(self, active: DeviceContext) -> list[DeviceContext]:
        """Contexts other than ``active`` keeping a working memory and not in use, least
        recently used first."""
        with self.lock:
            return sorted((c for c in self.contexts.values()
                           if c.hot is not None and c is not active and not _in_use(c)),
                          key=lambda c: c.last_used)


def _in_use(ctx: DeviceContext) -> bool:
    """Locked, and not by a call waiting for the model (:meth:`ContextRegistry.running`)."""
    return ctx.lock.locked() and not ctx.waiting
