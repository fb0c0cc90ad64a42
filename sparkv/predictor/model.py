"""The learned step-latency model (the paper's ``f_theta``), its file format, and the fallback.

:class:`LatencyModel` predicts the wall-clock milliseconds of a layer step:

* attention steps (``l < L-1``): a scikit-learn ``MLPRegressor`` (hidden layers 48 and 24, ReLU,
  squared-error loss) on standardised features ``<n, k, s, U, sparse>``
  (:mod:`sparkv.predictor.features`), trained on an 80/20 split of profiled real steps. The target
  is ``log(ms)`` (standardised): squared error in log space weighs a 10% miss on a 50 ms step like a
  10% miss on a 500 ms step, which is what the scheduler's relative comparisons need (set
  ``log_target=False`` for raw milliseconds). The paper's split ``f_theta + t_dense`` is learned as
  one function here: the dense part depends only on ``n``, which is a feature.
* the last layer's projection-only step: the paper's "direct profile lookup", here a least-squares
  fit ``log ms = c0 + c1 log n + c2 U`` through the profiled projection steps.

Prediction never calls scikit-learn: the trained weights run through a small numpy forward pass
(about 20 us for one step, versus ~100 us of ``MLPRegressor.predict`` call overhead).

Files are JSON (no pickle: readable, portable across scikit-learn versions) and carry the device
fingerprint; :func:`load_predictor` returns the MLP on the same device and, on another one, warns
(:class:`DeviceMismatchWarning`) and returns a :class:`~sparkv.predictor.roofline.Roofline`
measured on the current device. See docs/predictor.md.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sparkv.errors import SparkvError
from sparkv.fileio import atomic_write
from sparkv.predictor.cost import StepCostModel, mape
from sparkv.predictor.device import compute_name, device_fingerprint, fingerprint_differences
from sparkv.predictor.features import StepFeatures
from sparkv.predictor.roofline import ModelArch, Roofline

MODEL_FORMAT = "sparkv-latency-model/1"
DEFAULT_FEATURES = ("query_tokens", "key_tokens", "active_blocks", "utilisation", "sparse")
#: The block-sparse threshold whose profiled densities define the default density prior.
PRIOR_CDF = 0.95

__all__ = ["LatencyModel", "Roofline", "ModelArch", "load_predictor", "DeviceMismatchWarning",
           "PredictorFileError", "MODEL_FORMAT", "DEFAULT_FEATURES", "split_indices"]


class DeviceMismatchWarning(UserWarning):
    """A latency model was loaded on a device (or for a model) other than the one it was profiled
    on; its predictions do not apply there."""


class PredictorFileError(SparkvError):
    """A latency model file is missing, unreadable or not in the expected format."""


def split_indices(m: int, test_fraction: float = 0.2, seed: int = 0
                  ) -> tuple[np.ndarray, np.ndarray]:
    """A seeded random ``(train, test)`` split of ``range(m)`` (``round(m * test_fraction)`` test
    rows, at least one of each when ``m >= 2``)."""
    order = np.random.default_rng(seed).permutation(m)
    n_test = int(round(m * test_fraction))
    if m >= 2:
        n_test = min(max(n_test, 1), m - 1)
    return np.sort(order[n_test:]), np.sort(order[:n_test])


class LatencyModel(StepCostModel):
    """MLP step-latency model with a projection lookup; scikit-learn style ``fit``/``predict``.

    Args:
        hidden_layers: MLP hidden layer sizes.
        features: feature columns (see :data:`sparkv.predictor.features.FEATURE_NAMES`).
        log_target: learn ``log(ms)`` instead of ``ms``.
        test_fraction: share of samples held out by :meth:`fit`.
        solver, alpha, learning_rate_init, max_iter, batch_size: passed to ``MLPRegressor``
            (loss: squared error). ``alpha`` (L2 penalty) 0.1 was chosen by 5-fold cross-validation
            on the training portions of two real profiles (a busy and a quiet machine) among
            1e-4, 1e-2, 0.1 and 1: the default 1e-4 fits the noise of ``U``.
        random_state: seeds the split and the MLP.
    """

    name = "mlp"

    def __init__(self, hidden_layers: Sequence[int] = (48, 24),
                 features: Sequence[str] = DEFAULT_FEATURES, log_target: bool = True,
                 test_fraction: float = 0.2, solver: str = "adam", alpha: float = 0.1,
                 learning_rate_init: float = 1e-3, max_iter: int = 3000,
                 batch_size: int | str = "auto", random_state: int = 0) -> None:
        self.hidden_layers = tuple(int(h) for h in hidden_layers)
        self.features = tuple(features)
        self.log_target = bool(log_target)
        self.test_fraction = float(test_fraction)
        self.solver = solver
        self.alpha = float(alpha)
        self.learning_rate_init = float(learning_rate_init)
        self.max_iter = int(max_iter)
        self.batch_size = batch_size
        self.random_state = int(random_state)
        # fitted state
        self.x_mean: np.ndarray | None = None
        self.x_scale: np.ndarray | None = None
        self.y_mean = 0.0
        self.y_scale = 1.0
        self.weights: list[np.ndarray] = []
        self.biases: list[np.ndarray] = []
        self.projection_coef: np.ndarray | None = None
        self.density_prior: tuple[float, float] | None = None
        self.roofline: Roofline | None = None
        self.info: dict[str, Any] = {}
        self.train_index: np.ndarray | None = None
        self.test_index: np.ndarray | None = None

    # ---- training ----------------------------------------------------------------------------
    def fit(self, samples: Sequence[Any], metadata: dict[str, Any] | None = None,
            roofline: Roofline | None = None) -> "LatencyModel":
        """Trains on profiler samples: a seeded 80/20 split of all samples (``train_index`` /
        ``test_index`` index ``samples``); the MLP on the training attention steps, the projection
        fit on the training projection steps, the density prior on the training block-sparse
        steps at ``cdf_threshold == 0.95`` (or all block-sparse steps). ``metadata`` (from
        :meth:`Profiler.metadata`) supplies the device fingerprint and the model identity."""
        samples = list(samples)
        if len(samples) < 10:
            raise ValueError(f"need at least 10 samples to train, got {len(samples)}")
        train, test = split_indices(len(samples), self.test_fraction, self.random_state)
        self.train_index, self.test_index = train, test
        tr = [samples[i] for i in train]
        att = [s for s in tr if s.kind == "attention"]
        proj = [s for s in tr if s.kind == "projection"]
        start = time.perf_counter()
        f = StepFeatures.from_samples(att)
        y = np.array([s.ms for s in att], dtype=np.float64)
        iters = self.fit_arrays(f, y)
        self._fit_projection(proj)
        sparse = [s for s in tr if s.kind == "attention" and s.backend != "dense"]
        at_prior = [s for s in sparse if s.cdf_threshold is not None
                    and abs(s.cdf_threshold - PRIOR_CDF) < 1e-9] or sparse
        self.density_prior = _fit_density_prior(at_prior)
        meta = metadata or {}
        self.roofline = roofline
        test_att = [samples[i] for i in test if samples[i].kind == "attention"]
        self.info = {
            "samples": len(samples), "train": len(train), "test": len(test),
            "train_attention": len(att), "train_projection": len(proj),
            "iterations": iters, "fit_seconds": time.perf_counter() - start,
            "test_mape_attention": (mape(self.predict_ms(StepFeatures.from_samples(test_att)),
                                         [s.ms for s in test_att]) if test_att else None),
            "model": meta.get("model"), "model_fingerprint": meta.get("model_fingerprint"),
            "arch": meta.get("arch"), "num_layers": meta.get("num_layers"),
            "device": meta.get("device", "cpu"),
            "fingerprint": meta.get("fingerprint") or device_fingerprint(
                meta.get("device", "cpu"), (meta.get("config") or {}).get("threads")),
            "utilisation_source": meta.get("utilisation_source"),
        }
        return self

    def fit_arrays(self, f: StepFeatures, ms: np.ndarray) -> int:
        """Trains the MLP on features and measured milliseconds (all rows); returns the number
        of optimizer iterations."""
        from sparkv.extras import require

        feature = "training the latency model"
        ConvergenceWarning = require("sklearn.exceptions", feature=feature).ConvergenceWarning
        MLPRegressor = require("sklearn.neural_network", feature=feature).MLPRegressor

        x = f.matrix(self.features)
        ms = np.asarray(ms, dtype=np.float64)
        if np.any(ms <= 0):
            raise ValueError("measured times must be positive")
        y = np.log(ms) if self.log_target else ms
        self.x_mean = x.mean(axis=0)
        self.x_scale = np.where(x.std(axis=0) > 0, x.std(axis=0), 1.0)
        self.y_mean = float(y.mean())
        self.y_scale = float(y.std()) or 1.0
        mlp = MLPRegressor(loss="squared_error", hidden_layer_sizes=self.hidden_layers,
                           activation="relu", solver=self.solver, alpha=self.alpha,
                           learning_rate_init=self.learning_rate_init, max_iter=self.max_iter,
                           batch_size=self.batch_size, random_state=self.random_state,
                           n_iter_no_change=50, tol=1e-6)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            mlp.fit((x - self.x_mean) / self.x_scale, (y - self.y_mean) / self.y_scale)
        self.weights = [np.asarray(w, dtype=np.float64) for w in mlp.coefs_]
        self.biases = [np.asarray(b, dtype=np.float64) for b in mlp.intercepts_]
        return int(mlp.n_iter_)

    def _fit_projection(self, proj: Sequence[Any]) -> None:
        if not proj:
            self.projection_coef = None
            return
        n = np.array([s.query_tokens for s in proj], dtype=np.float64)
        u = np.array([s.utilisation for s in proj], dtype=np.float64)
        ms = np.array([s.ms for s in proj], dtype=np.float64)
        design = np.stack([np.ones_like(n), np.log(n), u], axis=1)
        coef, *_ = np.linalg.lstsq(design, np.log(ms), rcond=None)
        self.projection_coef = coef

    @property
    def fitted(self) -> bool:
        return bool(self.weights)

    # ---- prediction --------------------------------------------------------------------------
    def _forward(self, x: np.ndarray) -> np.ndarray:
        h = (x - self.x_mean) / self.x_scale
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = h @ w + b
            if i < last:
                np.maximum(h, 0.0, out=h)
        y = h[:, 0] * self.y_scale + self.y_mean
        return np.exp(y) if self.log_target else y

    def predict_ms(self, f: StepFeatures) -> np.ndarray:
        """Milliseconds of each step (projection rows from the projection line; without
        projection samples, from the Roofline when one was saved)."""
        if not self.fitted:
            raise RuntimeError("the latency model is not fitted")
        out = self._forward(f.matrix(self.features))
        proj = f.projection > 0
        if np.any(proj):
            out = np.where(proj, self._projection_ms(f), out)
        return np.maximum(out, 1e-3)

    def _projection_ms(self, f: StepFeatures) -> np.ndarray:
        if self.projection_coef is not None:
            c = self.projection_coef
            return np.exp(c[0] + c[1] * np.log(np.maximum(f.query_tokens, 1.0))
                          + c[2] * f.utilisation)
        if self.roofline is not None:
            return self.roofline.predict_ms(f)
        raise RuntimeError("no projection-only samples were profiled and no Roofline was saved")

    def predict_one_ms(self, query_tokens: float, key_tokens: float, active_blocks: float,
                       utilisation: float, sparse: bool = True) -> float:
        """One attention step, the fast path (no feature object; see the benchmark's timing)."""
        cols = {"query_tokens": query_tokens, "key_tokens": key_tokens,
                "active_blocks": active_blocks, "utilisation": utilisation,
                "sparse": 1.0 if sparse else 0.0, "prefix_tokens": key_tokens - query_tokens,
                "t": (key_tokens - query_tokens) / max(query_tokens, 1.0)}
        if not set(self.features) <= cols.keys():
            f = StepFeatures.single(int(query_tokens), int(key_tokens), active_blocks,
                                    utilisation, sparse)
            return float(self.predict_ms(f)[0])
        x = np.array([[cols[n] for n in self.features]], dtype=np.float64)
        return max(float(self._forward(x)[0]), 1e-3)

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        if not self.fitted or self.x_mean is None or self.x_scale is None:
            raise RuntimeError("the latency model is not fitted")
        return {
            "format": MODEL_FORMAT,
            "kind": "mlp",
            "features": list(self.features),
            "log_target": self.log_target,
            "x_mean": self.x_mean.tolist(), "x_scale": self.x_scale.tolist(),
            "y_mean": self.y_mean, "y_scale": self.y_scale,
            "activation": "relu",
            "layers": [{"weight": w.tolist(), "bias": b.tolist()}
                       for w, b in zip(self.weights, self.biases)],
            "projection": (None if self.projection_coef is None else
                           {"log_ms_terms": ["1", "log n", "U"],
                            "coef": self.projection_coef.tolist()}),
            "density_prior": None if self.density_prior is None else list(self.density_prior),
            "roofline": None if self.roofline is None else self.roofline.to_dict(),
            "hyperparameters": {
                "hidden_layers": list(self.hidden_layers), "solver": self.solver,
                "alpha": self.alpha, "learning_rate_init": self.learning_rate_init,
                "max_iter": self.max_iter, "test_fraction": self.test_fraction,
                "random_state": self.random_state, "loss": "squared_error"},
            "info": _jsonable(self.info),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LatencyModel":
        if d.get("format") != MODEL_FORMAT:
            raise PredictorFileError(f"not a sparkv latency model (format {d.get('format')!r}, "
                                     f"expected {MODEL_FORMAT!r})")
        hp = d.get("hyperparameters", {})
        m = cls(hidden_layers=hp.get("hidden_layers", (48, 24)), features=d["features"],
                log_target=d["log_target"], test_fraction=hp.get("test_fraction", 0.2),
                solver=hp.get("solver", "adam"), alpha=hp.get("alpha", 0.1),
                learning_rate_init=hp.get("learning_rate_init", 1e-3),
                max_iter=hp.get("max_iter", 3000), random_state=hp.get("random_state", 0))
        m.x_mean = np.array(d["x_mean"], dtype=np.float64)
        m.x_scale = np.array(d["x_scale"], dtype=np.float64)
        m.y_mean, m.y_scale = float(d["y_mean"]), float(d["y_scale"])
        m.weights = [np.array(layer["weight"], dtype=np.float64) for layer in d["layers"]]
        m.biases = [np.array(layer["bias"], dtype=np.float64) for layer in d["layers"]]
        proj = d.get("projection")
        m.projection_coef = None if proj is None else np.array(proj["coef"], dtype=np.float64)
        prior = d.get("density_prior")
        m.density_prior = None if prior is None else (float(prior[0]), float(prior[1]))
        m.roofline = Roofline.from_dict(d["roofline"]) if d.get("roofline") else None
        m.info = dict(d.get("info", {}))
        return m

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the JSON model file (atomically)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps(self.to_dict(), indent=1) + "\n").encode())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "LatencyModel":
        """Reads a model file as is (no device check: see :func:`load_predictor`)."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise PredictorFileError(f"no latency model at {path}: run `sparkv profile --train "
                                     f"{path}` on this device") from exc
        except (OSError, ValueError) as exc:
            raise PredictorFileError(f"cannot read the latency model {path}: {exc}") from exc
        return cls.from_dict(doc)

    @property
    def fingerprint(self) -> dict[str, Any]:
        return dict(self.info.get("fingerprint") or {})


def load_predictor(path: str | os.PathLike[str], lm: Any = None, device: str | None = None,
                   threads: int | None = None, quick_roofline: bool = True) -> StepCostModel:
    """The step-cost model to plan with on this device.

    Loads the :class:`LatencyModel` at ``path`` and checks its fingerprint against this device
    (``device``: default the one it was profiled on; ``threads``: default torch's current count)
    and, when ``lm`` is given, its model fingerprint. On a match it is returned. Otherwise a
    :class:`DeviceMismatchWarning` says what differs, and a :class:`Roofline` for the model's
    shapes with this device's measured peaks is returned instead (with the file's density prior).
    """
    model = LatencyModel.load(path)
    dev = device or model.info.get("device") or "cpu"
    dtype = compute_name(lm) if lm is not None else model.fingerprint.get("dtype")
    current = device_fingerprint(dev, threads, dtype)
    diffs = fingerprint_differences(model.fingerprint, current)
    # a model with its RoPE extended (the long-context mode) runs its base's steps: its profile
    if lm is not None and model.info.get("model_fingerprint") not in (
            None, lm.fingerprint, getattr(lm, "base_fingerprint", lm.fingerprint)):
        diffs.append(f"model: {model.info.get('model')!r} ({model.info.get('model_fingerprint')})"
                     f" != {lm.name!r} ({lm.fingerprint})")
    if not diffs:
        return model
    if lm is not None:
        arch = ModelArch.from_model(lm)
    elif model.info.get("arch"):
        arch = ModelArch.from_dict(model.info["arch"])
    elif model.roofline is not None:
        arch = model.roofline.arch
    else:
        raise PredictorFileError(f"{path} was profiled elsewhere and records no model shapes; "
                                 "pass lm= to build the Roofline fallback")
    warnings.warn(DeviceMismatchWarning(
        f"latency model {path} was profiled on another device or model ({'; '.join(diffs)}): "
        f"its predictions do not apply here. Falling back to the Roofline model with this "
        f"device's measured peaks (expect several times larger errors). Re-run `sparkv profile "
        f"--train {path}` on this device."), stacklevel=2)
    roof = Roofline.measure(arch, dev, threads, quick=quick_roofline,
                            dtype=lm.dtype if lm is not None else None)
    roof.density_prior = model.density_prior
    return roof


def _fit_density_prior(samples: Sequence[Any]) -> tuple[float, float] | None:
    """Least squares ``log density = a + b log causal_blocks`` (None with < 3 samples)."""
    rows = [(s.causal_blocks, s.density) for s in samples if s.causal_blocks > 0
            and s.density > 0]
    if len(rows) < 3:
        return None
    c = np.log(np.array([r[0] for r in rows], dtype=np.float64))
    dens = np.log(np.array([r[1] for r in rows], dtype=np.float64))
    if np.ptp(c) == 0:
        return float(dens.mean()), 0.0
    b, a = np.polyfit(c, dens, 1)
    return float(a), float(b)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
