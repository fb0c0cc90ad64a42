"""What a decode policy reports: :class:`DecodeStats` (docs/dynakv.md, "The stats"), summed from
the :class:`Counters` its layers count into at every step."""

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
        decode_s: every feed's time but the recall probe's (probe_s) and the wait for the
            clusters (build_wait_s); tokens_per_s = tokens / decode_s.
        full_steps / full_s: the first feeds, over the full KV while the clusters were built
            (``DecodeConfig.full_steps``), and their time (part of decode_s).
        build_s: clustering and placement, on a thread from the end of the question's prefill
            (off the first token's path); 0 while it runs.
        build_wait_s: what the switch to the clusters waited for the build; switch_s: the full
            steps' entries joining their clusters (part of decode_s).
        teardown_s (:func:`~sparkv.decode.session.generate` only): after the last token, the
            pending page writes and the removal of the flash files.
        the policy's share of decode_s: select_s, io_s (critical-path reads and waiting for
            prefetch), attend_s, update_s (the step's end on the decoding thread and the waits
            for the cluster upkeep; with ``background_upkeep=False`` the upkeep itself).
        upkeep_s: the cluster upkeep's own seconds (new entries joining clusters, splits, the
            cache's offers and reservations), on its thread off the token's path
            (``background_upkeep``; inline: part of update_s); upkeep_wait_s: what the decoding
            thread waited for it (part of update_s).
    Per-token figures of retrieval and flash divide by the tokens fed since the switch.
    budget: the entries each KV head attends per step (a fraction <= 1 of what it holds).
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
    budget: float = 0.0
    full_steps: int = 0
    full_s: float = 0.0
    build_wait_s: float = 0.0
    switch_s: float = 0.0
    teardown_s: float = 0.0
    select_s: float = 0.0
    io_s: float = 0.0
    attend_s: float = 0.0
    update_s: float = 0.0
    upkeep_s: float = 0.0
    upkeep_wait_s: float = 0.0
    reads: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode_rows(d: dict[str, Any]) -> list[tuple[str, str]]:
    """A decode's rows of an ask's printed breakdown (``d``: :meth:`DecodeStats.to_dict`): what it
    did, where every second went, and whether its tokens may differ from full KV's."""
    rows = [(f"decode ({d['policy']})",
             f"{d['tokens_per_s']:8.2f} tok/s, flash {d['flash_read_bytes_per_token'] / 1e3:.1f} "
             f"kB/token in {d['flash_read_ops_per_token']:.1f} reads, hit rate "
             f"{d['hit_rate']:.2f}, RAM peak {d['ram_peak_bytes'] / 1e6:.1f} MB")]
    if d["policy"] == "full":
        return rows
    rows.append(("  decode time", _time_text(d)))
    if d["policy"] == "stream":
        rows.append(("  KV written to flash", f"{d['build_s']:8.3f} s, in the question's prefill"))
        return rows
    if d["build_s"]:
        rows.append(("  cluster build", f"{d['build_s']:8.3f} s on a thread, off the first "
                     f"token's path ({d['clusters']} clusters)"))
    else:
        rows.append(("  cluster build", "   not used: the answer ended within the steps over "
                     "the full KV (the build was stopped)"))
    b = d["budget"]
    share = f"{b:.0%} of its entries" if b <= 1.0 else f"{b:g} entries"
    first = d["full_steps"] + 2          # the question's token, then the full steps' tokens
    rows.append(("  note", f"tokens 1-{first - 1} attend the full KV, as --decode full does; "
                 f"from token {first} each KV head attends {share}, so the answer may leave "
                 "full's from there: expected at a sparse budget (docs/dynakv.md)"))
    return rows


def _time_text(d: dict[str, Any]) -> str:
    """Every second of a decode: the steps over the full KV, the wait for the clusters and
    their catch-up, the policy's steps (by part) and the recall probe."""
    wait, probe, full, switch = d["build_wait_s"], d["probe_s"], d["full_s"], d["switch_s"]
    policy = d["decode_s"] - full - switch
    parts = [("select", d["select_s"]), ("reads", d["io_s"]), ("attend", d["attend_s"]),
             ("update", d["update_s"])]
    rest = max(0.0, policy - sum(t for _, t in parts))
    text = (f"{d['decode_s'] + wait + probe:8.3f} s = {d['full_steps']} steps over the full KV "
            f"{full:.2f} s + waiting for the clusters {wait:.2f} s + their catch-up "
            f"{switch:.2f} s + {d['steps'] - d['full_steps']} steps of the policy "
            f"{policy:.2f} s (" + ", ".join(f"{n} {t:.2f}" for n, t in parts)
            + f", the model and the rest {rest:.2f})")
    if probe:
        text += f" + the recall probe {probe:.2f} s"
    if d.get("teardown_s"):
        text += f"; then {d['teardown_s']:.2f} s of pending page writes and file removal"
    return text


class Counters:
    """Per-step counters (summed over layers and heads)."""

    def __init__(self) -> None:
        self.steps = 0                 # decoding forwards (all layers)
        self.tokens = 0                # tokens those forwards fed
        self.retrieved_entries = 0     # attended entries from selected clusters (window excluded)
        self.retrieved_bytes = 0
        self.attended_entries = 0      # everything attended (window, buffers included)
        self.selected_units = 0
        self.hits = 0                  # selected clusters found in the cache
        self.hit_bytes = 0
        self.prefetch_hits = 0         # ... found in the prefetch staging
        self.prefetch_hit_bytes = 0
        self.misses = 0                # ... read on the critical path
        self.first_uses = 0            # selected clusters never cached before (no cache could hit)
        self.miss_bytes = 0
        self.prefetched_unused_bytes = 0
        self.recall_sum = 0.0
        self.error_sum = 0.0
        self.recall_n = 0
        self.select_s = 0.0
        self.io_s = 0.0
        self.update_s = 0.0
        self.attend_s = 0.0
        self.probe_s = 0.0             # measurement only (recall probe): excluded from decode_s
        self.ram_peak = 0
        self.staging_peak = 0
