"""A loading plan: which KV chunks are streamed (at which level), which layer steps are computed, and
in which order each path works.

The compute thread runs ``compute_order``; the link fetches ``stream_order``. A computed step
``(t, l)`` produces ``KV(t, l, *)``, so the chunks of a computed step are never streamed. The plan does
not fix times: the executor (the simulator or the edge engine, both through a
:class:`~sparkv.scheduler.controller.Controller`) starts each step as soon as its inputs are
available. :func:`~sparkv.scheduler.graph.validate_plan` checks that a plan can be executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkv.layout import KVChunkId, StepId


@dataclass
class Plan:
    """One planner's answer for one :class:`~sparkv.scheduler.instance.Instance`.

    Attributes:
        compute_order: layer steps computed on the device, in the order the compute thread runs them.
        stream_order: KV chunks fetched over the link, in the order they are requested.
        levels: the codec level of every streamed chunk (joint path + bitrate).
        planner: the planner's registry name.
        stage_budget_s: the stage length ``Delta_t`` the plan was built with (the controller's stage
            clock for its migration cap); ``None`` when the planner has no stages.
        estimated_ttft_s: the planner's own TTFT estimate at the instance's bandwidth (seconds).
        plan_time_s: wall time the planner took.
        info: planner-specific facts (MILP status and gap, chosen split, ...), JSON-serialisable.
    """

    compute_order: list[StepId]
    stream_order: list[KVChunkId]
    levels: dict[KVChunkId, str]
    planner: str = ""
    stage_budget_s: float | None = None
    estimated_ttft_s: float | None = None
    plan_time_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def computed_steps(self) -> set[StepId]:
        return set(self.compute_order)

    @property
    def streamed_chunks(self) -> set[KVChunkId]:
        return set(self.stream_order)

    def level_of(self, cid: KVChunkId) -> str:
        return self.levels[cid]

    def counts(self) -> dict[str, int]:
        return {"computed_steps": len(self.compute_order), "streamed_chunks": len(self.stream_order)}

    def to_dict(self) -> dict[str, Any]:
        """JSON form: steps as ``[t, l]``, chunks as ``[t, l, g, level]`` in stream order."""
        return {
            "planner": self.planner,
            "compute_order": [[s.t, s.l] for s in self.compute_order],
            "stream_order": [[c.t, c.l, c.g, self.levels[c]] for c in self.stream_order],
            "stage_budget_s": self.stage_budget_s,
            "estimated_ttft_s": self.estimated_ttft_s,
            "plan_time_s": self.plan_time_s,
            "info": self.info,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        stream = [KVChunkId(int(t), int(l), int(g)) for t, l, g, _ in d["stream_order"]]
        levels = {KVChunkId(int(t), int(l), int(g)): str(lv) for t, l, g, lv in d["stream_order"]}
        return cls(
            compute_order=[StepId(int(t), int(l)) for t, l in d["compute_order"]],
            stream_order=stream, levels=levels, planner=d.get("planner", ""),
            stage_budget_s=d.get("stage_budget_s"), estimated_ttft_s=d.get("estimated_ttft_s"),
            plan_time_s=float(d.get("plan_time_s", 0.0)), info=dict(d.get("info", {})),
        )
