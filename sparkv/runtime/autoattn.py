"""``auto`` attention: dense or block-sparse per call, from this device's measured profile.

On the CPU, ``auto`` is :class:`~sparkv.runtime.attention.BlockSparseAttention` with its measured
CPU rule (dense SDPA below ``dense_below`` visible keys: docs/runtime.md). On CUDA (decided per
call by the tensors' device):

* square chunks at offset 0 run SDPA's causal flash kernel;
* chunks after a prefix shorter than the profile's ``min_sparse_keys`` run
  :class:`~sparkv.runtime.flex.FlexAttention` dense (block-causal, no per-step mask tensor), or SDPA
  with a mask where flex_attention is missing;
* longer ones predict the block mask, and run flex_attention over the kept blocks only if the
  predicted density is below the profile's break-even density at that length; otherwise dense:
  never sparse where it is slower.

:func:`calibrate` measures the profile on this GPU (dense vs sparse attention time over key
lengths and densities, mask prediction included) and :func:`save_profile` keeps it beside the
predictor's profiles; without one, conservative defaults apply (sparse only from 8K keys, below
50% density).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sparkv.runtime.attention import (AttentionStats, BlockSparseAttention, SparsityConfig,
                                      _check_shapes, _sdpa_causal, register_backend)


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
        self.cpu = BlockSparseAttention(self.config)
        self.profile = profile
        self._flex: dict[bool, Any] = {}

    def _flex_backend(self, sparse: bool) -> Any:
        if sparse not in self._flex:
            try:
                from sparkv.runtime.flex import FlexAttention

                self._flex[sparse] = FlexAttention(sparse=sparse, config=self.config)
            except Exception:  # noqa: BLE001 - no flex_attention in this PyTorch
                self._flex[sparse] = None
        return self._flex[sparse]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_offset: int,
               scale: float | None = None) -> tuple[torch.Tensor, AttentionStats]:
        if not q.is_cuda:
            return self.cpu.attend(q, k, v, q_offset, scale)
        _check_shapes(q, k, v, q_offset)
        if self.profile is None:
            self.profile = load_profile(q.device)
        nq = q.shape[2]
        keys = q_offset + nq
        dense = self._flex_backend(False)
        if q_offset == 0 and k.shape[2] == nq:
            out = _sdpa_causal(q, k, v, 0, scale)
            blocks = self.cpu._geometry(nq, nq, 0, q.device)[3].sum()
            return out, AttentionStats("dense", torch.full((q.shape[1],), int(blocks)),
                                       int(blocks))
        limit = self.profile.density_limit(keys)
        sparse = self._flex_backend(True) if limit > 0 else None
        if sparse is None:
            if dense is not None:
                return dense.attend(q, k, v, q_offset, scale)
            return self.cpu.attend(q, k, v, q_offset, scale)
        mask = self.cpu.predict_mask(q, k[:, :, :keys], q_offset, scale)
        _, _, _, visible, _ = self.cpu._geometry(nq, keys, q_offset, q.device)
        density = float(mask.sum()) / max(1, int(visible.sum()) * mask.shape[0] * mask.shape[1])
        if density >= limit:
            return (dense or sparse).attend(q, k, v, q_offset, scale,
                                            mask=visible.expand_as(mask))
        return sparse.attend(q, k, v, q_offset, scale, mask=mask)


def calibrate(device: torch.device, heads: tuple[int, int] = (24, 8), head_dim: int = 128,
              lengths: tuple[int, ...] = (4096, 8192, 16384, 32768),
              densities: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75), chunk: int = 4096,
              repeats: int = 5) -> AttentionProfile:
    """Measures dense vs sparse attention of one ``chunk``-query chunk at the end of each key
    length (random bf16 data; sparse includes its mask prediction) on ``device``."""
    from sparkv.runtime.flex import FlexAttention

    if device.type != "cuda":
        raise ValueError("calibrate() measures a CUDA device; the CPU rule is BlockSparse's own")
    hq, hkv = heads
    dense = FlexAttention(sparse=False)
    breakeven: dict[int, float] = {}
    min_keys = math.inf
    for n in lengths:
        off = n - chunk
        q = torch.randn(1, hq, chunk, head_dim, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, n, head_dim, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)

        def timed(fn: Any) -> float:
            fn()
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            torch.cuda.synchronize(device)
            return (time.perf_counter() - t0) / repeats

        t_dense = timed(lambda: dense.attend(q, k, v, off))
        best = 0.0
        for d in densities:
            cfg = SparsityConfig(topk=d, dense_below=0, min_keys=0)
            sp = FlexAttention(sparse=True, config=cfg)
            if timed(lambda: sp.attend(q, k, v, off)) < t_dense:
                best = max(best, d)
        breakeven[n] = best
        if best > 0:
            min_keys = min(min_keys, n)
    name = torch.cuda.get_device_name(device)
    return AttentionProfile(name, int(min_keys) if math.isfinite(min_keys) else 1 << 30,
                            breakeven, True)


register_backend("auto", lambda config: AutoAttention(config))
