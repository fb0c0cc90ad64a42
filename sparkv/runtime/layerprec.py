"""Per-layer precision chosen by measured sensitivity: which decoder layers ``mixed-layers``
computes with bf16 matmuls (the others stay float32), as the codec's levels choose bits per layer.

:func:`measure_layer_precision` runs the model's full forward over calibration text once in
float32 and once per layer with only that layer's linear layers in bf16 (``mixed``), and records
per layer the mean KL(float32 || that) over every position and the share of positions whose
argmax it keeps. The layers are taken from the least sensitive up while the sum of their KLs
stays within ``budget_kl`` (per-layer roundings are small, independent perturbations, so their KLs
about add; the selection's own KL is then measured and recorded). The record is kept per model
fingerprint, as the sparse thresholds are: ``<cache dir>/compute/layer-precision-<fp>.json``, and
for the bundled SmolLM2 one shipped in ``sparkv/data`` (docs/dtypes.md).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from sparkv.errors import SparkvError

FORMAT = 1
#: the default budget: the summed per-layer KL (nats per position) the selection may spend
DEFAULT_BUDGET_KL = 5e-5


class LayerPrecisionError(SparkvError):
    """No usable per-layer selection for the model."""


@dataclass
class LayerPrecision:
    """One model's measured per-layer sensitivity and the selection made from it.

    Attributes:
        fingerprint: the model's (base) fingerprint.
        bf16: the layers ``mixed-layers`` computes with bf16 matmuls, ascending.
        layer_kl: per layer, mean KL(float32 || only that layer mixed) per position, nats.
        layer_agreement: per layer, the share of positions whose argmax it keeps.
        budget_kl: the summed per-layer KL the selection was allowed.
        selection_kl, selection_agreement: measured with every selected layer mixed.
        meta: how it was measured (tokens, text, threads).
    """

    fingerprint: str
    bf16: list[int]
    layer_kl: list[float]
    layer_agreement: list[float]
    budget_kl: float
    selection_kl: float = 0.0
    selection_agreement: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT


def _safe(fingerprint: str) -> str:
    return "".join(c for c in fingerprint if c.isalnum() or c in "-_") or "model"


def precision_path(fingerprint: str) -> Path:
    """Where this machine keeps the model's selection."""
    from sparkv.runtime.model import cache_dir

    return cache_dir() / "compute" / f"layer-precision-{_safe(fingerprint)}.json"


def shipped_precision_path(fingerprint: str) -> Path:
    """Where the package keeps the selection measured for a bundled model (``sparkv/data``)."""
    return (Path(__file__).resolve().parent.parent / "data"
            / f"layer-precision-{_safe(fingerprint)}.json")


def parse_precision(doc: Any) -> LayerPrecision:
    """A :class:`LayerPrecision` from its JSON form; :class:`LayerPrecisionError` if
    malformed."""
    try:
        if doc.get("format") != FORMAT:
            raise LayerPrecisionError(f"layer precision format {doc.get('format')!r}, expected "
                                      f"{FORMAT}")
        kl = [float(x) for x in doc["layer_kl"]]
        rec = LayerPrecision(str(doc["fingerprint"]), sorted(int(i) for i in doc["bf16"]), kl,
                             [float(x) for x in doc["layer_agreement"]],
                             float(doc["budget_kl"]), float(doc.get("selection_kl", 0.0)),
                             float(doc.get("selection_agreement", 1.0)),
                             dict(doc.get("meta", {})))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise LayerPrecisionError(f"malformed layer precision: {exc!r}") from None
    if any(not 0 <= i < len(kl) for i in rec.bf16) or len(rec.layer_agreement) != len(kl):
        raise LayerPrecisionError("layer precision: layer indices outside the measured layers")
    return rec


def save_precision(rec: LayerPrecision, path: str | os.PathLike[str] | None = None) -> Path:
    """Writes ``rec`` (atomically) to ``path`` or :func:`precision_path`; returns the path."""
    from sparkv.fileio import atomic_write

    out = Path(path) if path else precision_path(rec.fingerprint)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(asdict(rec), indent=1).encode())
    return out


def load_precision(fingerprint: str, path: str | os.PathLike[str] | None = None
                   ) -> LayerPrecision | None:
    """``path``, else this machine's record, else the shipped one; ``None`` when there is none
    usable for ``fingerprint``."""
    sources = [Path(path)] if path else [precision_path(fingerprint),
                                         shipped_precision_path(fingerprint)]
    for src in sources:
        try:
            rec = parse_precision(json.loads(src.read_text()))
        except (OSError, ValueError, LayerPrecisionError):
            continue
        if rec.fingerprint == fingerprint:
            return rec
    return None


def bf16_layers(fingerprint: str | None, num_layers: int) -> list[int]:
    """The layers ``mixed-layers`` converts for the model ``fingerprint``; raises
    :class:`LayerPrecisionError` when no selection was measured for it (or it was measured on
    another number of layers)."""
    rec = load_precision(fingerprint) if fingerprint else None
    if rec is None or len(rec.layer_kl) != num_layers:
        raise LayerPrecisionError("mixed-layers needs the model's measured per-layer sensitivity: run "
                           "`sparkv bench layer-precision --save` (docs/dtypes.md)")
    return list(rec.bf16)


def select_layers(layer_kl: Sequence[float], budget_kl: float) -> list[int]:
    """The least sensitive layers, taken in order of their KL while the sum stays within
    ``budget_kl``; ascending."""
    chosen, spent = [], 0.0
    for i in sorted(range(len(layer_kl)), key=lambda j: (layer_kl[j], j)):
        if spent + max(0.0, layer_kl[i]) > budget_kl:
            break
        spent += max(0.0, layer_kl[i])
        chosen.append(i)
    return sorted(chosen)


@torch.inference_mode()
def _logits(lm: Any, ids: torch.Tensor) -> torch.Tensor:
    return lm.model(input_ids=ids).logits[0].float()


def _compare(ref: torch.Tensor, out: torch.Tensor) -> tuple[float, float]:
    """Mean KL(ref || out) per position and the share of positions whose argmax agrees."""
    p = torch.log_softmax(ref, -1)
    q = torch.log_softmax(out, -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    return kl, float((ref.argmax(-1) == out.argmax(-1)).float().mean())


def measure_layer_precision(lm: Any, token_ids: Sequence[int],
                            budget_kl: float = DEFAULT_BUDGET_KL,
                            progress: Any = None) -> LayerPrecision:
    """Measures every layer's sensitivity on ``token_ids`` (module docstring) and selects the
    layers within ``budget_kl``. ``lm`` must compute in float32; it is left as it was."""
    from sparkv.runtime.linears import Bf16Linear, replace_linears

    if lm.dtype != torch.float32 or lm.extra.get("compute", "float32") != "float32":
        raise LayerPrecisionError("measure the per-layer precision on a float32 model")
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    ref = _logits(lm, ids)
    layers = lm.decoder.layers
    kls, agree = [], []

    def with_mixed(chosen: Sequence[int]) -> tuple[float, float]:
        saved = {i: {p: dict(getattr(layers[i], p).named_children()) for p in ("self_attn", "mlp")}
                 for i in chosen}
        try:
            for i in chosen:
                replace_linears(layers[i], Bf16Linear)
            return _compare(ref, _logits(lm, ids))
        finally:
            for i, parents in saved.items():
                for p, children in parents.items():
                    for name, mod in children.items():
                        setattr(getattr(layers[i], p), name, mod)

    for i in range(len(layers)):
        kl, a = with_mixed([i])
        kls.append(kl)
        agree.append(a)
        if progress is not None:
            progress(i, kl, a)
    chosen = select_layers(kls, budget_kl)
    sel_kl, sel_a = with_mixed(chosen) if chosen else (0.0, 1.0)
    return LayerPrecision(lm.base_fingerprint, chosen, kls, agree, budget_kl, sel_kl, sel_a,
                          {"tokens": len(token_ids), "torch_threads": torch.get_num_threads()})


__all__ = ["DEFAULT_BUDGET_KL", "LayerPrecision", "LayerPrecisionError", "bf16_layers",
           "load_precision", "measure_layer_precision", "parse_precision", "precision_path",
           "save_precision", "select_layers", "shipped_precision_path"]
