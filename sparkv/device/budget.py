"""The memory budget: the account of every KV memory's bytes, reservations, and the eviction policy
that chooses what a reservation reclaims.

The budget is never exceeded: every allocation (a restored chunk, a working memory, a new chunk)
is reserved first (:meth:`MemoryBudget.reserve`), and the owner checks the account
(:meth:`MemoryBudget.check`: the sum of the KV memories' own ``nbytes``, working memories included)
after every layer and chunk it adds, keeping the high-water mark.

A reservation first checks that what it may reclaim is enough, and nothing is reclaimed when it
is not (a refused request costs the other contexts nothing): :class:`BudgetTooSmall` (507) when
the context cannot run even with every other context's memory freed, :class:`BudgetBusy` (503,
try again) when it could but the rest is held by contexts in use (a running call, a locked
context; a call waiting for the model holds nothing). Then it reclaims, in order: kept
working memories of other contexts (least recently used first; dropping one writes nothing, the
context's chunks hold everything), then what the :class:`EvictionPolicy` lists, until the
allocation fits. The policies (one class each, by name in
:data:`EVICTION_POLICIES`):

* ``lctru`` (:class:`LCTRU`, LLMS): resident token chunks, fp and int8 first, then k8v4, int4,
  int2, least recently used context first in each, then by position;
* ``lru`` (:class:`LRU`): resident token chunks, least recently used context first;
* ``whole`` (:class:`WholeContextLRU`, the LMK and whole-swap baselines): whole contexts, least
  recently used first.

What an evicted chunk or context becomes (written to flash, dropped, killed) is the
:class:`Evictor`'s, passed to the budget when it is made: the service's keeper, which makes its
budget (:class:`sparkv.device.keeper.Keeper`) and alone changes a context's memory.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import ClassVar, Iterable, NamedTuple, Protocol, Sequence

from sparkv.cache import ContextKV
from sparkv.device.errors import BudgetBusy, BudgetTooSmall
from sparkv.device.registry import ContextRegistry, DeviceContext

#: the LCTRU sub-queue of each level (fp and int8 chunks first, the fewest bits last)
LEVEL_RANK = {"fp": 0, "int8": 0, "k8v4": 1, "int4": 2, "int2": 3}
#: a victim's ``t`` when the whole context goes
WHOLE = -1


class Victim(NamedTuple):
    """Something a reservation may reclaim: token chunk ``t`` of ``ctx`` (or the whole context,
    ``t == WHOLE``) and the bytes it frees."""

    ctx: DeviceContext
    t: int
    nbytes: int


class Evictor(Protocol):
    """What a reservation reclaims through (the service's keeper); called with the registry's
    lock held, on a context nobody holds."""

    def drop_hot(self, ctx: DeviceContext) -> int:
        """Frees ``ctx``'s kept working memory; returns the bytes freed."""

    def evict(self, ctx: DeviceContext, ts: Sequence[int]) -> int:
        """Reclaims token chunks ``ts`` of ``ctx`` (or all of it); returns the bytes written."""


class EvictionPolicy(ABC):
    """The order in which resident memory is reclaimed."""

    name: ClassVar[str]

    @abstractmethod
    def victims(self, contexts: Iterable[DeviceContext]) -> list[Victim]:
        """What may be reclaimed from ``contexts`` (all of them evictable), first to go first."""


class ChunkOrder(EvictionPolicy):
    """Resident token chunks, ordered by :meth:`key`."""

    @abstractmethod
    def key(self, ctx: DeviceContext, t: int, level: str) -> tuple[int, ...]:
        """The sort key of token chunk ``t`` of ``ctx`` (at ``level``)."""

    def victims(self, contexts: Iterable[DeviceContext]) -> list[Victim]:
        out: list[tuple[tuple[int, ...], Victim]] = []
        for c in contexts:
            assert c.memory is not None
            for t, b in sorted(c.memory.resident_bytes_by_token().items()):
                if not b:
                    continue
                lv = c.levels[t] if t < len(c.levels) else "int8"
                out.append((self.key(c, t, lv), Victim(c, t, b)))
        out.sort(key=lambda x: x[0])
        return [v for _, v in out]


class LCTRU(ChunkOrder):
    """Least compression-tolerable and recently used first (LLMS)."""

    name = "lctru"

    def key(self, ctx: DeviceContext, t: int, level: str) -> tuple[int, ...]:
        return (LEVEL_RANK.get(level, 0), ctx.last_used, t)


class LRU(ChunkOrder):
    """Least recently used context first, then by position."""

    name = "lru"

    def key(self, ctx: DeviceContext, t: int, level: str) -> tuple[int, ...]:
        return (ctx.last_used, t)


class WholeContextLRU(EvictionPolicy):
    """Whole contexts, least recently used first (the baselines that do not manage chunks)."""

    name = "whole"

    def victims(self, contexts: Iterable[DeviceContext]) -> list[Victim]:
        return [Victim(c, WHOLE, c.memory.nbytes)
                for c in sorted(contexts, key=lambda c: c.last_used) if c.memory is not None]


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    p.name: p for p in (LCTRU, LRU, WholeContextLRU)}


def eviction_policy(name: str) -> EvictionPolicy:
    """The eviction policy called ``name`` (:data:`EVICTION_POLICIES`)."""
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name]()


class MemoryBudget:
    """The budget (``limit`` bytes) and its account over every context of ``registry``.

    State: ``working`` (key -> working memory: those in use by calls, kept ones, one being grown),
    ``peak_bytes``, ``violations`` (checks that found the account over the limit: 0 unless a
    reservation was wrong). Lock: the registry's lock guards ``working`` and the contexts'
    ``memory``/``hot``; :meth:`reserve` holds it for the whole reclaim, so two calls never count
    the same free bytes.

    Args:
        evictor: what a reservation reclaims through (the keeper that makes this budget).
    """

    def __init__(self, limit: int, registry: ContextRegistry, policy: EvictionPolicy,
                 evictor: Evictor) -> None:
        if int(limit) <= 0:
            raise BudgetTooSmall("the memory budget must be a positive number of bytes")
        self.limit = int(limit)
        self.registry = registry
        self.policy = policy
        self.evictor = evictor
        self.working: dict[str, ContextKV] = {}
        self.claims: dict[str, int] = {}      # bytes a running turn's fold-back may add
        self.peak_bytes = 0
        self.violations = 0

    # ---- the account -----------------------------------------------------------------------------
    def used(self) -> int:
        """Bytes every context's KV memory and every working memory hold now, and those the
        calls in their turn claim for their fold-back (:meth:`claim`)."""
        with self.registry.lock:
            total = sum(c.memory.nbytes for c in self.registry.contexts.values()
                        if c.memory is not None)
            return (total + sum(w.nbytes for w in self.working.values())
                    + sum(self.claims.values()))

    def claim(self, key: str, nbytes: int) -> None:
        """Counts ``nbytes`` under ``key`` (a context id) until :meth:`unclaim`: what a call's
        fold-back may add, reserved at its switch-in, kept from the reservations other calls
        make while its turn runs without the model lock."""
        if nbytes > 0:
            with self.registry.lock:
                self.claims[key] = nbytes

    def try_claim(self, key: str, nbytes: int) -> bool:
        """Claims ``nbytes`` under ``key`` (as :meth:`claim`) if they fit in the budget now,
        reclaiming nothing: whether they did (a call joining a read turn,
        :mod:`~sparkv.device.readturns`, waits for its context's lock instead)."""
        with self.registry.lock:
            if self.used() + nbytes > self.limit:
                return False
            self.claims[key] = nbytes
            return True

    def unclaim(self, key: str) -> None:
        with self.registry.lock:
            self.claims.pop(key, None)

    def check(self) -> int:
        """The account now; keeps the high-water mark and counts a violation if over."""
        used = self.used()
        if used > self.peak_bytes:
            self.peak_bytes = used
        if used > self.limit:
            self.violations += 1
        return used

    def fits(self, need: int) -> bool:
        return self.used() + need <= self.limit

    def hold(self, key: str, W: ContextKV) -> None:
        """Counts working memory ``W`` under ``key`` (a context id) until :meth:`release`."""
        with self.registry.lock:
            self.working[key] = W

    def release(self, key: str, W: ContextKV | None = None) -> None:
        """Stops counting the working memory under ``key`` (only if it is ``W``, when given)."""
        with self.registry.lock:
            if W is None or self.working.get(key) is W:
                self.working.pop(key, None)

    def stats(self) -> dict[str, int | dict[str, int]]:
        """``budget_bytes``, ``used_bytes``, ``peak_bytes``, ``budget_violations`` and
        ``resident_bytes_by_level`` (every context's resident chunk bytes by level)."""
        levels: dict[str, int] = {}
        with self.registry.lock:
            for c in self.registry.contexts.values():
                if c.memory is not None:
                    for lv, b in c.memory.account().resident.items():
                        levels[lv] = levels.get(lv, 0) + b
            return {"budget_bytes": self.limit, "used_bytes": self.used(),
                    "peak_bytes": self.peak_bytes, "budget_violations": self.violations,
                    "resident_bytes_by_level": levels}

    # ---- reservation -----------------------------------------------------------------------------
    def victims(self, active: DeviceContext) -> list[Victim]:
        """What may be reclaimed for ``active``, in the policy's order."""
        return self.policy.victims(self.registry.evictable(active))

    def reserve(self, need: int, active: DeviceContext) -> float:
        """Reclaims (module docstring) through the evictor until ``need`` more bytes fit the
        budget; returns the seconds spent. Raises :class:`BudgetTooSmall` (or
        :class:`BudgetBusy`) when even reclaiming everything it may is not enough, and then
        reclaims nothing: the check comes before any eviction."""
        t0 = time.perf_counter()
        with self.registry.lock:
            if self.fits(need):
                return 0.0
            hot = self.registry.hot(active)
            hot_bytes = sum(c.hot.nbytes for c in hot if c.hot is not None)
            after_hot = self.used() - hot_bytes + need
            victims = self.victims(active) if after_hot > self.limit else []
            freeable = sum(v.nbytes for v in victims)
            if after_hot - freeable > self.limit:
                raise self._refusal(need, active, freeable + hot_bytes)
            for c in hot:
                if self.fits(need):
                    return time.perf_counter() - t0
                self.evictor.drop_hot(c)
            if self.fits(need):
                return time.perf_counter() - t0
            for ctx, ts in self._choose(victims, self.used() + need - self.limit):
                self.evictor.evict(ctx, ts)
        return time.perf_counter() - t0

    def _refusal(self, need: int, active: DeviceContext, reclaimable: int
                 ) -> BudgetTooSmall | BudgetBusy:
        """Why ``need`` more bytes for ``active`` do not fit (module docstring): busy if they
        would with every other context's memory freed."""
        own = sum(w.nbytes for k, w in self.working.items() if k.split("#")[0] == active.id)
        own += active.memory.nbytes if active.memory is not None else 0
        said = (f"context {active.id} needs {need / 1e6:.1f} MB more to run "
                f"({len(active.tokens)} tokens); the budget is {self.limit / 1e6:.1f} MB and "
                f"only {reclaimable / 1e6:.1f} MB can be reclaimed from other contexts")
        if own + need > self.limit:
            return BudgetTooSmall(said)
        busy = len(self.registry.in_use(active))
        return BudgetBusy(f"{said} now: the rest is held by {busy} context(s) in use; try "
                          f"again")

    @staticmethod
    def _choose(victims: Sequence[Victim], over: int
                ) -> list[tuple[DeviceContext, list[int]]]:
        """The first victims that free ``over`` bytes, grouped by context (in order of first
        appearance)."""
        chosen: dict[str, tuple[DeviceContext, list[int]]] = {}
        for v in victims:
            if over <= 0:
                break
            chosen.setdefault(v.ctx.id, (v.ctx, []))[1].append(v.t)
            over -= v.nbytes
        return list(chosen.values())
