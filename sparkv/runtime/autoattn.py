"""``auto`` attention: dense or block-sparse per call, from this device's measured profile.

On the CPU, ``auto`` is :class:`~sparkv.runtime.attention.BlockSparseAttention` with its measured
CPU rule (dense SDPA up to ``dense_below`` visible keys and where the predicted mask keeps at
least ``max_density`` of the blocks: docs/runtime.md). Both sides use the model's calibrated
per-layer thresholds when they are stored (:mod:`sparkv.runtime.thresholds`). On CUDA (decided
per call by the tensors' device):

* chunks with fewer visible keys than the profile's ``min_sparse_keys`` run
  :class:`~sparkv.runtime.attention.DenseAttention`: SDPA's causal kernel for a square chunk at
  offset 0, the prefix + own-keys split merged by LSE after a prefix (:mod:`sparkv.runtime.split`;
  flex_attention with every block kept was ~1.7x slower per visible pair than cuDNN's kernel on an
  H100);
* longer ones predict the block mask, and run flex_attention over the kept blocks only if the
  predicted density is below the profile's break-even density at that length; otherwise dense:
  never sparse where it is slower. A flex kernel that fails (compilation, a missing Triton) is
  dropped for the process and the call runs dense (``failure`` says why).

:func:`calibrate` measures the profile on this GPU (dense vs sparse attention time over key
lengths and densities, mask prediction included) and :func:`save_profile` keeps it beside the
predictor's profiles; without one, conservative defaults apply (sparse only from 8K keys, below
50% density).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from sparkv.runtime.attention import (AttentionStats, BlockSparseAttention, DenseAttention,
                                      SparsityConfig, check_shapes, register_backend)


@dataclass
class AttentionProfile:
    """When block-sparse attention pays on one device.

    Attributes:
        device: the device's name (``torch.cuda.get_device_name``) or ``cpu``.
        min_sparse_keys: below this many visible keys, always dense.
        breakeven: key length -> the density below which sparse (mask prediction included) was
            faster than dense; lengths in between are interpolated, longer ones take the last.
        measured: whether :func:`calibrate` produced it (else: defaults).
    """

    device: str = "cuda"
    min_sparse_keys: int = 8192
    breakeven: dict[int, float] = field(default_factory=lambda: {8192: 0.5, 32768: 0.5})
    measured: bool = False

    def density_limit(self, keys: int) -> float:
        if keys < self.min_sparse_keys or not self.breakeven:
            return 0.0
        pts = sorted(self.breakeven.items())
        if keys <= pts[0][0]:
            return pts[0][1]
        for (a, da), (b, db) in zip(pts, pts[1:]):
            if keys <= b:
                return da + (db - da) * (keys - a) / (b - a)
        return pts[-1][1]


def profile_path(device_name: str) -> Path:
    from sparkv.runtime.model import cache_dir

    safe = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return cache_dir() / "predictor" / f"attention-{safe or 'device'}.json"


def save_profile(profile: AttentionProfile, path: str | os.PathLike[str] | None = None) -> Path:
    path = Path(path) if path else profile_path(profile.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=1))
    os.replace(tmp, path)
    return path


def load_profile(device: torch.device) -> AttentionProfile:
    """The saved profile of this device, else the defaults."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    path = profile_path(name)
    try:
        doc = json.loads(path.read_text())
        doc["breakeven"] = {int(k): float(v) for k, v in doc.get("breakeven", {}).items()}
        return AttentionProfile(**doc)
    except (OSError, ValueError, TypeError):
        return AttentionProfile(device=name)


class AutoAttention:
    """Dense or block-sparse per call (module docstring)."""

    name = "auto"

    def __init__(self, config: SparsityConfig | None = None,
                 profile: AttentionProfile | None = None) -> None:
        self.config = config or SparsityConfig()
        #: the mask predictor and CPU executor (calibrated per layer when built without config)
        self.cpu = BlockSparseAttention(config)
        self.profile = profile
        self._layers: dict[int, AutoAttention] = {}
        self.dense = DenseAttention()
        self.failure: str | None = None
        self._sparse: Any = None
        self._sparse_tried = False

    def _sparse_backend(self) -> Any:
        """flex_attention over the predicted blocks, or None where it is missing or failed."""
        if not self._sparse_tried:
            self._sparse_tried = True
            try:
                from sparkv.runtime.flex import FlexAttention

                self._sparse = FlexAttention(sparse=True, config=self.config)
            except Exception:  # noqa: BLE001 - no flex_attention in this PyTorch
                self._sparse = None
        return self._sparse

    def bind_model(self, fingerprint: str) -> None:
        """Uses the model's calibrated block-sparse thresholds (when built without a config)."""
        before = self.cpu.thresholds
        self.cpu.bind_model(fingerprint)
        if self.cpu.thresholds is not before:
            self._layers = {}

    def for_layer(self, layer: int) -> "AutoAttention":
        """This backend with layer ``layer``'s calibrated thresholds (itself without them). The
        per-layer copies share nothing mutable but the profile: a flex kernel that fails is
        dropped by each copy on its own first failure."""
        cpu = self.cpu.for_layer(layer)
        if cpu is self.cpu:
            return self
        if layer not in self._layers:
            twin = copy.copy(self)
            twin.cpu, twin._layers = cpu, {}
            self._layers[layer] = twin
        return self._layers[layer]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        if not q.is_cuda:
            return self.cpu.attend(q, k, v, q_offset, scale)
        check_shapes(q, k, v, q_offset)
        if self.profile is None:
            self.profile = load_profile(q.device)
        keys = q_offset + q.shape[2]
        limit = self.profile.density_limit(keys)
        sparse = self._sparse_backend() if limit > 0 else None
        if sparse is None:
            return self.dense.attend(q, k, v, q_offset, scale)
        mask, indices = sparse.predict(q, k, q_offset, scale, predictor=self.cpu)
        if self.cpu.density_of(mask, q.shape[2], keys, q_offset) >= limit:
            return self.dense.attend(q, k, v, q_offset, scale)
        try:
            return sparse.attend(q, k, v, q_offset, scale, mask=mask, indices=indices)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to compile: stay dense
            self._sparse = None
            self.failure = f"flex_sparse failed, dense from now on: {exc!r}"[:500]
            return self.dense.attend(q, k, v, q_offset, scale)


def median_time_s(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs on ``device`` (CUDA synchronized after
    each), after one warm-up."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_point(device: torch.device, heads: tuple[int, int], head_dim: int, keys: int,
                  queries: int, densities: tuple[float, ...], repeats: int = 5,
                  config: SparsityConfig | None = None, static: bool = False) -> dict[str, Any]:
    """One layer's attention of ``queries`` queries at the end of ``keys`` keys (random bf16):
    dense (:class:`DenseAttention`: SDPA causal, or the LSE split after a prefix), the mask
    prediction alone, and flex_attention over top-k masks of each density, alone and with the
    prediction, and the prediction with the ``BlockMask``'s indices as ``flex_sparse`` runs it
    (``pipeline_ms``: compiled on CUDA). Milliseconds; ``density`` is the share of visible
    blocks each mask really keeps (the causal diagonal and the sink are always kept). ``static``: also the kernel compiled for
    this one shape (``kernel_static_ms``), which the runtime cannot afford per step."""
    from sparkv.runtime.flex import FlexAttention

    hq, hkv = heads
    off = keys - queries
    gen = torch.Generator(device=device).manual_seed(keys)
    q = torch.randn(1, hq, queries, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, hkv, keys, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    dense = DenseAttention()
    dense_s = median_time_s(lambda: dense.attend(q, k, v, off), device, repeats)
    row: dict[str, Any] = {"heads": f"{hq}/{hkv}/{head_dim}", "keys": keys, "queries": queries,
                           "dense_ms": 1e3 * dense_s, "sparse": []}
    base = config or SparsityConfig()
    predictor = BlockSparseAttention(base)
    row["predict_ms"] = 1e3 * median_time_s(lambda: predictor.predict_mask(q, k, off), device,
                                            repeats)
    # the mask pipeline as flex_sparse runs it (compiled on CUDA: prediction and indices)
    pipeline = FlexAttention(sparse=True, config=base)
    row["pipeline_ms"] = 1e3 * median_time_s(lambda: pipeline.predict(q, k, off), device,
                                             repeats)
    row["pipeline_failure"] = pipeline.failure
    _, _, _, visible, _ = predictor._geometry(queries, keys, off, q.device)
    for d in densities:
        # random data is never self-similar: with the filter on, every mask would be dense;
        # the filter still runs (its cost is part of ``total_ms``), it only marks nothing
        cfg = replace(base, topk=d, dense_below=0, min_keys=0, sim_threshold=-1.0)
        sp = FlexAttention(sparse=True, config=cfg)
        mask = sp._predictor.predict_mask(q, k, off)
        real = float(mask.sum()) / max(1, int(visible.sum()) * hq)
        try:
            kernel = 1e3 * median_time_s(lambda: sp.attend(q, k, v, off, mask=mask), device,
                                         repeats)
            total = 1e3 * median_time_s(lambda: sp.attend(q, k, v, off), device, repeats)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails: never sparse here
            row["error"] = repr(exc)[:800]
            kernel = total = math.inf
        point = {"topk": d, "density": real, "kernel_ms": kernel, "total_ms": total,
                 "speedup": row["dense_ms"] / total}
        if static:
            fixed = FlexAttention(sparse=True, config=cfg, dynamic=False)
            try:
                point["kernel_static_ms"] = 1e3 * median_time_s(
                    lambda: fixed.attend(q, k, v, off, mask=mask), device, repeats)
            except Exception as exc:  # noqa: BLE001
                point["static_error"] = repr(exc)[:400]
        row["sparse"].append(point)
    return row


def profile_from(rows: list[dict[str, Any]], device_name: str) -> AttentionProfile:
    """The break-even density per key length: the highest real density whose sparse attention
    (prediction included) beat dense, 0 where none did."""
    breakeven: dict[int, float] = {}
    for row in rows:
        wins = [s["density"] for s in row["sparse"] if s["total_ms"] < row["dense_ms"]]
        breakeven[int(row["keys"])] = max(wins, default=0.0)
    winning = [n for n, d in breakeven.items() if d > 0]
    return AttentionProfile(device_name, min(winning) if winning else 1 << 30, breakeven, True)


def calibrate(device: torch.device, heads: tuple[int, int] = (24, 8), head_dim: int = 128,
              lengths: tuple[int, ...] = (4096, 8192, 16384, 32768),
              densities: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75), chunk: int = 4096,
              repeats: int = 5) -> AttentionProfile:
    """Measures dense vs sparse attention of one ``chunk``-query chunk at the end of each key
    length (random bf16 data; sparse includes its mask prediction) on ``device``."""
    if device.type != "cuda":
        raise ValueError("calibrate() measures a CUDA device; the CPU rule is BlockSparse's own")
    rows = [measure_point(device, heads, head_dim, n, min(chunk, n), densities, repeats)
            for n in lengths]
    return profile_from(rows, torch.cuda.get_device_name(device))


register_backend("auto", lambda config: AutoAttention(config))
