"""Block-sparse thresholds calibrated per model and layer, and where they are kept.

:func:`sparkv.runtime.sparsecal.calibrate_thresholds` finds, per layer, the self-similarity
threshold and per query head the cdf threshold that keep the relative L1 error of the layer's
attention output under a bound on calibration prompts; this module is the record it produces and
its store: one JSON per model fingerprint under ``<cache dir>/sparse/`` (docs/runtime.md), and
for the bundled SmolLM2 one shipped in ``sparkv/data`` (used where the machine has none). A
:class:`~sparkv.runtime.attention.BlockSparseAttention` built without an explicit config loads it
for the model it runs (``bind_model``); without one, the defaults of ``SparsityConfig`` apply.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sparkv.errors import SparkvError

FORMAT = 1


class ThresholdsError(SparkvError):
    """A thresholds file that cannot be read or does not fit the model."""


@dataclass
class LayerThresholds:
    """One layer's calibrated settings.

    Attributes:
        cdf: per query head, the share of estimated attention mass to keep (1.0: every block).
        sim: the self-similarity threshold (blocks below it are always computed).
        error: the largest relative L1 error of the layer's output measured with these settings.
        density: the share of causally visible blocks they kept on the calibration prompts.
    """

    cdf: list[float]
    sim: float
    error: float = 0.0
    density: float = 1.0


@dataclass
class SparseThresholds:
    """Calibrated thresholds of one model (``layers[l]`` for decoder layer ``l``).

    Attributes:
        fingerprint: the model's fingerprint (``LoadedModel.fingerprint``).
        eps: the error bound they were calibrated for (relative L1 of each call's output).
        layers: per decoder layer.
        meta: how they were made (prompts, lengths, estimator, dtype), for the record.
    """

    fingerprint: str
    eps: float
    layers: list[LayerThresholds]
    meta: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT

    def layer(self, index: int) -> LayerThresholds | None:
        return self.layers[index] if 0 <= index < len(self.layers) else None


def thresholds_path(fingerprint: str) -> Path:
    """Where the thresholds of the model with this fingerprint are kept."""
    from sparkv.runtime.model import cache_dir

    safe = "".join(c for c in fingerprint if c.isalnum() or c in "-_") or "model"
    return cache_dir() / "sparse" / f"thresholds-{safe}.json"


def save_thresholds(th: SparseThresholds, path: str | os.PathLike[str] | None = None) -> Path:
    """Writes ``th`` (atomically) to ``path`` or :func:`thresholds_path`; returns the path."""
    from sparkv.fileio import atomic_write

    out = Path(path) if path else thresholds_path(th.fingerprint)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(asdict(th), indent=1).encode())
    return out


def parse_thresholds(doc: Any) -> SparseThresholds:
    """A :class:`SparseThresholds` from its JSON form; :class:`ThresholdsError` if malformed."""
    try:
        if doc.get("format") != FORMAT:
            raise ThresholdsError(f"thresholds format {doc.get('format')!r}, expected {FORMAT}")
        layers = [LayerThresholds(cdf=[float(c) for c in x["cdf"]], sim=float(x["sim"]),
                                  error=float(x.get("error", 0.0)),
                                  density=float(x.get("density", 1.0))) for x in doc["layers"]]
        for lt in layers:
            if not lt.cdf or any(not 0.0 < c <= 1.0 for c in lt.cdf):
                raise ThresholdsError(f"cdf thresholds must be in (0, 1]: {lt.cdf}")
        return SparseThresholds(str(doc["fingerprint"]), float(doc["eps"]), layers,
                                dict(doc.get("meta", {})))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ThresholdsError(f"malformed thresholds: {exc!r}") from None


def shipped_thresholds_path(fingerprint: str) -> Path:
    """Where the package keeps thresholds calibrated for a bundled model (``sparkv/data``)."""
    safe = "".join(c for c in fingerprint if c.isalnum() or c in "-_") or "model"
    return Path(__file__).resolve().parent.parent / "data" / f"sparse-thresholds-{safe}.json"


def load_thresholds(fingerprint: str,
                    path: str | os.PathLike[str] | None = None) -> SparseThresholds | None:
    """The stored thresholds of this model: ``path``, else this machine's own calibration
    (:func:`thresholds_path`), else the ones shipped for a bundled model
    (:func:`shipped_thresholds_path`); None when there are none (or they are unreadable: the
    defaults apply then)."""
    sources = [Path(path)] if path else [thresholds_path(fingerprint),
                                         shipped_thresholds_path(fingerprint)]
    for src in sources:
        try:
            th = parse_thresholds(json.loads(src.read_text()))
        except (OSError, ValueError, ThresholdsError):
            continue
        if th.fingerprint == fingerprint:
            return th
    return None
