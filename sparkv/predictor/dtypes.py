"""The compute dtype a model runs in: ``--dtype auto`` with the model's quality table.

:func:`sparkv.runtime.device.auto_dtype` knows the hardware (bfloat16 on CUDA; on the CPU only with
AVX512-BF16 or AMX); this module adds the one thing the runtime layer cannot read, the model's
quality-table verdict on ``bfloat16`` (:func:`sparkv.predictor.quality.table_dtype_passes`), so
that ``auto`` computes in bf16 on a CPU only where the table passes it. Every part that runs the
model (the server's prefill, the edge's layer steps, the local baseline, the dense reference, the
benchmarks) loads it through :func:`load_model_in_dtype`::

    from sparkv.predictor.dtypes import load_model_in_dtype

    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    lm.extra["dtype_choice"].reason    # e.g. "CPU has avx512_bf16+amx_bf16 and the ... passes"

``--dtype float32`` (or ``bfloat16``) is taken as given. See docs/dtypes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model computes in and why.

    Attributes:
        dtype: the torch dtype.
        requested: what was asked (``auto``, ``float32``, ...).
        reason: one line (``auto``'s reason, or ``requested``).
    """

    dtype: torch.dtype
    requested: str
    reason: str

    @property
    def name(self) -> str:
        """``float32``, ``bfloat16`` or ``float16``."""
        return str(self.dtype).replace("torch.", "")


def _requested_name(dtype: str | torch.dtype | None) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return (dtype or "auto").strip().lower()


def choose_dtype(dtype: str | torch.dtype | None, device: torch.device, model_fingerprint: str,
                 table_path: str | os.PathLike[str] | None = None,
                 cpuinfo: str | os.PathLike[str] = CPUINFO) -> DtypeChoice:
    """The dtype ``dtype`` means for the model ``model_fingerprint`` on ``device``.

    Raises:
        DeviceUnavailable: an unknown dtype, or float16 on the CPU.
    """
    from sparkv.predictor.quality import table_dtype_passes
    from sparkv.runtime.device import auto_dtype, resolve_dtype

    requested = _requested_name(dtype)
    if requested != "auto":
        return DtypeChoice(resolve_dtype(dtype, device), requested, f"--dtype {requested}")
    verdict = table_dtype_passes(model_fingerprint, "bfloat16", table_path)
    chosen, reason = auto_dtype(device, verdict, cpuinfo)
    return DtypeChoice(chosen, requested, reason)


def load_model_in_dtype(name_or_path: str | os.PathLike[str] | None = None,
                        dtype: str | torch.dtype | None = "auto",
                        device: str | torch.device = "auto", progress: bool = True,
                        table_path: str | os.PathLike[str] | None = None,
                        cpuinfo: str | os.PathLike[str] = CPUINFO) -> Any:
    """:func:`sparkv.runtime.load_model` with ``auto`` decided by :func:`choose_dtype`: the
    model is loaded (in float32 when ``auto`` must first learn its fingerprint) and cast to the
    chosen dtype. The choice is kept in ``lm.extra["dtype_choice"]``."""
    from sparkv.runtime.device import auto_dtype, resolve_device
    from sparkv.runtime import load_model

    dev = resolve_device(device)
    requested = _requested_name(dtype)
    if requested != "auto" or dev.type != "cpu":       # no table needed: load as asked
        lm = load_model(name_or_path, dtype=dtype or "auto", device=dev, progress=progress)
        reason = f"--dtype {requested}" if requested != "auto" else auto_dtype(dev)[1]
        lm.extra["dtype_choice"] = DtypeChoice(lm.dtype, requested, reason)
        return lm
    lm = load_model(name_or_path, dtype=torch.float32, device=dev, progress=progress)
    choice = choose_dtype("auto", dev, lm.base_fingerprint, table_path, cpuinfo)
    if choice.dtype != torch.float32:
        lm.model.to(choice.dtype)
    lm.extra["dtype_choice"] = choice
    return lm


__all__ = ["DtypeChoice", "choose_dtype", "load_model_in_dtype"]
