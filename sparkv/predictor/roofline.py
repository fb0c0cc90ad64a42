"""The Roofline baseline: ``t = max(W / P_peak, Q / B_peak)`` for one layer step.

``W`` (FLOPs) and ``Q`` (bytes) of a step come from the model config (:class:`ModelArch`) and the
step's shape: ``n`` query tokens (the chunk), ``k`` key tokens (prefix + chunk) and, for
block-sparse attention, ``s`` active 128x64 blocks per query head. ``P_peak`` and ``B_peak`` are
this machine's measured peak FLOP/s (best of 10 square fp32 matmuls) and memory bandwidth (best of
6 large tensor copies, counting read + write), at the thread count the steps use.

What is counted (a multiply-add is 2 FLOPs):

* attention step (``l < L-1``):
  ``W = 2 n h (Hq D) + 2 * 2 n h (Hkv D) + 2 n (Hq D) h``  (Q, K, V, O projections)
  ``  + 3 * 2 n h I``                                     (gate, up, down of the MLP)
  ``  + 4 D Hq P``                                        (Q K^T and P V over ``P`` pairs)
  where ``P`` is the number of causally visible (query, key) pairs,
  ``P = n (k - n) + n (n + 1) / 2``, for dense attention, and ``min(s * 128 * 64, P)`` for
  block-sparse attention with ``s`` active blocks per query head.
  ``Q = bytes * (weights + 2 n h + 2 n Hkv D + 2 Hkv D k * P / P_dense)``: the layer's weights
  (attention, MLP, two norms), the hidden state in and out, the new K/V written, and the share of
  the K/V prefix that the computed pairs touch.
* projection-only step (``l = L-1``): ``W = 2 * 2 n h (Hkv D)``,
  ``Q = bytes * (2 h Hkv D + h + n h + 2 n Hkv D)``.

Not counted: norms, RoPE, softmax and the block-sparse mask estimate (a few percent of dense
attention, docs/runtime.md). The Roofline ignores device load ``U`` entirely.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sparkv.predictor.cost import StepCostModel
from sparkv.predictor.features import K_BLOCK, Q_BLOCK, StepFeatures, visible_pairs


@dataclass(frozen=True)
class ModelArch:
    """The shapes of one decoder layer (all a Roofline needs to know about the model)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_layers: int
    dtype_bytes: int = 4

    @classmethod
    def from_config(cls, config: Any, dtype_bytes: int = 4) -> "ModelArch":
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        return cls(int(config.hidden_size), heads,
                   int(getattr(config, "num_key_value_heads", None) or heads), int(head_dim),
                   int(config.intermediate_size), int(config.num_hidden_layers), dtype_bytes)

    @classmethod
    def from_model(cls, lm: Any) -> "ModelArch":
        """From a :class:`sparkv.runtime.LoadedModel`."""
        return cls.from_config(lm.config, int(getattr(lm.dtype, "itemsize", 4)))

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArch":
        return cls(**{k: int(v) for k, v in d.items()})

    @property
    def layer_weights(self) -> int:
        """Parameters of one decoder layer (attention, MLP, two RMSNorms)."""
        h, hq, hkv, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        return h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * self.intermediate + 2 * h


def step_work(arch: ModelArch, query_tokens: np.ndarray | float, key_tokens: np.ndarray | float,
              active_blocks: np.ndarray | float | None = None, projection_only: bool = False,
              ) -> tuple[np.ndarray, np.ndarray]:
    """FLOPs ``W`` and bytes ``Q`` of steps (vectorised; see the module docstring).

    ``active_blocks`` (per query head) ``None`` or ``NaN`` means dense attention.
    """
    n = np.asarray(query_tokens, dtype=np.float64)
    k = np.asarray(key_tokens, dtype=np.float64)
    h, hq, hkv, d, b = arch.hidden, arch.heads, arch.kv_heads, arch.head_dim, arch.dtype_bytes
    if projection_only:
        flops = 2.0 * 2.0 * n * h * hkv * d
        nbytes = b * (2.0 * h * hkv * d + h + n * h + 2.0 * n * hkv * d)
        return flops, nbytes
    dense_pairs = visible_pairs(n, k)
    if active_blocks is None:
        pairs = dense_pairs
    else:
        s = np.asarray(active_blocks, dtype=np.float64)
        pairs = np.where(np.isnan(s), dense_pairs,
                         np.minimum(np.nan_to_num(s) * Q_BLOCK * K_BLOCK, dense_pairs))
    flops = (2.0 * n * h * hq * d + 4.0 * n * h * hkv * d + 2.0 * n * hq * d * h
             + 6.0 * n * h * arch.intermediate + 4.0 * d * hq * pairs)
    share = np.where(dense_pairs > 0, pairs / np.maximum(dense_pairs, 1.0), 1.0)
    nbytes = b * (arch.layer_weights + 2.0 * n * h + 2.0 * n * hkv * d + 2.0 * hkv * d * k * share)
    return flops, nbytes


@dataclass
class Roofline(StepCostModel):
    """``t = max(W / peak_flops, Q / peak_bandwidth)`` per step, in milliseconds.

    Attributes:
        arch: the model's layer shapes.
        peak_flops: FLOP/s, measured (:meth:`measure`).
        peak_bandwidth: bytes/s, measured.
        density_prior: see :class:`~sparkv.predictor.cost.StepCostModel` (used by ``t_comp`` only).
    """

    arch: ModelArch
    peak_flops: float
    peak_bandwidth: float
    density_prior: tuple[float, float] | None = None
    name = "roofline"

    @classmethod
    def measure(cls, arch: ModelArch, device: str = "cpu", threads: int | None = None,
                quick: bool = False, dtype: Any = None) -> "Roofline":
        """Measures this machine's peaks (about 1 s; ``quick``: about 0.3 s) on ``device`` in the
        model's ``dtype`` (default fp32)."""
        flops, bw = measure_peaks(device, threads, quick, dtype)
        return cls(arch, flops, bw)

    def predict_ms(self, f: StepFeatures) -> np.ndarray:
        """Predicted milliseconds of each step (``f.projection`` rows: projection-only)."""
        w, q = step_work(self.arch, f.query_tokens, f.key_tokens,
                         np.where(f.sparse > 0, f.active_blocks, np.nan))
        wp, qp = step_work(self.arch, f.query_tokens, f.key_tokens, projection_only=True)
        w = np.where(f.projection > 0, wp, w)
        q = np.where(f.projection > 0, qp, q)
        return 1e3 * np.maximum(w / self.peak_flops, q / self.peak_bandwidth)

    def to_dict(self) -> dict[str, Any]:
        return {"arch": self.arch.to_dict(), "peak_flops": self.peak_flops,
                "peak_bandwidth": self.peak_bandwidth}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Roofline":
        return cls(ModelArch.from_dict(d["arch"]), float(d["peak_flops"]),
                   float(d["peak_bandwidth"]))


_PEAKS: dict[tuple[str, int, bool, str], tuple[float, float]] = {}


def measure_peaks(device: str = "cpu", threads: int | None = None, quick: bool = False,
                  dtype: Any = None) -> tuple[float, float]:
    """``(FLOP/s, bytes/s)``: best of 10 matmuls in ``dtype`` (default fp32; 1024^3, 2 FLOPs per
    multiply-add; 4096^3 on a GPU, where a smaller one measures the launch, not the peak) and of
    6 copies of a 32 Mi-float tensor (read + write bytes); ``quick``: half the matmul size and
    8 Mi floats, fewer runs. Cached per (device, threads, quick, dtype)."""
    import torch

    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    dtype = dtype or torch.float32
    key = (str(device), torch.get_num_threads(), quick, str(dtype))
    try:
        if key in _PEAKS:
            return _PEAKS[key]
        gpu = str(device).startswith("cuda")
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        size = (4096 if gpu else 1024) // (2 if quick else 1)
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        best = math.inf
        for _ in range(4 if quick else 10):  # short runs, best of many: dodges preemption
            sync()
            t0 = time.perf_counter()
            torch.mm(a, b)
            sync()
            best = min(best, time.perf_counter() - t0)
        flops = 2.0 * size ** 3 / best
        numel = (8 if quick else 32) * 1024 * 1024
        src = torch.ones(numel, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch the pages once
        best = math.inf
        for _ in range(3 if quick else 6):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src)
            sync()
            best = min(best, time.perf_counter() - t0)
        bandwidth = 2.0 * numel * src.element_size() / best
        _PEAKS[key] = (flops, bandwidth)
        return flops, bandwidth
    finally:
        torch.set_num_threads(old)
