"""Which device and dtype the model runs on: ``--device cpu|cuda|auto`` and ``--dtype``.

* ``cpu``: always available.
* ``cuda`` (or ``cuda:N``): a clear :class:`DeviceUnavailable` when PyTorch has no CUDA here (a CPU build,
  no driver, no GPU), never a traceback from deep inside a kernel.
* ``auto``: CUDA when available, else the CPU.

``--dtype``: ``float32``, ``bfloat16``, ``float16``, a compute configuration
(:mod:`sparkv.runtime.compute`: ``mixed``, ``int4``, ...) or ``auto``
(:func:`sparkv.runtime.compute.auto_compute`): bfloat16 on a CUDA device that supports it (float16
otherwise); on the CPU a configuration with bf16 matmuls only when the CPU computes bf16 in
hardware (AVX512-BF16 or AMX, :func:`cpu_bf16_flags`) **and** the model's quality table passes it
(the caller says so: this layer does not read tables, see :mod:`sparkv.predictor.dtypes`), else
float32. ``--dtype float32`` forces fp32 anywhere. The codec
and the server's stores stay on the CPU whatever the device; docs/dtypes.md says what crosses the
wire when the two ends compute in different dtypes.

Unified memory (Jetson): CPU and GPU share one DRAM, so staging frames in pinned memory and copying
them buys nothing. ``SPARKV_UNIFIED_MEMORY=1`` (or :func:`unified_memory`) tells the edge to skip
the pinned staging buffer and write decoded chunks straight into the device tensors.
"""

from __future__ import annotations

import os

import torch

from sparkv.errors import SparkvError

DEVICES = ("cpu", "cuda", "auto")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class DeviceUnavailable(SparkvError):
    """The requested device or dtype cannot be used on this machine."""


def cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver counts as no CUDA
        return False


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """The ``torch.device`` for ``cpu``, ``cuda[:N]`` or ``auto`` (module docstring)."""
    if isinstance(name, torch.device):
        name = str(name)
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda") if cuda_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not cuda_available():
            build = "a CPU-only build" if torch.version.cuda is None else \
                f"built for CUDA {torch.version.cuda}, but no GPU or driver is usable"
            raise DeviceUnavailable(f"--device {name}: CUDA is not available here (PyTorch "
                              f"{torch.__version__} is {build}); use --device cpu or auto")
        index = int(name.split(":", 1)[1]) if ":" in name else 0
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceUnavailable(f"--device {name}: this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    raise DeviceUnavailable(f"unknown device {name!r}; choose one of {', '.join(DEVICES)} "
                      "(or cuda:N)")


def plain_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``name`` as a plain dtype (a ``torch.dtype`` or a key of :data:`DTYPES`); raises
    :class:`DeviceUnavailable` for another name and for float16 on the CPU. Compute
    configurations and ``auto``: :func:`sparkv.runtime.compute.resolve_dtype`."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        key = name.strip().lower()
        if key not in DTYPES:
            raise DeviceUnavailable(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or "
                                    "float16, or a compute configuration (docs/dtypes.md)")
        dtype = DTYPES[key]
    if device.type == "cpu" and dtype == torch.float16:
        raise DeviceUnavailable("float16 on the CPU is not supported (slow and inexact kernels); use "
                                "float32 or bfloat16")
    return dtype


#: /proc/cpuinfo flags of CPUs with bfloat16 arithmetic in hardware (AVX512-BF16, AMX-BF16);
#: without them torch emulates bf16 matmuls on the CPU, slower than fp32
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flags(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> list[str]:
    """The flags of :data:`BF16_CPU_FLAGS` this CPU has (``cpuinfo``'s ``flags`` / ``Features``
    lines), in that order; empty where the file cannot be read (not Linux)."""
    found: set[str] = set()
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    found |= set(line.partition(":")[2].split()) & set(BF16_CPU_FLAGS)
    except OSError:
        return []
    return [f for f in BF16_CPU_FLAGS if f in found]


def cpu_has_bf16(cpuinfo: str | os.PathLike[str] = "/proc/cpuinfo") -> bool:
    """Whether this CPU computes bfloat16 in hardware (:func:`cpu_bf16_flags` is not empty)."""
    return bool(cpu_bf16_flags(cpuinfo))


def unified_memory() -> bool:
    """Whether the device shares the CPU's memory (``SPARKV_UNIFIED_MEMORY=1``)."""
    return os.environ.get("SPARKV_UNIFIED_MEMORY", "").strip() in ("1", "true", "yes")


def host_bound(device: torch.device) -> bool:
    """Whether the model's steps on ``device`` are bound by the host issuing their kernels (a
    GPU): there a busy Python thread beside the compute thread stalls it, since each kernel
    launch gives up the GIL and waits up to the switch interval to take it back (the H200's run
    3: a 0.3 s plan made beside the prelude let it compute 8 layer steps; docs/gpu.md). The
    environment variable ``SPARKV_HOST_BOUND`` (``1`` / ``0``) overrides it either way."""
    return _switch("SPARKV_HOST_BOUND", device.type == "cuda")


def fused_spans(device: torch.device) -> bool:
    """Whether the edge engine runs a layer's consecutive local steps as one span
    (:class:`~sparkv.scheduler.rules.CommitSpans`): on every device. On a GPU a layer step at
    T=1024 is bound by kernel launches (docs/gpu.md); on a CPU a span's larger GEMMs and single
    call pay the per-call cost once (SmolLM2 2K, T=512, session 64 on an AMX CPU: the stepper
    step by step 1.73-1.91 s against 1.36-1.51 s layer by layer in ``mixed-attn``, 3.9-5.0 s
    against 3.1-3.9 s in float32; the whole ask 7-21% sooner for every strategy, docs/
    scheduler.md). The environment variable ``SPARKV_FUSED_SPANS`` (``1`` / ``0``) overrides
    it either way."""
    return _switch("SPARKV_FUSED_SPANS", True)


def cuda_graphs(device: torch.device) -> bool:
    """Whether layer steps whose shapes repeat run as captured CUDA graphs
    (:mod:`sparkv.runtime.graphs`): on a GPU, whose steps at T=1024 are bound by kernel launches;
    never on a CPU (no graphs there). The environment variable ``SPARKV_CUDA_GRAPHS`` (``1`` /
    ``0``) overrides it on a GPU."""
    return device.type == "cuda" and _switch("SPARKV_CUDA_GRAPHS", True)


def _switch(name: str, default: bool) -> bool:
    """The environment variable ``name`` as an on/off switch (``1``/``true``/``yes``,
    ``0``/``false``/``no``), ``default`` when it is unset or says neither."""
    env = os.environ.get(name, "").strip().lower()
    if env in ("1", "true", "yes"):
        return True
    if env in ("0", "false", "no"):
        return False
    return default
