"""The engine's record of one load: what each path did, what fell back and why, and the
:class:`~sparkv.edge.results.LoadResult` made of it.

:class:`EngineStats` only records; the rules that act on faults live in the parts that apply
them (:mod:`sparkv.edge.compute` reads :attr:`EngineStats.failed`, :attr:`EngineStats.link_dead`,
:attr:`EngineStats.stall` and :attr:`EngineStats.deadline` to choose fallback steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparkv.cache import ContextKV
from sparkv.edge.results import (MIN_COMPUTE_SAMPLES, PRELUDE_STEP_S, LoadResult, TransferLog,
                                 TransferStatus)
from sparkv.layout import KVChunkId, StepId
from sparkv.scheduler.controller import Controller, Fetch
from sparkv.scheduler.estimators import receive_tax_estimate, stream_tax_estimate

#: streamed bytes below which a run says nothing about the link (the next plan keeps its prior)
MIN_BYTES_FOR_ESTIMATE = 1 << 20


@dataclass(eq=False)
class EngineStats:
    """What one load did, written by every part of the engine.

    Lock discipline: every field is written, and read by another thread, only while holding
    the engine's lock (:attr:`Hub.cv <sparkv.edge.hub.Hub.cv>`); every method expects the
    caller to hold it. :meth:`result` runs after the threads are joined. Nothing here waits
    or notifies.

    Who writes what:

    * the compute worker: ``steps``, ``compute_busy_s``, ``fallback_steps``, ``stall``,
      ``deadline``, ``ready_s``;
    * the link loop: ``transfers`` (a log per requested chunk), ``requests``,
      ``bytes_received``, the first and last byte, ``silence_s``, ``link_dead``, ``refused``;
    * a decode worker: each log's decode time and outcome, ``bytes_used``, ``decode_busy_s``,
      ``failed``;
    * all three: ``link_errors``.

    Attributes:
        transfers: chunk -> the log of its latest request (every log, re-requests included,
            goes to ``LoadResult.transfers``).
        failed: chunk -> why the link's frame of it cannot be used (it is computed locally).
        link_dead: why the link was given up (everything missing is computed), or ``None``.
        refused: the error with which the source refused this client's credentials (a 401 or
            403): the compute worker ends the load with it (no fallback), or ``None``.
        stall: what ``LoadResult.fallback["stalled"]`` says once the stall or the idle rule
            fired, or a prelude failed (everything missing is computed while the link goes
            on), or ``None``.
        deadline: why the link was given up at the ask's time limit (everything missing is
            computed), or ``None``.
    """

    steps: dict[StepId, tuple[float, float]] = field(default_factory=dict)
    transfers: dict[KVChunkId, TransferLog] = field(default_factory=dict)
    failed: dict[KVChunkId, str] = field(default_factory=dict)
    link_dead: str | None = None
    refused: Exception | None = None
    stall: str | None = None
    deadline: str | None = None
    link_errors: list[str] = field(default_factory=list)
    fallback_steps: int = 0
    compute_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    bytes_received: int = 0
    bytes_used: int = 0
    requests: int = 0
    silence_s: float = 0.0
    ready_s: float = 0.0
    _transfer_list: list[TransferLog] = field(default_factory=list, init=False)  # + re-requests
    _first_byte: float | None = field(default=None, init=False)
    _last_byte: float = field(default=0.0, init=False)

    # ---- compute path ------------------------------------------------------------------------
    def step_ran(self, step: StepId, start: float, end: float, busy_s: float) -> None:
        self.steps[step] = (start, end)
        self.compute_busy_s += busy_s

    # ---- link path ---------------------------------------------------------------------------
    def requested(self, f: Fetch, nbytes: int, now: float) -> None:
        """``f`` was pulled from the controller into a request (a log for it begins)."""
        log = TransferLog(f.cid, f.level, nbytes, now)
        self.transfers[f.cid] = log
        self._transfer_list.append(log)

    def bytes_flowing(self, cid: KVChunkId, now: float, chunk_start: bool) -> None:
        """Bytes of ``cid`` arrived at ``now`` (``chunk_start``: its first ones)."""
        if self._first_byte is None:
            self._first_byte = now
        self._last_byte = now
        if chunk_start:
            self.transfers[cid].first_byte_s = now

    def received(self, cid: KVChunkId, now: float) -> TransferLog:
        """Every byte of ``cid``'s frame was read (it goes to a decode worker)."""
        log = self.transfers[cid]
        log.end_s, log.status = now, TransferStatus.RECEIVED
        return log

    def count(self, received: int, used: int) -> None:
        self.bytes_received += received
        self.bytes_used += used

    def cancelled(self, cid: KVChunkId) -> None:
        """The controller moved ``cid``'s step to the compute path."""
        self._settle(cid, TransferStatus.CANCELLED)

    def lost(self, fetches: list[Fetch]) -> None:
        """The link died before these arrived."""
        for f in fetches:
            self._settle(f.cid, TransferStatus.LOST)

    def _settle(self, cid: KVChunkId, status: TransferStatus) -> None:
        log = self.transfers.get(cid)
        if log is not None and log.status == TransferStatus.PENDING:
            log.status = status

    # ---- decode path -------------------------------------------------------------------------
    def decoded(self, log: TransferLog, now: float, busy_s: float, nbytes: int,
                why: str | None) -> None:
        """A decode worker finished ``log``'s frame of ``nbytes``: in place, or not (``why``)."""
        self.decode_busy_s += busy_s
        log.decoded_s = now
        if why is None:
            log.status = TransferStatus.ARRIVED
            self.bytes_used += nbytes
        else:
            log.status = TransferStatus.FAILED
            self.failed[log.cid] = why.split(":")[0]
            self.link_errors.append(f"{log.cid}: {why}")

    # ---- the result --------------------------------------------------------------------------
    @property
    def link_given_up(self) -> bool:
        """Whether everything missing is being computed (the link dead, stalled, or past the
        ask's time limit): what the link still holds is no longer waited for."""
        return self.link_dead is not None or self.stall is not None or self.deadline is not None

    def fallback(self) -> dict[str, Any]:
        """What fell back and why (``LoadResult.fallback``; empty when nothing did)."""
        out: dict[str, Any] = {}
        if self.failed:
            reasons: dict[str, int] = {}
            for why in self.failed.values():
                reasons[why] = reasons.get(why, 0) + 1
            out["chunks"] = reasons
        if self.link_dead:
            out["link"] = self.link_dead
        if self.stall:
            out["stalled"] = self.stall
        if self.deadline:
            out["deadline"] = self.deadline
        if self.fallback_steps:
            out["steps_computed"] = self.fallback_steps
        return out

    def result(self, kv: ContextKV, ctl: Controller) -> LoadResult:
        """The load's :class:`LoadResult` (``kv``: the assembled cache; ``ctl``: the load's
        controller, for its estimates)."""
        counts: dict[str, int] = {}
        for src in kv.sources().values():
            counts[src] = counts.get(src, 0) + 1
        link_active = (self._last_byte - self._first_byte) if self._first_byte is not None else 0.0
        estimate = ctl.run_bandwidth() if self.bytes_received >= MIN_BYTES_FOR_ESTIMATE else None
        fallback = self.fallback()
        if ctl.link_dead is not None:
            fallback["slow_link"] = f"{ctl.link_dead}: its work was computed locally"
        (tax, tax_chunks), (recv, recv_steps) = self._stream_taxes(ctl)
        ratio, frames = self._decode_ratio(ctl)
        return LoadResult(
            ready_s=self.ready_s, steps=dict(self.steps), transfers=list(self._transfer_list),
            compute_busy_s=self.compute_busy_s, decode_busy_s=self.decode_busy_s,
            link_active_s=link_active, bytes_streamed=self.bytes_used,
            bytes_received=self.bytes_received, requests=self.requests,
            migrations=list(ctl.migrations), sources=counts, fallback=fallback,
            link_errors=list(self.link_errors), kv=kv, link_estimate_Bps=estimate,
            compute_ratio=ctl.quiet_compute_ratio(), compute_samples=ctl.quiet_compute_samples,
            silence_s=self.silence_s, stream_tax_s=tax, stream_tax_samples=tax_chunks,
            receive_tax=recv, receive_tax_samples=recv_steps, decode_ratio=ratio,
            decode_samples=frames,
            replan=dict(ctl.replanned) if ctl.replanned is not None else None)

    def _decode_ratio(self, ctl: Controller) -> tuple[float, int]:
        """The decoders' busy time over the instance's ``t_proc`` of the frames decoded (and
        their count); ``(1.0, 0)`` when none was, or other asks shared the cores."""
        inst = ctl.inst
        done = [x for x in self._transfer_list if x.decoded_s == x.decoded_s]
        if not done or ctl.state.compute_estimator.peak_load > 1:
            return 1.0, 0
        predicted = sum(float(inst.t_proc[inst.chunk_index(x.cid), inst.level_index(x.level)])
                        for x in done)
        if predicted <= 0 or self.decode_busy_s <= 0:
            return 1.0, 0
        return self.decode_busy_s / predicted, len(done)

    def _stream_taxes(self, ctl: Controller) -> tuple[tuple[float, int], tuple[float, int]]:
        """The load's stream tax (:func:`stream_tax_estimate`) and receive tax
        (:func:`receive_tax_estimate`) over its steps below the last layer (the projection-only
        layer's prediction is no sample of the device's speed), the reference the steps that ran
        while the link was quiet, when there were enough; nothing from a load that shared the
        device with other asks (its lane's load above 1)."""
        decoded = [x.decoded_s for x in self._transfer_list if x.decoded_s == x.decoded_s]
        if self._first_byte is None or not decoded or ctl.state.compute_estimator.peak_load > 1:
            return (0.0, 0), (0.0, 0)   # other asks' steps and decodes shared the cores
        last = ctl.inst.L - 1
        predicted = ctl.state.compute.t_comp
        steps = [(a, b, p) for s, (a, b) in self.steps.items()
                 if s.l != last and (p := predicted[ctl.inst.step_index(s)]) > PRELUDE_STEP_S]
        ref = (ctl.quiet_compute_ratio() if ctl.quiet_compute_samples >= MIN_COMPUTE_SAMPLES
               else 1.0)
        receiving = [(x.first_byte_s, x.end_s) for x in self._transfer_list]
        return (stream_tax_estimate(steps, decoded, (self._first_byte, max(decoded)), ref),
                receive_tax_estimate(steps, decoded, receiving, ref))
