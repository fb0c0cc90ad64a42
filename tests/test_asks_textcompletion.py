"""``POST /v1/completions`` (sparkv/asks/textcompletion.py): the unchanged ``openai`` client's
text completions through a real device service on its socket, asking a real server about a
context (the tiny model): the answer is the ask's with ``chat`` off, streamed or not, with echo,
several prompts, log-probabilities, and clear refusals of what it cannot answer."""

from __future__ import annotations

import json

import httpx
import pytest

from sparkv.device.client import DeviceProcess
from sparkv.edge.client import EdgeClient
from sparkv.runtime.generate import sample_text
from helpers import shared_tiny_checkpoint, start_tiny_server, stop_checked

openai = pytest.importorskip("openai")

GUARD_S = 300.0          # hang guards only (never a timing assertion)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny server with one context and a device service asking it by default."""
    tmp = tmp_path_factory.mktemp("textcompletion")
    srv = start_tiny_server(tmp)
    key = srv.keys["alice"]
    client = EdgeClient(srv.url, key, timeout_s=120)
    cid = client.create_context(text=sample_text()[:1500], levels=["raw", "q5"],
                                chunk_tokens=32)
    client.close()
    dev = DeviceProcess(tmp / "dev", 200, model=str(shared_tiny_checkpoint()),
                        extra_args=["--ask-server", srv.url]).start()
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)), timeout=GUARD_S)
    oa = openai.OpenAI(base_url="http://localhost/v1", api_key=dev.app_token("app"),
                       http_client=http, max_retries=0)
    # exact and local: every answer is the model's greedy continuation, whatever the link
    fields = {"api_key": key, "strategy": "local", "backend": "dense", "level": "raw",
              "keep": False, "stop_at_eos": False}
    yield {"srv": srv, "cid": cid, "dev": dev, "oa": oa, "http": http, "fields": fields}
    http.close()
    dev.stop()
    log = dev.log()
    stop_checked(srv)
    assert "Traceback" not in log, log[-4000:]


def _complete(world, **kw):
    return world["oa"].completions.create(model=world["cid"], extra_body={
        "sparkv": world["fields"]}, **kw)


def _ask(world, question: str, n: int) -> dict:
    """The ``done`` event of the same question through ``POST /v1/asks`` with ``chat`` off."""
    r = world["http"].post("http://localhost/v1/asks", headers={
        "Authorization": f"Bearer {world['dev'].app_token('app')}"}, json={
        "context_id": world["cid"], "question": question, "max_new_tokens": n, "chat": False,
        **world["fields"]})
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.text.splitlines()][-1]


def test_a_text_completion_is_the_ask_with_chat_off(world):
    r = _complete(world, prompt=" The story", max_tokens=6)
    done = _ask(world, " The story", 6)
    assert done["type"] == "done"
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.model == world["cid"]
    [choice] = r.choices
    assert choice.text == done["text"] and choice.index == 0
    assert choice.finish_reason == "length" and choice.logprobs is None
    stats = done["stats"]
    assert r.usage.prompt_tokens == stats["context_tokens"] + stats["question_tokens"]
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_echo_and_the_stream_add_up_to_the_whole_answer(world):
    whole = _complete(world, prompt=" Once", max_tokens=5, echo=True)
    assert whole.choices[0].text.startswith(" Once")
    assert whole.choices[0].text == " Once" + _ask(world, " Once", 5)["text"]
    chunks = list(_complete(world, prompt=" Once", max_tokens=5, echo=True, stream=True,
                            stream_options={"include_usage": True}))
    *texts, last = chunks
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert texts[0].choices[0].text == " Once"              # the echo comes first
    assert "".join(c.choices[0].text for c in texts) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in texts][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in texts[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens


def test_several_prompts_answer_in_prompt_order_n_choices_each(world):
    r = _complete(world, prompt=[" Alpha", " Beta went"], n=2, max_tokens=4)
    a, b = (_complete(world, prompt=p, max_tokens=4) for p in (" Alpha", " Beta went"))
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text] * 2 + [b.choices[0].text] * 2
    assert r.usage.prompt_tokens == a.usage.prompt_tokens + b.usage.prompt_tokens
    assert r.usage.completion_tokens == 4 * 4
    sampled = _complete(world, prompt=[" Alpha", " Beta went"], n=2, max_tokens=4,
                        temperature=1.0, seed=11)
    again = _complete(world, prompt=[" Alpha", " Beta went"], n=2, max_tokens=4,
                      temperature=1.0, seed=11)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]   # seeded


def test_logprobs_are_the_legacy_lists_with_offsets_into_the_text(world):
    r = _complete(world, prompt=" The end", max_tokens=5, logprobs=2)
    [choice] = r.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5 and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(choice.text)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)     # greedy: the likeliest token
        assert top[token] == pytest.approx(logprob)
    streamed = [c.choices[0].logprobs for c in _complete(world, prompt=" The end", max_tokens=5,
                                                         logprobs=2, stream=True)
                if c.choices[0].logprobs is not None]
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    assert [t for s in streamed for t in s.tokens] == lp.tokens


@pytest.mark.parametrize("kw, says", [
    ({"prompt": "a", "suffix": "b"}, "suffix"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "echo": True, "logprobs": 1}, "echo with logprobs"),
    ({"prompt": ["a", "b", "c"], "n": 3}, "at most 8 choices"),
    ({"prompt": ""}, "empty prompt"),
    ({"prompt": [1, 2, 3]}, "valid string"),
])
def test_what_it_cannot_answer_is_refused_clearly(world, kw, says):
    with pytest.raises(openai.UnprocessableEntityError) as e:
        _complete(world, max_tokens=3, **kw)
    assert says in str(e.value)
    assert _complete(world, prompt=" Still", max_tokens=2).choices[0].text   # still answers
