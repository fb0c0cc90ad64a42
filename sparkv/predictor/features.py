"""What a latency model sees of one layer step: :class:`StepFeatures` (columns of numpy arrays).

A step ``(t, l)`` of a context cut into chunks of ``T`` tokens has ``n = len(chunk t)`` query tokens
and ``k = t*T + n`` key tokens; with block-sparse attention it computes ``s`` (query block, key
block) pairs per query head (``AttentionStats.active_blocks``, averaged over heads), out of
``causal_blocks(n, k)``; the device is under load ``U``. The paper's feature vector
``<t, s, U>`` becomes ``<n, k, s, U, sparse>`` here because chunk sizes vary (``t`` alone does not
say how long the prefix is) and the dense and block-sparse backends run different code.

Plain numpy (no torch), so planners can build features without loading a model.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Sequence

import numpy as np
from numpy.typing import ArrayLike

Q_BLOCK = 128  # query tokens per block (sparkv.runtime.attention.Q_BLOCK)
K_BLOCK = 64   # key tokens per block (sparkv.runtime.attention.K_BLOCK)

#: Columns :meth:`StepFeatures.matrix` can build.
FEATURE_NAMES = ("query_tokens", "key_tokens", "active_blocks", "utilisation", "sparse", "t",
                 "density", "causal_blocks", "prefix_tokens")


def causal_blocks(query_tokens: np.ndarray | float, key_tokens: np.ndarray | float,
                  bq: int = Q_BLOCK, bk: int = K_BLOCK) -> np.ndarray:
    """Blocks with at least one visible (query, key) pair, bottom-right causal (vectorised;
    equals ``sparkv.runtime.attention.causal_block_count(n, k, k - n)``).

    Query block ``i`` ends at query ``o + min((i+1) bq, n) - 1`` (``o = k - n``) and sees key blocks
    ``0 .. last // bk``; that never exceeds the last key block, so no clipping is needed.
    """
    n, k = np.broadcast_arrays(np.atleast_1d(np.asarray(query_tokens, dtype=np.int64)),
                               np.atleast_1d(np.asarray(key_tokens, dtype=np.int64)))
    if n.size == 1:  # the per-step path: plain Python is ~10x faster than numpy here
        nq, nk = int(n.flat[0]), int(k.flat[0])
        total = sum((nk - nq + min((i + 1) * bq, nq) - 1) // bk + 1 for i in range(-(-nq // bq)))
        return np.full(n.shape, total, dtype=np.int64)
    nqb = -(-n // bq)
    i = np.arange(int(nqb.max()) if n.size else 0)
    last = (k - n)[..., None] + np.minimum((i + 1) * bq, n[..., None]) - 1
    return np.where(i < nqb[..., None], last // bk + 1, 0).sum(-1).astype(np.int64)


def visible_pairs(query_tokens: np.ndarray | float, key_tokens: np.ndarray | float) -> np.ndarray:
    """Causally visible (query, key) pairs: ``n (k - n) + n (n + 1) / 2``."""
    n = np.asarray(query_tokens, dtype=np.float64)
    k = np.asarray(key_tokens, dtype=np.float64)
    return n * (k - n) + n * (n + 1) / 2


@dataclass(init=False)
class StepFeatures:
    """Features of ``m`` steps, each attribute an ``[m]`` float64 array.

    Attributes:
        query_tokens: ``n``, tokens of the step's chunk.
        key_tokens: ``k``, tokens attended over (prefix + chunk).
        active_blocks: ``s``, computed 128x64 blocks per query head (mean over heads); for dense
            attention the causal block count.
        utilisation: ``U`` in ``[0, 1]`` (see :mod:`sparkv.predictor.device`).
        sparse: 1 for the block-sparse backend, 0 for dense.
        projection: 1 for a projection-only (last layer) step, else 0.
        t: the token chunk index (informational unless a model uses it).
    """

    query_tokens: np.ndarray
    key_tokens: np.ndarray
    active_blocks: np.ndarray
    utilisation: np.ndarray
    sparse: np.ndarray
    projection: np.ndarray
    t: np.ndarray

    def __init__(self, query_tokens: ArrayLike, key_tokens: ArrayLike, active_blocks: ArrayLike,
                 utilisation: ArrayLike, sparse: ArrayLike, projection: ArrayLike,
                 t: ArrayLike) -> None:
        """Each argument an ``[m]`` array or a scalar (broadcast to the others' length)."""
        given = (query_tokens, key_tokens, active_blocks, utilisation, sparse, projection, t)
        cols = np.broadcast_arrays(*(np.atleast_1d(np.asarray(x, dtype=np.float64))
                                     for x in given))
        for f, c in zip(fields(self), cols):
            setattr(self, f.name, np.array(c, dtype=np.float64))

    def __len__(self) -> int:
        return len(self.query_tokens)

    @classmethod
    def single(cls, query_tokens: int, key_tokens: int, active_blocks: float | None = None,
               utilisation: float = 0.0, sparse: bool = True, projection: bool = False,
               t: int | None = None) -> "StepFeatures":
        """One step; ``active_blocks=None`` means all causal blocks (dense)."""
        s = float(causal_blocks(query_tokens, key_tokens)[0]) if active_blocks is None \
            else float(active_blocks)
        return cls(query_tokens, key_tokens, s, utilisation, float(sparse), float(projection),
                   (key_tokens - query_tokens) // max(query_tokens, 1) if t is None else t)

    @classmethod
    def from_samples(cls, samples: Iterable) -> "StepFeatures":
        """From profiler :class:`~sparkv.predictor.profiler.Sample` objects."""
        rows = list(samples)
        return cls(
            np.array([r.query_tokens for r in rows], dtype=np.float64),
            np.array([r.key_tokens for r in rows], dtype=np.float64),
            np.array([r.active_blocks for r in rows], dtype=np.float64),
            np.array([r.utilisation for r in rows], dtype=np.float64),
            np.array([r.backend != "dense" for r in rows], dtype=np.float64),
            np.array([r.kind == "projection" for r in rows], dtype=np.float64),
            np.array([r.t for r in rows], dtype=np.float64),
        )

    def subset(self, index: np.ndarray | Sequence[int]) -> "StepFeatures":
        idx = np.asarray(index)
        return StepFeatures(*(getattr(self, f.name)[idx] for f in fields(self)))

    def column(self, name: str) -> np.ndarray:
        if name == "density":
            return self.active_blocks / np.maximum(self.column("causal_blocks"), 1.0)
        if name == "causal_blocks":
            return causal_blocks(self.query_tokens, self.key_tokens).astype(np.float64)
        if name == "prefix_tokens":
            return self.key_tokens - self.query_tokens
        if name not in FEATURE_NAMES:
            raise KeyError(f"unknown feature {name!r}; choose from {FEATURE_NAMES}")
        return getattr(self, name)

    def matrix(self, names: Sequence[str]) -> np.ndarray:
        """``[m, len(names)]`` float64 design matrix."""
        return np.stack([self.column(n) for n in names], axis=1)
