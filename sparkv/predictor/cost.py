"""The interface every step-latency model offers the scheduler and the edge engine.

A :class:`StepCostModel` predicts milliseconds from
:class:`~sparkv.predictor.features.StepFeatures` (:meth:`predict_ms`) and, from that, fills the
scheduler's ``t_comp[t, l]`` matrix in seconds (:meth:`t_comp`) or one step's cost
(:meth:`step_seconds`). :class:`~sparkv.predictor.model.LatencyModel` (the MLP) and
:class:`~sparkv.predictor.roofline.Roofline` both implement it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from sparkv.predictor.features import StepFeatures, causal_blocks


class StepCostModel:
    """Base class: subclasses implement :meth:`predict_ms`.

    Attributes:
        density_prior: ``(a, b)`` with ``density ~ exp(a) * causal_blocks ** b``, the block-sparse
            density assumed when a step's active blocks are not known in advance (fitted on the
            profile by :class:`~sparkv.predictor.model.LatencyModel`); ``None``: assume dense.
    """

    name = "cost-model"
    density_prior: tuple[float, float] | None = None

    def predict_ms(self, f: StepFeatures) -> np.ndarray:  # pragma: no cover - interface
        raise NotImplementedError

    # ---- conveniences --------------------------------------------------------------------------
    def expected_active_blocks(self, query_tokens: np.ndarray, key_tokens: np.ndarray
                               ) -> np.ndarray:
        """Active blocks per query head assumed for block-sparse steps whose ``s`` is unknown."""
        causal = causal_blocks(query_tokens, key_tokens).astype(np.float64)
        if self.density_prior is None:
            return causal
        a, b = self.density_prior
        density = np.clip(np.exp(a) * np.maximum(causal, 1.0) ** b, 0.0, 1.0)
        return np.maximum(1.0, density * causal)

    def step_seconds(self, t: int, layer: int, geometry: Any, *, sparse: bool = True,
                     active_blocks: float | None = None, utilisation: float = 0.0) -> float:
        """Predicted seconds of step ``(t, layer)`` of a context with this
        :class:`~sparkv.layout.ChunkGeometry`."""
        start, end = geometry.token_range(t)
        n = end - start
        projection = layer == geometry.num_layers - 1
        if active_blocks is None:
            s = (0.0 if projection else
                 float(self.expected_active_blocks(np.array([n]), np.array([end]))[0]) if sparse
                 else float(causal_blocks(n, end)[0]))
        else:
            s = float(active_blocks)
        f = StepFeatures(n, end, s, utilisation, float(sparse), float(projection), t)
        return float(self.predict_ms(f)[0]) / 1e3

    def t_comp(self, geometry: Any, *, sparse: bool = True,
               active_blocks: np.ndarray | None = None, utilisation: float | None = None,
               device: str = "cpu") -> np.ndarray:
        """``float64[num_token_chunks, num_layers]`` predicted seconds of every layer step, the
        scheduler's ``Instance.t_comp``.

        Args:
            geometry: the context's :class:`~sparkv.layout.ChunkGeometry`.
            sparse: the engine computes with the block-sparse backend (else dense SDPA).
            active_blocks: ``[num_token_chunks, num_layers]`` active blocks per query head when
                known (e.g. from the server's profile of the context); NaN or ``None``: the
                density prior (sparse) or every causal block (dense).
            utilisation: device load ``U``; ``None`` reads it now
                (:func:`~sparkv.predictor.device.current_utilisation`).
        """
        if utilisation is None:
            from sparkv.predictor.device import current_utilisation

            utilisation = current_utilisation(device)
        nt, L = geometry.num_token_chunks, geometry.num_layers
        ends = np.array([geometry.token_range(t)[1] for t in range(nt)], dtype=np.float64)
        n = np.array([geometry.chunk_len(t) for t in range(nt)], dtype=np.float64)
        q = np.repeat(n, L)
        k = np.repeat(ends, L)
        layer = np.tile(np.arange(L), nt)
        if sparse:
            default = self.expected_active_blocks(q, k)
        else:
            default = causal_blocks(q, k).astype(np.float64)
        if active_blocks is not None:
            given = np.asarray(active_blocks, dtype=np.float64).reshape(-1)
            if given.shape != default.shape:
                raise ValueError(f"active_blocks must have shape {(nt, L)}")
            s = np.where(np.isnan(given), default, given)
        else:
            s = default
        projection = (layer == L - 1).astype(np.float64)
        f = StepFeatures(q, k, np.where(projection > 0, 0.0, s), float(utilisation),
                         float(sparse), projection, np.repeat(np.arange(nt), L))
        ms = self.predict_ms(f)
        out = (ms / 1e3).reshape(nt, L)
        if not np.all(np.isfinite(out)):
            raise ValueError("the latency model produced a non-finite prediction")
        return np.maximum(out, 1e-6)


def mape(predicted: ArrayLike, measured: ArrayLike) -> float:
    """Mean absolute percentage error, in percent."""
    predicted = np.asarray(predicted, dtype=np.float64)
    measured = np.asarray(measured, dtype=np.float64)
    if len(measured) == 0:
        return math.nan
    return float(np.mean(np.abs(predicted - measured) / measured) * 100.0)
