"""A step-cost model measured on the model's own layer steps, in a second: the fallback when no
latency profile of this device, thread count and compute configuration exists.

The Roofline fallback it replaces predicted ``max(W / P, Q / B)`` with ``P`` from a synthetic
512^3 (``quick``) fp32 matmul measured the moment the edge first planned. That rate is not the
rate of a layer step (other shapes, the norms, RoPE, softmax and the attention kernel, another
configuration's kernels: ``int4`` dequantizes, ``mixed`` runs bf16), and whatever else the CPU
was doing at that moment went into it: the local prefill of SmolLM2 at 4K was predicted at
30.4 s while it took 10.77 s (2K: 10.2 s against 3.2 s; docs/predictor.md, "The local prefill's
miss").

:meth:`MeasuredSteps.measure` times the model's own work instead, in its configuration, on its
device and thread count, and predicts

    ms = c_step + c_token * n + c_pair * pairs

per step (``n`` query tokens, ``pairs`` the (query, key) pairs attention computes: every causally
visible pair for dense, ``s * 128 * 64`` for block-sparse). ``c_pair`` comes from the dense
attention kernel of one chunk after a long prefix (4K keys: what grows with the context; on a
GPU the slope between 4K and 32K keys, the call's fixed cost left in the steps' ``c_step``);
``c_step`` and ``c_token`` from real steps, layers 0-1 of a 768-token context cut at 128 and 256
tokens (the profiler's shortcut: a layer's cost depends on its shapes, not its depth), less
their attention, by least squares. The projection-only last layer is timed too, from random
hidden states over the first token chunk of each size (until session 64 it was priced at
``c_token * n`` times its share of a step's matmul FLOPs, 6% for SmolLM2, while its norm, RoPE
and cache write, memory work, made it 3-10x that). Each shape is timed a few times and the
median kept: the model's own cost on this CPU under the load of the moment, in about a second (the edge session's online correction, ``compute_scale``, follows
later changes of the load). For block-sparse steps whose active blocks are unknown the
density prior applies: the mean of the model's calibrated per-layer densities when stored
(:mod:`sparkv.runtime.thresholds`), all causal blocks up to ``dense_below`` keys.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import numpy as np

from sparkv.predictor.cost import StepCostModel
from sparkv.predictor.features import K_BLOCK, Q_BLOCK, StepFeatures, visible_pairs

#: calibration: a context of CAL_TOKENS cut at each of CAL_CHUNKS tokens (two sizes separate the
#: per-step and per-token costs), each step timed CAL_REPEATS times; the attention kernel timed
#: over CAL_KEYS keys (a long prefix: attention's per-pair cost is what grows with the context)
CAL_TOKENS = 768
CAL_CHUNKS = (128, 256)
CAL_REPEATS = 3
CAL_KEYS = 4096
#: the attention kernel is timed again over this many times CAL_KEYS keys, and ``c_pair`` is the
#: slope between the two: a call's fixed cost (the dispatch; on a GPU the launches, most of a
#: 256-query call at 4K keys) is a per-step cost, which the steps' fit keeps in ``c_step``. Per
#: pair it made a GPU's long steps look dear: the H200 predicted a 32K local prefill (Llama-3.2-1B
#: shape) at 1.45 s against 0.63 s measured, the miss growing with the keys (run 3, docs/gpu.md)
PAIR_KEYS_FACTOR = {"cuda": 8}
#: elsewhere one call, its mean per pair: on this CPU a call's fixed cost is ~5% of a 4K call
#: (1.2 of 22 ms, SmolLM2) and the per-pair cost grows with the keys (caches); the slope between
#: 4K and 8K predicted the 4K local prefill at 10.9 s, the mean at 11.8, against 12.4 measured
PAIR_KEYS_FACTOR_DEFAULT = 1


@dataclass
class MeasuredSteps(StepCostModel):
    """``ms = c_step + c_token * n + c_pair * pairs`` per attention step, ``p_step + p_token * n``
    per projection-only step, at most ``c_step + c_token * n`` (a part of a step's dense work;
    module docstring).

    Attributes:
        coef: ``(c_step, c_token, c_pair)`` in ms, ms per token, ms per (query, key) pair.
        projection: ``(p_step, p_token)``.
        density: the share of causally visible blocks block-sparse computes past
            ``dense_below`` keys (``None``: all of them).
        dense_below: keys at or under which block-sparse runs dense.
        info: how it was measured (threads, configuration, steps, seconds, fit error).
        span_tokens: on a device whose engine runs a layer's token chunks as spans of up to
            this many tokens (:class:`~sparkv.scheduler.rules.CommitSpans`, a GPU), a step pays
            its share ``n / span_tokens`` of ``c_step``, the per-call cost the span pays once
            (``None``: every step pays all of it; :meth:`with_spans`).
    """

    coef: tuple[float, float, float]
    projection: tuple[float, float]
    density: float | None = None
    dense_below: int = 2048
    info: dict[str, Any] | None = None
    span_tokens: int | None = None
    name = "measured"

    def with_spans(self, span_tokens: int | None) -> "MeasuredSteps":
        """The same model for an engine that runs spans of up to ``span_tokens`` tokens."""
        return replace(self, span_tokens=span_tokens)

    def predict_ms(self, f: StepFeatures) -> np.ndarray:
        dense = visible_pairs(f.query_tokens, f.key_tokens)
        pairs = np.where(f.sparse > 0,
                         np.minimum(f.active_blocks * Q_BLOCK * K_BLOCK, dense), dense)
        c0, c1, c2 = self.coef
        fixed = (c0 * np.minimum(f.query_tokens / self.span_tokens, 1.0) if self.span_tokens
                 else c0)
        dense_part = fixed + c1 * f.query_tokens
        att = dense_part + c2 * pairs
        # the projection-only layer does a part of a full step's dense work: never more than it
        # (its own timing, a few repeats on a busy machine, can come out above)
        proj = np.minimum(self.projection[0] + self.projection[1] * f.query_tokens, dense_part)
        return np.maximum(np.where(f.projection > 0, proj, att), 1e-3)

    def expected_active_blocks(self, query_tokens: np.ndarray, key_tokens: np.ndarray
                               ) -> np.ndarray:
        """All causal blocks at or under ``dense_below`` keys; the stored density past it."""
        causal = super().expected_active_blocks(query_tokens, key_tokens)
        if self.density is None:
            return causal
        k = np.asarray(key_tokens, dtype=np.float64)
        return np.where(k <= self.dense_below, causal, np.maximum(1.0, self.density * causal))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def measure(cls, lm: Any, tokens: int = CAL_TOKENS, chunk_sizes: Sequence[int] = CAL_CHUNKS,
                repeats: int = CAL_REPEATS, attention_keys: int = CAL_KEYS) -> "MeasuredSteps":
        """Measures ``lm`` as it is (configuration, device, torch's current threads): the dense
        attention kernel of one chunk after ``attention_keys - chunk`` keys gives ``c_pair``;
        the real steps ``(t, 0)``, ``(t, 1)`` of a ``tokens``-token context cut at each of
        ``chunk_sizes``, less their attention, give ``c_step`` and ``c_token``."""
        import torch

        from sparkv.runtime import LayerStepper, sample_context_ids
        from sparkv.layout import StepId

        start = time.perf_counter()
        c_pair, pair_call_ms = _pair_slope(lm, max(chunk_sizes), attention_keys, repeats)
        n_ctx = min(tokens, lm.max_positions or tokens)
        ids = sample_context_ids(lm, n_ctx)
        times: dict[tuple[int, int], list[float]] = {}     # (n, keys) -> ms of each run
        for _, chunk in ((r, c) for r in range(repeats) for c in chunk_sizes):
            stepper = LayerStepper(lm, ids, chunk)
            g = stepper.geometry
            for t in range(g.num_token_chunks):
                for layer in range(min(2, g.num_layers - 1)):
                    ms = _step_ms(stepper, StepId(t, layer))
                    a, b = g.token_range(t)
                    times.setdefault((b - a, b), []).append(ms)
        rows = [(n, float(np.median(ms)) - c_pair * float(visible_pairs(n, k)))
                for (n, k), ms in times.items()]
        c_step, c_token = _fit_line(rows)
        projection = (_fit_line(_projection_rows(lm, ids, chunk_sizes, repeats))
                      if lm.config.num_hidden_layers > 1
                      else (0.0, c_token * _projection_share(lm)))
        model = cls((c_step, c_token, c_pair), projection, *_density(lm))
        model.info = {"threads": torch.get_num_threads(), "compute": _compute_name(lm),
                      "steps": sum(len(v) for v in times.values()), "context_tokens": n_ctx,
                      "chunk_sizes": list(chunk_sizes), "attention_keys": attention_keys,
                      "attention_call_ms": pair_call_ms,
                      "seconds": time.perf_counter() - start}
        return model


def _step_ms(stepper: Any, step: Any) -> float:
    """Milliseconds of one layer step: its own timing on a CPU; on a GPU the wall time until its
    kernels are done (a step's own timing there is the host's dispatch, which replayed CUDA
    graphs make a small part of the step: :mod:`sparkv.runtime.graphs`)."""
    import torch

    device = stepper.lm.device
    if device.type != "cuda":
        return float(stepper.run_step(step).seconds) * 1e3
    t0 = time.perf_counter()
    stepper.run_step(step)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def _projection_rows(lm: Any, ids: Sequence[int], chunk_sizes: Sequence[int], repeats: int
                     ) -> list[tuple[float, float]]:
    """``(n, ms)`` of the projection-only last layer over the first token chunk of each size,
    the median of ``repeats`` (from random hidden states: the layers below are not computed).
    Priced as a share of a step's matmul FLOPs it was predicted at 0.4-0.8 ms where it took
    2.4-4.5 (SmolLM2, 512 tokens, session 64): its norm, RoPE and cache write are memory work."""
    import torch

    from sparkv.runtime import LayerStepper

    last = int(lm.config.num_hidden_layers) - 1
    rows = []
    for chunk in chunk_sizes:
        stepper = LayerStepper(lm, ids[:chunk], chunk)
        x = torch.randn(1, chunk, int(lm.config.hidden_size),
                        generator=torch.Generator().manual_seed(0)).to(lm.device, lm.dtype)
        ms = _median_ms(lambda: stepper.calibrate_layer(x, 0, last), lm.device, repeats)
        rows.append((float(chunk), ms))
    return rows


def _median_ms(call: Any, device: Any, repeats: int) -> float:
    """The median milliseconds of ``repeats`` calls of ``call`` (under inference mode, until
    its kernels are done on a GPU), after one call that allocates."""
    import torch

    runs = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            runs.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(runs[1:]))


def _pair_slope(lm: Any, n: int, keys: int, repeats: int) -> tuple[float, float]:
    """``(c_pair, fixed_ms)``: the attention kernel's milliseconds per causally visible pair
    between ``keys`` and ``PAIR_KEYS_FACTOR`` times as many (its marginal cost), and what a
    call costs besides (the line's intercept). Noise that makes the slope negative or steeper
    than the long call's mean cost per pair gives that mean (the one-point measure); a device
    without a factor gets the one-point measure at ``keys`` (fixed cost 0)."""
    factor = PAIR_KEYS_FACTOR.get(lm.device.type, PAIR_KEYS_FACTOR_DEFAULT)
    if factor <= 1:
        return _pair_ms(lm, n, keys, repeats) / float(visible_pairs(n, keys)), 0.0
    short, long_ = (_pair_ms(lm, n, k, repeats) for k in (keys, keys * factor))
    p_short, p_long = float(visible_pairs(n, keys)), float(visible_pairs(n, keys * factor))
    mean = long_ / p_long
    slope = (long_ - short) / (p_long - p_short)
    c_pair = slope if 0.0 < slope <= mean else mean
    return c_pair, max(0.0, long_ - c_pair * p_long)


def _pair_ms(lm: Any, n: int, keys: int, repeats: int) -> float:
    """Milliseconds of the dense attention of ``n`` queries after ``keys - n`` keys, in the
    model's head shapes and activations' dtype, or its attention products' dtype where the
    configuration has one (``mixed-attn``: Q, K and V cast per call, as its prefill passes do);
    the median of ``repeats``, after one call that allocates. Timed in float32 for
    ``mixed-attn``, the pair cost was 2-2.5x the bf16 kernel's and a 2K step's prediction grew
    3.9 ms a token chunk where the step grew 1.5 (session 64)."""
    import torch

    from sparkv.runtime.attention import DenseAttention

    cfg = lm.config
    hq = int(cfg.num_attention_heads)
    hkv = int(getattr(cfg, "num_key_value_heads", None) or hq)
    d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // hq)
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(1, hq, n, d, generator=gen).to(lm.device, lm.dtype)
    k = torch.randn(1, hkv, keys, d, generator=gen).to(lm.device, lm.dtype)
    v = torch.randn(1, hkv, keys, d, generator=gen).to(lm.device, lm.dtype)
    backend = DenseAttention()
    dtype = getattr(getattr(lm, "compute", None), "attention", None) or lm.dtype
    return _median_ms(lambda: backend.attend(q.to(dtype), k.to(dtype), v.to(dtype), keys - n,
                                             d ** -0.5), lm.device, repeats)


def _fit_line(rows: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """``ms = c0 + c1 * n`` by least squares, both clipped at 0 (one distinct ``n``: a line
    through the origin)."""
    ns = np.array([r[0] for r in rows], dtype=np.float64)
    ys = np.array([r[1] for r in rows], dtype=np.float64)
    if len(set(ns.tolist())) < 2:
        return 0.0, float(max(np.sum(ys * ns) / np.sum(ns * ns), 0.0))
    c, *_ = np.linalg.lstsq(np.stack([np.ones_like(ns), ns], 1), ys, rcond=None)
    if c[0] < 0:
        return 0.0, float(max(np.sum(ys * ns) / np.sum(ns * ns), 0.0))
    return float(c[0]), float(max(c[1], 0.0))


def _compute_name(lm: Any) -> str:
    from sparkv.predictor.device import compute_name

    return compute_name(lm)


def _projection_share(lm: Any) -> float:
    """The projection-only step's matmul FLOPs per token (K and V projections) over a full
    step's (every projection and the MLP): its per-token cost relative to ``c_token``."""
    from sparkv.predictor.roofline import ModelArch

    a = ModelArch.from_model(lm)
    kv = 4.0 * a.hidden * a.kv_heads * a.head_dim
    full = (2.0 * a.hidden * a.heads * a.head_dim * 2 + kv + 6.0 * a.hidden * a.intermediate)
    return kv / full


def _density(lm: Any) -> tuple[float | None, int]:
    """The block-sparse density prior: the mean over layers of the model's calibrated densities
    (:mod:`sparkv.runtime.thresholds`) past ``SparsityConfig.dense_below`` keys; ``None`` (all
    causal blocks) without stored thresholds."""
    from sparkv.runtime.attention import SparsityConfig
    from sparkv.runtime.thresholds import load_thresholds

    below = int(SparsityConfig().dense_below)
    th = load_thresholds(getattr(lm, "base_fingerprint", lm.fingerprint))
    if th is None or not th.layers:
        return None, below
    return float(np.mean([lt.density for lt in th.layers])), below


__all__ = ["MeasuredSteps"]
