"""The Responses API's request read into a chat's parts, and its event stream, without a
service (tests/test_asks_service.py asks the running one with the ``openai`` client).

What is asserted: the input becomes the same turns a chat's messages do (instructions first,
an assistant's message and its calls one turn, a call's output the user's turn, output items
sent back as input); what the service does not do is refused by name; ``text.format`` is a
chat's ``response_format``; the stream's events are numbered, its deltas add up to the text,
an answer at the cap ends ``response.incomplete`` and an ask that fails ``response.failed``."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from sparkv.asks.completion import Completion
from sparkv.asks.respschemas import ResponsesBody
from sparkv.asks.responses import ResponseOf, StreamEvents
from sparkv.device.schemas import JsonSchemaFormat
from sparkv.runtime.turns import ChatTurn

CID = "0" * 32


def _body(**fields) -> ResponsesBody:
    return ResponsesBody.model_validate({"model": CID, "input": "What is it?", **fields})


def test_the_input_becomes_the_turns_a_chats_messages_do():
    body = _body(instructions="Be brief.", input=[
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "Rain"}]},
        {"role": "developer", "content": "Now answer."},
        {"role": "user", "content": [{"type": "input_text", "text": "So?"}]}])
    turns = body.turns()
    assert [t.role for t in turns] == ["system", "user", "assistant", "user", "user",
                                       "system", "user"]
    assert turns[0] == ChatTurn("system", "Be brief.")
    said = turns[2].text
    assert said.startswith("Let me look.\n<tool_call>") and said.count("<tool_call>") == 2
    assert '"Oslo"' in said and '"Rome"' in said
    assert turns[3].text == "<tool_response>\nSunny\n</tool_response>"
    assert turns[4].text == "<tool_response>\nRain\n</tool_response>"
    assert turns[-1] == ChatTurn("user", "So?")
    assert _body().turns() == [ChatTurn("user", "What is it?")]


@pytest.mark.parametrize("fields, says", [
    ({"previous_response_id": ""}, "previous_response_id"),
    ({"conversation": "conv_1", "previous_response_id": "resp_1"},
     "conversation is not taken with previous_response_id"),
    ({"background": True, "store": False}, "background is not taken with store false"),
    ({"reasoning": {"effort": "low"}}, "does not reason"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "functions only"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "'reasoning' items are not taken"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "'input_file' content"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tool_choice": {"type": "function", "name": "nope"},
      "tools": [{"type": "function", "name": "f"}]}, "not one of the tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"n": {"minimum": 1}}}}}}, "minimum"),
    ({"unknown_field": 1}, "unknown_field"),
    ({"include": ["file_search_call.results"]}, "include"),
])
def test_what_the_service_does_not_do_is_refused_by_name(fields, says):
    with pytest.raises(ValidationError, match=says):
        _body(**fields)


def test_what_stock_clients_send_at_no_op_values_is_taken():
    body = _body(store=False, background=False, truncation="disabled", reasoning=None,
                 metadata={"a": "b"}, user="u", safety_identifier="s", prompt_cache_key="k",
                 prompt_cache_retention="24h", prompt_cache_options={"ttl": "1h"},
                 max_tool_calls=3,
                 text={"format": {"type": "text"}, "verbosity": "low"}, temperature=0)
    assert body.text is not None and body.text.response_format().form() is None
    assert body.logprobs() is None
    assert _body(include=["message.output_text.logprobs"]).logprobs() == 0
    assert _body(top_logprobs=3).logprobs() == 3


def test_a_json_schema_format_is_a_chats_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    body = _body(text={"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                  "strict": True}})
    fmt = body.text.response_format()
    assert isinstance(fmt, JsonSchemaFormat) and fmt.json_schema.schema_ == schema
    assert fmt.form() is not None


# ---- the event stream --------------------------------------------------------------------------
class _Ticket:
    def __init__(self, events: list[dict]) -> None:
        self.events = events

    async def aevents(self):
        for e in self.events:
            yield e


def _events(body: ResponsesBody, events: list[dict], max_tokens: int = 3,
            tools=None) -> list[dict]:
    asks = SimpleNamespace(lm=SimpleNamespace(decode_tokens=lambda ids: f"<{ids[0]}>"),
                           eos={0})
    ask = SimpleNamespace(options=SimpleNamespace(max_new_tokens=max_tokens, stop=[]),
                          logprobs=None)
    r = ResponseOf(body, Completion(body.model, asks, ask, tools))

    async def read() -> list[bytes]:
        return [b async for b in StreamEvents(r).of(_Ticket(events))]

    out = []
    for raw in asyncio.run(read()):
        head, data = raw.decode().rstrip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def _done(text: str, tokens: list[int]) -> dict:
    return {"type": "done", "text": text, "tokens": tokens, "kept_id": None,
            "first_token_s": 0.1, "stats": {"context_tokens": 10, "question_tokens": 4}}


def test_the_stream_is_numbered_and_its_deltas_are_the_text():
    tokens = [{"type": "token", "token": t, "text": s} for t, s in [(5, "Hel"), (6, "lo")]]
    out = _events(_body(), [{"type": "queued", "position": 0}, *tokens,
                            _done("Hello", [5, 6, 0])])
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert "".join(e["delta"] for e in out if "delta" in e) == "Hello"
    final = out[-1]["response"]
    assert final["status"] == "completed" and final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 14 and final["usage"]["output_tokens"] == 3


def test_an_answer_at_the_cap_is_incomplete_and_a_failed_ask_fails_the_response():
    tokens = [{"type": "token", "token": t, "text": "x"} for t in (5, 6, 7)]
    out = _events(_body(max_output_tokens=3), [*tokens, _done("xxx", [5, 6, 7])])
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out[-1]["response"]["output"][0]["status"] == "incomplete"
    error = {"type": "error", "error": {"status": 502, "code": "server_unavailable",
                                        "message": "gone"}}
    out = _events(_body(), [tokens[0], error])
    assert out[-1]["type"] == "response.failed"
    assert out[-1]["response"]["error"] == {"code": "server_unavailable", "message": "gone"}
    assert out[-1]["response"]["status"] == "failed"
    empty = _events(_body(), [_done("", [0])])     # no text: the message is still there
    assert empty[-1]["response"]["output"][0]["content"][0]["text"] == ""


def test_truncation_drops_the_oldest_turns_until_the_conversation_fits(monkeypatch):
    """By bisection over the user turns: the instructions stay, what is left begins with a
    user's turn and ends with the question; a question too long alone is left whole."""
    import sparkv.edge.prompts as prompts
    from sparkv.asks.truncation import fitted
    from sparkv.runtime.turns import Conversation

    monkeypatch.setattr(prompts, "question_suffix",       # a token a character
                        lambda lm, conv, chat=True: list("".join(t.text for t in conv.turns)))
    pairs = [t for k in range(5) for t in (ChatTurn("user", f"q{k}" * 50),
                                             ChatTurn("assistant", f"a{k}" * 50))]
    conv = Conversation((ChatTurn("system", "rules"), *pairs, ChatTurn("user", "last?")))
    assert fitted(None, conv, 10_000) == (conv, 0)
    kept, dropped = fitted(None, conv, 5 + 4 * 100 + 5)   # the last two pairs and the question
    assert dropped == 6 and kept.turns[0] == ChatTurn("system", "rules")
    assert kept.turns[1:] == conv.turns[7:]
    kept, dropped = fitted(None, conv, 5 + 4 * 100 + 4)   # one short: a pair less
    assert dropped == 8 and kept.turns[1].text == "q4" * 50
    kept, dropped = fitted(None, conv, 3)                 # not even the question
    assert dropped == 10 and kept.turns[1:] == (ChatTurn("user", "last?"),)


def test_streamed_calls_come_as_the_model_writes_them_a_repeat_never_and_a_cut_one_incomplete():
    """A call's item is added once its name is written, its arguments' deltas come as the
    tokens write them and add up to the arguments, then their done and the item's; a repeat
    of a call shows no event; the final response names the calls with the streamed ids. Cut
    off in its arguments at the cap, the call's item ends incomplete, as the response."""
    from sparkv.runtime.toolform import Tool, ToolSet, call_text

    tools = ToolSet([Tool("note")], "required")
    one, two = call_text("note", '{"a": 1}'), call_text("note", '{"a": 2}')
    text = one + "\n" + one + "\n" + two
    pieces = [text[k:k + 7] for k in range(0, len(text), 7)]
    tokens = [{"type": "token", "token": 5, "text": p} for p in pieces]
    out = _events(_body(), [*tokens, _done(text, [5] * len(pieces) + [0])], 99, tools)
    kinds = [e["type"] for e in out]
    assert kinds.count("response.output_item.added") == 2
    assert kinds.count("response.function_call_arguments.done") == 2
    added = [e for e in out if e["type"] == "response.output_item.added"]
    assert [a["item"]["status"] for a in added] == ["in_progress"] * 2
    for j, args in enumerate(['{"a": 1}', '{"a": 2}']):
        deltas = [e["delta"] for e in out
                  if e["type"] == "response.function_call_arguments.delta"
                  and e["output_index"] == j]
        assert len(deltas) >= (2 if j == 0 else 1) and "".join(deltas) == args  # 2: held
    final = out[-1]["response"]
    assert out[-1]["type"] == "response.completed"
    assert [(i["call_id"], i["arguments"], i["status"]) for i in final["output"]] == [
        (a["item"]["call_id"], args, "completed")
        for a, args in zip(added, ['{"a": 1}', '{"a": 2}'])]
    cut = one[:48]
    out = _events(_body(), [{"type": "token", "token": 5, "text": cut}, _done(cut, [5])], 1,
                  tools)
    assert out[-2]["type"] == "response.output_item.done"
    assert out[-2]["item"]["status"] == "incomplete" and out[-2]["item"]["arguments"] == '{"a": '
    assert out[-1]["type"] == "response.incomplete"
