"""What loading one context did: :class:`LoadResult` and one :class:`TransferLog` per streamed
chunk. Times are seconds from the start of loading."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from sparkv.layout import KVChunkId, StepId
from sparkv.cache import ContextKV


class TransferStatus(str, Enum):
    """Where one streamed chunk ended up."""

    PENDING = "pending"        # requested, not (completely) received
    RECEIVED = "received"      # every byte read, decoding
    ARRIVED = "arrived"        # decoded into the KV buffers
    CANCELLED = "cancelled"    # the controller moved its step to the compute path
    FAILED = "failed"          # damaged (checksum, decryption, layout): recomputed locally
    LOST = "lost"              # the link died before it arrived: recomputed locally

    def __str__(self) -> str:
        return self.value


@dataclass
class TransferLog:
    """One streamed chunk."""

    cid: KVChunkId
    level: str
    nbytes: int
    requested_s: float
    first_byte_s: float = float("nan")
    end_s: float = float("nan")
    decoded_s: float = float("nan")
    status: TransferStatus = TransferStatus.PENDING

    def to_list(self) -> list[Any]:
        return [self.cid.t, self.cid.l, self.cid.g, self.level, self.nbytes, self.requested_s,
                self.first_byte_s, self.end_s, self.decoded_s, str(self.status)]


#: layer steps the controller must have timed on their own (the link quiet) before a load's
#: compute ratio moves the session's prior, or serves as the reference of its stream tax
MIN_COMPUTE_SAMPLES = 4
#: the predicted time of a step the prelude ran (the instance wants positive times; such a step
#: says nothing of the load's speed)
PRELUDE_STEP_S = 1e-6


@dataclass
class LoadResult:
    """What loading one context did.

    Attributes:
        ready_s: when every KV chunk was in place.
        steps: layer step -> (start, end).
        link_active_s: first response byte to last byte (0 when nothing streamed).
        bytes_streamed: bytes of chunks that arrived (were used).
        bytes_received: every body byte read, including wasted ones.
        fallback: reason -> details (empty when nothing fell back).
        link_estimate_Bps: the controller's link throughput over the run (silences included),
            ``None`` when too little was streamed to tell: the next plan's prior.
        compute_ratio: the median measured / predicted layer-step time over the load's steps
            that ran while the link was quiet (1.0 when none did): the device's own speed,
            what the session learns; ``compute_samples`` steps measured it. Steps that ran
            beside streaming and decoding measure that load's contention for the cores, which
            the controller's window follows within the load.
        stream_tax_s: the compute time the load's steps lost while the link streamed, per
            chunk decoded while a step ran (:func:`~sparkv.scheduler.estimators.
            stream_tax_estimate`); ``stream_tax_samples`` such chunks (0: nothing to say).
        receive_tax: how much slower the load's steps ran while the link received beside them,
            decodes aside (:attr:`Instance.receive_tax <sparkv.scheduler.instance.Instance.
            receive_tax>`, :func:`~sparkv.scheduler.estimators.receive_tax_estimate`);
            ``receive_tax_samples`` steps measured it (0: nothing to say).
        decode_ratio: the decoders' busy time over the instance's predicted decode time
            (``t_proc`` at each frame's level) of the frames they decoded: what the session
            learns as its decode scale; ``decode_samples`` such frames (0: nothing to say).
        replan: the controller's verdict on a re-plan at the measured link rate
            (:attr:`Controller.replanned <sparkv.scheduler.controller.Controller.replanned>`:
            taken or not, and why not), ``None`` when none was judged.
    """

    ready_s: float
    steps: dict[StepId, tuple[float, float]]
    transfers: list[TransferLog]
    compute_busy_s: float
    decode_busy_s: float
    link_active_s: float
    bytes_streamed: int
    bytes_received: int
    requests: int
    migrations: list[Any]
    sources: dict[str, int]
    fallback: dict[str, Any]
    link_errors: list[str]
    kv: ContextKV = field(repr=False)
    link_estimate_Bps: float | None = None
    compute_ratio: float = 1.0
    compute_samples: int = 0
    silence_s: float = 0.0
    stream_tax_s: float = 0.0
    stream_tax_samples: int = 0
    receive_tax: float = 0.0
    receive_tax_samples: int = 0
    decode_ratio: float = 1.0
    decode_samples: int = 0
    replan: dict[str, Any] | None = None

    @property
    def bytes_wasted(self) -> int:
        return max(0, self.bytes_received - self.bytes_streamed)

    def timeline(self) -> dict[str, Any]:
        """JSON form (steps as ``[t, l, start, end]``, transfers as lists; see TransferLog)."""
        return {"ready_s": self.ready_s,
                "steps": [[s.t, s.l, a, b] for s, (a, b) in sorted(self.steps.items(),
                                                                   key=lambda x: x[1][0])],
                "transfers": [x.to_list() for x in self.transfers],
                "migrations": [m.to_dict() for m in self.migrations]}
