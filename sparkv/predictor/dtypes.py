"""The compute configuration a model runs in: ``--dtype auto`` with the model's quality table.

:func:`sparkv.runtime.compute.auto_compute` knows the hardware (bfloat16 on CUDA; on the CPU a
configuration with bf16 matmuls only with AVX512-BF16 or AMX); this module adds the one thing the
runtime layer cannot read, the model's quality-table verdicts on the configurations (the
``dtypes`` section: :func:`sparkv.predictor.quality.table_dtype_passes`), so that ``auto`` takes
a configuration other than float32 on a CPU only where the table passes it. Every part that runs
the model (the server's prefill, the edge's layer steps, the local baseline, the dense
reference, the benchmarks) loads it through :func:`load_model_in_dtype`::

    from sparkv.predictor.dtypes import load_model_in_dtype

    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    lm.extra["dtype_choice"].reason    # e.g. "CPU without bfloat16 hardware ...: float32 ..."

``--dtype float32`` (or any configuration's name) is taken as given. See docs/dtypes.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

CPUINFO = "/proc/cpuinfo"


@dataclass(frozen=True)
class DtypeChoice:
    """The compute configuration a model runs in and why.

    Attributes:
        compute: the configuration's name (:mod:`sparkv.runtime.compute`).
        dtype: its activations' dtype (the KV memory's).
        requested: what was asked (``auto``, ``float32``, ``mixed``, ...).
        reason: one line (``auto``'s reason, or ``requested``).
    """

    compute: str
    dtype: torch.dtype
    requested: str
    reason: str

    @property
    def name(self) -> str:
        """The configuration's name (``float32``, ``bfloat16``, ``mixed``, ...)."""
        return self.compute


def _requested_name(dtype: str | torch.dtype | None) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return (dtype or "auto").strip().lower()


def choose_dtype(dtype: str | torch.dtype | None, device: torch.device, model_fingerprint: str,
                 table_path: str | os.PathLike[str] | None = None,
                 cpuinfo: str | os.PathLike[str] = CPUINFO) -> DtypeChoice:
    """The configuration ``dtype`` means for the model ``model_fingerprint`` on ``device``.

    Raises:
        DeviceUnavailable: an unknown name, or one that cannot run on ``device`` (float16 on
            the CPU, ``int4-kernel`` on CUDA).
    """
    from sparkv.predictor.quality import table_verdicts
    from sparkv.runtime.compute import ComputeError, auto_compute, resolve_compute
    from sparkv.runtime.device import DeviceUnavailable

    requested = _requested_name(dtype)
    if requested != "auto":
        try:
            config = resolve_compute(dtype, device)
        except ComputeError as exc:
            raise DeviceUnavailable(str(exc)) from None
        return DtypeChoice(config.name, config.dtype, requested, f"--dtype {requested}")
    config, reason = auto_compute(device, table_verdicts(model_fingerprint, table_path),
                                  cpuinfo)
    return DtypeChoice(config.name, config.dtype, requested, reason)


def load_model_in_dtype(name_or_path: str | os.PathLike[str] | None = None,
                        dtype: str | torch.dtype | None = "auto",
                        device: str | torch.device = "auto", progress: bool = True,
                        table_path: str | os.PathLike[str] | None = None,
                        cpuinfo: str | os.PathLike[str] = CPUINFO) -> Any:
    """:func:`sparkv.runtime.load_model` in the configuration ``dtype`` names, ``auto`` decided
    by :func:`choose_dtype`: the model is loaded in float32 (or the plain dtype asked) and
    converted (:func:`sparkv.runtime.compute.apply_compute`; ``mixed-layers`` with the model's
    measured per-layer selection). The choice is kept in ``lm.extra["dtype_choice"]``.

    Raises:
        DeviceUnavailable: an unknown name, one that cannot run on ``device``, or
            ``mixed-layers`` for a model without a measured selection.
    """
    from sparkv.runtime import load_model
    from sparkv.runtime.compute import ComputeError, resolve_compute
    from sparkv.runtime.device import DeviceUnavailable, resolve_device

    dev = resolve_device(device)
    requested = _requested_name(dtype)
    if requested == "auto":
        lm = load_model(name_or_path, dtype=torch.float32, device=dev, progress=progress)
        choice = choose_dtype("auto", dev, lm.base_fingerprint, table_path, cpuinfo)
    else:
        try:
            config = resolve_compute(dtype, dev)
        except ComputeError as exc:
            raise DeviceUnavailable(str(exc)) from None
        lm = load_model(name_or_path, dtype=config.dtype if config.plain else torch.float32,
                        device=dev, progress=progress)
        choice = DtypeChoice(config.name, config.dtype, requested, f"--dtype {requested}")
    convert(lm, choice.compute)
    lm.extra["dtype_choice"] = choice
    return lm


def convert(lm: Any, name: str) -> None:
    """Converts ``lm`` (float32, or already in the plain dtype) to configuration ``name`` in
    place; a per-layer configuration takes the model's stored selection
    (:func:`sparkv.runtime.layerprec.bf16_layers`). Raises ``DeviceUnavailable`` when it cannot
    be built."""
    from sparkv.runtime.compute import ComputeError, apply_compute, get_compute
    from sparkv.runtime.device import DeviceUnavailable
    from sparkv.runtime.layerprec import LayerPrecisionError, bf16_layers

    config = get_compute(name)
    if config.name == lm.compute.name:
        return
    try:
        layers = (bf16_layers(lm.base_fingerprint, len(lm.decoder.layers)) if config.per_layer
                  else None)
        apply_compute(lm, config, layers)
    except (ComputeError, LayerPrecisionError) as exc:
        raise DeviceUnavailable(str(exc)) from None


__all__ = ["DtypeChoice", "choose_dtype", "convert", "load_model_in_dtype"]
