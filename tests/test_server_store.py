"""The store's contracts (a ChunkStore of frames and token ids, a ManifestStore, a JobStore, and
the Store over them), run against every store: the file store and a real Redis (Debian's
redis-server on a free loopback port; skipped cleanly when it is not installed)."""

from __future__ import annotations

import os
import threading

import pytest

from sparkv.server.errors import StoreError
from sparkv.server.stores import (ChunkKey, ChunkStore, FileStore, JobStore, ManifestStore,
                                  ValueTooLarge, file_path_of, open_store)


CID = "0123456789abcdef0123456789abcdef"
CID2 = "fedcba9876543210fedcba9876543210"
JOB = "aa" * 16


def frame(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))


def test_chunk_roundtrip_and_absent(store):
    k = ChunkKey(0, 1, 0, "q5")
    assert store.chunks.get("alice", CID, k) is None
    store.chunks.put("alice", CID, k, frame(1))
    assert store.chunks.get("alice", CID, k) == frame(1)
    store.chunks.put("alice", CID, k, frame(2, 10))  # replace
    assert store.chunks.get("alice", CID, k) == frame(2, 10)
    store.chunks.put("alice", CID, k, frame(3), later=True)   # durable with the token ids
    assert store.chunks.get("alice", CID, k) == frame(3)
    assert store.chunks.get("alice", CID, ChunkKey(0, 1, 0, "raw")) is None


def test_batch_read_keeps_order_and_reports_missing(store):
    keys = [ChunkKey(t, l, 0, "q5") for t in range(3) for l in range(4)]  # noqa: E741
    for i, k in enumerate(keys):
        store.chunks.put("alice", CID, k, frame(i, 100 + i))
    order = list(reversed(keys)) + [ChunkKey(9, 9, 0, "q5")]
    got = store.chunks.get_many("alice", CID, order)
    assert got[:-1] == [frame(keys.index(k), 100 + keys.index(k)) for k in order[:-1]]
    assert got[-1] is None
    assert store.chunks.get_many("alice", CID, []) == []
    assert store.chunks.keys("alice", CID) == set(keys)


def test_ranges(store):
    k = ChunkKey(0, 0, 0, "raw")
    data = frame(3, 500)
    store.chunks.put("alice", CID, k, data)
    assert store.chunks.get_range("alice", CID, k, 0, 10) == data[:10]
    assert store.chunks.get_range("alice", CID, k, 490, 600) == data[490:]
    assert store.chunks.get_range("alice", CID, k, 100, 101) == data[100:101]
    assert store.chunks.get_range("alice", CID, ChunkKey(1, 0, 0, "raw"), 0, 10) is None


def test_context_invisible_until_manifest_written_last(store):
    k = ChunkKey(0, 0, 0, "q5")
    store.chunks.put("alice", CID, k, frame(1))
    assert store.manifests.get("alice", CID) is None
    assert store.manifests.contexts("alice") == []
    store.manifests.put("alice", CID, b'{"m": 1}')
    assert store.manifests.get("alice", CID) == b'{"m": 1}'
    assert store.manifests.contexts("alice") == [CID]


def test_delete_removes_manifest_and_every_chunk(store):
    keys = [ChunkKey(t, 0, 0, lv) for t in range(5) for lv in ("q5", "raw")]
    for i, k in enumerate(keys):
        store.chunks.put("alice", CID, k, frame(i))
    store.manifests.put("alice", CID, b"{}")
    store.chunks.put("alice", CID2, keys[0], frame(0))
    store.manifests.put("alice", CID2, b"{}")
    assert store.delete_context("alice", CID) is True
    assert store.manifests.get("alice", CID) is None
    assert all(store.chunks.get("alice", CID, k) is None for k in keys)
    assert store.chunks.keys("alice", CID) == set()
    assert store.manifests.contexts("alice") == [CID2]
    assert store.delete_context("alice", CID) is False
    assert store.chunks.get("alice", CID2, keys[0]) == frame(0)  # the other context is intact


def test_delete_of_a_half_written_context(store):
    store.chunks.put("alice", CID, ChunkKey(0, 0, 0, "q5"), frame(0))
    assert store.delete_context("alice", CID) is True
    assert store.chunks.keys("alice", CID) == set()


def test_tenants_are_separate_namespaces(store):
    k = ChunkKey(0, 0, 0, "q5")
    store.chunks.put("alice", CID, k, frame(1))
    store.manifests.put("alice", CID, b"{}")
    assert store.chunks.get("bob", CID, k) is None
    assert store.manifests.get("bob", CID) is None
    assert store.manifests.contexts("bob") == []
    assert store.delete_context("bob", CID) is False
    assert store.manifests.get("alice", CID) == b"{}"


def test_jobs(store):
    assert store.jobs.get("alice", JOB) is None
    store.jobs.put("alice", JOB, b'{"state": "queued"}')
    store.jobs.put("alice", JOB, b'{"state": "done"}')
    store.jobs.put("bob", "bb" * 16, b"{}")
    assert store.jobs.get("alice", JOB) == b'{"state": "done"}'
    assert store.jobs.get("bob", JOB) is None
    assert sorted(store.jobs.ids()) == [("alice", JOB), ("bob", "bb" * 16)]
    store.jobs.delete("alice", JOB)
    assert store.jobs.get("alice", JOB) is None
    assert store.jobs.ids() == [("bob", "bb" * 16)]


@pytest.mark.parametrize("bad", [
    dict(tenant="../x"), dict(context_id="../../etc"), dict(context_id="ABC"),
    dict(key=ChunkKey(0, 0, 0, "../x")), dict(key=ChunkKey(-1, 0, 0, "q5")),
])
def test_names_that_could_escape_are_refused(store, bad):
    tenant = bad.get("tenant", "alice")
    cid = bad.get("context_id", CID)
    key = bad.get("key", ChunkKey(0, 0, 0, "q5"))
    with pytest.raises(StoreError):
        store.chunks.put(tenant, cid, key, b"x")
    with pytest.raises(StoreError):
        store.chunks.get(tenant, cid, key)


def test_concurrent_writers_and_readers_see_whole_frames(store):
    k = ChunkKey(0, 0, 0, "raw")
    a, b = frame(1, 200_000), frame(2, 150_000)
    store.chunks.put("alice", CID, k, a)
    stop = threading.Event()
    bad = []

    def write():
        i = 0
        while not stop.is_set():
            store.chunks.put("alice", CID, k, a if i % 2 else b)
            i += 1

    def read():
        while not stop.is_set():
            got = store.chunks.get("alice", CID, k)
            if got not in (a, b):
                bad.append(len(got) if got is not None else None)

    threads = [threading.Thread(target=write), threading.Thread(target=read),
               threading.Thread(target=read)]
    for t in threads:
        t.start()
    threading.Event().wait(0.5)
    stop.set()
    for t in threads:
        t.join()
    assert bad == []


def test_ping(store):
    store.ping()


def test_the_parts_are_split_by_what_they_store(store):
    assert isinstance(store.chunks, ChunkStore)
    assert isinstance(store.manifests, ManifestStore) and isinstance(store.jobs, JobStore)
    k = ChunkKey(0, 0, 0, "q5")
    store.chunks.put("alice", CID, k, frame(1))
    store.manifests.put("alice", CID, b"{}")
    assert store.manifests.delete("alice", CID) is True  # hidden; the frames stay until...
    assert store.manifests.contexts("alice") == [] and store.chunks.get("alice", CID, k)
    assert store.chunks.delete("alice", CID) is True  # ...the chunk part removes them
    assert store.chunks.keys("alice", CID) == set()
    assert store.manifests.delete("alice", CID) is False
    assert store.chunks.delete("alice", CID) is False


def test_a_read_with_max_bytes_never_reads_a_larger_frame(store):
    small, large = ChunkKey(0, 0, 0, "q5"), ChunkKey(1, 0, 0, "q5")
    store.chunks.put("alice", CID, small, frame(1, 100))
    store.chunks.put("alice", CID, large, frame(2, 5000))
    assert store.chunks.get("alice", CID, small, 100) == frame(1, 100)
    assert store.chunks.get("alice", CID, ChunkKey(2, 0, 0, "q5"), 100) is None
    with pytest.raises(ValueTooLarge) as err:
        store.chunks.get("alice", CID, large, 4999)
    assert (err.value.key, err.value.size, err.value.max_bytes) == (large, 5000, 4999)
    assert store.chunks.get_many("alice", CID, [small, ChunkKey(3, 0, 0, "q5")], 100) == \
        [frame(1, 100), None]
    with pytest.raises(ValueTooLarge):
        store.chunks.get_many("alice", CID, [small, large], 100)


# --- file store specifics ----------------------------------------------------------------------
def test_file_store_leaves_no_temp_files_and_layout(tmp_path):
    s = FileStore(tmp_path / "st")
    s.chunks.put("alice", CID, ChunkKey(1, 2, 0, "q5"), b"abc")
    s.manifests.put("alice", CID, b"{}")
    cdir = tmp_path / "st" / "tenants" / "alice" / "contexts" / CID
    assert sorted(os.listdir(cdir)) == ["chunks", "manifest.json"]
    assert os.listdir(cdir / "chunks") == ["1.2.0.q5"]


def test_frames_put_later_are_made_durable_together_by_the_token_ids(tmp_path, monkeypatch):
    """An encode's frames go without an fsync each; the context's put_tokens syncs them in one
    call (then its directory) before the token ids, so before the manifest."""
    from sparkv.server.stores import file_store

    synced: list[tuple[str, set[str]]] = []
    monkeypatch.setattr(file_store, "sync_files",
                        lambda d, paths: synced.append((str(d), {str(p) for p in paths})))
    store = FileStore(tmp_path / "s")
    keys = [ChunkKey(t, 0, 0, "q5") for t in range(3)]
    for i, k in enumerate(keys):
        store.chunks.put("alice", CID, k, frame(i), later=True)
    store.chunks.put("alice", CID2, keys[0], frame(9), later=True)
    store.chunks.put("alice", CID, ChunkKey(9, 0, 0, "q5"), frame(8))      # durable at once
    assert synced == [] and store.chunks.get("alice", CID, keys[2]) == frame(2)
    store.chunks.put_tokens("alice", CID, b"\x01\x00\x00\x00")
    chunks = tmp_path / "s" / "tenants" / "alice" / "contexts" / CID / "chunks"
    assert synced == [(str(chunks), {str(chunks / k.name()) for k in keys})]
    store.chunks.put_tokens("alice", CID, b"\x01\x00\x00\x00")             # nothing left
    assert len(synced) == 1
    store.chunks.delete("alice", CID2)                     # a discarded encode: forgotten
    store.chunks.put_tokens("alice", CID2, b"\x01\x00\x00\x00")
    assert len(synced) == 1
    unsynced = FileStore(tmp_path / "t", fsync=False)      # a throwaway store syncs nothing
    unsynced.chunks.put("alice", CID, keys[0], frame(1), later=True)
    unsynced.chunks.put_tokens("alice", CID, b"\x01\x00\x00\x00")
    assert len(synced) == 1


def test_file_store_ignores_leftover_temp_files(tmp_path):
    s = FileStore(tmp_path / "st")
    s.chunks.put("alice", CID, ChunkKey(0, 0, 0, "q5"), b"abc")
    chunks = tmp_path / "st" / "tenants" / "alice" / "contexts" / CID / "chunks"
    (chunks / ".tmp-deadbeef").write_bytes(b"half a frame")  # a crash mid-write
    assert s.chunks.keys("alice", CID) == {ChunkKey(0, 0, 0, "q5")}
    assert s.delete_context("alice", CID)
    assert not chunks.exists()


def test_file_store_reads_only_regular_files_inside_its_root(tmp_path):
    s = FileStore(tmp_path / "st")
    k = ChunkKey(0, 0, 0, "raw")
    s.chunks.put("alice", CID, k, b"abc")
    s.manifests.put("alice", CID, b"{}")
    cdir = tmp_path / "st" / "tenants" / "alice" / "contexts" / CID
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    path = cdir / "chunks" / k.name()
    path.unlink()
    path.symlink_to(outside)  # a symlink out of the store: never followed
    with pytest.raises(OSError):
        s.chunks.get("alice", CID, k)
    path.unlink()
    os.mkfifo(path)  # a FIFO: refused at once, never waited on
    with pytest.raises(OSError):
        s.chunks.get("alice", CID, k)
    path.unlink()
    (cdir / "manifest.json").unlink()
    (cdir / "manifest.json").symlink_to(outside)
    with pytest.raises(StoreError):  # not a frame: the store's own error (503)
        s.manifests.get("alice", CID)
    (cdir / "manifest.json").unlink()
    os.rename(cdir / "chunks", tmp_path / "moved")  # a symlinked directory on the way
    (cdir / "chunks").symlink_to(tmp_path / "moved")
    (tmp_path / "moved" / k.name()).write_bytes(b"abc")
    with pytest.raises(OSError):
        s.chunks.get("alice", CID, k)


def test_store_urls(tmp_path):
    assert file_path_of("file:///abs/dir") == "/abs/dir"
    assert file_path_of("file://./rel/dir") == "./rel/dir"
    assert file_path_of("/plain/path") == "/plain/path"
    with pytest.raises(StoreError):
        open_store("s3://bucket/x")
    with pytest.raises(StoreError):
        file_path_of("file://otherhost/x")
