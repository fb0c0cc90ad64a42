"""The kept responses of the Responses API, without a service (tests/test_asks_service.py
continues and reads them through the ``openai`` client): a response is its app's alone; one
continuing another comes after its whole conversation, which outlives the response it came
from; the store stays within its count and bytes by evicting the least recently used response
of the app holding the most, so a busy app cannot push out a quiet one's; on flash, a restarted
store reads back what it kept (its bounds kept, damaged files removed, no others touched)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from sparkv.asks.respschemas import InputMessage, ResponsesBody, as_input
from sparkv.asks.respfiles import ResponseFiles
from sparkv.asks.respstore import ResponseStore, StoredResponse

pytest.importorskip("fastapi")
from sparkv.asks.respkept import (NoResponsesKept, PreviousNotDone,  # noqa: E402
                                  ResponseKeeper, UnknownPrevious, between, previous)


def _kept(nbytes: int = 100) -> StoredResponse:
    return StoredResponse({"id": "r"}, (), (), nbytes)


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "object": "response", "status": "completed", "output": [
        {"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": text, "annotations": []}]}]}


def test_a_response_is_its_apps_alone_until_deleted():
    store = ResponseStore(10, 10_000)
    assert store.put("app:a", "r1", _kept())
    assert store.get("app:a", "r1") is not None
    assert store.get("app:b", "r1") is None and not store.delete("app:b", "r1")
    assert store.delete("app:a", "r1") and store.get("app:a", "r1") is None
    assert store.stats()["responses"] == 0 and store.stats()["bytes"] == 0


def test_room_is_made_from_the_app_holding_the_most_least_recently_used_first():
    store = ResponseStore(4, 10_000)
    store.put("app:quiet", "q1", _kept())
    for i in range(3):
        store.put("app:busy", f"b{i}", _kept())
    store.get("app:busy", "b0")                  # b0 used: b1 is now the oldest
    store.put("app:busy", "b3", _kept())
    assert store.get("app:quiet", "q1") is not None
    assert store.get("app:busy", "b1") is None
    assert [store.get("app:busy", f"b{i}") is not None for i in (0, 2, 3)] == [True] * 3
    assert store.stats()["evicted"] == 1 and store.stats()["responses"] == 4


def test_bytes_are_bounded_and_a_response_bigger_than_the_store_is_not_kept():
    store = ResponseStore(100, 1_000)
    store.put("app:quiet", "q", _kept(300))
    for i in range(5):
        store.put("app:busy", f"b{i}", _kept(300))
    st = store.stats()
    assert st["bytes"] <= 1_000 and store.get("app:quiet", "q") is not None
    assert not store.put("app:busy", "huge", _kept(1_001))
    assert store.stats()["too_big"] == 1 and store.get("app:busy", "huge") is None
    off = ResponseStore(0, 1_000)
    assert not off.enabled and not off.put("app:a", "r", _kept(1))


def test_a_response_continuing_another_comes_after_its_whole_conversation():
    store = ResponseStore()
    first = ResponsesBody(model="m", input="What is it?", instructions="Be brief.")
    asyncio.run(ResponseKeeper(store, "app:a", None, first.items())(_response("r1", "A poem.")))
    r1 = previous(store, "app:a", "r1")
    assert r1 is not None and [i.id is not None for i in r1.items] == [True]
    second = ResponsesBody(model="m", input="Who wrote it?", previous_response_id="r1")
    turns = second.turns(r1.conversation())
    assert [(t.role, t.text) for t in turns] == [
        ("user", "What is it?"), ("assistant", "A poem."), ("user", "Who wrote it?")]
    asyncio.run(ResponseKeeper(store, "app:a", r1, second.items())(_response("r2", "Keats.")))
    r2 = store.get("app:a", "r2")
    assert r2 is not None and r2.input_items()[:2] == r1.conversation()
    assert r2.earlier is r1 and len(r2.items) == 1      # it holds only its own turn
    store.delete("app:a", "r1")                  # held: r2 keeps its conversation
    assert len(r2.conversation()) == 4 and store.stats()["held"] == 1
    with pytest.raises(UnknownPrevious, match="'r1' not found"):
        previous(store, "app:a", "r1")
    with pytest.raises(UnknownPrevious):
        previous(store, "app:b", "r2")
    running = ResponseKeeper(store, "app:a", r2, second.items())
    running.pending({**_response("r3", ""), "status": "in_progress", "output": []})
    with pytest.raises(PreviousNotDone, match="'r3' is in_progress"):
        previous(store, "app:a", "r3")
    with pytest.raises(NoResponsesKept, match="--responses-kept 0"):
        previous(ResponseStore(0), "app:a", "r2")
    assert previous(store, "app:a", None) is None


def test_output_items_are_input_items_and_a_page_of_them_is_cut_by_id():
    items = as_input(_response("r", "Hi.")["output"])
    assert isinstance(items[0], InputMessage) and items[0].id == "msg_r"
    rows = [{"id": f"i{k}"} for k in range(5)]
    assert [r["id"] for r in between(rows, "i1", "i4")] == ["i2", "i3"]
    assert between(rows, None, None) == rows
    with pytest.raises(Exception, match="no item .x."):
        between(rows, "x", None)


def _rid(k: int) -> str:
    return f"resp_{k:032x}"


def _keep(store: ResponseStore, app: str, k: int, earlier=None, text: str = "Hi.") -> str:
    body = ResponsesBody(model="m", input=f"Question {k}?")
    response = {**_response(_rid(k), text), "id": _rid(k)}
    asyncio.run(ResponseKeeper(store, app, earlier, body.items())(response))
    return _rid(k)


def test_kept_responses_are_read_back_from_flash_after_a_restart(tmp_path):
    store = ResponseStore(10, 100_000, files=ResponseFiles(tmp_path / "responses"))
    first = _keep(store, "app:a", 1)
    second = _keep(store, "app:a", 2, earlier=store.get("app:a", first))
    _keep(store, "app:b", 3)
    assert oct(os.stat(tmp_path / "responses").st_mode & 0o777) == "0o700"
    assert all(oct(p.stat().st_mode & 0o777) == "0o600"
               for p in (tmp_path / "responses").glob("*.json"))
    assert store.delete("app:b", _rid(3))
    assert sorted(p.stem for p in (tmp_path / "responses").glob("*.json")) == [first, second]
    again = ResponseStore(10, 100_000, files=ResponseFiles(tmp_path / "responses"))
    assert again.load() == 2
    before, after = store.get("app:a", second), again.get("app:a", second)
    assert after is not None and after.response == before.response
    assert after.conversation() == before.conversation()       # ids and all
    assert after.nbytes == before.nbytes
    assert again.get("app:b", second) is None


def test_a_restart_keeps_the_bounds_and_removes_what_it_cannot_read(tmp_path, caplog):
    folder = tmp_path / "responses"
    store = ResponseStore(10, 100_000, files=ResponseFiles(folder))
    kept = [_keep(store, "app:a", k) for k in range(4)]
    for k, rid in enumerate(kept):          # the order they were kept in, whatever the clock
        os.utime(folder / f"{rid}.json", (1_000 + k, 1_000 + k))
    (folder / f"{_rid(90)}.json").write_text("{not json")
    (folder / f"{_rid(91)}.json").write_text(json.dumps({"format": "other/9"}))
    doc = json.loads((folder / f"{kept[0]}.json").read_text())
    (folder / f"{_rid(92)}.json").write_text(json.dumps(doc))        # another id inside
    (folder / ".x.json.1.ab.tmp").write_text("half a write")
    (folder / "notes.txt").write_text("not ours")
    small = ResponseStore(2, 100_000, files=ResponseFiles(folder))
    assert small.load() == 2
    assert [small.get("app:a", r) is not None for r in kept] == [False, False, True, True]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"{kept[2]}.json", f"{kept[3]}.json", "notes.txt"])
    assert "cannot be read" in caplog.text


def test_a_disk_that_fails_leaves_the_response_in_memory(tmp_path, caplog):
    store = ResponseStore(10, 100_000, files=ResponseFiles(tmp_path / "responses"))
    (tmp_path / "responses").chmod(0o500)      # no writes: as a full or read-only flash
    try:
        rid = _keep(store, "app:a", 1)
    finally:
        (tmp_path / "responses").chmod(0o700)
    if os.geteuid() != 0:                       # root writes anyway
        assert "in memory only" in caplog.text
    assert store.get("app:a", rid) is not None


def test_input_items_are_listed_as_the_api_lists_them():
    from sparkv.asks.respschemas import identified, listed

    body = ResponsesBody.model_validate({"model": "m", "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "id": "msg_7",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1",
         "output": [{"type": "input_text", "text": "Sunny"}]}]})
    rows = [listed(identified(i)) for i in body.items()]
    assert [r["id"].split("_")[0] for r in rows] == ["msg", "msg", "fc", "fco"]
    assert rows[1]["id"] == "msg_7"                       # its own id kept
    assert rows[0]["content"] == [{"type": "input_text", "text": "Weather?"}]
    assert rows[1]["content"][0]["type"] == "output_text"
    assert rows[2] == {"id": rows[2]["id"], "type": "function_call", "call_id": "call_1",
                       "name": "get_weather", "arguments": "{}", "status": "completed"}
    assert rows[3]["output"] == "Sunny" and rows[3]["status"] == "completed"
    assert len({r["id"] for r in rows}) == 4


def test_a_response_past_its_time_to_live_is_forgotten_with_its_file(tmp_path):
    now = [1_000.0]
    folder = tmp_path / "responses"

    def store() -> ResponseStore:
        return ResponseStore(10, 100_000, files=ResponseFiles(folder), ttl_s=100,
                             clock=lambda: now[0])

    s = store()
    for k, made in ((1, 950), (2, 1_000), (3, 1_040)):
        body = ResponsesBody(model="m", input="Q?")
        response = {**_response(_rid(k), "A."), "id": _rid(k), "created_at": made}
        asyncio.run(ResponseKeeper(s, "app:a", None, body.items())(response))
    now[0] = 1_060.0                               # the first is 110 s old
    assert s.get("app:a", _rid(1)) is None and not (folder / f"{_rid(1)}.json").exists()
    assert s.get("app:a", _rid(2)) is not None and s.stats()["expired"] == 1
    now[0] = 1_120.0                               # the second, never asked for: swept
    s.put("app:b", "r9", _kept())
    assert s.stats()["expired"] == 2 and not (folder / f"{_rid(2)}.json").exists()
    assert s.get("app:a", _rid(3)) is not None
    now[0] = 1_200.0                               # read back: the third is past too
    again = store()
    assert again.load() == 0 and list(folder.glob("*.json")) == []
    forever = ResponseStore(10, 100_000, ttl_s=None, clock=lambda: now[0])
    forever.put("app:a", "old", StoredResponse({"id": "old", "created_at": 0}, (), (), 10))
    assert forever.get("app:a", "old") is not None


def test_a_response_whose_output_is_no_input_is_answered_unkept(caplog):
    store = ResponseStore()
    body = ResponsesBody(model="m", input="Q?")
    odd = {"id": _rid(5), "status": "completed", "output": [
        {"type": "function_call", "call_id": "c", "name": "not a name", "arguments": "{}"}]}
    asyncio.run(ResponseKeeper(store, "app:a", None, body.items())(odd))
    assert store.get("app:a", _rid(5)) is None and "is not kept" in caplog.text


def test_a_background_response_the_service_stopped_is_read_back_failed(tmp_path):
    store = ResponseStore(10, 100_000, files=ResponseFiles(tmp_path / "responses"))
    body = ResponsesBody(model="m", input="Q?")
    queued = {"id": _rid(7), "object": "response", "status": "queued", "output": []}
    asyncio.run(ResponseKeeper(store, "app:a", None, body.items())(queued))
    again = ResponseStore(10, 100_000, files=ResponseFiles(tmp_path / "responses"))
    assert again.load() == 1
    kept = again.get("app:a", _rid(7))
    assert kept is not None and kept.response["status"] == "failed"
    assert kept.response["error"]["code"] == "service_stopped"


def _turns(store: ResponseStore, app: str, n: int, start: int = 0) -> list[str]:
    """A conversation of ``n`` turns, each continuing the one before."""
    rids: list[str] = []
    for k in range(start, start + n):
        earlier = store.get(app, rids[-1]) if rids else None
        rids.append(_keep(store, app, k, earlier=earlier, text=f"Answer {k}."))
    return rids


def test_a_conversation_is_held_once_each_response_holding_only_its_own_turn():
    store = ResponseStore(100, 10_000_000)
    rids = _turns(store, "app:a", 24)
    sizes = [store.get("app:a", r).nbytes for r in rids]
    assert max(sizes) - min(sizes) < 16              # the 24th as small as the 1st
    assert store.stats()["bytes"] == sum(sizes)      # linear in the turns, not quadratic
    last = store.get("app:a", rids[-1])
    assert len(last.conversation()) == 48 and last.input_items()[0].id is not None
    assert [r.response["id"] for r in last.chain()] == rids
    flat = last.flattened()
    assert flat.conversation() == last.conversation() and flat.earlier is None


def test_a_deleted_response_is_held_for_those_continuing_it_then_goes(tmp_path):
    folder = tmp_path / "responses"
    store = ResponseStore(100, 10_000_000, files=ResponseFiles(folder))
    rids = _turns(store, "app:a", 4)
    whole = store.get("app:a", rids[-1]).conversation()
    assert store.delete("app:a", rids[1]) and store.delete("app:a", rids[0])
    assert store.get("app:a", rids[1]) is None and not store.delete("app:a", rids[1])
    assert store.stats()["held"] == 2 and store.stats()["responses"] == 2
    assert (folder / f"{rids[1]}.held.json").exists()
    assert not (folder / f"{rids[1]}.json").exists()
    assert store.get("app:a", rids[-1]).conversation() == whole      # still whole
    again = ResponseStore(100, 10_000_000, files=ResponseFiles(folder))
    assert again.load() == 2 and again.get("app:a", rids[1]) is None  # held after a restart
    assert again.get("app:a", rids[-1]).conversation() == whole
    assert again.delete("app:a", rids[3]) and again.delete("app:a", rids[2])
    assert again.stats() | {"expired": 0} == {**again.stats(), "responses": 0, "held": 0,
                                              "bytes": 0}
    assert list(folder.iterdir()) == []              # the held ones went with the last


def test_room_is_made_from_a_conversations_end_and_a_long_one_goes_on_kept_whole():
    store = ResponseStore(6, 10_000_000)
    other = _turns(store, "app:a", 3)
    rids = _turns(store, "app:a", 9, start=10)
    st = store.stats()
    assert st["responses"] + st["held"] <= 6 and st["kept_whole"] >= 1
    last = store.get("app:a", rids[-1])
    assert len(last.conversation()) == 18            # every turn, though most were evicted
    assert store.get("app:a", other[-1]) is None     # the older conversation went first,
    assert store.stats()["evicted"] >= 3             # from its end
    one = store.get("app:a", rids[-2]).nbytes     # a turn's bytes
    small = ResponseStore(100, 10 * one)
    long = _turns(small, "app:b", 12)
    assert len(small.get("app:b", long[-1]).conversation()) == 24
    assert small.stats()["bytes"] <= small.max_bytes and small.stats()["kept_whole"] >= 1


def test_a_response_whose_previous_went_meanwhile_is_kept_whole(tmp_path):
    store = ResponseStore(100, 10_000_000, files=ResponseFiles(tmp_path / "responses"))
    first = _keep(store, "app:a", 1)
    earlier = previous(store, "app:a", first)
    store.delete("app:a", first)                  # while the next one was being answered
    second = _keep(store, "app:a", 2, earlier=earlier)
    kept = store.get("app:a", second)
    assert kept.earlier is None and len(kept.items) == 3 and store.stats()["kept_whole"] == 1
    doc = json.loads((tmp_path / "responses" / f"{second}.json").read_text())
    assert doc["previous"] is None and len(doc["items"]) == 3


def test_a_file_continuing_one_that_cannot_be_read_is_removed(tmp_path, caplog):
    folder = tmp_path / "responses"
    store = ResponseStore(100, 10_000_000, files=ResponseFiles(folder))
    rids = _turns(store, "app:a", 3)
    lone = _keep(store, "app:b", 9)
    (folder / f"{rids[0]}.json").write_text("{damaged")
    old = {"format": "sparkv-kept-response/1", "app": "app:c", "id": _rid(50),
           "response": {**_response(_rid(50), "Old."), "id": _rid(50)},
           "items": [{"role": "user", "content": "Q?", "id": "msg_1"}],
           "output": _response(_rid(50), "Old.")["output"]}
    (folder / f"{_rid(50)}.json").write_text(json.dumps(old))         # the first format
    again = ResponseStore(100, 10_000_000, files=ResponseFiles(folder))
    assert again.load() == 2
    assert [again.get("app:a", r) for r in rids] == [None] * 3
    assert again.get("app:b", lone) is not None
    assert len(again.get("app:c", _rid(50)).conversation()) == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted([f"{_rid(50)}.json",
                                                            f"{lone}.json"])
    assert "which cannot be read back" in caplog.text


def test_a_file_written_after_its_response_went_is_removed(tmp_path):
    folder = tmp_path / "responses"
    store = ResponseStore(100, 10_000_000, files=ResponseFiles(folder))
    rids = _turns(store, "app:a", 2)
    kept = store.get("app:a", rids[0])
    store.delete("app:a", rids[0])                  # held: rids[1] continues it
    assert store.persist("app:a", rids[0], kept)    # a write that was under way
    assert sorted(p.name for p in folder.iterdir()) == [f"{rids[0]}.held.json",
                                                        f"{rids[1]}.json"]
    store.delete("app:a", rids[1])
    assert store.persist("app:a", rids[1], store.get("app:a", rids[1]) or kept)
    assert list(folder.iterdir()) == []


def test_a_response_past_its_time_is_held_while_a_newer_one_continues_it(tmp_path):
    now = [1_000.0]
    folder = tmp_path / "responses"
    store = ResponseStore(10, 100_000, files=ResponseFiles(folder), ttl_s=100,
                          clock=lambda: now[0])
    body = ResponsesBody(model="m", input="Q?")
    first = {**_response(_rid(1), "A."), "id": _rid(1), "created_at": 1_000}
    asyncio.run(ResponseKeeper(store, "app:a", None, body.items())(first))
    second = {**_response(_rid(2), "B."), "id": _rid(2), "created_at": 1_080}
    asyncio.run(ResponseKeeper(store, "app:a", store.get("app:a", _rid(1)),
                               body.items())(second))
    now[0] = 1_150.0                               # the first is past its time
    assert store.get("app:a", _rid(1)) is None and store.stats()["held"] == 1
    assert len(store.get("app:a", _rid(2)).conversation()) == 4
    assert (folder / f"{_rid(1)}.held.json").exists()
    now[0] = 1_200.0                               # the second too: both go
    assert store.get("app:a", _rid(2)) is None
    assert store.stats()["bytes"] == 0 and list(folder.iterdir()) == []
