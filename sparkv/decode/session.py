"""Decoding with a KV policy: :class:`DecodeSession` (token by token) and :func:`generate`.

The prompt's last part (the question) is prefilled with full attention over the context's memory,
recording its queries; then, for a clustered policy, every layer's entries (context + question)
are clustered, placed on flash, and decoding runs over a :class:`~sparkv.decode.hf.DynaKVCache`.
``kv_policy="full"`` decodes over the memory itself (:class:`~sparkv.cache.SparkvCache`), exactly
as :func:`sparkv.runtime.greedy_generate` does.

The caller's memory is left as it was (the question's entries are truncated away); a clustered
policy keeps its own copy on flash, so the caller may drop (or swap out) the memory to realise the
RAM saving.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch

from sparkv.cache import AttentionView, ContextKV, SparkvCache
from sparkv.cache.attention import OneQuery
from sparkv.cache.hf import SparkvLayer
from sparkv.cache.layer import HeadEntries
from sparkv.decode.background import BackgroundBuild
from sparkv.decode.config import DecodeConfig, policy_config
from sparkv.decode.hf import DynaKVCache
from sparkv.decode.index import ClusterIndex
from sparkv.decode.policy import ClusteredKV
from sparkv.decode.stats import DecodeStats
from sparkv.decode.stream import StreamedKV
from sparkv.runtime.generate import GenerationResult, answer_text, context_memory
from sparkv.runtime.hfcache import model_call
from sparkv.runtime.kvcache import LayerKV
from sparkv.runtime.model import LoadedModel
from sparkv.runtime.sampling import Sampling, TokenChooser
from sparkv.runtime.stops import StopStrings


# ---- the question's prefill, recording its queries ---------------------------------------------------
@dataclass
class _RecordingView(AttentionView):
    sink: Any = None
    layer: int = 0

    def attend(self, q: torch.Tensor, scale: float | None, one_query: OneQuery | None = None
               ) -> torch.Tensor:
        self.sink[self.layer] = q[0].detach().clone()
        return super().attend(q, scale, one_query)


class _RecordingLayer(SparkvLayer):
    def __init__(self, memory: ContextKV, layer: int, sink: dict[int, torch.Tensor]) -> None:
        super().__init__(memory, layer)
        self.sink = sink

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        start = self.get_seq_length()
        k, v = super().update(key_states, value_states, *args, **kwargs)
        q_pos = torch.arange(start, start + int(key_states.shape[2]))
        if isinstance(k, AttentionView):
            view = _RecordingView(k.q_pos, heads=k.heads, sink=self.sink, layer=self.layer)
        else:
            view = _RecordingView(q_pos, k=k, v=v, sink=self.sink, layer=self.layer)
        return view, view


class _RecordingCache(SparkvCache):
    def __init__(self, memory: ContextKV) -> None:
        self.memory = memory
        self.queries: dict[int, torch.Tensor] = {}
        from transformers.cache_utils import Cache

        Cache.__init__(self, layers=[_RecordingLayer(memory, l, self.queries)
                                     for l in range(memory.geometry.num_layers)])


class _GrowingLayer(SparkvLayer):
    """A :class:`SparkvLayer` that also keeps the entries it appends (the full KV's steps while
    the clusters are built: they join the clusters at the switch)."""

    def __init__(self, memory: ContextKV, layer: int) -> None:
        super().__init__(memory, layer)
        self.appended: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[Any, Any]:
        self.appended.append((key_states[0].detach(), value_states[0].detach()))
        return super().update(key_states, value_states, *args, **kwargs)


class _GrowingCache(SparkvCache):
    def __init__(self, memory: ContextKV) -> None:
        self.memory = memory
        from transformers.cache_utils import Cache

        self.growing = [_GrowingLayer(memory, l) for l in range(memory.geometry.num_layers)]
        Cache.__init__(self, layers=list(self.growing))

    def appended(self, l: int) -> tuple[torch.Tensor, torch.Tensor] | None:  # noqa: E741
        """Layer ``l``'s appended entries ``[H, q, D]`` (K, V), in order; None: none."""
        parts = self.growing[l].appended
        if not parts:
            return None
        return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


def on_host(entries: Sequence[HeadEntries]) -> list[HeadEntries]:
    """A layer's entries in host memory: a clustered memory lives in RAM and on flash whatever
    the model's device (:mod:`sparkv.decode.hf`: on a GPU each step's new entries and queries
    come down, the attention output goes back up); on the CPU the same tensors."""
    return [HeadEntries(e.k.cpu(), e.v.cpu(), e.pos.cpu()) for e in entries]


class DecodeSession:
    """One decode over a context's KV under a policy.

    Args:
        lm: the model (``"sparkv"`` attention: :func:`sparkv.runtime.load_model` sets it).
        kv: the context's memory, or per-layer ``(K, V)`` ``[1, kv_heads, N, head_dim]``.
        context_len: N, or the context's token ids.
        kv_policy: a name of :data:`sparkv.decode.POLICIES`.
        config: base knobs (defaults: :class:`DecodeConfig`); ``overrides`` set any field.
        final_tokens: positions expected at the end (sizes a fractional ``ram_budget``; default
            the model's window).
        flash_dir: where the layer files go (default: the system temp directory).
        probe: measure recall and output error against full attention (costs time and keeps a
            full shadow copy of the KV - measurement only).

    ``prefill(question_ids)`` then ``feed(ids)`` (any number of tokens); each returns the last
    position's logits. ``stats()``; ``close()`` (also on ``with``).

    A clustered policy builds its clusters on a thread from the end of ``prefill``: the first
    ``full_steps`` feeds attend the full KV, the next one waits for the build and switches to the
    policy (:class:`~sparkv.decode.config.DecodeConfig`, ``full_steps``).
    """

    def __init__(self, lm: LoadedModel, kv: LayerKV | ContextKV, context_len: int | Sequence[int],
                 kv_policy: str = "dynakv", config: DecodeConfig | None = None, *,
                 final_tokens: int | None = None, flash_dir: str | Path | None = None,
                 probe: bool = False, **overrides: Any) -> None:
        self.lm = lm
        self.policy = kv_policy
        self.cfg = policy_config(kv_policy, config, **overrides)
        self.n = context_len if isinstance(context_len, int) else len(context_len)
        self.memory = context_memory(lm, kv, self.n)
        self.final_tokens = final_tokens or int(lm.max_positions)
        self.flash_dir, self.probe = flash_dir, probe
        self.cur = self.n
        self.kv: ClusteredKV | StreamedKV | None = None
        self.cache: Any = None
        self.building: BackgroundBuild | None = None    # until the switch
        self.failed: BaseException | None = None         # the build's error, raised at the switch
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.full_steps = 0          # feeds over the full KV while the clusters were built
        self.full_s = 0.0
        self.switch_s = 0.0          # the full steps' entries joining the clusters
        self.build_wait_s = 0.0      # the switch's wait for the build
        self.tokens_fed = 0
        self.forwards = 0
        self._closed = False

    # ---- steps -------------------------------------------------------------------------------------
    def _forward(self, ids: Sequence[int], logits_to_keep: int = 1) -> torch.Tensor:
        dev = self.lm.device
        t = torch.tensor([list(ids)], dtype=torch.long, device=dev)
        pos = torch.arange(self.cur, self.cur + t.shape[1], device=dev)
        out = model_call(self.lm.model, input_ids=t, cache=self.cache, position_ids=pos[None],
                         cache_position=pos, use_cache=True, logits_to_keep=logits_to_keep)
        self.cur += int(t.shape[1])
        return out.logits[0]

    @torch.inference_mode()
    def prefill(self, question_ids: Sequence[int]) -> torch.Tensor:
        """The question (the prompt's suffix, at least one token) with full attention over the
        context; builds the clustered memory. Returns the last position's logits."""
        if not question_ids:
            raise ValueError("the question needs at least one token")
        if self.cache is not None:
            raise RuntimeError("prefill() once per session")
        t0 = time.perf_counter()
        if self.cfg.update == "full":
            self.cache = SparkvCache(self.memory)
            logits = self._forward(question_ids)
        elif self.cfg.update == "stream":
            self.cache = SparkvCache(self.memory)
            try:
                logits = self._forward(question_ids)
                layers = self.memory.geometry.num_layers
                self.kv = StreamedKV([on_host(self.memory.layer_entries(l))
                                      for l in range(layers)],
                                     self.cfg, final_tokens=self.final_tokens,
                                     max_positions=int(self.lm.max_positions),
                                     flash_dir=self.flash_dir)
            finally:
                self.memory.truncate()
            self.cache = DynaKVCache(self.kv)
        else:
            rec = _RecordingCache(self.memory)
            self.cache = rec
            try:
                logits = self._forward(question_ids)
                layers = self.memory.geometry.num_layers
                entries = [on_host(self.memory.layer_entries(l)) for l in range(layers)]
                queries = [None if (q := rec.queries.get(l)) is None else q.cpu()
                           for l in range(layers)]
                kv = ClusteredKV(entries, queries, int(self.lm.config.num_attention_heads),
                                 self.cfg, final_tokens=self.final_tokens,
                                 max_positions=int(self.lm.max_positions),
                                 flash_dir=self.flash_dir, probe=self.probe, deferred=True)
            except BaseException:
                self.memory.truncate()
                raise
            # the clusters are built on a thread, off the first token's path; the full KV stays
            # in RAM (and is attended) until the switch (feed)
            self.building = BackgroundBuild(kv, entries, queries)
            self.cache = _GrowingCache(self.memory)
        self.prefill_s = time.perf_counter() - t0
        return logits[-1].float()

    def _switch(self) -> None:
        """Waits for the clusters, lets the entries of the full KV's steps join them, gives the
        memory back as it was and decodes over the clusters from now on."""
        building, cache = self.building, self.cache
        assert building is not None and isinstance(cache, _GrowingCache)
        self.building = None
        try:
            kv = building.wait()
        except BaseException as e:
            self.memory.truncate()
            self.failed = e
            raise
        self.kv = kv
        t0 = time.perf_counter()
        try:
            for l, layer in enumerate(kv.layers):  # noqa: E741
                new = cache.appended(l)
                if new is not None:
                    layer.absorb(new[0].cpu(), new[1].cpu())
        finally:
            self.memory.truncate()
        if any(layer.end != self.cur for layer in kv.layers):
            raise AssertionError("the clusters do not hold every position fed")
        self.cache = DynaKVCache(kv)
        self.switch_s = time.perf_counter() - t0
        self.build_wait_s = building.wait_s

    @torch.inference_mode()
    def feed(self, ids: Sequence[int]) -> torch.Tensor:
        """Feeds tokens (a decoded token, or a whole new turn); the last position's logits."""
        if self.cache is None:
            raise RuntimeError("prefill() first")
        if self.failed is not None:
            raise RuntimeError(f"the clusters' build failed ({self.failed!r}): this session "
                               "cannot decode further") from self.failed
        t0 = time.perf_counter()
        full = self.building is not None and self.forwards < self.cfg.full_steps
        if self.building is not None and not full:
            self._switch()
        logits = self._forward(ids)
        if self.kv is not None:
            self.kv.end_step(len(ids))
        dt = time.perf_counter() - t0
        self.decode_s += dt
        if full:
            self.full_steps += 1
            self.full_s += dt
        self.tokens_fed += len(ids)
        self.forwards += 1
        return logits[-1].float()

    def check(self) -> None:
        """The clustered memory's invariants (tests)."""
        if self.kv is not None:
            self.kv.check()

    # ---- results -----------------------------------------------------------------------------------
    def stats(self) -> DecodeStats:
        """The decode's counters so far (:class:`~sparkv.decode.stats.DecodeStats`), once every
        page write it queued on the I/O thread has finished (so the written bytes it reports
        are the bytes on flash, and a write that failed raises here)."""
        if self.kv is not None:
            self.kv.flush()
        st = DecodeStats(self.policy, steps=self.forwards, tokens=self.tokens_fed,
                         decode_s=max(0.0, self.decode_s - self.build_wait_s))
        st.budget = self.cfg.budget
        st.full_steps, st.full_s = self.full_steps, self.full_s
        st.build_wait_s, st.switch_s = self.build_wait_s, self.switch_s
        st.tokens_per_s = self.tokens_fed / st.decode_s if st.decode_s > 0 else 0.0
        if self.kv is None:
            mem = self.memory
            st.ram_peak_bytes = mem.nbytes
            st.ram = {"memory": mem.nbytes}
            st.recall, st.output_error = (1.0, 0.0) if self.probe else (None, None)
            st.hit_rate = st.ram_hit_rate = st.byte_hit_rate = 1.0
            return st
        kv, cnt = self.kv, self.kv.counters
        per = max(1, cnt.tokens)                  # the tokens fed since the switch
        st.decode_s = max(0.0, st.decode_s - cnt.probe_s)        # the probe is measurement only
        st.probe_s = cnt.probe_s
        st.tokens_per_s = self.tokens_fed / st.decode_s if st.decode_s > 0 else 0.0
        st.retrieved_entries, st.retrieved_bytes = cnt.retrieved_entries, cnt.retrieved_bytes
        st.retrieved_entries_per_token = cnt.retrieved_entries / per
        st.attended_entries_per_token = cnt.attended_entries / per
        if cnt.recall_n:
            st.recall = cnt.recall_sum / cnt.recall_n
            st.output_error = cnt.error_sum / cnt.recall_n
        _flash_stats(st, kv, per)
        _hit_stats(st, kv)
        _cluster_stats(st, kv)
        st.ram_budget, st.cache_capacity = kv.ram_budget, kv.cache_capacity
        st.ram = kv.ram_bytes()
        st.ram_peak_bytes = cnt.ram_peak
        st.index_bytes = kv.index_bytes()
        st.final_kv_bytes = kv.final_kv_bytes
        st.build_s = kv.build_s
        st.select_s, st.io_s = cnt.select_s, cnt.io_s
        st.attend_s, st.update_s = cnt.attend_s, cnt.update_s
        if isinstance(kv, ClusteredKV):
            st.upkeep_s, st.upkeep_wait_s = kv.upkeep.work_s, kv.upkeep.wait_s
        return st

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.building is not None:          # closed before the switch: the build stops
            self.building.stop()
            self.building = None
        if self.kv is not None:
            self.kv.close()
        else:
            self.memory.truncate()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- the stats of a clustered policy -----------------------------------------------------------------
def _flash_stats(st: DecodeStats, kv: ClusteredKV | StreamedKV, per: int) -> None:
    """Reads and writes on flash (``per``: the tokens fed, at least 1), by reason."""
    io = kv.io.snapshot()
    eb = kv.entry_bytes
    rb, ro, re = io["read_bytes"], io["read_ops"], io["read_entries"]
    st.flash_read_bytes = int(sum(rb.values()))
    st.flash_read_ops = int(sum(ro.values()))
    st.flash_read_bytes_per_token = st.flash_read_bytes / per
    st.flash_read_ops_per_token = st.flash_read_ops / per
    if st.flash_read_ops:
        st.mean_run_entries = st.flash_read_bytes / eb / st.flash_read_ops
        st.useful_read_fraction = sum(re.values()) * eb / max(1, st.flash_read_bytes)
    crit = ("retrieve", "split", "overflow", "relocate")      # everything but prefetch
    st.critical_read_ops_per_token = sum(ro.get(r, 0) for r in crit) / per
    st.critical_read_bytes_per_token = sum(rb.get(r, 0) for r in crit) / per
    st.prefetch_read_ops_per_token = ro.get("prefetch", 0) / per
    st.prefetch_read_bytes_per_token = rb.get("prefetch", 0) / per
    st.split_read_bytes = int(rb.get("split", 0) + rb.get("overflow", 0))
    st.split_read_ops = int(ro.get("split", 0) + ro.get("overflow", 0))
    wb, lb = io["write_bytes"], io["logical_bytes"]
    st.prefill_write_bytes = int(wb.get("prefill", 0))
    st.flash_write_bytes = int(sum(v for k, v in wb.items() if k != "prefill"))
    st.logical_write_bytes = int(sum(v for k, v in lb.items() if k != "prefill"))
    st.relocation_write_bytes = int(wb.get("relocate", 0) + wb.get("compact", 0))
    st.write_amplification = (st.flash_write_bytes / st.logical_write_bytes
                              if st.logical_write_bytes else 1.0)
    st.reads = {"ops": ro, "bytes": rb, "entries": re, "seconds": io["read_s"],
                "write_bytes": wb, "logical_bytes": lb}


def _hit_stats(st: DecodeStats, kv: ClusteredKV | StreamedKV) -> None:
    """Where the selected clusters came from (cache, prefetch, flash) and the cache's
    evictions."""
    cnt = kv.counters
    st.hits, st.prefetch_hits, st.misses = cnt.hits, cnt.prefetch_hits, cnt.misses
    total = cnt.hits + cnt.prefetch_hits + cnt.misses
    if total:
        st.hit_rate = cnt.hits / total
        st.ram_hit_rate = (cnt.hits + cnt.prefetch_hits) / total
        tb = cnt.hit_bytes + cnt.prefetch_hit_bytes + cnt.miss_bytes
        st.byte_hit_rate = cnt.hit_bytes / max(1, tb)
        st.hit_rate_ceiling = 1.0 - cnt.first_uses / total
    cs = kv.cache.stats()
    st.evictions, st.evicted_reserved = int(cs["evictions"]), int(cs["evicted_reserved"])


def _cluster_stats(st: DecodeStats, kv: ClusteredKV | StreamedKV) -> None:
    """Splits by kind, clusters, their mean size, buffered and flagged entries (every layer and
    KV head)."""
    splits: dict[str, int] = {"inline": 0, "delayed": 0, "overflow": 0, "eager": 0,
                              "local_batches": 0}
    clusters = sizes = buffered = peak = flagged = 0
    for layer in kv.layers:
        for idx in layer.indexes:
            for k in splits:
                splits[k] += getattr(idx.splits, k)
            clusters += idx.clusters
            buffered += idx.buffered
            peak = max(peak, idx.buffer_peak)
            if isinstance(idx, ClusterIndex):
                flagged += int((idx.flag[:idx.size] & idx.alive[:idx.size]).sum())
                sizes += int(idx.n[:idx.size][idx.alive[:idx.size]].sum())
    splits["prefill"] = kv.prefill_splits
    st.splits = splits
    st.clusters = clusters
    st.mean_cluster_size = sizes / clusters if clusters else 0.0
    st.buffered, st.buffer_peak, st.flagged = buffered, peak, flagged


class DecodeResult(NamedTuple):
    """What :func:`generate` returns: a :class:`~sparkv.generation.Generation` (``text``,
    ``tokens``, ``stats``) that still unpacks as ``result, stats = generate(...)``.

    ``stats`` (the shared shape's dict) is the generation's timings plus the policy's
    :class:`DecodeStats` under ``"decode"``; the records themselves are ``generation`` and
    ``decode_stats``."""

    generation: GenerationResult
    decode_stats: DecodeStats

    @property
    def text(self) -> str:
        return self.generation.text

    @property
    def tokens(self) -> list[int]:
        return self.generation.tokens

    @property
    def stats(self) -> dict[str, Any]:
        return {**self.generation.stats, "decode": self.decode_stats.to_dict()}


def generate(lm: LoadedModel, kv: LayerKV | ContextKV, context_len: int | Sequence[int],
             question_ids: Sequence[int], max_new_tokens: int = 32, *,
             kv_policy: str = "dynakv", ram_budget: float | int | None = None,
             budget: float | int | None = None, stop_at_eos: bool = True,
             stop: Sequence[str] = (), config: DecodeConfig | None = None,
             flash_dir: str | Path | None = None, probe: bool = False,
             sampling: Sampling | None = None, **overrides: Any) -> DecodeResult:
    """Greedy decoding (or sampling) after ``question_ids`` over a context's KV under
    ``kv_policy``.

    Args:
        kv: the context's memory (:class:`~sparkv.cache.ContextKV`, left as it was) or per-layer
            ``(K, V)``.
        context_len: N, or the context's token ids.
        kv_policy: ``full`` | ``dynakv`` | ``dynakv-eager`` | ``dynakv-packed`` | ``dynakv-lru`` |
            ``static`` | ``local`` | ``nocluster`` (:data:`sparkv.decode.POLICIES`).
        ram_budget: bytes of KV the policy may hold in RAM, or a fraction (<= 1.0) of the final KV
            (context + question + ``max_new_tokens``, every layer and head); None: the cache is
            unbounded.
        budget: entries retrieved per KV head per step, or a fraction (<= 1.0) of what the head
            holds; default: the config's (10%).
        stop: stop strings (:func:`~sparkv.runtime.generate.greedy_generate`'s).
        config, overrides: any :class:`DecodeConfig` field.
        flash_dir: where the clusters go on flash (a temporary directory under it, removed after).
        probe: also measure attention-mass recall and output error against full attention.
        sampling: how each token is chosen (default: greedy).

    Returns:
        a :class:`DecodeResult`: ``text``, ``tokens``, ``stats``; unpacks as
        ``(GenerationResult, DecodeStats)``.
    """
    n = context_len if isinstance(context_len, int) else len(context_len)
    overrides["ram_budget"] = ram_budget
    if budget is not None:
        overrides["budget"] = budget
    start = time.perf_counter()
    final = n + len(question_ids) + max_new_tokens
    with DecodeSession(lm, kv, n, kv_policy, config, final_tokens=final, flash_dir=flash_dir,
                       probe=probe, **overrides) as s:
        logits = s.prefill(question_ids)
        prefill_s = time.perf_counter() - start
        choose = TokenChooser.of_model(lm, sampling)
        token = choose(logits)
        first_s = time.perf_counter() - start
        tokens = [token]
        eos = lm.eos_ids
        stops = StopStrings(stop)
        while (len(tokens) < max_new_tokens and not (stop_at_eos and token in eos)
               and not stops.hit(lm, tokens) and not choose.finished):
            token = choose(s.feed([token]))
            tokens.append(token)
        last = time.perf_counter()
        stats = s.stats()
    stats.teardown_s = time.perf_counter() - last
    # total_s counts the pending page writes (stats) and the flash files' removal (close): an
    # ask's TTFT is its time minus what came after the first token
    result = GenerationResult(tokens, logits, first_s, time.perf_counter() - start,
                              answer_text(lm, tokens, stops), prefill_s, choose.seed)
    return DecodeResult(result, stats)
