"""Profiles real layer steps on this device: the training data of the latency model.

Protocol (docs/predictor.md):

* For every induced load level (:class:`~sparkv.predictor.load.LoadGenerator`, in CPU cores' worth
  of busy background processes), the burners start, run ``ramp_seconds`` (1.5 s, longer than the
  1 s ``U`` window), and every combination of
  chunk size ``T`` x backend (dense, and block-sparse at each cdf threshold) x repeat is run in a
  shuffled order; then the burners stop (always: ``finally``, plus a hard lifetime bound).
* A combination is one :class:`~sparkv.runtime.LayerStepper` over a natural-text context of
  ``context_tokens`` tokens (repeat ``r`` starts ``r * 997`` tokens further into the sample text so
  that sparsity patterns differ). It runs the real steps ``(t, l)`` for every token chunk ``t`` and
  the first ``layers`` layers, token-major. These are exactly the steps those layers need: step
  ``(t, l)`` reads ``Y[l-1, t]`` and ``KV(t' < t, l)``, all produced by earlier steps of the same
  run, so nothing is injected or faked and every executed step is one sample. Deeper layers are not
  run: a layer's cost depends on its shapes and its own sparsity ``s`` (recorded per step), not on
  its depth, so a few layers give the full range of ``t`` and ``s`` at a fraction of the time.
* Each step is timed on the wall clock (CUDA synchronised before and after). ``U`` is read just
  before the step over the last second of step boundaries
  (:class:`~sparkv.predictor.device.UtilisationWindow`), as the engine can at run time; ``U`` during
  the step is recorded too, for diagnosis. ``s`` is the step's ``AttentionStats.active_blocks``
  (mean over query heads).
* The last layer's projection-only step (``t_proj``) is reachable only through every layer below
  it. When the profiled layers include the last layer (tiny test models) those real steps are
  recorded; otherwise the same operations as :meth:`LayerStepper.run_step` performs for the last
  layer (input norm, K and V projections, RoPE with cached tables, the copy into a KV buffer) are
  timed on a random hidden state of the chunk's shape (its values do not change the cost), for each
  chunk size, ``projection_repeats`` times per load level.

Results are a list of :class:`Sample`; :func:`save_samples` writes JSON (with the metadata: model,
device fingerprint, config) or CSV (metadata on a ``#`` first line).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from sparkv.predictor.device import (UtilisationMonitor, UtilisationWindow, compute_name,
                                     detect_monitor, device_fingerprint)
from sparkv.predictor.load import LoadGenerator

if TYPE_CHECKING:
    from sparkv.runtime.attention import BlockSparseAttention, DenseAttention

SAMPLES_FORMAT = "sparkv-step-samples/1"


@dataclass
class Sample:
    """One timed layer step.

    Attributes:
        t: token chunk index.
        layer: decoder layer (0-based).
        kind: ``"attention"`` (``l < L-1``) or ``"projection"`` (the last layer's projection-only
            step).
        chunk_tokens: T of the context's chunking.
        query_tokens: n, tokens of this chunk (T except a ragged last chunk).
        prefix_tokens: ``t * T``, tokens before the chunk.
        key_tokens: ``prefix_tokens + query_tokens``, the keys attended over.
        active_blocks: s, computed 128x64 blocks per query head (mean over heads); the causal
            block count for dense attention; 0 for projection steps.
        causal_blocks: blocks dense attention computes.
        density: ``active_blocks / causal_blocks`` (1.0 for dense; 0 for projection steps).
        utilisation: U in [0, 1] over the second before the step started
            (:class:`~sparkv.predictor.device.UtilisationWindow`): what a prediction knows.
        ms: wall-clock milliseconds of the step.
        backend: ``"dense"`` or ``"block_sparse"``.
        cdf_threshold: the block-sparse mask's cdf threshold (None for dense).
        load: induced background load, in CPU cores' worth of busy work.
        threads: torch intra-op threads.
        cpu_share: this process's CPU seconds / wall seconds over the step (diagnostic).
        utilisation_source: which monitor measured U.
        device: torch device of the steps.
        repeat: repeat index (context offset).
        utilisation_during: U over the step itself (diagnostic: not known before the step).
    """

    t: int
    layer: int
    kind: str
    chunk_tokens: int
    query_tokens: int
    prefix_tokens: int
    key_tokens: int
    active_blocks: float
    causal_blocks: int
    density: float
    utilisation: float
    ms: float
    backend: str
    cdf_threshold: float | None
    load: float
    threads: int
    cpu_share: float
    utilisation_source: str
    device: str
    repeat: int = 0
    utilisation_during: float = 0.0


@dataclass
class ProfileConfig:
    """What to profile (defaults: the full run of ``sparkv bench predictor``).

    Attributes:
        context_tokens: N, tokens per profiled context (at most the model's positions).
        chunk_sizes: chunk sizes T.
        cdf_thresholds: block-sparse mask thresholds (each gives other active block counts s).
        dense: also profile the dense (SDPA) backend.
        loads: induced load levels, CPU cores' worth of busy background work (0 = none).
        layers: profile layers ``0 .. layers-1`` of every token chunk.
        repeats: contexts per combination (each at another offset into the text).
        projection_repeats: projection-only timings per chunk size and load level.
        threads: torch intra-op threads during profiling (1 avoids OpenMP spin-waits on a
            shared machine; the latency model is valid for this thread count only).
        ramp_seconds: wait after starting the burners (longer than the ``U`` window, so the
            first steps' ``U`` reads the new load only).
        max_load_seconds: hard lifetime bound of each load phase's burners.
        time_budget_s: if set, each load phase stops starting new combinations after its share
            (``time_budget_s / len(loads)``); the combinations are shuffled, so the ones left out
            are a random subset (counted in :meth:`Profiler.metadata` as ``skipped``).
        seed: order shuffling and the random ids of tokenizer-less models.
    """

    context_tokens: int = 4096
    chunk_sizes: tuple[int, ...] = (256, 512, 1024)
    cdf_thresholds: tuple[float, ...] = (0.8, 0.9, 0.95, 0.98)
    dense: bool = True
    loads: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0)
    layers: int = 2
    repeats: int = 1
    projection_repeats: int = 8
    threads: int = 1
    ramp_seconds: float = 1.5
    max_load_seconds: float = 600.0
    time_budget_s: float | None = None
    seed: int = 0

    @classmethod
    def quick(cls) -> "ProfileConfig":
        """A small run (well under a minute of steps for SmolLM2 on 2 cores)."""
        return cls(context_tokens=2048, chunk_sizes=(512, 1024), cdf_thresholds=(0.8, 0.95),
                   loads=(0.0, 1.0), layers=2, projection_repeats=4)

    def backends(self) -> list[tuple[str, float | None]]:
        out: list[tuple[str, float | None]] = [("dense", None)] if self.dense else []
        return out + [("block_sparse", float(c)) for c in self.cdf_thresholds]

    def planned_steps(self, num_layers: int) -> int:
        """Number of steps :meth:`Profiler.run` will time."""
        layers = min(self.layers, num_layers)
        per_ctx = sum(-(-self.context_tokens // T) for T in self.chunk_sizes) * layers
        proj = 0 if layers >= num_layers else len(self.chunk_sizes) * self.projection_repeats
        return len(self.loads) * (len(self.backends()) * self.repeats * per_ctx + proj)


class Profiler:
    """Times real layer steps of ``lm`` on its device (see the module docstring).

    Args:
        lm: a :class:`sparkv.runtime.LoadedModel`.
        config: what to profile.
        token_ids: the context's token ids (at least ``context_tokens + 997 * (repeats-1)``);
            default: the bundled sample text, or seeded random ids for a model without tokenizer.
        monitor: utilisation monitor (default :func:`detect_monitor` for the model's device).
        progress: show a tqdm progress bar.
        window_s: the history ``U`` is read over before each step.
    """

    def __init__(self, lm: Any, config: ProfileConfig | None = None,
                 token_ids: Sequence[int] | None = None,
                 monitor: UtilisationMonitor | None = None, progress: bool = True,
                 window_s: float = 1.0) -> None:
        self.lm = lm
        self.config = config or ProfileConfig()
        cfg = self.config
        if lm.max_positions and cfg.context_tokens > lm.max_positions:
            raise ValueError(f"context_tokens={cfg.context_tokens} exceeds the model's "
                             f"{lm.max_positions} positions")
        if not cfg.chunk_sizes or not cfg.loads or not cfg.backends() or cfg.layers < 1:
            raise ValueError("profile at least one chunk size, load level, backend and layer")
        self.device = str(lm.device)
        self.monitor = monitor or detect_monitor(self.device)
        self.window = UtilisationWindow(self.monitor, window_s)
        self.progress = progress
        need = cfg.context_tokens + 997 * (cfg.repeats - 1)
        if token_ids is None:
            if lm.tokenizer is not None:
                from sparkv.runtime import sample_context_ids

                token_ids = sample_context_ids(lm, need)
            else:
                rng = random.Random(cfg.seed)
                vocab = int(lm.config.vocab_size)
                token_ids = [rng.randrange(vocab) for _ in range(need)]
        if len(token_ids) < need:
            raise ValueError(f"need {need} token ids, got {len(token_ids)}")
        self.token_ids = list(token_ids)
        self.fingerprint: dict[str, Any] = {}
        self.elapsed_s = 0.0
        self.skipped: list[dict[str, Any]] = []

    # ---- metadata ----------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """Model, device fingerprint and config of this profile (for :func:`save_samples`)."""
        from sparkv.predictor.roofline import ModelArch

        return {
            "model": self.lm.name,
            "model_fingerprint": self.lm.fingerprint,
            "arch": ModelArch.from_model(self.lm).to_dict(),
            "num_layers": int(self.lm.config.num_hidden_layers),
            "device": self.device,
            "fingerprint": self.fingerprint or device_fingerprint(
                self.device, self.config.threads, compute_name(self.lm)),
            "utilisation_source": self.monitor.source,
            "config": asdict(self.config),
            "elapsed_s": self.elapsed_s,
            "skipped": self.skipped,
        }

    # ---- running -----------------------------------------------------------------------------
    def run(self) -> list[Sample]:
        """Profiles every combination; returns the samples (in execution order)."""
        import torch
        from sparkv.logs import progress_bar

        cfg = self.config
        old_threads = torch.get_num_threads()
        torch.set_num_threads(cfg.threads)
        self.fingerprint = device_fingerprint(self.device, cfg.threads, compute_name(self.lm))
        num_layers = int(self.lm.config.num_hidden_layers)
        bar = progress_bar(total=cfg.planned_steps(num_layers), desc="profiling layer steps",
                   unit="step", disable=not self.progress)
        rng = random.Random(cfg.seed)
        samples: list[Sample] = []
        self.skipped = []
        start = time.perf_counter()
        phase_budget = (cfg.time_budget_s / len(cfg.loads)) if cfg.time_budget_s else None
        try:
            self._warm_up()
            for load in cfg.loads:
                combos = [(T, b, c, r) for T in cfg.chunk_sizes for b, c in cfg.backends()
                          for r in range(cfg.repeats)]
                rng.shuffle(combos)
                with LoadGenerator(load, cfg.max_load_seconds):
                    phase_start = time.perf_counter()
                    time.sleep(cfg.ramp_seconds)  # also lets the previous level's load fade
                    self.window.reset()  # the sleep is no window to read U over: probe instead
                    for T, backend, cdf, rep in combos:
                        if phase_budget and time.perf_counter() - phase_start > phase_budget:
                            self.skipped.append({"load": load, "chunk_tokens": T,
                                                 "backend": backend, "cdf_threshold": cdf,
                                                 "repeat": rep})
                            bar.update(-(-cfg.context_tokens // T) * min(cfg.layers, num_layers))
                            continue
                        bar.set_postfix(load=load, T=T, backend=backend if cdf is None
                                        else f"cdf{cdf}")
                        samples.extend(self._profile_context(T, backend, cdf, rep, load, bar))
                    if min(cfg.layers, num_layers) < num_layers:
                        for T in cfg.chunk_sizes:
                            samples.extend(self._profile_projection(T, load, bar))
        finally:
            bar.close()
            torch.set_num_threads(old_threads)
            self.elapsed_s = time.perf_counter() - start
        return samples

    def _backend(self, backend: str, cdf: float | None
                 ) -> DenseAttention | BlockSparseAttention:
        from sparkv.runtime import BlockSparseAttention, DenseAttention, SparsityConfig

        if backend == "dense":
            return DenseAttention()
        if cdf is None:
            raise ValueError(f"the {backend} backend needs a CDF threshold")
        return BlockSparseAttention(SparsityConfig(cdf_threshold=float(cdf)))

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def _warm_up(self) -> None:
        """One untimed small run per backend kind (first calls allocate and pick kernels)."""
        from sparkv.layout import StepId
        from sparkv.runtime import LayerStepper

        T = min(self.config.chunk_sizes)
        ids = self.token_ids[: min(len(self.token_ids), 2 * T)]
        for backend, cdf in (("dense", None), ("block_sparse", 0.9)):
            stepper = LayerStepper(self.lm, ids, T, self._backend(backend, cdf))
            for t in range(stepper.geometry.num_token_chunks):
                stepper.run_step(StepId(t, 0))

    def _profile_context(self, T: int, backend: str, cdf: float | None, rep: int, load: float,
                         bar: Any) -> list[Sample]:
        from sparkv.layout import StepId
        from sparkv.runtime import LayerStepper

        cfg = self.config
        offset = 997 * rep
        ids = self.token_ids[offset: offset + cfg.context_tokens]
        stepper = LayerStepper(self.lm, ids, T, self._backend(backend, cdf))
        geo = stepper.geometry
        layers = min(cfg.layers, geo.num_layers)
        out = []
        for t in range(geo.num_token_chunks):
            t0, t1 = geo.token_range(t)
            for layer in range(layers):
                self._sync()
                u_before = self.window.read()
                mark = self.monitor.snapshot()
                self.window.tick()
                cpu0, wall0 = time.process_time(), time.perf_counter()
                res = stepper.run_step(StepId(t, layer))
                self._sync()
                wall = time.perf_counter() - wall0
                cpu = time.process_time() - cpu0
                u = self.monitor.since(mark)
                if res.stats is None:  # the last layer: projection-only
                    kind, s, causal, density = "projection", 0.0, 0, 0.0
                else:
                    kind = "attention"
                    s = float(res.stats.active_blocks.float().mean())
                    causal = int(res.stats.causal_blocks)
                    density = float(res.stats.density)
                out.append(Sample(t, layer, kind, T, t1 - t0, t0, t1, s, causal, density,
                                  u_before, wall * 1e3, backend, cdf, load, cfg.threads,
                                  cpu / wall if wall > 0 else 0.0, self.monitor.source,
                                  self.device, rep, u))
                bar.update(1)
        return out

    def _profile_projection(self, T: int, load: float, bar: Any) -> list[Sample]:
        """The last layer's projection-only step on a random hidden state of T tokens."""
        import torch

        from sparkv.runtime.fastops import apply_rope

        cfg = self.config
        lm = self.lm
        layer = lm.decoder.layers[-1]
        attn = layer.self_attn
        n = min(T, cfg.context_tokens)
        d = int(getattr(lm.config, "head_dim", None) or
                lm.config.hidden_size // lm.config.num_attention_heads)
        x = torch.randn(1, n, int(lm.config.hidden_size), dtype=lm.dtype, device=lm.device)
        kv_heads = int(getattr(lm.config, "num_key_value_heads", None) or
                       lm.config.num_attention_heads)
        buf_k = torch.zeros(1, kv_heads, n, d, dtype=lm.dtype, device=lm.device)
        buf_v = torch.zeros_like(buf_k)
        with torch.inference_mode():
            cos, sin = lm.decoder.rotary_emb(x, torch.arange(n, device=lm.device).unsqueeze(0))
        out = []
        for _ in range(cfg.projection_repeats):
            self._sync()
            u_before = self.window.read()
            mark = self.monitor.snapshot()
            self.window.tick()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            with torch.inference_mode():
                h = layer.input_layernorm(x)
                k = attn.k_proj(h).view(1, n, -1, d)
                v = attn.v_proj(h).view(1, n, -1, d).transpose(1, 2)
                if getattr(attn, "k_norm", None) is not None:
                    k = attn.k_norm(k)
                k = apply_rope(k.transpose(1, 2), cos, sin)
                buf_k.copy_(k)
                buf_v.copy_(v)
            self._sync()
            wall = time.perf_counter() - wall0
            cpu = time.process_time() - cpu0
            u = self.monitor.since(mark)
            out.append(Sample(0, lm.config.num_hidden_layers - 1, "projection", T, n, 0, n, 0.0,
                              0, 0.0, u_before, wall * 1e3, "none", None, load, cfg.threads,
                              cpu / wall if wall > 0 else 0.0, self.monitor.source, self.device,
                              0, u))
            bar.update(1)
        return out


# ---- files ---------------------------------------------------------------------------------------
_FIELDS = [f.name for f in dataclasses.fields(Sample)]


def save_samples(path: str | os.PathLike[str], samples: Sequence[Sample],
                 metadata: dict[str, Any] | None = None) -> Path:
    """Writes samples as JSON (``{"format", "meta", "samples": [...]}``) or, for a ``.csv`` path,
    CSV with a header row (metadata as JSON on a first ``# meta:`` line). Atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = metadata or {}
    if path.suffix.lower() == ".csv":
        buf = io.StringIO()
        buf.write("# meta: " + json.dumps(meta) + "\n")
        writer = csv.DictWriter(buf, fieldnames=_FIELDS)
        writer.writeheader()
        for s in samples:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(s).items()})
        text = buf.getvalue()
    else:
        text = json.dumps({"format": SAMPLES_FORMAT, "meta": meta,
                           "samples": [asdict(s) for s in samples]}, indent=1) + "\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def load_samples(path: str | os.PathLike[str]) -> tuple[list[Sample], dict[str, Any]]:
    """Reads what :func:`save_samples` wrote; returns ``(samples, metadata)``."""
    path = Path(path)
    text = path.read_text()
    if path.suffix.lower() == ".csv":
        meta: dict[str, Any] = {}
        lines = text.splitlines(keepends=True)
        if lines and lines[0].startswith("# meta:"):
            meta = json.loads(lines[0][len("# meta:"):])
            lines = lines[1:]
        types = {f.name: f.type for f in dataclasses.fields(Sample)}
        samples = [Sample(**{k: _parse(types[k], v) for k, v in row.items()})
                   for row in csv.DictReader(lines)]
        return samples, meta
    doc = json.loads(text)
    if doc.get("format") != SAMPLES_FORMAT:
        raise ValueError(f"{path} is not a sparkv samples file (format {doc.get('format')!r})")
    return [Sample(**row) for row in doc["samples"]], doc.get("meta", {})


def _parse(kind: Any, value: str) -> Any:
    kind = str(kind)
    if value == "" and "None" in kind:
        return None
    if kind.startswith("int"):
        return int(value)
    if kind.startswith("float"):
        return float(value)
    return value


__all__ = ["Sample", "ProfileConfig", "Profiler", "save_samples", "load_samples"]
