"""Bandwidth traces: piecewise-constant link throughput over time, from CSV files or constants.

CSV format (docs/scheduler.md): a header ``time_s,mbps`` with an optional third column ``rtt_ms``;
one row per change point, ``time_s`` strictly increasing from 0. Row ``i``'s rate (Mbit/s,
1 Mbit = 10^6 bits) holds on ``[time_s[i], time_s[i+1])``; the last row holds for as long as the gap
before it, which closes one period. Past the end the trace repeats (``loop=True``, the default) or
keeps its last rate (``loop=False``). A rate of 0 is an outage.

Sample traces ship in ``sparkv/data/`` (see :data:`SAMPLE_TRACES`); :func:`make_sample_trace`
regenerates them deterministically.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.scheduler.instance import MBPS, portable_exp

DATA_DIR = Path(__file__).resolve().parent.parent / "data"

#: name -> file in sparkv/data
SAMPLE_TRACES = {
    "wifi": "trace_wifi.csv",
    "lte": "trace_lte.csv",
    "deep-fade": "trace_deep_fade.csv",
    "fade-start": "trace_fade_start.csv",
}


class TraceError(SparkvError):
    """A trace file is malformed."""


@dataclass(frozen=True)
class Trace:
    """Piecewise-constant throughput. ``times_s[0] == 0``; ``mbps[i]`` holds from ``times_s[i]``."""

    times_s: tuple[float, ...]
    mbps: tuple[float, ...]
    rtt_ms: tuple[float, ...] | None = None
    period_s: float = math.inf
    loop: bool = True
    name: str = ""

    def __post_init__(self) -> None:
        if not self.times_s or len(self.times_s) != len(self.mbps):
            raise TraceError("a trace needs as many times as rates, at least one")
        if self.times_s[0] != 0:
            raise TraceError(f"a trace starts at time 0, got {self.times_s[0]}")
        if any(b <= a for a, b in zip(self.times_s, self.times_s[1:])):
            raise TraceError("trace times must be strictly increasing")
        if any(not (m >= 0 and math.isfinite(m)) for m in self.mbps):
            raise TraceError("trace rates must be finite and >= 0 Mbit/s")
        if max(self.mbps) <= 0:
            raise TraceError("a trace with no positive rate never delivers a byte")
        if self.rtt_ms is not None and len(self.rtt_ms) != len(self.mbps):
            raise TraceError("rtt_ms must have one value per row")
        if self.period_s <= self.times_s[-1]:
            raise TraceError("the period must end after the last change point")

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def constant(cls, mbps: float, rtt_ms: float | None = None) -> "Trace":
        return cls((0.0,), (float(mbps),), None if rtt_ms is None else (float(rtt_ms),),
                   math.inf, False, f"const-{mbps:g}mbps")

    @classmethod
    def from_rows(cls, times_s: Sequence[float] | np.ndarray, mbps: Sequence[float] | np.ndarray,
                  rtt_ms: Sequence[float] | np.ndarray | None = None, *, loop: bool = True,
                  name: str = "") -> "Trace":
        times = tuple(float(t) for t in times_s)
        if len(times) >= 2:
            period = times[-1] + (times[-1] - times[-2])
        else:
            period = math.inf
        return cls(times, tuple(float(m) for m in mbps),
                   None if rtt_ms is None else tuple(float(r) for r in rtt_ms),
                   period, loop and math.isfinite(period), name)

    @classmethod
    def from_csv(cls, path: str | Path, *, loop: bool = True) -> "Trace":
        text = Path(path).read_text()
        return cls.parse(text, loop=loop, name=Path(path).stem)

    @classmethod
    def parse(cls, text: str, *, loop: bool = True, name: str = "") -> "Trace":
        reader = csv.reader(io.StringIO(text))
        rows = [r for r in reader if r and not r[0].lstrip().startswith("#")]
        if not rows:
            raise TraceError(f"trace {name!r} is empty")
        header = [h.strip() for h in rows[0]]
        if header[:2] != ["time_s", "mbps"] or len(header) > 3 or (
                len(header) == 3 and header[2] != "rtt_ms"):
            raise TraceError(f"trace {name!r}: header must be 'time_s,mbps[,rtt_ms]', got {header}")
        times, rates, rtts = [], [], []
        for n, row in enumerate(rows[1:], start=2):
            if len(row) != len(header):
                raise TraceError(f"trace {name!r} row {n}: expected {len(header)} fields")
            try:
                times.append(float(row[0]))
                rates.append(float(row[1]))
                if len(header) == 3:
                    rtts.append(float(row[2]))
            except ValueError as exc:
                raise TraceError(f"trace {name!r} row {n}: {exc}") from None
        return cls.from_rows(times, rates, rtts if len(header) == 3 else None, loop=loop, name=name)

    @classmethod
    def sample(cls, name: str, *, loop: bool = True) -> "Trace":
        """One of the traces shipped in ``sparkv/data`` (:data:`SAMPLE_TRACES`)."""
        if name not in SAMPLE_TRACES:
            raise TraceError(f"unknown sample trace {name!r}; known: {sorted(SAMPLE_TRACES)}")
        text = (DATA_DIR / SAMPLE_TRACES[name]).read_text()
        return cls.parse(text, loop=loop, name=name)

    def to_csv(self) -> str:
        out = io.StringIO()
        if self.rtt_ms is None:
            out.write("time_s,mbps\n")
            for t, m in zip(self.times_s, self.mbps):
                out.write(f"{t:.3f},{m:.3f}\n")
        else:
            out.write("time_s,mbps,rtt_ms\n")
            for t, m, r in zip(self.times_s, self.mbps, self.rtt_ms):
                out.write(f"{t:.3f},{m:.3f},{r:.1f}\n")
        return out.getvalue()

    def after(self, offset_s: float) -> "Trace":
        """The same link seen from ``offset_s`` on (time 0 of the result is ``offset_s`` here)."""
        if offset_s <= 0:
            return self
        if self.loop and math.isfinite(self.period_s):
            offset_s = offset_s % self.period_s
            times = list(self.times_s) + [t + self.period_s for t in self.times_s]
            rates = list(self.mbps) * 2
            rtts = list(self.rtt_ms) * 2 if self.rtt_ms is not None else None
            horizon = offset_s + self.period_s
        else:
            times, rates = list(self.times_s), list(self.mbps)
            rtts = list(self.rtt_ms) if self.rtt_ms is not None else None
            horizon = math.inf
        i = bisect.bisect_right(times, offset_s) - 1
        keep = [j for j in range(i + 1, len(times)) if times[j] < horizon]
        new_t = [0.0] + [times[j] - offset_s for j in keep]
        new_m = [rates[i]] + [rates[j] for j in keep]
        new_r = None if rtts is None else [rtts[i]] + [rtts[j] for j in keep]
        if self.loop and math.isfinite(self.period_s):
            return Trace(tuple(new_t), tuple(new_m), None if new_r is None else tuple(new_r),
                         self.period_s, True, self.name)
        return Trace(tuple(new_t), tuple(new_m), None if new_r is None else tuple(new_r),
                     math.inf, False, self.name)

    # --- queries ----------------------------------------------------------------------------
    def _locate(self, t: float) -> tuple[int, float, float]:
        """(segment index, segment start, segment end) in absolute time for time ``t``."""
        if t < 0:
            t = 0.0
        base = 0.0
        if self.loop and math.isfinite(self.period_s) and t >= self.period_s:
            k = math.floor(t / self.period_s)
            base = k * self.period_s
            t -= base
        i = bisect.bisect_right(self.times_s, t) - 1
        if i + 1 < len(self.times_s):
            end = self.times_s[i + 1]
        else:
            end = self.period_s if self.loop else math.inf
        if base + end <= base + t + 1e-12 and math.isfinite(end):
            # rounding put us at the very end of a segment: step into the next one
            return self._locate(base + end + 1e-9)
        return i, base + self.times_s[i], base + end

    def rate_Bps(self, t: float) -> float:  # noqa: N802
        """Throughput at time ``t`` in bytes/s."""
        return self.mbps[self._locate(t)[0]] * MBPS

    def rtt_s(self, t: float, default: float) -> float:
        if self.rtt_ms is None:
            return default
        return self.rtt_ms[self._locate(t)[0]] / 1e3

    def transfer_end(self, start: float, nbytes: float) -> float:
        """When ``nbytes`` that start draining at ``start`` have all arrived."""
        if nbytes <= 0:
            return start
        t = start
        remaining = float(nbytes)
        per = self._period_bytes()
        if per is not None and remaining > 2 * per:
            k = math.floor(remaining / per) - 1   # whole periods deliver exactly per bytes each
            t += k * self.period_s
            remaining -= k * per
        for _ in range(4 * len(self.times_s) + 8):
            i, _, end = self._locate(t)
            rate = self.mbps[i] * MBPS
            if rate > 0:
                if end == math.inf or remaining <= rate * (end - t):
                    return t + remaining / rate
                remaining -= rate * (end - t)
            elif end == math.inf:
                raise TraceError("the trace ends in an outage: the transfer never completes")
            t = end
        raise TraceError("transfer did not complete")  # pragma: no cover - unreachable

    def bytes_between(self, t0: float, t1: float) -> float:
        """Bytes the link can deliver between ``t0`` and ``t1``."""
        total, t = 0.0, t0
        per = self._period_bytes()
        if per is not None and t1 - t0 > 2 * self.period_s:
            k = math.floor((t1 - t0) / self.period_s) - 1
            total += k * per
            t += k * self.period_s
        while t < t1:
            i, _, end = self._locate(t)
            seg_end = min(end, t1)
            total += self.mbps[i] * MBPS * (seg_end - t)
            t = seg_end
        return total

    def _period_bytes(self) -> float | None:
        """Bytes one whole period delivers (``None`` if the trace does not loop)."""
        if not (self.loop and math.isfinite(self.period_s)):
            return None
        times = list(self.times_s) + [self.period_s]
        return sum(m * MBPS * (b - a) for m, a, b in zip(self.mbps, times, times[1:]))

    def mean_mbps(self, horizon_s: float | None = None) -> float:
        h = horizon_s or (self.period_s if math.isfinite(self.period_s) else 1.0)
        return self.bytes_between(0.0, h) / h / MBPS


# ------------------------------------------------------------------------------------------------
# Sample traces
# ------------------------------------------------------------------------------------------------
def make_sample_trace(kind: str, seed: int = 0, duration_s: float = 120.0) -> Trace:
    """Deterministic synthetic traces, the source of the CSVs in ``sparkv/data``.

    * ``wifi``: 100 ms steps, log-AR(1) around 200 Mbit/s (sd ~30%), short dips to ~20% on ~2% of
      steps (interference); RTT 4-15 ms.
    * ``lte``: 200 ms steps, log-AR(1) around 25 Mbit/s between ~3 and ~80, slower swings; RTT
      35-90 ms.
    * ``deep-fade``: 80 Mbit/s (+-5%) with a fade to 1 Mbit/s from 1.0 s to 9.0 s, then 80 again;
      RTT 20 ms, 300 ms during the fade.
    * ``fade-start``: :func:`fade_start_trace` (a deep fade from time 0, then ~80 Mbit/s).
    """
    rng = np.random.default_rng(seed)
    if kind == "wifi":
        dt, mean, sd, rho = 0.1, 200.0, 0.3, 0.9
    elif kind == "lte":
        dt, mean, sd, rho = 0.2, 25.0, 0.55, 0.95
    elif kind == "deep-fade":
        times = np.arange(0.0, duration_s, 0.1)
        mbps = 80.0 * (1 + 0.05 * rng.uniform(-1, 1, len(times)))
        fade = (times >= 1.0 - 1e-9) & (times < 9.0 - 1e-9)
        mbps[fade] = 1.0
        rtt = np.where(fade, 300.0, 20.0)
        return Trace.from_rows(np.round(times, 3), np.round(mbps, 3), rtt, name=kind)
    elif kind == "fade-start":
        return replace(fade_start_trace(seed, duration_s), loop=True, name=kind)
    else:
        raise TraceError(f"unknown sample trace kind {kind!r}")
    n = int(round(duration_s / dt))
    x = np.empty(n)
    x[0] = 0.0
    eps = rng.normal(0.0, sd * math.sqrt(1 - rho * rho), n)
    for i in range(1, n):
        x[i] = rho * x[i - 1] + eps[i]
    mbps = mean * portable_exp(x - sd * sd / 2)
    if kind == "wifi":
        dips = rng.uniform(size=n) < 0.02
        mbps[dips] *= 0.2
        rtt = rng.uniform(4.0, 15.0, n)
        mbps = np.clip(mbps, 5.0, 900.0)
    else:
        rtt = rng.uniform(35.0, 90.0, n)
        mbps = np.clip(mbps, 3.0, 80.0)
    times = np.round(np.arange(n) * dt, 3)
    return Trace.from_rows(times, np.round(mbps, 3), np.round(rtt, 1), name=kind)


def adversarial_trace(seed: int, duration_s: float = 60.0, dt: float = 0.05) -> Trace:
    """A seeded adversarial link: what a phone sees, made to break a scheduler's assumptions.

    * A base rate drawn per trace, log-uniform in 20-300 Mbit/s, varied per ``dt`` step as bursty
      Wi-Fi: a log-AR(1) swing (sd 35%) and short interference dips to 10-30% on 3% of steps.
    * Deep fades of 0.5-3 s down to 0.5-3 Mbit/s at random times (one every 2-10 s on average),
      including, on 40% of traces, one that starts at time 0 (the manifest and the first
      estimate then see the fade).
    * After a fade the link recovers to a new level (20-300 Mbit/s), so a rate measured before
      or during a fade is wrong afterwards.
    * RTT 10-40 ms, 150-400 ms during a fade.

    ``loop=False``: past ``duration_s`` the last rate holds.
    """
    rng = np.random.default_rng([seed, 7919])
    n = int(round(duration_s / dt))
    times = np.arange(n) * dt
    level = np.empty(n)
    fade = np.zeros(n, dtype=bool)
    fade_rate = np.empty(n)

    def log_uniform(lo: float, hi: float) -> float:
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))

    mean_gap = rng.uniform(2.0, 10.0)
    t = 0.0
    if rng.uniform() < 0.4:                         # a fade at the very start
        d = rng.uniform(0.5, 3.0)
        fade[(times >= 0) & (times < d)] = True
        fade_rate[(times >= 0) & (times < d)] = log_uniform(0.5, 3.0)
        t = d
    cur = log_uniform(20.0, 300.0)
    level[:] = cur
    while t < duration_s:
        gap = rng.exponential(mean_gap)
        d = rng.uniform(0.5, 3.0)
        start, end = t + gap, t + gap + d
        sel = (times >= start) & (times < end)
        fade[sel] = True
        fade_rate[sel] = log_uniform(0.5, 3.0)
        cur = log_uniform(20.0, 300.0)              # recovery to a new level
        level[times >= end] = cur
        t = end
    x = np.empty(n)
    x[0] = 0.0
    sd, rho = 0.35, 0.85
    eps = rng.normal(0.0, sd * math.sqrt(1 - rho * rho), n)
    for i in range(1, n):
        x[i] = rho * x[i - 1] + eps[i]
    mbps = level * portable_exp(x - sd * sd / 2)
    dips = rng.uniform(size=n) < 0.03
    mbps[dips] *= rng.uniform(0.1, 0.3, int(dips.sum()))
    mbps = np.where(fade, fade_rate, np.clip(mbps, 2.0, 900.0))
    rtt = np.where(fade, rng.uniform(150.0, 400.0, n), rng.uniform(10.0, 40.0, n))
    return Trace.from_rows(np.round(times, 3), np.round(mbps, 3), np.round(rtt, 1), loop=False,
                           name=f"adversarial-{seed}")


def adversarial_traces(count: int, seed: int = 0) -> list[Trace]:
    """``count`` adversarial traces, seeds ``seed .. seed + count - 1``."""
    return [adversarial_trace(seed + i) for i in range(count)]


def fade_start_trace(seed: int, duration_s: float = 60.0, dt: float = 0.1) -> Trace:
    """A seeded link that starts in a deep fade and recovers: what a phone sees when a question
    is asked in a dead spot it is just leaving (the case that left a plan computing everything).

    * A fade from time 0 of 1.5-2.5 s at 0.5-3 Mbit/s (RTT 150-400 ms): the manifest and the
      first estimate see only the fade;
    * then about 80 Mbit/s (a level drawn in 70-90, +-5% per ``dt`` step), RTT 10-40 ms, to the
      end (``loop=False``: past ``duration_s`` the last rate holds).
    """
    rng = np.random.default_rng([seed, 104729])
    n = int(round(duration_s / dt))
    times = np.arange(n) * dt
    fade_s = rng.uniform(1.5, 2.5)
    fade = times < fade_s - 1e-9
    level = rng.uniform(70.0, 90.0)
    mbps = np.where(fade, rng.uniform(0.5, 3.0), level * (1 + 0.05 * rng.uniform(-1, 1, n)))
    rtt = np.where(fade, rng.uniform(150.0, 400.0), rng.uniform(10.0, 40.0, n))
    return Trace.from_rows(np.round(times, 3), np.round(mbps, 3), np.round(rtt, 1), loop=False,
                           name=f"fade-start-{seed}")


def fade_start_traces(count: int, seed: int = 0) -> list[Trace]:
    """``count`` fade-start traces, seeds ``seed .. seed + count - 1``."""
    return [fade_start_trace(seed + i) for i in range(count)]


def write_sample_traces(directory: str | Path) -> list[Path]:
    """Writes every sample trace as CSV into ``directory`` (used to produce sparkv/data)."""
    out = []
    for kind, fname in SAMPLE_TRACES.items():
        path = Path(directory) / fname
        path.write_text(make_sample_trace(kind).to_csv())
        out.append(path)
    return out


if __name__ == "__main__":  # pragma: no cover
    import sys

    for p in write_sample_traces(sys.argv[1] if len(sys.argv) > 1 else "sparkv/data"):
        print(p)
