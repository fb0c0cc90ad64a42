"""``POST /v1/completions``: the asks through OpenAI's text completion API (the "legacy"
completions that llama.cpp's server, vLLM and lm-evaluation-harness's ``local-completions``
speak; docs/asks.md, "Text completions").

A stock client continues a server context's text unchanged::

    client = OpenAI(base_url="http://127.0.0.1:8079/v1", api_key=APP_TOKEN)
    r = client.completions.create(model=CONTEXT_ID, prompt="The license says", max_tokens=32)

* ``model`` names the server context as a chat completion's does (``sparkv.context_id`` too);
  the ``sparkv`` extension carries the ask's other fields, as there;
* ``prompt``: the text after the context, **as it is** (no chat template: the ask's ``chat`` is
  off, whatever the extension says), or a list of them (each its own ask, its choices in prompt
  order: choice ``p * n + i`` is prompt ``p``'s ``i``-th; at most 8 choices in all); or the
  model's token ids (a list, or several), run as they are (their text is their decoding);
* ``max_tokens`` (default 16, as OpenAI's; 0 with ``echo``: the prompt alone), ``stop``,
  ``n``, ``temperature``, ``top_p``, ``seed``, ``frequency_penalty``, ``presence_penalty`` and
  ``logit_bias`` as in a chat completion; ``best_of`` only equal to ``n``, ``suffix`` only
  empty (no fill in the middle);
* ``echo``: each choice's text begins with its prompt (streamed: a first event with it, with
  ``logprobs`` once the prompt ran); with ``logprobs`` its ``logprobs`` begin with the
  prompt's tokens, each scored after the context and the prompt before it in the question's
  own pass (:mod:`sparkv.runtime.promptscore`; the first token's ``null``, as OpenAI's): what
  lm-evaluation-harness's loglikelihood requests read (``echo``, ``max_tokens`` 1,
  ``logprobs`` 1);
* ``logprobs`` (0-20): ``choices[i].logprobs`` is ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (per token ``{text: logprob}`` of that many alternatives) and
  ``text_offset`` (each token's first character in the choice's ``text``);
* ``stream``: server-sent ``text_completion`` events, each choice's text as it is generated,
  then its ``finish_reason`` (``usage`` last with ``stream_options.include_usage``), then
  ``data: [DONE]``; a failure once streaming is one ``data: {"error": ...}`` event;
* ``usage``: ``prompt_tokens`` (every prompt's, each with the context's), ``completion_tokens``,
  ``total_tokens``, ``prompt_tokens_details.cached_tokens``.

Refusals and cancellation are a chat completion's (:mod:`sparkv.asks.chat`).
"""

from __future__ import annotations

from typing import Any, Sequence

from sparkv.extras import require_all

require_all(("fastapi",), feature="the OpenAI-compatible route of the device service "
                                   "(sparkv.asks.textcompletion)")

from fastapi import APIRouter, Request  # noqa: E402 - after the check

from sparkv.asks.chat import context_id_of, openai_fields, openai_responses
from sparkv.asks.completion import ChoiceStream, Choices, Completion, answer, prompt_counts
from sparkv.asks.routes import AsksDep, ask_request
from sparkv.asks.schemas import CompletionBody, SparkvFields
from sparkv.asks.tickets import AskRequest
from sparkv.runtime.turns import TokenPrompt
from sparkv.device.app import CallerDep

__all__ = ["TextCompletion", "completions_router", "text_offsets"]


class TextCompletion(Completion):
    """A text completion's identity, counts and shapes: a choice is ``text`` (after its prompt
    with ``echo``), its ``logprobs`` OpenAI's legacy lists."""

    OBJECT = CHUNK = "text_completion"
    PREFIX = "cmpl"

    def __init__(self, model: str, asks: Any, ask: AskRequest, prompts: Sequence[str], n: int,
                 echo: bool, shown: int | None = None) -> None:
        super().__init__(model, asks, ask)
        self.prompts, self.n, self.echo = list(prompts), n, echo
        self.shown = self.max_tokens if shown is None else shown   # 0: the prompt alone

    def lead(self, i: int) -> str:
        """What choice ``i``'s text begins with: its prompt with ``echo``, else nothing."""
        return self.prompts[i // self.n] if self.echo else ""

    def choice(self, i: int, done: dict[str, Any], events: list[dict[str, Any]]
               ) -> dict[str, Any]:
        lead = self.lead(i)
        if self.shown == 0:
            return {"index": i, "text": lead, "finish_reason": "length",
                    "logprobs": self.with_prompt(done, self.text_logprobs([], len(lead)))}
        return {"index": i, "text": lead + done["text"],
                "logprobs": self.with_prompt(done, self.text_logprobs(events, len(lead))),
                "finish_reason": self.finish_reason(done)}

    def usage(self, done: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if self.shown == 0:                       # the answer's token was not shown
            done = [{**d, "tokens": []} for d in done]
        return super().usage(done)

    def with_prompt(self, done: dict[str, Any], answer: dict[str, Any] | None
                    ) -> dict[str, Any] | None:
        """A choice's ``logprobs``: the prompt's scored tokens (echoed: ``done["prompt"]``),
        then the ``answer``'s."""
        scored = done.get("prompt")
        if answer is None or not self.echo or scored is None:
            return answer
        word = self.lm.decode_tokens
        ids = [e["token"] for e in scored]
        return {"tokens": [word([t]) for t in ids] + answer["tokens"],
                "token_logprobs": [e["logprob"] for e in scored] + answer["token_logprobs"],
                "top_logprobs": [None if e["top_logprobs"] is None
                                 else {word([a["token"]]): a["logprob"]
                                       for a in e["top_logprobs"]} for e in scored]
                + answer["top_logprobs"],
                "text_offset": text_offsets(self.lm, ids) + answer["text_offset"]}

    def opening(self, i: int) -> list[dict[str, Any]]:
        if self.echo and self.logprobs:      # the echo comes with its scores: the first token's
            return []
        return [self.chunk(i, {"content": self.lead(i)})] if self.echo else []

    def prompt_chunks(self, event: dict[str, Any], indexes: list[int]) -> list[dict[str, Any]]:
        """Each choice's echo with its prompt's scores (``logprobs`` with ``echo``), out of the
        ask's first token ``event``."""
        if event.get("prompt") is None or not (self.echo and self.logprobs):
            return []
        lp = self.with_prompt(event, self.text_logprobs([], 0))     # one prompt: the ask's
        return [self.chunk(i, {"content": self.lead(i)}, logprobs=lp) for i in indexes]

    def shown_logprobs(self, i: int, events: list[dict[str, Any]], before: str
                       ) -> dict[str, Any] | None:
        return self.text_logprobs(events, len(self.lead(i)) + len(before))

    def chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": self.CHUNK, "created": self.created,
                "model": self.model, "choices": [{"index": index,
                                                  "text": delta.get("content", ""),
                                                  "logprobs": logprobs,
                                                  "finish_reason": finish}]}

    def prompt_tokens(self, done: Sequence[dict[str, Any]]) -> tuple[int, int]:
        """Every prompt's tokens, each with the context's (its first choice's ask counts it)."""
        counts = [prompt_counts(done[p * self.n]["stats"]) for p in range(len(self.prompts))]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def text_logprobs(self, events: list[dict[str, Any]], start: int) -> dict[str, Any] | None:
        """OpenAI's legacy ``logprobs`` of token ``events`` whose text begins at character
        ``start`` of the choice's text (``None`` unless asked for)."""
        if not self.logprobs:
            return None
        offsets, at = [], start
        for e in events:
            offsets.append(at)
            at += len(e["text"])
        word = self.lm.decode_tokens
        return {"tokens": [word([e["token"]]) for e in events],
                "token_logprobs": [e["logprob"] for e in events],
                "top_logprobs": [{word([a["token"]]): a["logprob"] for a in e["top_logprobs"]}
                                 for e in events],
                "text_offset": offsets}


def text_offsets(lm: Any, ids: Sequence[int], window: int = 8) -> list[int]:
    """Each token's first character in the text ``ids`` decode to: the characters a token
    adds after the ``window`` tokens before it (a character split across tokens counts at the
    first of them, the rest add nothing)."""
    out, at = [], 0
    for k, t in enumerate(ids):
        out.append(at)
        before = list(ids[max(0, k - window):k])
        at += len(lm.decode_tokens(before + [t])) - len(lm.decode_tokens(before))
    return out


completions_router = APIRouter(tags=["openai"])


@completions_router.post("/v1/completions", responses=openai_responses(
    "a text_completion (JSON), or with stream: server-sent text_completion events, then "
    "[DONE]"))
async def completions(body: CompletionBody, request: Request, asks: AsksDep,
                      caller: CallerDep) -> Any:
    """OpenAI's text completion over asks: ``model`` names the server context, each prompt is
    text after it (no chat template), ``extra_body={"sparkv": {...}}`` the rest of the ask."""
    cid = context_id_of(body.model, body.sparkv)
    fields = (body.sparkv or SparkvFields()).model_copy(
        update={**openai_fields(body), "chat": False})
    scored = body.logprobs if body.echo else None
    questions = [p if isinstance(p, str) else TokenPrompt(tuple(p)) for p in body.prompts()]
    each = [ask_request(fields, asks, cid, q, max(1, body.max_tokens), body.logprobs, scored)
            for q in questions]
    texts = [q if isinstance(q, str) else asks.lm.decode_tokens(list(q.ids))
             for q in questions]
    c = TextCompletion(body.model, asks, each[0], texts, body.n, body.echo, body.max_tokens)
    choices = Choices.submit_each(asks, caller, each, body.n)
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        return ChoiceStream(choices, c, include)
    return await answer(choices, c, request, len(each) * body.n)
