"""What an ask returns: :class:`AskResult` (the answer, the plan, the load) and its
:class:`Breakdown` (where the time to first token went, what each path did). Plain records: no
behaviour beyond formatting."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkv.edge.results import LoadResult
from sparkv.generation import base_stats
from sparkv.scheduler.controller import ControllerConfig
from sparkv.scheduler.instance import Instance
from sparkv.scheduler.plan import Plan


@dataclass
class Breakdown:
    """Where the time to first token went (seconds) and what each path did."""

    strategy: str
    ttft_s: float
    manifest_s: float = 0.0
    planning_s: float = 0.0
    loading_s: float = 0.0          # overlapped: until every KV chunk is in place
    streaming_s: float = 0.0        # the link's active time (first to last body byte)
    decoding_s: float = 0.0         # decode worker busy time (overlapped)
    local_compute_s: float = 0.0    # compute thread busy time (overlapped)
    question_prefill_s: float = 0.0
    first_token_s: float = 0.0      # sampling after the question's forward pass
    bytes_streamed: int = 0
    bytes_wasted: int = 0
    chunks_streamed: int = 0
    chunks_computed: int = 0
    steps_computed: int = 0
    migrations: int = 0
    requests: int = 0
    levels: dict[str, int] = field(default_factory=dict)
    fallback: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)   # DecodeStats of a decode policy
    prelude_steps: int = 0          # layer steps computed before the plan (sparkv.edge.prelude)
    #: the question's tokens whose KV the context service kept from an earlier ask of the same
    #: conversation (not run; sparkv.device.tails)
    turn_tokens_reused: int = 0
    #: a sampled answer's seed (``AskOptions.seed``, or the one the ask drew); ``None``: greedy
    seed: int | None = None
    #: a kept context's ask that read the working memory another ask about it had switched in,
    #: at once (sparkv.device.readturns)
    joined: bool = False
    #: a kept context's ask: its working memory's token chunks by where their KV came from
    #: (the context service's :attr:`~sparkv.device.loader.LoadStats.sources`: a level's name,
    #: ``recomputed``, ``streamed``, or ``working memory``: the one its last call or its
    #: import left, kept)
    memory_sources: dict[str, int] = field(default_factory=dict)
    #: the seconds keeping the loaded context took at the answer's first token, other asks
    #: waiting for it (after the first token, before the second; sparkv.asks.kept); ``None``:
    #: kept after the answer, or not kept
    kept_early_s: float | None = None
    #: the load's verdict on a re-plan at the measured link rate (``time_s``, ``measured_mbps``,
    #: ``planned_mbps``, ``taken``; not taken: ``kept``, why, or the planner's ``error``;
    #: ``None``: none was judged; docs/scheduler.md, "A re-plan at the measured rate")
    replan: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def rows(self) -> list[tuple[str, str]]:
        r = [("time to first token", f"{self.ttft_s:8.3f} s"),
             ("  manifest + tokens", f"{self.manifest_s:8.3f} s"),
             ("  planning", f"{self.planning_s:8.3f} s"),
             ("  loading the cache", f"{self.loading_s:8.3f} s   (overlapped:)"),
             ("    streaming (link active)", f"{self.streaming_s:8.3f} s"),
             ("    decoding", f"{self.decoding_s:8.3f} s"),
             ("    local compute", f"{self.local_compute_s:8.3f} s"),
             ("  question prefill", f"{self.question_prefill_s:8.3f} s"
              + (f"   ({self.turn_tokens_reused} tokens of earlier turns kept)"
                 if self.turn_tokens_reused else "")),
             ("  first token", f"{self.first_token_s:8.3f} s"),
             ("bytes streamed", f"{self.bytes_streamed / 1e6:8.2f} MB"
              + (f" (+{self.bytes_wasted / 1e6:.2f} MB wasted)" if self.bytes_wasted else "")),
             ("chunks streamed / computed", f"{self.chunks_streamed} / {self.chunks_computed}"
              f" ({self.steps_computed} layer steps"
              + (f", {self.prelude_steps} before the plan" if self.prelude_steps else "") + ")"),
             ("controller migrations", f"{self.migrations}")]
        if self.seed is not None:
            r.append(("answer sampled", f"seed {self.seed}"))
        if self.replan and self.replan.get("kept") != "link not slower":
            r.append(self._replan_row(self.replan))
        if self.levels:
            r.append(("levels streamed", ", ".join(f"{k} x{v}" for k, v in self.levels.items())))
        if self.decode:
            from sparkv.decode.stats import decode_rows

            r.extend(decode_rows(self.decode))
        if self.fallback:
            r.append(("FELL BACK to local compute", "; ".join(f"{k}: {v}"
                                                           for k, v in self.fallback.items())))
        return r

    @staticmethod
    def _replan_row(v: dict[str, Any]) -> tuple[str, str]:
        rates = (f"at {v['time_s']:.2f} s for the {v['measured_mbps']:.3g} Mbit/s measured "
                 f"(planned for {v['planned_mbps']:.3g})")
        if v.get("taken"):
            return "re-planned", rates
        return "not re-planned", f"{rates}: {v.get('kept') or v.get('error')}"

    def table(self) -> str:
        w = max(len(a) for a, _ in self.rows())
        return "\n".join(f"{a:<{w}}  {b}" for a, b in self.rows())


@dataclass
class AskResult:
    """The answer and everything measured on the way; a :class:`~sparkv.generation.Generation`
    (``text``: the answer, ``tokens``, ``stats``), with the :class:`Breakdown`, the plan and the
    load beside it (``controller``: the configuration the load's controller ran with, and
    ``started_by``: the plan the load started by, for a simulation of the same load; ``plan``
    is the one it ended with, a handover's or a re-plan's)."""

    text: str
    tokens: list[int]
    breakdown: Breakdown
    plan: Plan | None
    instance: Instance | None
    load: LoadResult | None
    first_logits: Any = None
    context_tokens: int = 0
    kept_id: str | None = None     # the context service's id of the kept context (``keep``)
    controller: ControllerConfig | None = None
    started_by: Plan | None = None
    question_tokens: int = 0       # the prompt's tokens after the context (its turns)

    @property
    def ttft_s(self) -> float:
        return self.breakdown.ttft_s

    @property
    def stats(self) -> dict[str, Any]:
        """``ttft_s``, ``new_tokens``, ``context_tokens``, ``question_tokens``, then the
        :class:`Breakdown`'s fields (its ``first_token_s`` is the sampling after the question's
        forward pass)."""
        return {**base_stats(self.ttft_s, self.tokens), "context_tokens": self.context_tokens,
                "question_tokens": self.question_tokens,
                **self.breakdown.to_dict()}
