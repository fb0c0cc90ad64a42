"""A load that changes plans while it runs: what is left of a new plan once part of another
plan's work is under way (:func:`handover`), applied by
:meth:`LoadState.adopt <sparkv.scheduler.state.LoadState.adopt>`.

The edge starts a load with a plan that is made in a millisecond (the best structured split) and
hands it the greedy's plan when that one is ready and wins (docs/edge.md, "The plan's
handover"): planning then costs the link nothing. What the running load has done stays done:

* steps computed, running or committed stay on the compute path;
* chunks in place stay, and so do fetches whose bytes have begun to arrive (or are being
  decoded): a planned step whose chunk is one of those is left out, unless a planned step above
  it in its token chunk needs its hidden state (a streamed chunk carries none): it is then
  recomputed (and a fetch of its chunk still in flight cancelled);
* a fetch requested but not begun follows the new plan: cancelled where the plan computes its
  step, kept (not requested again) where it streams it;
* the new plan's steps and chunks take the rest, in its order and at its levels; a chunk that
  nothing covers any more (a dropped step's other groups) joins the link at its cheapest
  level.

The result is valid whenever the new plan is (:func:`~sparkv.scheduler.graph.validate_plan`):
every computed step's layer below is computed, and every chunk is covered exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan


@dataclass(frozen=True)
class Remaining:
    """What a load does after a handover (dense ids of the instance).

    Attributes:
        compute: steps to queue on the compute path, in order.
        stream: chunks to queue on the link, in order.
        levels: each queued chunk's level index.
        cancel: in-flight chunks whose steps are now computed (their fetches are aborted).
    """

    compute: list[int]
    stream: list[int]
    levels: dict[int, int]
    cancel: list[int]


def handover(inst: Instance, plan: Plan, *, settled_steps: set[int], requested: set[int],
             started: set[int], available: list[bool]) -> Remaining:
    """The work ``plan`` leaves to a load whose ``settled_steps`` (computed, running or
    committed) are done or under way, with chunks ``requested`` (in flight) and ``started``
    (bytes arriving, or received and being decoded), and ``available`` per chunk in place
    (module docstring)."""
    L, G = inst.L, inst.G
    planned = [inst.step_index(s) for s in plan.compute_order]
    keep = {s for s in planned if s not in settled_steps}

    def carried(s: int) -> bool:
        chunks = range(s * G, s * G + G)
        return any(c in started for c in chunks) or all(available[c] for c in chunks)

    for s in sorted(keep, reverse=True):    # top down: a step's fate is known before its below
        needed = s % L < L - 1 and (s + 1) in keep
        if carried(s) and not needed:
            keep.discard(s)
    cancel = [c for s in sorted(keep) for c in range(s * G, s * G + G) if c in requested]
    covered = settled_steps | keep
    on_link = requested | started
    cheapest = inst.cheapest_level.tolist()
    stream: list[int] = []
    levels: dict[int, int] = {}
    for cid in plan.stream_order:
        c = inst.chunk_index(cid)
        if c // G not in covered and c not in on_link and not available[c]:
            stream.append(c)
            levels[c] = inst.level_index(plan.levels[cid])
    queued = set(stream)
    for c in range(inst.num_chunks):
        if c // G not in covered and c not in on_link and not available[c] and c not in queued:
            stream.append(c)
            levels[c] = cheapest[c]
    return Remaining([s for s in planned if s in keep], stream, levels, cancel)
