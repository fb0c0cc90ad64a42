"""An encode job codes its frames on several threads: same frames and manifest as one thread,
frames recorded in order, memory bounded, and a stop or an error leaves nothing running."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from sparkv.server.ordered_pool import AUTO_MAX_THREADS, auto_threads, ordered_map


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sparkv-frames")]


def test_results_come_in_order_with_a_bounded_window():
    lock = threading.Lock()
    started, consumed, most_ahead = [0], [0], [0]

    def work(i: int) -> int:
        with lock:
            started[0] += 1
            most_ahead[0] = max(most_ahead[0], started[0] - consumed[0])
        time.sleep(0.001 * ((7 * i) % 5))  # later items often finish first
        return i * i

    out = []
    for r in ordered_map(work, range(40), threads=3, window=4):
        out.append(r)
        with lock:
            consumed[0] += 1
    assert out == [i * i for i in range(40)]
    assert most_ahead[0] <= 4
    assert not _pool_threads()


def test_one_thread_runs_in_the_callers_thread():
    me = threading.get_ident()
    assert list(ordered_map(lambda i: threading.get_ident() == me, range(3), 1)) == [True] * 3


def test_an_error_is_raised_at_its_turn_and_nothing_is_left_running():
    done: list[int] = []

    def work(i: int) -> int:
        if i == 5:
            raise ValueError("bad item")
        done.append(i)
        return i

    got = []
    with pytest.raises(ValueError, match="bad item"):
        for r in ordered_map(work, range(100), threads=2, window=4):
            got.append(r)
    assert got == [0, 1, 2, 3, 4]
    assert max(done) < 5 + 4  # the window bounds what ran past the error
    assert not _pool_threads()


def test_closing_early_cancels_the_rest_and_waits_for_the_running():
    running = [0]
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            running[0] += 1
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return i

    gen = ordered_map(work, range(1000), threads=3)
    assert [next(gen) for _ in range(3)] == [0, 1, 2]
    gen.close()
    assert running[0] == 0 and not _pool_threads()


def test_auto_threads_share_the_cores_among_jobs():
    assert auto_threads(5) == 5
    assert 1 <= auto_threads(0) <= AUTO_MAX_THREADS
    assert auto_threads(0, jobs=10_000) == 1
    assert auto_threads(0, jobs=2) <= max(1, auto_threads(0))


# --- the encoder ------------------------------------------------------------------------------
def _spec(lm, levels=("q8", "q5", "raw")):
    from sparkv.server.encoder import ContextSpec, derive_context_id
    from sparkv.server.models import ModelEntry

    entry = ModelEntry.from_loaded("tiny", lm, 4096)
    ids = tuple(int(x) for x in torch.randint(1, 128, (96,), generator=torch.Generator()
                                               .manual_seed(5)))
    spec = ContextSpec("t", "tiny", ids, 32, levels, 0, False, None)
    return entry, spec, derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)


def _frames(store, spec, cid):
    return {key: store.chunks.get(spec.tenant, cid, key)
            for key in sorted(store.chunks.keys(spec.tenant, cid))}


def test_threads_store_the_same_frames_and_manifest_as_one(tiny_llama, tmp_path):
    from sparkv.server.encoder import encode_context
    from sparkv.server.stores import open_store

    entry, spec, cid = _spec(tiny_llama)
    results = []
    for threads in (1, 3):
        store = open_store(f"file://{tmp_path}/store{threads}")
        seen: list[int] = []
        manifest, stats = encode_context(entry, spec, cid, store.chunks, threads=threads,
                                         progress=lambda ph, d, t: seen.append(d))
        assert seen[-1] == stats.frames_encoded and stats.codec_s > 0
        doc = json.loads(manifest)
        doc.pop("created_unix")
        results.append((doc, _frames(store, spec, cid), stats.frames_by_level))
    assert results[0] == results[1]
    assert not _pool_threads()


class _CountingChunks:
    """A chunk store that counts puts, and fails the ``fail_at``-th."""

    def __init__(self, inner, fail_at: int | None = None) -> None:
        self.inner, self.fail_at, self.puts = inner, fail_at, 0
        self.lock = threading.Lock()

    def put(self, *args, **kwargs):
        from sparkv.server.errors import StoreError

        with self.lock:
            self.puts += 1
            n = self.puts
        if n == self.fail_at:
            raise StoreError("disk full")
        self.inner.put(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_stop_waits_for_the_frames_in_flight(tiny_llama, tmp_path):
    from sparkv.server.encoder import JobCancelled, encode_context
    from sparkv.server.stores import open_store

    entry, spec, cid = _spec(tiny_llama)
    store = open_store(f"file://{tmp_path}/store")
    chunks = _CountingChunks(store.chunks)
    recorded = []  # the frames reported done: each was stored before its report
    with pytest.raises(JobCancelled):
        encode_context(entry, spec, cid, chunks, threads=3,
                       progress=lambda ph, d, t: recorded.append(d) if d else None,
                       should_stop=lambda: len(recorded) >= 3)
    assert not _pool_threads()  # nothing can store a frame after the caller cleans up
    puts = chunks.puts
    assert recorded == [1, 2, 3]
    assert 3 <= puts < len(_frames_expected(spec, tiny_llama))
    assert len(store.chunks.keys(spec.tenant, cid)) == puts


def _frames_expected(spec, lm):
    from sparkv.layout import ChunkGeometry

    geo = ChunkGeometry.from_config(lm.config, spec.num_tokens, spec.chunk_tokens, 0)
    return [(c, lv) for c in geo.chunk_ids() for lv in spec.levels]


def test_a_store_error_in_a_frame_stops_the_job_with_it(tiny_llama, tmp_path):
    from sparkv.server.encoder import encode_context
    from sparkv.server.errors import StoreError
    from sparkv.server.stores import open_store

    entry, spec, cid = _spec(tiny_llama)
    store = open_store(f"file://{tmp_path}/store")
    chunks = _CountingChunks(store.chunks, fail_at=7)
    with pytest.raises(StoreError, match="disk full"):
        encode_context(entry, spec, cid, chunks, threads=3)
    assert not _pool_threads()
    assert chunks.puts < len(_frames_expected(spec, tiny_llama))
