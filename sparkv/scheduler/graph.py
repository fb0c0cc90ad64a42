"""The chunk dependency graph (docs/scheduler.md, "Dependencies") and the plan validator.

Layers are 0-based: ``L-1`` is the last layer, whose step is a projection only. For a layer step
``(t, l)``:

* **layer dependency**: ``Y[l-1, t]``, i.e. step ``(t, l-1)`` computed on the device (``l > 0``);
  a streamed KV chunk never provides a hidden state;
* **token dependency** (``l < L-1`` only): ``KV(t', l, g)`` available for *every* ``t' < t`` and every
  group ``g`` (the causal attention reads the whole prefix, not only chunk ``t-1``); available means
  streamed (and decoded) or produced by the computed step ``(t', l)``;
* the step produces ``KV(t, l, *)`` (all groups) and, for ``l < L-1``, ``Y[l, t]``.

Every KV chunk must be available exactly once: streamed, or produced by its computed step.

:class:`DepState` tracks readiness incrementally (planners, the controller and the simulator use
it); :func:`validate_plan` rejects a plan the engine could not execute, naming the problem.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from sparkv.errors import SparkvError
from sparkv.layout import ChunkGeometry, KVChunkId, StepId
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan


class PlanError(SparkvError):
    """A plan cannot be executed; the message names every problem found (up to a limit)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        head = "; ".join(self.problems[:5])
        more = f" (and {len(self.problems) - 5} more)" if len(self.problems) > 5 else ""
        super().__init__(f"invalid plan: {head}{more}")


def layer_dependency(step: StepId) -> StepId | None:
    """The step whose hidden state ``Y[l-1, t]`` this step reads (``None`` for layer 0)."""
    return StepId(step.t, step.l - 1) if step.l > 0 else None


def token_dependencies(step: StepId, geometry: ChunkGeometry) -> list[KVChunkId]:
    """The KV chunks this step's attention reads besides its own: all groups of ``(t' < t, l)``.

    Empty for the last layer (projection only).
    """
    if step.l == geometry.num_layers - 1:
        return []
    return [KVChunkId(tp, step.l, g) for tp in range(step.t) for g in range(geometry.num_groups)]


class DepState:
    """Incremental availability and readiness over dense step ids ``s = t*L + l``.

    ``add_kv`` / ``mark_computed`` return the steps whose inputs may just have become complete; call
    :meth:`ready` to check one. A step is *ready* when it is not computed, ``Y[l-1, t]`` exists and,
    below the last layer, every ``KV(t' < t, l, *)`` is available.
    """

    __slots__ = ("n_t", "L", "G", "kv_count", "chunk_avail", "computed", "frontier")

    def __init__(self, n_t: int, L: int, G: int):  # noqa: N803
        self.n_t, self.L, self.G = n_t, L, G
        self.kv_count = [0] * (n_t * L)        # groups available per step
        self.chunk_avail = [False] * (n_t * L * G)
        self.computed = [False] * (n_t * L)
        self.frontier = [0] * L                # first t whose KV(t, l, *) is not complete

    @classmethod
    def for_instance(cls, inst: Instance) -> "DepState":
        return cls(inst.n_t, inst.L, inst.G)

    def copy(self) -> "DepState":
        d = DepState.__new__(DepState)
        d.n_t, d.L, d.G = self.n_t, self.L, self.G
        d.kv_count = self.kv_count[:]
        d.chunk_avail = self.chunk_avail[:]
        d.computed = self.computed[:]
        d.frontier = self.frontier[:]
        return d

    def layer_ok(self, s: int) -> bool:
        return s % self.L == 0 or self.computed[s - 1]

    def token_ok(self, s: int) -> bool:
        t, l = divmod(s, self.L)
        return l == self.L - 1 or self.frontier[l] >= t

    def ready(self, s: int) -> bool:
        return not self.computed[s] and self.layer_ok(s) and self.token_ok(s)

    def kv_complete(self, s: int) -> bool:
        return self.kv_count[s] == self.G

    def add_chunk(self, c: int) -> list[int]:
        """Marks chunk ``c`` available; returns steps whose token dependency may now hold."""
        if self.chunk_avail[c]:
            return []
        self.chunk_avail[c] = True
        s = c // self.G
        self.kv_count[s] += 1
        if self.kv_count[s] < self.G:
            return []
        return self._advance(s)

    def _advance(self, s: int) -> list[int]:
        t, l = divmod(s, self.L)
        if self.frontier[l] != t:
            return []
        t2 = t + 1
        L = self.L
        while t2 < self.n_t and self.kv_count[t2 * L + l] == self.G:
            t2 += 1
        self.frontier[l] = t2
        if l == L - 1:
            return []
        return [tt * L + l for tt in range(t + 1, min(t2, self.n_t - 1) + 1)]

    def mark_computed(self, s: int) -> list[int]:
        """Marks step ``s`` computed (it produces all its KV groups); returns candidate steps."""
        self.computed[s] = True
        out: list[int] = []
        if (s + 1) % self.L:
            out.append(s + 1)
        base = s * self.G
        newly = False
        for g in range(self.G):
            if not self.chunk_avail[base + g]:
                self.chunk_avail[base + g] = True
                self.kv_count[s] += 1
                newly = True
        if newly:
            out.extend(self._advance(s))
        return out

    def missing_for(self, s: int) -> list[str]:
        """Human-readable inputs step ``s`` still lacks."""
        t, l = divmod(s, self.L)
        out = []
        if l > 0 and not self.computed[s - 1]:
            out.append(f"Y[l={l - 1}, t={t}] (step(t={t}, l={l - 1}) not computed)")
        if l < self.L - 1:
            for tp in range(t):
                for g in range(self.G):
                    if not self.chunk_avail[(tp * self.L + l) * self.G + g]:
                        out.append(str(KVChunkId(tp, l, g)))
        return out


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
class _LimitReached(Exception):
    """The problem list is full (:class:`_Problems`): the checks stop."""


class _Problems:
    """The problems found so far; :meth:`add` stops the checks (raises :class:`_LimitReached`)
    once ``limit`` are listed."""

    def __init__(self, limit: int):
        self.items: list[str] = []
        self.limit = limit

    def add(self, msg: str) -> None:
        self.items.append(msg)
        if len(self.items) >= self.limit:
            raise _LimitReached


def plan_problems(plan: Plan, inst: Instance, limit: int = 50) -> list[str]:
    """Every reason (up to ``limit``) why the engine could not execute ``plan`` on ``inst``.

    The executor runs the compute order on one thread, waiting for inputs; streamed chunks arrive
    eventually whatever the compute thread does. So a plan is executable iff: each chunk is covered
    exactly once; each computed step's ``Y`` input is computed *earlier* in the compute order; each
    KV chunk its attention reads is streamed or computed earlier; each streamed chunk has an allowed
    level.
    """
    problems = _Problems(limit)
    try:
        pos = {s: i for i, s, _ in _first_entries(
            plan.compute_order, inst, "compute", "step",
            lambda step: KVChunkId(step[0], step[1], 0), lambda step: StepId(*step),
            inst.step_index, problems)}
        streamed: dict[int, int] = {}
        for i, c, cid in _first_entries(plan.stream_order, inst, "stream", "chunk",
                                        lambda cid: KVChunkId(*cid), lambda cid: KVChunkId(*cid),
                                        inst.chunk_index, problems):
            streamed[c] = i
            _check_level(plan, inst, c, cid, problems)
        _check_coverage(inst, pos, streamed, problems)
        _check_dependencies(inst, pos, problems)
    except _LimitReached:
        pass
    return problems.items


def _first_entries(order: Sequence[Any], inst: Instance, which: str, what: str,
                   chunk_of: Callable[[Any], KVChunkId], name_of: Callable[[Any], Any],
                   index: Callable[[Any], int],
                   problems: _Problems) -> Iterator[tuple[int, int, Any]]:
    """``(position, dense id, entry)`` of each entry of the ``which`` order (``"compute"`` or
    ``"stream"``) that names a ``what`` of this context (``chunk_of`` gives the chunk whose
    coordinates are checked), the first time it appears; reports the others."""
    seen: dict[int, int] = {}
    for i, entry in enumerate(order):
        try:
            inst.geometry.check(chunk_of(entry))
        except (IndexError, TypeError) as exc:
            problems.add(f"{which} order position {i}: {entry!r} is not a {what} of this "
                         f"context ({exc})")
            continue
        x = index(entry)
        if x in seen:
            problems.add(f"{name_of(entry)} appears twice in the {which} order "
                         f"(positions {seen[x]} and {i})")
            continue
        seen[x] = i
        yield i, x, entry


def _check_level(plan: Plan, inst: Instance, c: int, cid: Any, problems: _Problems) -> None:
    """Streamed chunk ``c`` (``cid`` as the plan names it) has a known, encoded, allowed level."""
    level = plan.levels.get(cid)
    if level is None:
        problems.add(f"{KVChunkId(*cid)} is streamed but has no level")
        return
    names = [lv.name for lv in inst.levels]
    if level not in names:
        problems.add(f"{KVChunkId(*cid)} is streamed at unknown level {level!r} (levels: {names})")
        return
    li = inst.level_index(level)
    if inst.chunk_bytes[c, li] < 0:
        problems.add(f"{KVChunkId(*cid)} is streamed at level {level!r}, which was not encoded "
                     "for it")
    elif not inst.allowed_mask[c, li]:
        problems.add(f"{KVChunkId(*cid)} is streamed at level {level!r}, below the quality floor "
                     f"{inst.quality_floor!r}")


def _check_coverage(inst: Instance, pos: dict[int, int], streamed: dict[int, int],
                    problems: _Problems) -> None:
    """Every chunk exactly once: streamed (``streamed``) or produced by its computed step
    (``pos``: dense step id -> compute position)."""
    G = inst.G
    for c in range(inst.num_chunks):
        s = c // G
        if c in streamed and s in pos:
            problems.add(f"{inst.chunk_id(c)} is both streamed and produced by computed "
                         f"{inst.step_id(s)}")
        elif c not in streamed and s not in pos:
            problems.add(f"{inst.chunk_id(c)} is neither streamed nor computed")


def _check_dependencies(inst: Instance, pos: dict[int, int], problems: _Problems) -> None:
    """Each computed step's inputs come from steps computed earlier (or are streamed: a chunk
    neither streamed nor computed is the coverage check's to report)."""
    L = inst.L
    for s, i in sorted(pos.items(), key=lambda kv: kv[1]):
        t, l = divmod(s, L)
        step = StepId(t, l)
        if l > 0:
            j = pos.get(s - 1)
            if j is None:
                problems.add(f"{step} needs Y[l={l - 1}, t={t}] but step(t={t}, l={l - 1}) is not "
                             "computed (a streamed chunk carries no hidden state)")
            elif j > i:
                problems.add(f"{step} at compute position {i} needs Y[l={l - 1}, t={t}] from "
                             f"step(t={t}, l={l - 1}), which is computed later (position {j})")
        if l < L - 1:
            for tp in range(t):
                j = pos.get(tp * L + l)
                if j is not None and j > i:
                    problems.add(f"{step} at compute position {i} attends over KV(t={tp}, l={l}) "
                                 f"from step(t={tp}, l={l}), which is computed later (position "
                                 f"{j}): the compute thread would deadlock")


def validate_plan(plan: Plan, inst: Instance) -> None:
    """Raises :class:`PlanError` naming the problems if the engine could not execute ``plan``."""
    problems = plan_problems(plan, inst)
    if problems:
        raise PlanError(problems)
