"""The kept responses of the Responses API, without a service (tests/test_asks_service.py
continues and reads them through the ``openai`` client): a response is its app's alone; one
continuing another comes after its whole conversation, which outlives the response it came
from; the store stays within its count and bytes by evicting the least recently used response
of the app holding the most, so a busy app cannot push out a quiet one's."""

from __future__ import annotations

import pytest

from sparkv.asks.respschemas import InputMessage, ResponsesBody, as_input
from sparkv.asks.respstore import ResponseStore, StoredResponse

pytest.importorskip("fastapi")
from sparkv.asks.respkept import (NoResponsesKept, ResponseKeeper,  # noqa: E402
                                  UnknownPrevious, _between, previous)


def _kept(nbytes: int = 100) -> StoredResponse:
    return StoredResponse({"id": "r"}, (), (), 0, nbytes)


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "object": "response", "output": [
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
    ResponseKeeper(store, "app:a", None, first.items())(_response("r1", "A poem."))
    r1 = previous(store, "app:a", "r1")
    assert r1 is not None and [i.id is not None for i in r1.items] == [True]
    second = ResponsesBody(model="m", input="Who wrote it?", previous_response_id="r1")
    turns = second.turns(r1.conversation())
    assert [(t.role, t.text) for t in turns] == [
        ("user", "What is it?"), ("assistant", "A poem."), ("user", "Who wrote it?")]
    ResponseKeeper(store, "app:a", r1, second.items())(_response("r2", "Keats."))
    r2 = store.get("app:a", "r2")
    assert r2 is not None and r2.items[:2] == r1.conversation()
    assert r2.conversation_bytes > r1.conversation_bytes and r2.nbytes > r2.conversation_bytes
    store.delete("app:a", "r1")                  # r2 keeps its conversation
    assert len(r2.conversation()) == 4
    with pytest.raises(UnknownPrevious, match="'r1' not found"):
        previous(store, "app:a", "r1")
    with pytest.raises(UnknownPrevious):
        previous(store, "app:b", "r2")
    with pytest.raises(NoResponsesKept, match="--responses-kept 0"):
        previous(ResponseStore(0), "app:a", "r2")
    assert previous(store, "app:a", None) is None


def test_output_items_are_input_items_and_a_page_of_them_is_cut_by_id():
    items = as_input(_response("r", "Hi.")["output"])
    assert isinstance(items[0], InputMessage) and items[0].id == "msg_r"
    rows = [{"id": f"i{k}"} for k in range(5)]
    assert [r["id"] for r in _between(rows, "i1", "i4")] == ["i2", "i3"]
    assert _between(rows, None, None) == rows
    with pytest.raises(Exception, match="no input item 'x'"):
        _between(rows, "x", None)
