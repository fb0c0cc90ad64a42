"""A real shaped network path: the server in a network namespace behind a veth pair, tc shaping.

:class:`ShapedLink` wraps ``deploy/netns-link.sh`` (the one place the ``ip``/``tc`` commands live,
see docs/netns.md). The server runs inside the namespace (:meth:`ShapedLink.popen`); the client
stays in the root namespace and connects to :attr:`ShapedLink.ns_ip`. The server->client direction
(downloads) is rate-limited by a token bucket on the namespace-side veth, following a
:class:`~sparkv.scheduler.trace.Trace` over time (:meth:`ShapedLink.start_trace`); an RTT is added
with netem where the kernel has it (:attr:`ShapedLink.rtt_emulated`).

Rates are TCP goodput in Mbit/s (10^6 bit/s), as in the traces: the script scales the tc rate by
the Ethernet/IP/TCP header overhead of full-size segments.

Needs root, iproute2 and a kernel with network namespaces, veth and sch_tbf;
:func:`netns_available` says whether this machine qualifies (and why not).
"""

from __future__ import annotations

import atexit
import bisect
import functools
import ipaddress
import itertools
import logging
import math
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from sparkv.errors import SparkvError
from sparkv.scheduler.instance import MBPS
from sparkv.scheduler.trace import Trace

log = logging.getLogger(__name__)

#: the script that holds every ip/tc command; ``SPARKV_NETNS_SCRIPT`` overrides it
SCRIPT = Path(os.environ.get("SPARKV_NETNS_SCRIPT")
              or Path(__file__).resolve().parents[2] / "deploy" / "netns-link.sh")

#: namespaces are named ``sparkv-...`` (the script refuses anything else)
NAME_PREFIX = "sparkv-"

#: the private range the links take their /30 subnets from
SUBNET_POOL = ipaddress.IPv4Network("10.213.0.0/16")

#: a rate change smaller than this fraction is not applied (it would only cost a tc call)
RATE_TOLERANCE = 0.01

#: an RTT change smaller than this (ms) is not applied
RTT_TOLERANCE_MS = 0.1

_COUNTER = itertools.count(1)


class NetnsUnavailable(SparkvError):
    """This machine cannot run a shaped link (not root, no iproute2, no netns/veth/tbf)."""


class NetnsError(SparkvError):
    """A ``netns-link.sh`` command failed."""


def _run_script(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@functools.lru_cache(maxsize=1)
def _check() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if not SCRIPT.is_file():
        return False, f"{SCRIPT} is missing"
    try:
        proc = _run_script("check", timeout=30.0)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{SCRIPT} check failed: {exc}"
    reason = (proc.stdout.strip() or proc.stderr.strip() or f"exit status {proc.returncode}")
    return proc.returncode == 0, reason


def netns_available() -> tuple[bool, str]:
    """``(True, "ok (netem: yes|no ...)")`` if this machine can run a :class:`ShapedLink`, else
    ``(False, reason)``. Runs ``netns-link.sh check`` once per process (cached)."""
    return _check()


def netem_available() -> bool:
    """Whether the kernel has sch_netem, i.e. whether an RTT can be emulated."""
    ok, reason = _check()
    return ok and "netem: yes" in reason


def short_name(name: str) -> str:
    """The ``<short>`` in the interface names ``vh-<short>``/``vn-<short>`` (as the script does)."""
    rest = name[len(NAME_PREFIX):] if name.startswith(NAME_PREFIX) else name
    if 1 <= len(rest) <= 12 and all(c.isalnum() or c in "_-" for c in rest) and rest.isascii():
        return rest
    # the script hashes with POSIX cksum: ask the same tool so that both agree
    script = 'printf "%08x" "$(printf %s "$1" | cksum | cut -d" " -f1)"'
    proc = subprocess.run(["bash", "-c", script, "_", name], capture_output=True, text=True,
                          check=True)
    return proc.stdout.strip()


def next_change(trace: Trace, t: float) -> float:
    """The first time after ``t`` at which ``trace``'s row changes (``inf`` if never)."""
    base = 0.0
    period = trace.period_s
    looping = trace.loop and math.isfinite(period)
    if looping and t >= period:
        k = math.floor(t / period)
        base, t = k * period, t - k * period
    i = bisect.bisect_right(trace.times_s, t)
    if i < len(trace.times_s):
        return base + trace.times_s[i]
    return base + period if looping else math.inf


def _used_subnets() -> list[ipaddress.IPv4Network]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                         check=False).stdout
    nets = []
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            try:
                nets.append(ipaddress.IPv4Interface(parts[parts.index("inet") + 1]).network)
            except (ValueError, IndexError):
                continue
    return nets


def _pick_subnet() -> tuple[str, str]:
    """A /30 in :data:`SUBNET_POOL` that overlaps nothing configured in the root namespace."""
    used = _used_subnets()
    subnets = list(SUBNET_POOL.subnets(new_prefix=30))
    start = (os.getpid() * 7919 + next(_COUNTER) * 104729) % len(subnets)
    for k in range(len(subnets)):
        net = subnets[(start + k) % len(subnets)]
        if not any(net.overlaps(u) for u in used):
            host, ns = list(net.hosts())[:2]
            return str(host), str(ns)
    raise NetnsError(f"no free /30 left in {SUBNET_POOL}")


class ShapedLink:
    """A network namespace behind a veth pair whose downlink is shaped by tc.

    ``ShapedLink(name=None, trace=None)`` brings the namespace up (a fresh ``sparkv-<pid>-<n>``
    name and a free /30 from 10.213.0.0/16 unless given). With ``trace``, its rate at ``t=0`` is
    applied at once and :meth:`start_trace` without arguments plays it. Use as a context manager,
    or call :meth:`close`; an ``atexit`` hook tears the link down if neither happens.

    Attributes:
        name: the namespace.
        host_ip: the root-namespace end of the veth pair (the client's address).
        ns_ip: the namespace end (where the server listens; connect here).
        rtt_emulated: whether RTTs are applied (the kernel has netem); otherwise they are ignored.
        tc_calls: how many times the shaping was changed (rate/RTT updates applied).
        trace_error: the exception that stopped the trace thread, if one did.
    """

    def __init__(self, name: str | None = None, trace: Trace | None = None, *,
                 host_ip: str | None = None, ns_ip: str | None = None) -> None:
        ok, reason = netns_available()
        if not ok:
            raise NetnsUnavailable(f"cannot build a shaped link on this machine: {reason}")
        self.name = name or f"{NAME_PREFIX}{os.getpid()}-{next(_COUNTER)}"
        if not self.name.startswith(NAME_PREFIX):
            raise NetnsError(f"namespace name {self.name!r} must start with {NAME_PREFIX!r}")
        if (host_ip is None) != (ns_ip is None):
            raise NetnsError("give both host_ip and ns_ip, or neither")
        if host_ip is None or ns_ip is None:
            host_ip, ns_ip = _pick_subnet()
        self.host_ip: str = host_ip
        self.ns_ip: str = ns_ip
        self.rtt_emulated: bool = netem_available()
        self.tc_calls = 0
        self.trace: Trace | None = trace
        self.trace_error: BaseException | None = None
        self.mbps: float | None = None
        self.rtt_ms: float | None = None
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen[Any]] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._warned_rtt = False
        short = short_name(self.name)
        self.host_if, self.ns_if = f"vh-{short}", f"vn-{short}"
        self._script("up", self.name, self.host_ip, self.ns_ip)
        atexit.register(self.close)
        try:
            if trace is not None:
                self.set_rate(trace.rate_Bps(0.0) / MBPS,
                              trace.rtt_ms[0] if trace.rtt_ms is not None else None)
        except BaseException:
            self.close()
            raise

    # --- commands -------------------------------------------------------------------------------
    def _script(self, *args: str) -> str:
        proc = _run_script(*args)
        if proc.returncode != 0:
            raise NetnsError(f"netns-link.sh {shlex.join(args)} failed ({proc.returncode}): "
                             f"{proc.stderr.strip() or proc.stdout.strip()}")
        if proc.stderr.strip():
            log.warning("netns-link.sh %s: %s", args[0], proc.stderr.strip())
        return proc.stdout

    def set_rate(self, mbps: float, rtt_ms: float | None = None, *, force: bool = False) -> bool:
        """Shapes the downlink to ``mbps`` Mbit/s of TCP goodput (0: an outage, ~1 KB/s), with a
        round trip of ``rtt_ms`` if given (``None`` keeps the current one; ignored, with one
        warning, where the kernel has no netem). Returns whether tc was called: changes under 1%
        of the rate (and under 0.1 ms of RTT) are skipped unless ``force``."""
        if not (mbps >= 0 and math.isfinite(mbps)):
            raise ValueError(f"rate must be finite and >= 0 Mbit/s, got {mbps}")
        if rtt_ms is not None and not (rtt_ms >= 0 and math.isfinite(rtt_ms)):
            raise ValueError(f"rtt must be finite and >= 0 ms, got {rtt_ms}")
        if rtt_ms is not None and not self.rtt_emulated:
            if not self._warned_rtt and rtt_ms > 0:
                log.warning("this kernel has no sch_netem: RTT %.1f ms (and later ones) ignored",
                            rtt_ms)
                self._warned_rtt = True
            rtt_ms = None
        with self._lock:
            if self._closed:
                raise NetnsError(f"link {self.name} is closed")
            rate_same = (self.mbps is not None and
                         abs(mbps - self.mbps) <= RATE_TOLERANCE * max(self.mbps, 1e-3))
            rtt_same = rtt_ms is None or (self.rtt_ms is not None and
                                          abs(rtt_ms - self.rtt_ms) < RTT_TOLERANCE_MS)
            if rate_same and rtt_same and not force:
                return False
            args = ["rate", self.name, f"{mbps:.6g}"]
            rtt_now = rtt_ms if rtt_ms is not None else self.rtt_ms
            if rtt_now is not None:       # the script sizes the queue by the RTT: always tell it
                args.append(f"{rtt_now:.3f}")
            self._script(*args)
            self.tc_calls += 1
            self.mbps = mbps
            if rtt_ms is not None:
                self.rtt_ms = rtt_ms
            return True

    def popen(self, cmd: Sequence[str] | str, **kw: Any) -> "subprocess.Popen[Any]":
        """Starts ``cmd`` inside the namespace (a string runs through ``sh -c``); keyword arguments
        go to :class:`subprocess.Popen`. The process is ``cmd`` itself (``ip netns exec`` execs),
        so its pid and signals are the command's. :meth:`close` ends it if it still runs."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        if self._closed:
            raise NetnsError(f"link {self.name} is closed")
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["bash", str(SCRIPT), "exec", self.name, *argv], **kw)
        self._procs.append(proc)
        return proc

    def show(self) -> str:
        """The qdiscs on both veth ends, with statistics (``tc -s qdisc show``)."""
        return self._script("show", self.name)

    # --- traces ---------------------------------------------------------------------------------
    def start_trace(self, trace: Trace | None = None, interval_s: float = 0.1) -> None:
        """Plays ``trace`` (default: the one given to the constructor) on a daemon thread, with
        ``t=0`` now: the rate (and RTT, if the trace has it) changes at the trace's change
        points, at most once per ``interval_s`` (changes in between are coalesced: the thread
        applies the rate in force when it wakes). The rate at ``t=0`` is in force when this
        returns. Replaces a trace already playing."""
        trace = trace or self.trace
        if trace is None:
            raise ValueError("no trace given, here or to the constructor")
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.stop_trace()
        self.trace = trace
        self.trace_error = None
        self._stop = threading.Event()
        t0 = time.monotonic()
        self._apply(trace, 0.0)
        due = max(next_change(trace, 0.0), time.monotonic() - t0 + interval_s)
        if math.isinf(due):
            return
        self._thread = threading.Thread(target=self._play,
                                        args=(trace, t0, due, interval_s, self._stop),
                                        name=f"{self.name}-trace", daemon=True)
        self._thread.start()

    def _apply(self, trace: Trace, t: float) -> None:
        rtt = trace.rtt_s(t, math.nan) * 1e3 if trace.rtt_ms is not None else None
        self.set_rate(trace.rate_Bps(t) / MBPS, rtt)

    def _play(self, trace: Trace, t0: float, due: float, interval_s: float,
              stop: threading.Event) -> None:
        try:
            while not stop.wait(max(0.0, due - (time.monotonic() - t0))):
                t = max(time.monotonic() - t0, due)
                self._apply(trace, t)
                due = max(next_change(trace, t), time.monotonic() - t0 + interval_s)
                if math.isinf(due):
                    return
        except BaseException as exc:  # noqa: BLE001 - kept for the caller, logged
            if not stop.is_set():
                self.trace_error = exc
                log.warning("trace on %s stopped: %s", self.name, exc)

    def stop_trace(self) -> None:
        """Stops the trace thread (the last rate stays in force)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(30.0)
        self._thread = None

    # --- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops the trace, ends the processes started with :meth:`popen` (SIGTERM, then SIGKILL
        after 5 s) and deletes the namespace and veth pair. Idempotent."""
        if self._closed:
            return
        self.stop_trace()
        with self._lock:
            self._closed = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        self._procs.clear()
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - interpreter shutting down
            pass
        down = _run_script("down", self.name)
        if down.returncode != 0:
            raise NetnsError(f"netns-link.sh down {self.name} failed: {down.stderr.strip()}")

    def __enter__(self) -> "ShapedLink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"ShapedLink({self.name!r}, host={self.host_ip}, ns={self.ns_ip}, "
                f"mbps={self.mbps}, rtt_ms={self.rtt_ms})")
