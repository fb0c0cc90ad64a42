"""The ChunkStore contract, run against every store: the file store and a real Redis
(Debian's redis-server on a free loopback port; skipped cleanly when it is not installed)."""

from __future__ import annotations

import os
import threading

import pytest

from sparkv.server.errors import StoreError
from sparkv.server.stores import ChunkKey, FileStore, file_path_of, open_store


CID = "0123456789abcdef0123456789abcdef"
CID2 = "fedcba9876543210fedcba9876543210"
JOB = "aa" * 16


def frame(i: int, n: int = 1000) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))


def test_chunk_roundtrip_and_absent(store):
    k = ChunkKey(0, 1, 0, "q5")
    assert store.get_chunk("alice", CID, k) is None
    store.put_chunk("alice", CID, k, frame(1))
    assert store.get_chunk("alice", CID, k) == frame(1)
    store.put_chunk("alice", CID, k, frame(2, 10))  # replace
    assert store.get_chunk("alice", CID, k) == frame(2, 10)
    assert store.get_chunk("alice", CID, ChunkKey(0, 1, 0, "raw")) is None


def test_batch_read_keeps_order_and_reports_missing(store):
    keys = [ChunkKey(t, l, 0, "q5") for t in range(3) for l in range(4)]  # noqa: E741
    for i, k in enumerate(keys):
        store.put_chunk("alice", CID, k, frame(i, 100 + i))
    order = list(reversed(keys)) + [ChunkKey(9, 9, 0, "q5")]
    got = store.get_chunks("alice", CID, order)
    assert got[:-1] == [frame(keys.index(k), 100 + keys.index(k)) for k in order[:-1]]
    assert got[-1] is None
    assert store.get_chunks("alice", CID, []) == []
    assert store.list_chunks("alice", CID) == set(keys)


def test_ranges(store):
    k = ChunkKey(0, 0, 0, "raw")
    data = frame(3, 500)
    store.put_chunk("alice", CID, k, data)
    assert store.get_chunk_range("alice", CID, k, 0, 10) == data[:10]
    assert store.get_chunk_range("alice", CID, k, 490, 600) == data[490:]
    assert store.get_chunk_range("alice", CID, k, 100, 101) == data[100:101]
    assert store.get_chunk_range("alice", CID, ChunkKey(1, 0, 0, "raw"), 0, 10) is None


def test_context_invisible_until_manifest_written_last(store):
    k = ChunkKey(0, 0, 0, "q5")
    store.put_chunk("alice", CID, k, frame(1))
    assert store.get_manifest("alice", CID) is None
    assert store.list_contexts("alice") == []
    store.put_manifest("alice", CID, b'{"m": 1}')
    assert store.get_manifest("alice", CID) == b'{"m": 1}'
    assert store.list_contexts("alice") == [CID]


def test_delete_removes_manifest_and_every_chunk(store):
    keys = [ChunkKey(t, 0, 0, lv) for t in range(5) for lv in ("q5", "raw")]
    for i, k in enumerate(keys):
        store.put_chunk("alice", CID, k, frame(i))
    store.put_manifest("alice", CID, b"{}")
    store.put_chunk("alice", CID2, keys[0], frame(0))
    store.put_manifest("alice", CID2, b"{}")
    assert store.delete("alice", CID) is True
    assert store.get_manifest("alice", CID) is None
    assert all(store.get_chunk("alice", CID, k) is None for k in keys)
    assert store.list_chunks("alice", CID) == set()
    assert store.list_contexts("alice") == [CID2]
    assert store.delete("alice", CID) is False
    assert store.get_chunk("alice", CID2, keys[0]) == frame(0)  # the other context is intact


def test_delete_of_a_half_written_context(store):
    store.put_chunk("alice", CID, ChunkKey(0, 0, 0, "q5"), frame(0))
    assert store.delete("alice", CID) is True
    assert store.list_chunks("alice", CID) == set()


def test_tenants_are_separate_namespaces(store):
    k = ChunkKey(0, 0, 0, "q5")
    store.put_chunk("alice", CID, k, frame(1))
    store.put_manifest("alice", CID, b"{}")
    assert store.get_chunk("bob", CID, k) is None
    assert store.get_manifest("bob", CID) is None
    assert store.list_contexts("bob") == []
    assert store.delete("bob", CID) is False
    assert store.get_manifest("alice", CID) == b"{}"


def test_jobs(store):
    assert store.get_job("alice", JOB) is None
    store.put_job("alice", JOB, b'{"state": "queued"}')
    store.put_job("alice", JOB, b'{"state": "done"}')
    store.put_job("bob", "bb" * 16, b"{}")
    assert store.get_job("alice", JOB) == b'{"state": "done"}'
    assert store.get_job("bob", JOB) is None
    assert sorted(store.list_jobs()) == [("alice", JOB), ("bob", "bb" * 16)]
    store.delete_job("alice", JOB)
    assert store.get_job("alice", JOB) is None
    assert store.list_jobs() == [("bob", "bb" * 16)]


@pytest.mark.parametrize("bad", [
    dict(tenant="../x"), dict(context_id="../../etc"), dict(context_id="ABC"),
    dict(key=ChunkKey(0, 0, 0, "../x")), dict(key=ChunkKey(-1, 0, 0, "q5")),
])
def test_names_that_could_escape_are_refused(store, bad):
    tenant = bad.get("tenant", "alice")
    cid = bad.get("context_id", CID)
    key = bad.get("key", ChunkKey(0, 0, 0, "q5"))
    with pytest.raises(StoreError):
        store.put_chunk(tenant, cid, key, b"x")
    with pytest.raises(StoreError):
        store.get_chunk(tenant, cid, key)


def test_concurrent_writers_and_readers_see_whole_frames(store):
    k = ChunkKey(0, 0, 0, "raw")
    a, b = frame(1, 200_000), frame(2, 150_000)
    store.put_chunk("alice", CID, k, a)
    stop = threading.Event()
    bad = []

    def write():
        i = 0
        while not stop.is_set():
            store.put_chunk("alice", CID, k, a if i % 2 else b)
            i += 1

    def read():
        while not stop.is_set():
            got = store.get_chunk("alice", CID, k)
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


# --- file store specifics ----------------------------------------------------------------------
def test_file_store_leaves_no_temp_files_and_layout(tmp_path):
    s = FileStore(tmp_path / "st")
    s.put_chunk("alice", CID, ChunkKey(1, 2, 0, "q5"), b"abc")
    s.put_manifest("alice", CID, b"{}")
    cdir = tmp_path / "st" / "tenants" / "alice" / "contexts" / CID
    assert sorted(os.listdir(cdir)) == ["chunks", "manifest.json"]
    assert os.listdir(cdir / "chunks") == ["1.2.0.q5"]


def test_file_store_ignores_leftover_temp_files(tmp_path):
    s = FileStore(tmp_path / "st")
    s.put_chunk("alice", CID, ChunkKey(0, 0, 0, "q5"), b"abc")
    chunks = tmp_path / "st" / "tenants" / "alice" / "contexts" / CID / "chunks"
    (chunks / ".tmp-deadbeef").write_bytes(b"half a frame")  # a crash mid-write
    assert s.list_chunks("alice", CID) == {ChunkKey(0, 0, 0, "q5")}
    assert s.delete("alice", CID)
    assert not chunks.exists()


def test_store_urls(tmp_path):
    assert file_path_of("file:///abs/dir") == "/abs/dir"
    assert file_path_of("file://./rel/dir") == "./rel/dir"
    assert file_path_of("/plain/path") == "/plain/path"
    with pytest.raises(StoreError):
        open_store("s3://bucket/x")
    with pytest.raises(StoreError):
        file_path_of("file://otherhost/x")
