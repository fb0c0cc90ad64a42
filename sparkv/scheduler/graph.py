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

from typing import Iterable

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
def plan_problems(plan: Plan, inst: Instance, limit: int = 50) -> list[str]:
    """Every reason (up to ``limit``) why the engine could not execute ``plan`` on ``inst``.

    The executor runs the compute order on one thread, waiting for inputs; streamed chunks arrive
    eventually whatever the compute thread does. So a plan is executable iff: each chunk is covered
    exactly once; each computed step's ``Y`` input is computed *earlier* in the compute order; each
    KV chunk its attention reads is streamed or computed earlier; each streamed chunk has an allowed
    level.
    """
    geom = inst.geometry
    L, G = inst.L, inst.G
    problems: list[str] = []

    def add(msg: str) -> bool:
        problems.append(msg)
        return len(problems) >= limit

    pos: dict[int, int] = {}
    for i, step in enumerate(plan.compute_order):
        try:
            geom.check(KVChunkId(step[0], step[1], 0))
        except (IndexError, TypeError) as exc:
            if add(f"compute order position {i}: {step!r} is not a step of this context ({exc})"):
                return problems
            continue
        s = inst.step_index(step)
        if s in pos:
            if add(f"{StepId(*step)} appears twice in the compute order (positions {pos[s]} and {i})"):
                return problems
            continue
        pos[s] = i

    streamed: dict[int, int] = {}
    for i, cid in enumerate(plan.stream_order):
        try:
            geom.check(KVChunkId(*cid))
        except (IndexError, TypeError) as exc:
            if add(f"stream order position {i}: {cid!r} is not a chunk of this context ({exc})"):
                return problems
            continue
        c = inst.chunk_index(cid)
        if c in streamed:
            if add(f"{KVChunkId(*cid)} appears twice in the stream order "
                   f"(positions {streamed[c]} and {i})"):
                return problems
            continue
        streamed[c] = i
        level = plan.levels.get(cid)
        if level is None:
            if add(f"{KVChunkId(*cid)} is streamed but has no level"):
                return problems
            continue
        names = [lv.name for lv in inst.levels]
        if level not in names:
            if add(f"{KVChunkId(*cid)} is streamed at unknown level {level!r} (levels: {names})"):
                return problems
            continue
        li = inst.level_index(level)
        if inst.chunk_bytes[c, li] < 0:
            if add(f"{KVChunkId(*cid)} is streamed at level {level!r}, which was not encoded "
                   "for it"):
                return problems
        elif not inst.allowed_mask[c, li]:
            if add(f"{KVChunkId(*cid)} is streamed at level {level!r}, below the quality floor "
                   f"{inst.quality_floor!r}"):
                return problems

    # coverage: exactly once
    for c in range(inst.num_chunks):
        s = c // G
        if c in streamed and s in pos:
            if add(f"{inst.chunk_id(c)} is both streamed and produced by computed "
                   f"{inst.step_id(s)}"):
                return problems
        elif c not in streamed and s not in pos:
            if add(f"{inst.chunk_id(c)} is neither streamed nor computed"):
                return problems

    # dependencies of computed steps
    for s, i in sorted(pos.items(), key=lambda kv: kv[1]):
        t, l = divmod(s, L)
        step = StepId(t, l)
        if l > 0:
            j = pos.get(s - 1)
            if j is None:
                if add(f"{step} needs Y[l={l - 1}, t={t}] but step(t={t}, l={l - 1}) is not "
                       "computed (a streamed chunk carries no hidden state)"):
                    return problems
            elif j > i:
                if add(f"{step} at compute position {i} needs Y[l={l - 1}, t={t}] from "
                       f"step(t={t}, l={l - 1}), which is computed later (position {j})"):
                    return problems
        if l < L - 1:
            for tp in range(t):
                sp = tp * L + l
                j = pos.get(sp)
                if j is not None:
                    if j > i:
                        if add(f"{step} at compute position {i} attends over KV(t={tp}, l={l}) "
                               f"from step(t={tp}, l={l}), which is computed later (position {j}): "
                               "the compute thread would deadlock"):
                            return problems
                    continue
                for g in range(G):
                    if sp * G + g not in streamed:
                        break  # reported by the coverage check
    return problems


def validate_plan(plan: Plan, inst: Instance) -> None:
    """Raises :class:`PlanError` naming the problems if the engine could not execute ``plan``."""
    problems = plan_problems(plan, inst)
    if problems:
        raise PlanError(problems)


def topological_compute_order(steps: Iterable[StepId]) -> list[StepId]:
    """Sorts computed steps column by column (``(t, l)``), which satisfies every dependency among
    computed steps (``(t, l-1)`` and ``(t' < t, l)`` both come first)."""
    return sorted(steps, key=lambda s: (s[0], s[1]))
