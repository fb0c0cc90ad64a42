"""What a decode policy reports: :class:`DecodeStats` (docs/dynakv.md, "The stats")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DecodeStats:
    """Counters of one decode (every layer and KV head, summed; per-token figures divide by the
    tokens fed after the prompt).

    Retrieval:
        retrieved_entries / retrieved_bytes: entries attended from selected clusters (not the
            window); ``*_per_token`` per decoded token (all layers and heads).
        attended_entries_per_token: everything attended (window and buffers included).
        recall: mean attention-mass recall (share of full attention's probability on the
            entries attended), ``None`` unless probed; output_error: mean relative L2 error of
            the attention output against full attention.
    Flash:
        flash_read_bytes / flash_read_ops: every read (whole pages; merged runs), by reason in
            ``reads`` (``retrieve`` on the critical path, ``prefetch``, ``split`` and ``overflow``
            for splits, ``relocate`` for the packed layout); ``*_per_token``.
        mean_run_entries: entry slots per read operation (contiguity); useful_read_fraction:
            live entries / slots read.
        critical_read_ops/bytes_per_token: reads on the critical path (every reason but
            ``prefetch``); prefetch_read_ops/bytes_per_token: the prefetcher's, off it.
        split_read_bytes / split_read_ops: reads caused by splits (``split`` + ``overflow``).
        flash_write_bytes: pages written while decoding; logical_write_bytes: entry bytes the
            policy asked to write (new entries, split migrations); write_amplification: their
            ratio; relocation_write_bytes: layout-forced rewrites (compaction, packed
            relocation); prefill_write_bytes: the prompt's placement.
    Cache:
        hits / prefetch_hits / misses: selected clusters (with flushed entries) found in the
            cache, in the prefetch staging, or read on the critical path; hit_rate =
            hits / all, ram_hit_rate = (hits + prefetch_hits) / all, byte_hit_rate by bytes;
            hit_rate_ceiling = 1 - first uses / all (a cluster's first use after it came to be
            cannot hit: no replacement policy can exceed it).
        evictions, evicted_reserved (always 0).
    Clusters:
        clusters, mean_cluster_size, splits (by kind), buffered (now), buffer_peak (one head),
        flagged.
    Memory:
        ram_budget, cache_capacity, ram_peak_bytes (cache + window + buffers + write buffers +
        staging), ram (the same at the end, by part), index_bytes (centroids and statistics;
        ``nocluster``: its keys), final_kv_bytes (every entry of every layer at the end).
    Time:
        decode_s (without the recall probe's time, probe_s), tokens_per_s, build_s (clustering and placement), and the policy's share:
        select_s, io_s (critical-path reads and waiting for prefetch), attend_s, update_s.
    """

    policy: str
    steps: int = 0
    tokens: int = 0
    retrieved_entries: int = 0
    retrieved_bytes: int = 0
    retrieved_entries_per_token: float = 0.0
    attended_entries_per_token: float = 0.0
    recall: float | None = None
    output_error: float | None = None
    flash_read_bytes: int = 0
    flash_read_ops: int = 0
    flash_read_bytes_per_token: float = 0.0
    flash_read_ops_per_token: float = 0.0
    mean_run_entries: float = 0.0
    useful_read_fraction: float = 0.0
    critical_read_ops_per_token: float = 0.0
    critical_read_bytes_per_token: float = 0.0
    prefetch_read_ops_per_token: float = 0.0
    prefetch_read_bytes_per_token: float = 0.0
    split_read_bytes: int = 0
    split_read_ops: int = 0
    flash_write_bytes: int = 0
    logical_write_bytes: int = 0
    write_amplification: float = 0.0
    relocation_write_bytes: int = 0
    prefill_write_bytes: int = 0
    hits: int = 0
    prefetch_hits: int = 0
    misses: int = 0
    hit_rate: float = 0.0
    ram_hit_rate: float = 0.0
    byte_hit_rate: float = 0.0
    hit_rate_ceiling: float = 0.0
    evictions: int = 0
    evicted_reserved: int = 0
    clusters: int = 0
    mean_cluster_size: float = 0.0
    splits: dict[str, int] = field(default_factory=dict)
    buffered: int = 0
    buffer_peak: int = 0
    flagged: int = 0
    ram_budget: int | None = None
    cache_capacity: int | None = None
    ram_peak_bytes: int = 0
    ram: dict[str, int] = field(default_factory=dict)
    index_bytes: int = 0
    final_kv_bytes: int = 0
    decode_s: float = 0.0
    probe_s: float = 0.0
    tokens_per_s: float = 0.0
    build_s: float = 0.0
    select_s: float = 0.0
    io_s: float = 0.0
    attend_s: float = 0.0
    update_s: float = 0.0
    reads: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
