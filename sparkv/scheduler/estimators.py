"""What the runtime controller believes about its two paths: :class:`LinkEstimator` (the link's
throughput, from rate samples) and :class:`ComputeEstimator` (the compute path's speed against
the cost model, from timed layer steps).

The :class:`~sparkv.scheduler.controller.Controller` owns one of each; every rule reads them
through it, and the drivers (the simulator, the edge engine) feed them through the controller's
events (``rate_sample``, ``step_done``). Times in seconds, rates in bytes per second.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections import deque
from typing import Sequence

#: layer steps in the compute-speed window
COMPUTE_WINDOW = 8
#: steps without a decode inside that :func:`stream_tax_estimate` needs to take the load's
#: general speed error out
MIN_BASE_STEPS = 4
#: a manifest step (the ask's requests before the plan) that kept the link this long is a link
#: in a fade: the plan's prior is capped at its rate (:func:`start_prior`)
SLOW_START_S = 0.25


def start_prior(prior_Bps: float, nbytes: float, seconds: float) -> float:
    """The link prior a load is planned with, after its manifest step moved ``nbytes`` in
    ``seconds``: ``prior_Bps`` (the last load's rate, or the default), capped at that step's
    rate when it took :data:`SLOW_START_S` or more. A small manifest's rate says nothing about
    a healthy link (a round trip dominates it); one that took a quarter second or more says the
    link is in a fade now, whatever it did before: planned at the old rate, the load handed a
    silent link its first steps and waited for them (session 71, adversarial-3 at 2K: the
    compute path idle 0.2 s of a 1.3 s ask; simulated over 50 adversarial traces at 2K, p95
    sparkv / local 1.19 -> 1.03; docs/scheduler.md, "A slow start"). The controller's probes and
    rate samples raise the estimate as soon as the link delivers."""
    if seconds >= SLOW_START_S and nbytes > 0:
        return min(prior_Bps, nbytes / seconds)
    return prior_Bps


class LinkEstimator:
    """The link's throughput from rate samples ``(time, bytes, seconds)``.

    Args:
        prior_Bps: the rate the plan was made with (the estimate before any sample).
        window_s: the sliding window of :meth:`window` (s).
        fast_window_s: the recent window of :meth:`recent` (s; 0: off).

    Attributes:
        ahead_bytes: bytes of other loads the link carries before this load's remaining work
            (a device service's link plan, :mod:`sparkv.asks.linkplan`: the asks ranked before
            this one). The rules plan the link's remaining time as ``(ahead_bytes + pending) /
            estimate``. 0: the link is this load's alone.
    """

    def __init__(self, prior_Bps: float, window_s: float = 0.5,
                 fast_window_s: float = 0.15) -> None:
        self.prior_Bps = prior_Bps
        self.ahead_bytes = 0.0
        self.window_s, self.fast_window_s = window_s, fast_window_s
        self._samples: deque[tuple[float, float, float]] = deque()
        self._in_window = [0.0, 0.0]      # bytes, seconds of the samples in ``_samples``
        self._total = [0.0, 0.0]          # bytes, seconds of every sample of the run

    def add(self, now: float, nbytes: float, seconds: float) -> None:
        """``nbytes`` arrived over the ``seconds`` before ``now`` (0 bytes: a silence)."""
        if seconds > 0:
            self._samples.append((now, float(nbytes), float(seconds)))
            for acc in (self._in_window, self._total):
                acc[0] += float(nbytes)
                acc[1] += float(seconds)

    def window(self, now: float) -> float:
        """Throughput over the sliding window (at least the newest sample); the prior before
        any sample. Running sums (the link thread asks at every piece it reads), summed afresh only
        when the window moves."""
        samples, acc = self._samples, self._in_window
        if len(samples) > 1 and samples[0][0] < now - self.window_s:
            while len(samples) > 1 and samples[0][0] < now - self.window_s:
                samples.popleft()
            # summed afresh in order when the window moves: the same sums, bit for bit, as
            # adding every sample anew (appending keeps that order too)
            acc[0] = sum(x[1] for x in samples)
            acc[1] = sum(x[2] for x in samples)
        if not samples:
            return self.prior_Bps
        b, s = acc
        return max(b / s, 1.0) if s > 0 else self.prior_Bps

    def recent(self, now: float) -> float:
        """Throughput over the last ``fast_window_s`` of samples (at least the newest one); the
        window's when there are none or the fast window is off."""
        long = self.window(now)
        if self.fast_window_s <= 0 or not self._samples:
            return long
        b = s = 0.0
        for t, nb, sec in reversed(self._samples):
            if s > 0 and t < now - self.fast_window_s:
                break
            b, s = b + nb, s + sec
        return max(b / s, 1.0) if s > 0 else long

    def estimate(self, now: float) -> float:
        """The rate the link's remaining work is planned with: the slower of :meth:`window` and
        :meth:`recent`. A fade shows within a sample or two, a recovery once the window sees it;
        both directions of migration use this one estimate, so they never disagree about the
        same link (no ping-pong)."""
        return min(self.window(now), self.recent(now))

    @property
    def sampled_s(self) -> float:
        """Seconds covered by every sample of the run (silences included)."""
        return self._total[1]

    def run_rate(self) -> float | None:
        """Throughput over every sample of the run (silences included), or ``None`` before
        any: the link's goodput, a prior for the next load."""
        b, s = self._total
        return b / s if s > 0 and b > 0 else None


class ComputeEstimator:
    """The compute path's speed: measured / predicted step time over the last ``window`` steps.

    Attributes:
        load: an external load factor on the compute path (other asks sharing it: 2.0 = this
            load gets half of it). It scales :meth:`factor`, what the rules plan remaining
            compute time with, and not :meth:`ratio`, this device's own speed (what the session
            learns). 1.0: no other load. ``peak_load``: the most it has been.
    """

    def __init__(self, window: int = COMPUTE_WINDOW, load: float = 1.0) -> None:
        self._ratios: deque[float] = deque(maxlen=max(1, window))
        self._run: list[float] = []      # every step's ratio of the run
        self._quiet: list[float] = []    # those of steps that ran while the link was quiet
        self.peak_load = 1.0
        self.load = load

    @property
    def load(self) -> float:
        return self._load

    @load.setter
    def load(self, value: float) -> None:
        self._load = float(value)
        self.peak_load = max(self.peak_load, self._load)

    def add(self, predicted_s: float, seconds: float, quiet: bool = True) -> None:
        """A step predicted to take ``predicted_s`` took ``seconds``; ``quiet``: nothing was
        streamed or decoded beside it (the link had at most a probe to do)."""
        if predicted_s > 0 and seconds > 0:
            self._ratios.append(seconds / predicted_s)
            self._run.append(seconds / predicted_s)
            if quiet:
                self._quiet.append(seconds / predicted_s)

    @property
    def samples(self) -> int:
        """Layer steps in the window."""
        return len(self._ratios)

    def ratio(self) -> float:
        """Measured / predicted step time over the window (1.0 before any step)."""
        return sum(self._ratios) / len(self._ratios) if self._ratios else 1.0

    @property
    def run_samples(self) -> int:
        """Layer steps timed over the whole run."""
        return len(self._run)

    def run_ratio(self) -> float:
        """The median measured / predicted step time over every step of the run (1.0 before
        any): the device's speed against the cost model, what the next plan starts from. The
        median, not :meth:`ratio`'s recent mean: one step that waited for a core (measured here:
        a single step at 49x its prediction while another process held a core) must not move
        the next plan's whole compute estimate."""
        return statistics.median(self._run) if self._run else 1.0

    @property
    def quiet_samples(self) -> int:
        """Layer steps of the run timed while the link was quiet."""
        return len(self._quiet)

    def quiet_ratio(self) -> float:
        """:meth:`run_ratio` over the steps that ran while the link was quiet (1.0 before any):
        the device's own speed, what the session learns. A step that ran beside the link's
        decoding on the same cores measures that load's contention (on 2 cores, session 64:
        1.3-2.9x its prediction at 100 Mbit/s), which the next load, streaming more or less,
        does not share."""
        return statistics.median(self._quiet) if self._quiet else 1.0

    def factor(self) -> float:
        """Predicted step seconds x this = seconds of the compute path: :meth:`ratio` x
        :attr:`load`."""
        return self.ratio() * self.load


#: the most of a step's time beside the link :func:`receive_tax_estimate` believes was lost
MAX_RECEIVE_SHARE = 0.5


def stream_tax_estimate(steps: Sequence[tuple[float, float, float]], decoded: Sequence[float],
                        window: tuple[float, float], ref: float = 1.0) -> tuple[float, int]:
    """What one load says of :attr:`Instance.stream_tax_s
    <sparkv.scheduler.instance.Instance.stream_tax_s>`: the compute time its layer steps lost
    while the link streamed, per chunk decoded while a step ran. Returns ``(seconds per chunk,
    chunks)``; ``(0.0, 0)`` when no chunk was decoded inside a step.

    Args:
        steps: ``(start, end, predicted seconds)`` of the load's computed steps.
        decoded: when each streamed chunk was decoded.
        window: ``(first byte, last decode)``: the steps that overlap it ran beside the link;
            each lost ``end - start - predicted x ref`` (what a step running on its own takes),
            less what the window's steps without a decode inside lost (their median, when there
            are :data:`MIN_BASE_STEPS`): the load's general speed error, which a slow link's
            few decodes must not be charged with (session 65: 11-20 ms a chunk at 20 Mbit/s
            where 100 Mbit/s measured 3-4).
        ref: the load's measured / predicted time of its steps that ran on their own.
    """
    ends = sorted(decoded)
    excess: list[float] = []
    inside: list[int] = []
    for start, end, predicted in steps:
        if end <= window[0] or start >= window[1]:
            continue
        excess.append((end - start) - predicted * ref)
        inside.append(bisect_left(ends, end) - bisect_right(ends, start))   # strictly inside
    chunks = sum(inside)
    if chunks == 0:
        return 0.0, 0
    clear = [e for e, k in zip(excess, inside) if k == 0]
    base = statistics.median(clear) if len(clear) >= MIN_BASE_STEPS else 0.0
    return max(0.0, (sum(excess) - base * len(excess)) / chunks), chunks


def receive_tax_estimate(steps: Sequence[tuple[float, float, float]], decoded: Sequence[float],
                         receiving: Sequence[tuple[float, float]],
                         ref: float = 1.0) -> tuple[float, int]:
    """What one load says of :attr:`Instance.receive_tax
    <sparkv.scheduler.instance.Instance.receive_tax>`, how much slower its steps ran while the
    link received beside them (with a 512-token chunk 70 ms on a 20 Mbit/s link, receiving is a
    cost in proportion to that time, which the per-decode :func:`stream_tax_estimate` leaves
    out as the load's general speed error). Over the load's steps with no decode inside that
    spent at least half their time beside a transfer, ``r``, the median of ``(end - start -
    predicted x ref) / seconds beside a transfer``, is the share of the time beside the link
    lost, so the steps ran ``1 + r / (1 - r)`` times slower there. Returns ``(r / (1 - r),
    steps)`` (``r`` at most :data:`MAX_RECEIVE_SHARE`); ``(0.0, 0)`` with fewer than
    :data:`MIN_BASE_STEPS` such steps.

    Args:
        steps: ``(start, end, predicted seconds)`` of the load's computed steps.
        decoded: when each streamed chunk was decoded.
        receiving: ``(first byte, last byte)`` of each transfer.
        ref: the load's measured / predicted time of its steps that ran on their own.
    """
    ends = sorted(decoded)
    spans = _union(receiving)
    ratios: list[float] = []
    for start, end, predicted in steps:
        if bisect_left(ends, end) - bisect_right(ends, start) > 0:
            continue
        beside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans)
        if beside >= 0.5 * (end - start) > 0:
            ratios.append(((end - start) - predicted * ref) / beside)
    if len(ratios) < MIN_BASE_STEPS:
        return 0.0, 0
    share = min(max(0.0, statistics.median(ratios)), MAX_RECEIVE_SHARE)
    return share / (1.0 - share), len(ratios)


def _union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted disjoint ones (NaN or empty ones left out)."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv for iv in intervals if iv[0] < iv[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
