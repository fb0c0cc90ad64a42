"""The device a latency model describes: its fingerprint and its current utilisation ``U``.

* :func:`device_fingerprint` - what makes step latencies comparable between two runs: CPU model,
  core count, torch version, torch threads, and the CUDA device name when steps run on a GPU.
* Utilisation monitors, one per kind of device, all reporting ``U`` in ``[0, 1]``:

  ========================  =============================================================
  :class:`CpuUtilisation`   psutil: the share of all CPU cores used by *other* processes
                            (system busy time minus this process's own CPU time)
  :class:`NvmlUtilisation`  pynvml ``utilization.gpu`` (when ``pynvml`` imports)
  :class:`NvidiaSmiUtilisation`  ``nvidia-smi --query-gpu=utilization.gpu`` (when on PATH)
  :class:`TegrastatsUtilisation` Jetson: ``GR3D_FREQ`` from a background ``tegrastats``
  ========================  =============================================================

  :func:`detect_monitor` picks one for a torch device; none of the GPU tools is required.

Why the CPU monitor excludes this process: a layer step itself keeps a core busy, so the
whole-machine utilisation during a step says little about *competition*. The external share does:
on a 2-core machine with one compute thread, one competing busy thread gives ``U ~ 0.5``, three give
``U ~ 0.75`` (the scheduler splits the cores), none gives ``U ~ 0``.

What a prediction may use is the load *before* the step: :class:`UtilisationWindow` reads ``U``
over the last second of step boundaries. The profiler records that as each sample's ``U`` (and the
load during the step, for diagnosis only); the engine reads the same window over the steps it just
ran, or, before any step ran, :meth:`CpuUtilisation.probe` (a short busy window on the calling
thread that recreates "while computing").
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import threading
import time
from typing import Any, Callable, Protocol

FINGERPRINT_KEYS = ("cpu", "cores", "torch", "threads", "cuda", "dtype")
#: the dtype of a profile that records none (made before profiles were kept per dtype)
DEFAULT_PROFILE_DTYPE = "float32"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the board model on a Jetson)."""
    try:
        with open("/proc/device-tree/model", "rb") as fh:  # Jetson / ARM boards
            board = fh.read().rstrip(b"\x00").decode(errors="replace").strip()
    except OSError:
        board = ""
    name = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine() or "unknown"
    return f"{board} / {name}" if board else name


def device_fingerprint(device: str = "cpu", threads: int | None = None,
                       dtype: Any = None) -> dict[str, Any]:
    """What must match for profiled latencies to apply: ``cpu, cores, torch, threads, cuda,
    dtype`` (a profile measured in fp32 says nothing about bf16 steps: docs/dtypes.md).

    Args:
        device: the torch device the layer steps run on (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        threads: torch intra-op threads the steps use (default: ``torch.get_num_threads()``).
        dtype: the steps' compute configuration (:func:`compute_name`; a ``torch.dtype`` or a
            name; default float32).
    """
    import torch

    cuda = None
    if str(device).startswith("cuda") and torch.cuda.is_available():
        cuda = torch.cuda.get_device_name(torch.device(device))
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count() or 1,
        "torch": torch.__version__,
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "cuda": cuda,
        "dtype": dtype_name(dtype),
    }


def compute_name(lm: Any) -> str:
    """What a profile of ``lm``'s steps is kept and matched by: its compute configuration
    (``float32``, ``bfloat16``, ``mixed``, ...: :mod:`sparkv.runtime.compute`; the plain ones
    are named as their dtypes, so profiles made before configurations existed still match), or
    the one its prefill passes are bit for bit (``prefill_as``: ``int4-decode``'s steps are
    ``float32``'s, ``mixed-mlp-int4-decode``'s ``mixed-mlp``'s)."""
    compute = getattr(lm, "compute", None)
    name = getattr(compute, "prefill_name", None)
    return str(name or dtype_name(getattr(lm, "dtype", None)))


def dtype_name(dtype: Any) -> str:
    """``float32``, ``bfloat16``, ... for a ``torch.dtype``, a name, or ``None`` (float32)."""
    if dtype is None:
        return DEFAULT_PROFILE_DTYPE
    return str(dtype).replace("torch.", "")


def fingerprint_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable ``key: saved != current`` for every fingerprint key that differs (a
    fingerprint without ``dtype`` is float32's)."""
    defaults = {"dtype": DEFAULT_PROFILE_DTYPE}
    return [f"{k}: {saved.get(k, defaults.get(k))!r} != {current.get(k, defaults.get(k))!r}"
            for k in FINGERPRINT_KEYS if saved.get(k, defaults.get(k)) != current.get(k, defaults.get(k))]


# ---- utilisation ---------------------------------------------------------------------------------
class UtilisationMonitor(Protocol):
    """Reports the device's utilisation ``U`` in ``[0, 1]``."""

    source: str

    def snapshot(self) -> Any:
        """An opaque mark of now, for :meth:`since`."""

    def since(self, mark: Any) -> float:
        """``U`` over ``[mark, now]`` (GPU tools: their latest reading)."""

    def sample(self) -> float:
        """``U`` since the previous :meth:`sample` (the first call measures a short window)."""


class _WindowedMonitor:
    """:meth:`sample` on top of :meth:`snapshot` / :meth:`since`."""

    first_window_s = 0.1

    def __init__(self) -> None:
        self._last: Any = None

    def sample(self) -> float:
        if self._last is None:
            self._last = self.snapshot()
            time.sleep(self.first_window_s)
        value = self.since(self._last)
        self._last = self.snapshot()
        return value

    def snapshot(self) -> Any:
        raise NotImplementedError

    def since(self, mark: Any) -> float:
        raise NotImplementedError


class CpuUtilisation(_WindowedMonitor):
    """Share of all CPU cores used by other processes (psutil), in ``[0, 1]``.

    ``U = (system busy CPU-seconds - this process's CPU-seconds) / (wall seconds * cores)`` over the
    window. System times come from ``/proc/stat`` in 10 ms ticks: windows under ~50 ms are coarse.
    Child processes of this one count as other processes while they run (the profiler's load
    generator is one).
    """

    source = "cpu-psutil"

    def __init__(self) -> None:
        super().__init__()
        import psutil

        self._psutil = psutil
        self._cores = psutil.cpu_count() or os.cpu_count() or 1

    def snapshot(self) -> tuple[float, float, float]:
        ct = self._psutil.cpu_times()
        busy = sum(ct) - ct.idle - getattr(ct, "iowait", 0.0)
        # guest time is already counted in user time on Linux
        busy -= getattr(ct, "guest", 0.0) + getattr(ct, "guest_nice", 0.0)
        return time.perf_counter(), busy, time.process_time()

    def since(self, mark: tuple[float, float, float]) -> float:
        wall0, busy0, own0 = mark
        wall1, busy1, own1 = self.snapshot()
        wall = wall1 - wall0
        if wall <= 0:
            return 0.0
        other = (busy1 - busy0) - (own1 - own0)
        return min(1.0, max(0.0, other / (wall * self._cores)))

    def probe(self, seconds: float = 0.1) -> float:
        """``U`` while this thread is busy for ``seconds`` (the profiling semantics, before any
        step has run)."""
        mark = self.snapshot()
        end = time.perf_counter() + seconds
        x = 0
        while time.perf_counter() < end:
            x += 1
        return self.since(mark)


class NvmlUtilisation(_WindowedMonitor):
    """``utilization.gpu`` from NVML (pynvml), the share of the last sample period a kernel ran."""

    source = "nvml"
    first_window_s = 0.0

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    def snapshot(self) -> None:
        return None

    def since(self, mark: Any) -> float:
        return self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0


class NvidiaSmiUtilisation(_WindowedMonitor):
    """``nvidia-smi --query-gpu=utilization.gpu`` (a subprocess per reading, ~20-50 ms)."""

    source = "nvidia-smi"
    first_window_s = 0.0

    def __init__(self, index: int = 0) -> None:
        super().__init__()
        exe = shutil.which("nvidia-smi")
        if not exe:
            raise FileNotFoundError("nvidia-smi is not on PATH")
        self._exe = exe
        self._index = index

    def snapshot(self) -> None:
        return None

    def since(self, mark: Any) -> float:
        out = subprocess.run([self._exe, "--query-gpu=utilization.gpu", "--format=csv,noheader,"
                              "nounits", "-i", str(self._index)], capture_output=True, text=True,
                             timeout=5, check=True).stdout
        return float(out.strip().splitlines()[0]) / 100.0


_GR3D = re.compile(r"GR3D_FREQ\s+(\d+)%")


class TegrastatsUtilisation(_WindowedMonitor):
    """Jetson: ``GR3D_FREQ`` (GPU busy %) from a background ``tegrastats --interval 100``."""

    source = "tegrastats"
    first_window_s = 0.25

    def __init__(self, interval_ms: int = 100) -> None:
        super().__init__()
        exe = shutil.which("tegrastats")
        if not exe:
            raise FileNotFoundError("tegrastats is not on PATH")
        self._value = 0.0
        self._proc = subprocess.Popen([exe, "--interval", str(interval_ms)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            m = _GR3D.search(line)
            if m:
                self._value = int(m.group(1)) / 100.0

    def snapshot(self) -> None:
        return None

    def since(self, mark: Any) -> float:
        return self._value

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(2)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class UtilisationWindow:
    """``U`` over a sliding window of recent history: what a latency prediction can know.

    The profiler and the edge engine call :meth:`tick` at every step boundary and :meth:`read`
    just before a step: ``U`` from the oldest tick at most ``window_s`` old (at least the previous
    tick) until now. The profiler records this as each sample's ``utilisation``, so the model is
    trained on exactly what it is given at run time (not on the load during the step it predicts).
    """

    def __init__(self, monitor: UtilisationMonitor, window_s: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.monitor = monitor
        self.window_s = float(window_s)
        self.clock = clock
        self._marks: list[tuple[float, Any]] = []

    def tick(self) -> None:
        now = self.clock()
        self._marks.append((now, self.monitor.snapshot()))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.window_s:
            self._marks.pop(0)  # keep one mark at or before the window's start

    def reset(self) -> None:
        """Forgets the history (after an idle pause: an idle window reads other work as load)."""
        self._marks.clear()

    def read(self) -> float:
        """``U`` over the window ending now (a short probe on CPUs when nothing was ticked)."""
        if not self._marks:
            if isinstance(self.monitor, CpuUtilisation):
                return self.monitor.probe(0.05)
            return self.monitor.since(self.monitor.snapshot())
        now = self.clock()
        mark = self._marks[-1][1]
        for t, m in self._marks:
            if now - t <= self.window_s:
                mark = m
                break
        return self.monitor.since(mark)


def detect_monitor(device: str = "cpu") -> UtilisationMonitor:
    """The best monitor for a torch device: on CUDA, tegrastats (Jetson), then pynvml, then
    nvidia-smi; otherwise (or when none works) CPU utilisation via psutil."""
    if str(device).startswith("cuda"):
        index = int(str(device).split(":")[1]) if ":" in str(device) else 0
        for make in (TegrastatsUtilisation, lambda: NvmlUtilisation(index),
                     lambda: NvidiaSmiUtilisation(index)):
            try:
                monitor = make()
                monitor.since(monitor.snapshot())
                return monitor
            except Exception:  # tool missing or unusable: try the next one
                continue
    return CpuUtilisation()


_DEFAULT_MONITOR: UtilisationMonitor | None = None


def current_utilisation(device: str = "cpu") -> float:
    """``U`` of this device since the previous call (a process-wide monitor; the first call
    probes a short busy window on CPUs)."""
    global _DEFAULT_MONITOR
    if _DEFAULT_MONITOR is None:
        _DEFAULT_MONITOR = detect_monitor(device)
        if isinstance(_DEFAULT_MONITOR, CpuUtilisation):
            value = _DEFAULT_MONITOR.probe()
            _DEFAULT_MONITOR._last = _DEFAULT_MONITOR.snapshot()
            return value
    return _DEFAULT_MONITOR.sample()
