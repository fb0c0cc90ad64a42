"""The conversations of the Conversations API, without a service (tests/test_asks_service.py
asks through them with the ``openai`` client): a conversation is its app's alone; items are
added, removed and listed in order; the store stays within its count and bytes, a conversation
that outgrows it losing its oldest items; on flash every change is appended and a restarted
store reads back what it had (compacted, a torn last line left out, damaged files removed)."""

from __future__ import annotations

import json
import os

from sparkv.asks.convfiles import ConversationFiles
from sparkv.asks.convstore import ConversationStore
from sparkv.asks.respschemas import InputMessage, identified


def _msgs(*texts: str) -> list:
    return [identified(InputMessage(role="user", content=t)) for t in texts]


def test_a_conversation_is_its_apps_alone_and_holds_its_items_in_order():
    store = ConversationStore()
    snap = store.create("app:a", _msgs("one"), {"topic": "t"})
    cid = snap.info["id"]
    assert cid.startswith("conv_") and snap.info["metadata"] == {"topic": "t"}
    assert store.get("app:b", cid) is None and not store.delete("app:b", cid)
    added = store.add("app:a", cid, _msgs("two", "three"))
    assert [i.text() for i in added.items] == ["one", "two", "three"]
    second = added.items[1].id
    snap, found = store.remove_item("app:a", cid, second)
    assert found and [i.text() for i in snap.items] == ["one", "three"]
    assert store.remove_item("app:a", cid, second)[1] is False
    assert store.update("app:a", cid, {"topic": "u"}).info["metadata"] == {"topic": "u"}
    assert store.stats()["bytes"] == sum(len(i.model_dump_json()) for i in snap.items)
    assert store.delete("app:a", cid) and store.get("app:a", cid) is None
    assert store.add("app:a", cid, _msgs("late")) is None
    assert store.stats() | {"evicted": 0} == {"conversations": 0, "bytes": 0, "apps": 0,
                                              "evicted": 0, "items_dropped": 0}


def test_room_is_made_from_the_app_holding_the_most_and_a_big_one_loses_its_oldest():
    store = ConversationStore(3, 100_000)
    quiet = store.create("app:quiet", _msgs("q"), None).info["id"]
    busy = [store.create("app:busy", _msgs("b"), None).info["id"] for _ in range(2)]
    store.get("app:busy", busy[0])                     # used: busy[1] is now the oldest
    store.create("app:busy", _msgs("b"), None)
    assert store.get("app:quiet", quiet) is not None
    assert store.get("app:busy", busy[1]) is None and store.stats()["evicted"] == 1
    one = len(_msgs("x" * 100)[0].model_dump_json())
    small = ConversationStore(10, 5 * one + 10)
    cid = small.create("app:a", _msgs(*("x" * 100 for _ in range(4))), None).info["id"]
    snap = small.add("app:a", cid, _msgs(*("y" * 100 for _ in range(3))))
    assert [i.text()[0] for i in snap.items] == ["x", "x", "y", "y", "y"]
    assert small.stats()["items_dropped"] == 2 and small.stats()["bytes"] <= small.max_bytes
    assert not ConversationStore(0).enabled


def test_conversations_are_read_back_from_flash_after_a_restart(tmp_path, caplog):
    folder = tmp_path / "conversations"
    store = ConversationStore(10, 100_000, files=ConversationFiles(folder))
    cid = store.create("app:a", _msgs("one"), {"k": "v"}).info["id"]
    gone = store.create("app:b", _msgs("lost"), None).info["id"]
    snap = store.add("app:a", cid, _msgs("two", "three"))
    store.remove_item("app:a", cid, snap.items[0].id)
    store.update("app:a", cid, {"k": "w"})
    store.delete("app:b", gone)
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"
    path = folder / f"{cid}.jsonl"
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert len(path.read_text().splitlines()) == 5          # header, add, add, delete, meta
    with path.open("a") as f:
        f.write('{"add": [{"role": "user", "content": "torn')   # a crash mid-append
    (folder / f"conv_{'0' * 48}.jsonl").write_text("{damaged\n")
    (folder / "notes.txt").write_text("not ours")
    again = ConversationStore(10, 100_000, files=ConversationFiles(folder))
    assert again.load() == 1
    back = again.get("app:a", cid)
    assert [i.text() for i in back.items] == ["two", "three"]
    assert [i.id for i in back.items] == [i.id for i in snap.items[1:]]
    assert back.info == {**snap.info, "metadata": {"k": "w"}}
    assert len(path.read_text().splitlines()) == 2          # compacted: header and one add
    assert json.loads(path.read_text().splitlines()[1])["add"][0]["content"] == "two"
    assert sorted(p.name for p in folder.iterdir()) == sorted([path.name, "notes.txt"])
    assert "cannot be read" in caplog.text and "torn" not in caplog.text
    again.add("app:a", cid, _msgs("four"))                   # appends after the compaction
    third = ConversationStore(10, 100_000, files=ConversationFiles(folder))
    assert third.load() == 1
    assert [i.text() for i in third.get("app:a", cid).items] == ["two", "three", "four"]


class _FailingDisk:
    """Files whose appends fail while ``full`` (a full flash): what the store writes."""

    def __init__(self) -> None:
        self.full, self.writes = False, []

    def create(self, conv) -> bool:
        self.writes.append(("whole", len(conv.items)))
        return not self.full

    def append(self, cid, record) -> bool:
        self.writes.append(("append", sorted(record)))
        return not self.full

    def remove(self, cid) -> None:
        pass

    def read_all(self, max_bytes):
        return iter(())


def test_after_a_failed_append_the_whole_conversation_is_written_again():
    disk = _FailingDisk()
    store = ConversationStore(10, 100_000, files=disk)
    cid = store.create("app:a", _msgs("one"), None).info["id"]
    disk.full = True
    store.add("app:a", cid, _msgs("two"))            # fails: the file may end torn
    disk.full = False
    store.add("app:a", cid, _msgs("three"))          # so it is written whole, once
    store.add("app:a", cid, _msgs("four"))
    assert disk.writes == [("whole", 1), ("append", ["add"]), ("whole", 2), ("whole", 3),
                           ("append", ["add"])]
