"""The context service's policies (:class:`ServiceConfig`): one set of fields makes LLMS, its
ablations and every baseline of the context-switching benchmark with the same code.

* ``compression`` (:mod:`sparkv.device.levels`): ``tolerance`` (int8 / k8v4 / int4 / int2 by
  density, ``ratio``, ``fp_fraction``, ``fp_protect``), ``int8`` or ``fp``;
* ``eviction`` (:mod:`sparkv.device.budget`): ``lctru``, ``lru`` (chunks) or ``whole``
  (whole contexts);
* ``put_away``: how evicted KV leaves memory and comes back: ``chunks`` (token chunk records,
  :class:`~sparkv.device.chunked.ChunkKeeper`), ``kill`` (freed, recomputed from the tokens: LMK)
  or ``file`` (one file per context: whole-context swapping), the last two
  :class:`~sparkv.device.baselines.WholeKeeper`;
* ``pipeline`` (IO-recompute pipeline, or read everything first), ``aot`` (ahead-of-time
  swap-out, or write at reclaim), ``keep_working`` (keep a call's working memory while it fits);
* ``contiguous`` (the swap layout of ``put_away="chunks"``, :mod:`sparkv.device.flashio`): the
  token chunks one write takes as one segment file, read in runs of adjacent records (LLMS and
  its ablations), or one file per token chunk, one read each (VLLM-S / VLLM-SQ: vLLM swaps block
  by block).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sparkv.device.budget import EVICTION_POLICIES, WholeContextLRU
from sparkv.device.waitline import RESERVATION_ORDERS

PUT_AWAY = ("chunks", "kill", "file")
#: the ratio without a quality verdict: every unprotected chunk at int8 (docs/device-service.md)
FALLBACK_RATIO = 1.0


@dataclass
class ServiceConfig:
    """The service's policies (module docstring)."""

    name: str = "llms"
    chunk_tokens: int = 16
    compression: str = "tolerance"     # tolerance | int8 | fp
    ratio: float | None = None         # global ratio of bytes to int8 (tolerance only); None:
    #                                    the model's quality table's (:func:`resolved_ratio`)
    fp_fraction: float = 0.0           # the densest fraction of chunks kept at fp (tolerance)
    fp_protect: int = 1                # the first chunks (attention sinks) kept at fp, outside
    #                                    the ratio (tolerance only)
    pipeline: bool = True              # IO-recompute pipeline; else read every missing chunk first
    aot: bool = True                   # ahead-of-time swap-out when a call returns
    eviction: str = "lctru"            # lctru | lru | whole
    put_away: str = "chunks"           # chunks | kill | file
    keep_working: bool = True          # keep the last working memory (fp) while it fits: a call
    #                                    on a context still hot switches without a load
    contiguous: bool = True            # swap layout: one segment file per write, read in runs;
    #                                    else one file per token chunk
    hot_margin_tokens: int = 48        # spare slots a kept working memory gets beyond the call's
    io_threads: int = 4
    max_context_tokens: int = 0        # 0: the model's positions
    max_new_tokens: int = 512
    journal: bool = True
    measure_io: bool = True            # measure the per-file read latency once per swap dir
    host_tier_bytes: int = 0           # host RAM for copies of flash records, between the
    #                                    device's memory and flash (sparkv.device.hosttier);
    #                                    0: none
    turn_cache_bytes: int | None = None  # host RAM for the KV of recent turns after a
    #                                    context, reused by the next call of the same
    #                                    conversation (sparkv.device.tails); 0: none; None:
    #                                    2,048 tokens of the model's KV, at least 64 MB
    overlap_turns: bool = True         # a call's turn runs without the model lock (calls on
    #                                    other contexts switch in and answer meanwhile); False:
    #                                    one call at a time, whole (for comparison)
    shared_reads: bool = True          # calls that leave their context as it was read one
    #                                    working memory at once (sparkv.device.readturns; with
    #                                    overlap_turns); False: they take turns (for comparison)
    reservation_order: str = "fcfs"    # calls waiting for memory running turns hold:
    #                                    first come first served (sparkv.device.waitline), or
    #                                    "retry" (whoever fits first at a turn's end: for
    #                                    comparison)

    def __post_init__(self) -> None:
        if self.compression not in ("tolerance", "int8", "fp"):
            raise ValueError(f"compression must be tolerance, int8 or fp, not {self.compression!r}")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {sorted(EVICTION_POLICIES)}, "
                             f"not {self.eviction!r}")
        if self.put_away not in PUT_AWAY:
            raise ValueError(f"put_away must be one of {PUT_AWAY}, not {self.put_away!r}")
        if (self.put_away == "chunks") == (self.eviction == WholeContextLRU.name):
            raise ValueError("whole-context eviction goes with put_away kill or file, chunk "
                             "eviction with put_away chunks")
        if self.put_away != "chunks" and (self.compression != "fp" or self.journal):
            raise ValueError("whole contexts are kept at fp and not journaled")
        if self.ratio is not None and not 0.25 <= self.ratio <= 4.0:
            raise ValueError("ratio must be in [0.25, 4] (bytes relative to int8)")
        if not 0.0 <= self.fp_fraction <= 1.0 or self.fp_protect < 0:
            raise ValueError("fp_fraction must be in [0, 1] and fp_protect >= 0")
        if self.reservation_order not in RESERVATION_ORDERS:
            raise ValueError(f"reservation_order must be one of {sorted(RESERVATION_ORDERS)}, "
                             f"not {self.reservation_order!r}")
        if self.chunk_tokens < 16:
            raise ValueError("chunk_tokens must be >= 16")
        if self.host_tier_bytes < 0 or (self.turn_cache_bytes or 0) < 0:
            raise ValueError("host_tier_bytes and turn_cache_bytes must be >= 0")

    # ---- the systems of the benchmark --------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **kw: Any) -> "ServiceConfig":
        """``llms``, ``llms-no-compression``, ``llms-no-pipeline``, ``llms-no-lifecycle``,
        ``vllm-s`` (16-token chunks swapped one file each, fp, LRU, written at reclaim, no
        recompute), ``vllm-sq`` (the same at int8), ``lmk`` (whole fp contexts, killed under
        pressure and recomputed) and ``swap`` (whole fp contexts swapped as one file each)."""
        chunk_swap = {"pipeline": False, "aot": False, "eviction": "lru", "keep_working": False,
                      "contiguous": False}
        whole = {"compression": "fp", "aot": False, "eviction": "whole", "keep_working": False,
                 "journal": False}
        presets: dict[str, dict[str, Any]] = {
            "llms": {},
            "llms-no-compression": {"compression": "int8"},
            "llms-no-pipeline": {"pipeline": False},
            "llms-no-lifecycle": {"aot": False, "eviction": "lru", "keep_working": False},
            "vllm-s": {"compression": "fp", **chunk_swap},
            "vllm-sq": {"compression": "int8", **chunk_swap},
            "lmk": {"put_away": "kill", **whole},
            "swap": {"put_away": "file", **whole},
        }
        if name not in presets:
            raise ValueError(f"unknown preset {name!r}; known: {sorted(presets)}")
        return cls(name=name, **{**presets[name], **kw})


def longest_context(config: ServiceConfig, model_positions: int | None) -> int:
    """The most tokens a context may hold: ``config.max_context_tokens``, else the model's
    positions, else 32768."""
    return config.max_context_tokens or model_positions or (1 << 15)


def resolved_ratio(config: ServiceConfig, model_fingerprint: str,
                   table: str | None = None) -> float:
    """The tolerance ratio a service runs: ``config.ratio`` when set; else (``None``, the
    default) the smallest ratio whose verdict passes in the model's quality table (its
    ``device`` section, every larger measured ratio passing too:
    :func:`sparkv.predictor.quality.device_ratio_for`, judged by task accuracy and
    teacher-forced agreement against unlimited memory, docs/quality.md; only entries measured
    with the planner's :data:`~sparkv.device.density.LADDER`), else
    :data:`FALLBACK_RATIO` (1.0: every chunk at int8). ``table``: a table path (default: the
    model's usable table). Only ``tolerance`` compression has a ratio; the others get 1.0."""
    if config.ratio is not None:
        return float(config.ratio)
    if config.compression != "tolerance":
        return FALLBACK_RATIO
    from sparkv.device.density import OLD_LADDER, ladder_key
    from sparkv.predictor.quality import device_ratio_for

    # entries measured with another ladder judged other mixes: they do not count
    return float(device_ratio_for(model_fingerprint, fallback=FALLBACK_RATIO, path=table,
                                  ladder=ladder_key(), old_ladder=ladder_key(OLD_LADDER)))
