"""The main job's last part (``sparkv demo``): the device's system service. ``sparkv device
serve`` runs as its own process (the same model, dtype and emulated link as the rest of the
demo, the demo's server behind it); two apps ask it at once through the stock ``openai``
client, each with its own app token: one with chat completions, one with the Responses API,
both streamed, both SparKV over the one link. Then both ask a follow-up at once, the reader
app sending its conversation, the Responses app naming its first response
(``previous_response_id``): the service continues each conversation from the KV that app kept,
streaming nothing, both answering at once, their tokens in one pass
(docs/device-service.md, "Calls at once"). Each answer is printed with the TTFT its app saw,
what was streamed and computed, and whether it is the dense reference's answer (docs/asks.md,
"OpenAI's Responses API"; docs/device-service.md). Last, the reader app asks for three sampled
titles at once (``n=3``): the choices read the app's kept context together, their tokens in
the same passes (docs/device-service.md, "Calls that read one working memory"); sampled, they
are draws, not the greedy answer, and the demo says so.

This module sits beside :mod:`sparkv.demo`, above both sides.
"""

from __future__ import annotations

import argparse
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sparkv.device.client import DeviceProcess
    from sparkv.runtime.model import LoadedModel

log = logging.getLogger("sparkv.demo")

__all__ = ["ask_as_apps", "AppAnswer", "memory_said", "service_of"]

#: the device service's memory budget in the demo (MB: both apps' kept contexts fit)
SERVICE_BUDGET_MB = 1024


@dataclass
class AppAnswer:
    """What one app got: its text, the TTFT it saw (its request to its first text), the
    ask's stats (strategy, bytes streamed, chunks ...), the prompt tokens the service's memory
    held, the Responses API's id, and whether the text is a dense full prefill's (``dense``:
    the line that says so)."""

    app: str
    api: str
    text: str = ""
    ttft_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    cached_tokens: int = 0
    response_id: str | None = None
    same_as_dense: bool = False
    dense: str = ""

    def line(self) -> str:
        st = self.stats
        what = (f"{st.get('bytes_streamed', 0) / 1e6:.2f} MB streamed, "
                f"{st.get('chunks_streamed', 0)}/{st.get('chunks_computed', 0)} chunks "
                "streamed/computed" if st.get("bytes_streamed") else "nothing streamed")
        held = (f", {self.cached_tokens} prompt tokens from the service's memory"
                f"{memory_said(st.get('memory_sources') or {})}" if self.cached_tokens else "")
        return (f"[{self.app}, {self.api}] {self.text.strip()}\n"
                f"  TTFT {self.ttft_s:.2f} s as the app saw it; {st.get('strategy', '?')}: "
                f"{what}{held}; {self.dense}")


def memory_said(sources: dict[str, int]) -> str:
    """What a kept ask's working memory was filled from, said in a parenthesis (``sources``:
    its stats' ``memory_sources``; "" when unknown)."""
    if not sources:
        return ""
    if set(sources) == {"working memory"}:
        return " (the working memory its last call or its import left, kept)"
    parts = ", ".join(f"{n} {src}" for src, n in sorted(sources.items(), key=lambda x: -x[1]))
    return f" (its token chunks: {parts})"


def service_of(args: argparse.Namespace, server_url: str, tmp: str) -> "DeviceProcess":
    """``sparkv device serve`` (not started): the demo's model, dtype, device and link, its
    asks sent to ``server_url``, two asks at once."""
    import torch

    from sparkv.device.client import DeviceProcess

    link = (["--link-mbps", f"{args.mbps:g}"] if args.mbps else
            ["--link-trace", args.trace] if args.trace else [])
    return DeviceProcess(Path(tmp) / "device", SERVICE_BUDGET_MB, model=args.model,
                         torch_threads=max(1, torch.get_num_threads()),
                         extra_args=["--ask-server", server_url, "--ask-slots", "2",
                                     "--device", str(args.device), "--dtype", str(args.dtype),
                                     *link])


def ask_as_apps(args: argparse.Namespace, lm: "LoadedModel", context: list[int], cid: str,
                server_url: str, tmp: str, follow_up: str) -> dict[str, Any] | None:
    """The demo's device-service part (module docstring; ``follow_up``: the follow-up
    question): prints it, returns ``demo.json``'s ``apps`` (``None``, said in one line,
    without the ``openai`` client)."""
    try:
        import openai
    except ImportError:
        print("\nthe device service part is skipped: the openai client is not installed "
              "(pip install openai)", flush=True)
        return None
    log.info("starting the device service (sparkv device serve) ...")
    with service_of(args, server_url, tmp) as dev:
        print("\nthe device's system service (sparkv device serve, its own process, the same "
              "model and link): two apps ask it at once through the stock openai client",
              flush=True)
        clients = {app: _client(openai, dev, app) for app in ("reader", "notes")}
        try:
            _warm_up(clients["reader"], cid)
            got = _two_apps(clients, cid, args)
            got += _follow_ups(clients, cid, args, follow_up, got)
            drawn = _choices(clients["reader"], cid, args)
        finally:
            for c in clients.values():
                c.close()
    _say_dense(lm, context, args, follow_up, got)
    print(f"{got[0].line()}\n{got[1].line()}\n  (both asked at once: they share the "
          "service's one link and its cores, which go to the oldest ask's work first, its "
          "answer's tokens included, so the second app's load shares the cores with the first "
          "app's answer; device serve --ask-core-order first-tokens puts first tokens first)"
          f"\n{got[2].line()}\n{got[3].line()}\n  (both follow-ups "
          "asked at once, each from its app's kept context: both answer at once, their "
          "tokens in one pass)", flush=True)
    print(drawn.lines(), flush=True)
    return {"question": args.question, "answers": [asdict(a) for a in got],
            "choices": asdict(drawn)}


def _client(openai: Any, dev: "DeviceProcess", app: str) -> Any:
    """The stock client, asking the service on its socket as ``app``."""
    import httpx

    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)), timeout=600.0)
    return openai.OpenAI(base_url="http://localhost/v1", api_key=dev.app_token(app),
                         http_client=http, max_retries=0)


#: the ``sparkv`` extension of both apps' requests: SparKV, what it loaded kept for a follow-up
SPARKV_FIELDS = {"sparkv": {"strategy": "sparkv", "keep": True}}


def _warm_up(oa: Any, cid: str) -> None:
    """One short ask, kept by nobody, before the measured ones: the service's first use of
    each path's kernels and tables is paid here, as the in-process part's warm-up asks pay
    it."""
    log.info("warming the device service up: one short sparkv ask ...")
    oa.chat.completions.create(model=cid, max_tokens=1, messages=[
        {"role": "user", "content": "Warm up."}],
        extra_body={"sparkv": {"strategy": "sparkv", "keep": False}})


def _two_apps(clients: dict[str, Any], cid: str, args: argparse.Namespace) -> list[AppAnswer]:
    """Both apps' first question, asked at once."""
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(_chat, clients["reader"], cid, args)
        resp = pool.submit(_respond, clients["notes"], cid, args, args.question, None)
        return [chat.result(), resp.result()]


def _follow_ups(clients: dict[str, Any], cid: str, args: argparse.Namespace, follow_up: str,
                first: list[AppAnswer]) -> list[AppAnswer]:
    """Both apps' follow-up, asked at once: the reader's conversation, the notes app's
    response after its first."""
    talk = [{"role": "user", "content": args.question},
            {"role": "assistant", "content": first[0].text},
            {"role": "user", "content": follow_up}]
    with ThreadPoolExecutor(2) as pool:
        chat = pool.submit(_chat, clients["reader"], cid, args, talk)
        resp = pool.submit(_respond, clients["notes"], cid, args, follow_up,
                           first[1].response_id)
        return [chat.result(), resp.result()]


#: the sampled request's question, its choices and temperature
CHOICES_QUESTION, CHOICES_N, CHOICES_TEMPERATURE = "Suggest a title for this text.", 3, 0.8


@dataclass
class DrawnChoices:
    """The reader app's sampled request: its choices' texts, the request's time, and how many
    choices read the working memory another had switched in (``joined``)."""

    texts: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    joined: int = 0
    seed: int = 7

    def lines(self) -> str:
        shown = "\n".join(f"  {i + 1}. {' '.join(t.split())}"      # each on one line
                           for i, t in enumerate(self.texts))
        return (f"[reader, chat.completions, n={len(self.texts)} sampled at temperature "
                f"{CHOICES_TEMPERATURE}, seed {self.seed}] {CHOICES_QUESTION}\n{shown}\n"
                f"  {self.wall_s:.2f} s for all {len(self.texts)}: they read the app's kept "
                f"context together ({self.joined} joined the first's turn), their tokens in "
                "the same passes; sampled, each is a draw of the model, not the greedy answer "
                "(no dense reference to compare)")


def _choices(oa: Any, cid: str, args: argparse.Namespace) -> DrawnChoices:
    """The reader app's three sampled titles, asked in one request over its kept context."""
    out = DrawnChoices()
    t0 = time.perf_counter()
    r = oa.chat.completions.create(
        model=cid, messages=[{"role": "user", "content": CHOICES_QUESTION}],
        n=CHOICES_N, temperature=CHOICES_TEMPERATURE, seed=out.seed,
        max_tokens=min(args.max_new_tokens, 16), extra_body=SPARKV_FIELDS)
    out.wall_s = time.perf_counter() - t0
    out.texts = [c.message.content or "" for c in r.choices]
    each = (r.model_extra or {}).get("sparkv", {}).get("choices", [])
    out.joined = sum(bool(c.get("stats", {}).get("joined")) for c in each)
    return out


def _chat(oa: Any, cid: str, args: argparse.Namespace,
          messages: list[dict[str, str]] | None = None) -> AppAnswer:
    """The reader app: a streamed chat completion (of ``messages``, a conversation; else the
    question)."""
    out = AppAnswer("reader", "chat.completions" + (", the conversation" if messages else ""))
    t0 = time.perf_counter()
    stream = oa.chat.completions.create(
        model=cid, messages=messages or [{"role": "user", "content": args.question}],
        stream=True,
        max_tokens=args.max_new_tokens, stream_options={"include_usage": True},
        extra_body=SPARKV_FIELDS)
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content and not out.text:
                out.ttft_s = time.perf_counter() - t0
            out.text += choice.delta.content or ""
        if chunk.usage is not None:
            out.cached_tokens = chunk.usage.prompt_tokens_details.cached_tokens
            out.stats = (chunk.model_extra or {}).get("sparkv", {}).get("stats", {})
    return out


def _respond(oa: Any, cid: str, args: argparse.Namespace, question: str,
             previous: str | None) -> AppAnswer:
    """The notes app: a streamed response (after ``previous``, when it names one)."""
    out = AppAnswer("notes", "responses" + (", previous_response_id" if previous else ""))
    t0 = time.perf_counter()
    for ev in oa.responses.create(model=cid, input=question, previous_response_id=previous,
                                  stream=True, max_output_tokens=args.max_new_tokens,
                                  extra_body=SPARKV_FIELDS):
        if ev.type == "response.output_text.delta" and not out.text:
            out.ttft_s = time.perf_counter() - t0
        if ev.type == "response.output_text.delta":
            out.text += ev.delta
        elif ev.type in ("response.completed", "response.incomplete"):
            r = ev.response
            out.response_id = r.id
            out.cached_tokens = r.usage.input_tokens_details.cached_tokens
            out.stats = (r.model_extra or {}).get("sparkv", {}).get("stats", {})
    return out


def _say_dense(lm: "LoadedModel", context: list[int], args: argparse.Namespace,
               follow_up: str, got: list[AppAnswer]) -> None:
    """Sets each answer's ``dense``: whether it is what a dense full prefill of the same
    conversation answers (the demo never shows an answer worse than dense without saying so)."""
    from sparkv.edge.prompts import question_suffix
    from sparkv.runtime.generate import reference_generate
    from sparkv.runtime.turns import ChatTurn, Conversation

    first = reference_generate(lm, context + question_suffix(lm, args.question),
                               args.max_new_tokens)
    then: dict[str, list[int]] = {}
    for answer in {a.text for a in got[:2]}:
        conv = Conversation((ChatTurn("user", args.question), ChatTurn("assistant", answer),
                             ChatTurn("user", follow_up)))
        then[answer] = reference_generate(lm, context + question_suffix(lm, conv),
                                          args.max_new_tokens)
    for a, ref in zip(got, (first, first, then[got[0].text], then[got[1].text])):
        same = a.same_as_dense = lm.decode_tokens(ref).strip() == a.text.strip()
        a.dense = ("the same answer as a dense full prefill of the conversation" if same else
                   "NOT the dense reference's answer (a dense full prefill of the "
                   f"conversation answers {lm.decode_tokens(ref).strip()!r}; docs/quality.md)")

