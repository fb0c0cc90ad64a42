"""The IO-recompute split (LLMS eq. 4): which missing token chunks to read and which to recompute.

    pipelineDelay = max( T_fill + T_re(x),  T_IO(files, bytes of the chunks read) )

``T_re(x)`` is the recomputation of ``x`` token chunks through every layer over a context of
``N`` tokens: the predictor's step cost (:mod:`sparkv.predictor`: the profiled
:class:`~sparkv.predictor.model.LatencyModel` when ``sparkv profile`` has been run on this device,
else a :class:`~sparkv.predictor.roofline.Roofline` from measured peaks) of a dense step of
``16 x`` queries over ``N`` keys, times ``L`` layers, times a correction the service learns from
the loads it times (the ratio measured / predicted, as the edge session's priors do).
``T_IO`` is :class:`~sparkv.device.flashio.IOProfile` (flash profile bandwidth + per-read
latency). ``T_fill`` (dequantizing the resident chunks into the working memory, on the compute
thread) is learned per chunk from measured loads.

A swapped-out token chunk is one record (every layer, :mod:`sparkv.device.flashio`); ``T_IO``
counts reads, not chunks: records adjacent in a segment file are read with one request (up to a
few MiB), a chunk file with one of its own. Each missing chunk says whether it starts a read or
extends the read of the chunk before it; the chunks read are a suffix of the missing ones, whose
first always starts a read. The planner recomputes the **earliest** missing chunks first: a
recomputed chunk's queries attend over every earlier position, so recomputing a prefix of the
missing chunks needs nothing that is being read, and the reads of the later chunks overlap the
whole recomputation (the loader waits only for reads earlier than a recomputed chunk: absent
chunks, which must be recomputed whatever the plan, can force that). It evaluates every count
``x`` at once (one vectorised predictor call), so planning costs well under a millisecond.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from sparkv.device.flashio import IOProfile

if TYPE_CHECKING:
    import torch

    from sparkv.predictor.cost import StepCostModel
    from sparkv.runtime.model import LoadedModel

_COST_MODELS: dict[tuple[str, torch.dtype, int], StepCostModel] = {}


def recompute_cost_model(lm: LoadedModel) -> StepCostModel:
    """This device's step-cost model (the same choice as the edge's ``device_cost_model``: the
    profiled latency model if there is one for this model, else a measured roofline); made once
    per model and thread count."""
    import torch

    key = (lm.fingerprint, lm.dtype, torch.get_num_threads())
    if key not in _COST_MODELS:
        from sparkv.errors import SparkvError
        from sparkv.predictor.commands import default_model_path
        from sparkv.predictor.model import load_predictor
        from sparkv.predictor.roofline import ModelArch, Roofline

        model = None
        path = default_model_path(lm.fingerprint, lm.device, lm.dtype)
        if path.is_file():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    model = load_predictor(path, lm=lm)
            except SparkvError:
                model = None
        _COST_MODELS[key] = model or Roofline.measure(ModelArch.from_model(lm), str(lm.device),
                                                      quick=True, dtype=lm.dtype)
    return _COST_MODELS[key]


class RecomputeProfile:
    """``T_re(x)`` for ``x`` token chunks over ``N`` context tokens (module docstring)."""

    def __init__(self, cost_model: StepCostModel, num_layers: int, chunk_tokens: int) -> None:
        self.cost_model = cost_model
        self.num_layers = num_layers
        self.chunk_tokens = chunk_tokens
        self.scale = 1.0            # measured / predicted, learned
        self.fill_s_per_chunk = 2e-5  # dequantizing one (t, l) chunk into the working memory
        self.samples = 0

    def predicted(self, chunks: np.ndarray | Sequence[int], context_tokens: int) -> np.ndarray:
        """Unscaled seconds for each count in ``chunks``."""
        from sparkv.predictor.features import StepFeatures, causal_blocks

        x = np.asarray(chunks, dtype=np.float64)
        out = np.zeros_like(x)
        pos = x > 0
        if not pos.any():
            return out
        n = np.minimum(x[pos] * self.chunk_tokens, float(context_tokens))
        k = np.full_like(n, float(max(context_tokens, 1)))
        s = causal_blocks(n, k).astype(np.float64)
        f = StepFeatures(n, k, s, 0.0, 0.0, np.zeros_like(n), np.zeros_like(n))
        ms = np.asarray(self.cost_model.predict_ms(f), dtype=np.float64)
        out[pos] = ms / 1e3 * self.num_layers
        return out

    def seconds(self, chunks: np.ndarray | Sequence[int] | int, context_tokens: int) -> np.ndarray:
        arr = np.atleast_1d(np.asarray(chunks))
        return self.predicted(arr, context_tokens) * self.scale

    def learn(self, chunks: int, context_tokens: int, measured_s: float) -> None:
        """Folds a measured recomputation in (geometric mean of the ratio, recent ones weigh
        more)."""
        if chunks <= 0 or measured_s <= 0:
            return
        pred = float(self.predicted([chunks], context_tokens)[0])
        if pred <= 0 or not math.isfinite(pred):
            return
        r = measured_s / pred
        w = 0.5 if self.samples else 1.0
        self.scale = float(math.exp((1 - w) * math.log(self.scale) + w * math.log(r)))
        self.scale = min(max(self.scale, 1e-2), 1e3)
        self.samples += 1

    def learn_fill(self, chunks: int, measured_s: float) -> None:
        if chunks > 0 and measured_s > 0:
            self.fill_s_per_chunk = 0.5 * self.fill_s_per_chunk + 0.5 * measured_s / chunks


@dataclass
class MissingChunk:
    """A token chunk that is not (fully) resident."""

    t: int
    level: str
    reads: int          # reads it adds after the chunk before it (1; 0: it extends that read)
    nbytes: int         # its records' bytes
    readable: bool      # every non-resident layer has a clean flash copy
    chunks: int = 1     # its non-resident (layer, group) chunks (what filling W costs)
    held: bool = False  # its record is in the host tier (sparkv.device.hosttier): no flash read


@dataclass
class Split:
    """The plan of one load."""

    read: list[int]
    recompute: list[int]
    predicted_s: float
    io_s: float
    recompute_s: float
    fill_s: float


def plan_split(missing: Sequence[MissingChunk], context_tokens: int, resident_chunks: int,
               io: IOProfile, re: RecomputeProfile, *, allow_recompute: bool = True) -> Split:
    """Chooses the chunks to recompute (module docstring). ``resident_chunks`` counts the
    ``(t, l)`` chunks the compute thread dequantizes into the working memory."""
    forced = [m for m in missing if not m.readable]
    optional = sorted((m for m in missing if m.readable), key=lambda m: m.t)
    fill = re.fill_s_per_chunk * (resident_chunks + sum(m.chunks for m in optional))
    # x recomputed = forced + the first j optional ones, j = 0 .. len(optional)
    js = np.arange(len(optional) + 1) if allow_recompute else np.array([0])
    rest_reads = _suffix_reads(np.array([m.reads for m in optional], dtype=np.float64), js,
                               np.array([m.held for m in optional], dtype=bool))
    nbytes = np.array([m.nbytes for m in optional], dtype=np.float64)
    rest_bytes = nbytes.sum() - np.concatenate([[0.0], np.cumsum(nbytes)])[js]
    t_io = np.where(js < len(optional), rest_reads * io.per_file_s / max(1, io.threads)
                    + rest_bytes / io.read_Bps, 0.0)
    x = js + len(forced)
    t_re = re.seconds(x, context_tokens)
    chunks = np.array([m.chunks for m in optional], dtype=np.float64)
    fill_j = fill - re.fill_s_per_chunk * np.concatenate([[0.0], np.cumsum(chunks)])[js]
    total = np.maximum(t_re + fill_j, t_io)
    best = int(np.argmin(total))
    j = int(js[best])
    return Split(read=sorted(m.t for m in optional[j:]),
                 recompute=sorted([m.t for m in forced] + [m.t for m in optional[:j]]),
                 predicted_s=float(total[best]), io_s=float(t_io[best]),
                 recompute_s=float(t_re[best]), fill_s=float(fill_j[best]))


def _suffix_reads(reads: np.ndarray, js: np.ndarray, held: np.ndarray | None = None
                  ) -> np.ndarray:
    """The reads of the chunks ``j..`` for each ``j`` in ``js``: their own, plus one where the
    first of them extends a read of a chunk before it (recomputed now: its read starts
    anew). A chunk ``held`` in the host tier reads nothing from flash and extends nothing."""
    extends = np.concatenate([(reads == 0) & ~(held if held is not None
                                               else np.zeros(reads.shape, dtype=bool)),
                              [False]]).astype(np.float64)
    rest = reads.sum() - np.concatenate([[0.0], np.cumsum(reads)])[js]
    return rest + extends[js] * (js < len(reads))
