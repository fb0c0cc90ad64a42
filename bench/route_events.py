"""What the OpenAI routes' streamed events cost per token (docs/asks.md, "OpenAI's Responses
API"): a 4,096-token answer's events written by ``POST /v1/chat/completions``'s stream
(:class:`~sparkv.asks.completion.ChoiceStream`) and by ``POST /v1/responses``'s
(:class:`~sparkv.asks.responses.ResponseEvents`), from a scripted ask's events (no model, no
socket: the routes' own work only), with and without log-probabilities.

    python bench/route_events.py [--tokens 4096] [--out bench/results/route_events_cpu.json]

Wall clock on whatever machine runs it; the best of five runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import time
from types import SimpleNamespace
from typing import Any, AsyncIterator

from sparkv.asks.completion import ChoiceStream, Choices, Completion
from sparkv.asks.respschemas import ResponsesBody
from sparkv.asks.responses import ResponseEvents, ResponseOf

RUNS = 5


class ScriptedTicket:
    """An ask's events, given as they would come (what the routes read of a ticket)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    async def aevents(self) -> AsyncIterator[dict[str, Any]]:
        for e in self.events:
            yield e

    def cancel(self) -> None:
        pass


def answer_events(n: int, logprobs: bool) -> list[dict[str, Any]]:
    """``n`` token events of one word each, then the ``done`` event."""
    alts = [{"token": 7, "logprob": -2.0}, {"token": 8, "logprob": -3.0}] if logprobs else None
    tokens = [{"type": "token", "token": 5, "text": " word",
               **({"logprob": -0.5, "top_logprobs": alts} if logprobs else {})}
              for _ in range(n)]
    done = {"type": "done", "text": " word" * n, "tokens": [5] * n, "kept_id": None,
            "first_token_s": 0.1, "stats": {"context_tokens": 10, "question_tokens": 4}}
    return tokens + [done]


def completion(n: int, logprobs: bool) -> Completion:
    asks = SimpleNamespace(lm=SimpleNamespace(decode_tokens=lambda ids: " word"), eos={0})
    ask = SimpleNamespace(options=SimpleNamespace(max_new_tokens=n + 1, stop=[]),
                          logprobs=2 if logprobs else None)
    return Completion("0" * 32, asks, ask)  # type: ignore[arg-type]  # scripted, duck-typed


def chat_stream(events: list[dict[str, Any]], c: Completion) -> Any:
    ticket: Any = ScriptedTicket(events)
    choices = Choices([ticket], [[0]])
    return ChoiceStream(choices, c, include_usage=True).body_iterator


def responses_stream(events: list[dict[str, Any]], c: Completion) -> Any:
    body = ResponsesBody.model_validate({"model": "0" * 32, "input": "q"})
    ticket: Any = ScriptedTicket(events)
    return ResponseEvents(ticket, ResponseOf(body, c)).body_iterator


async def drain(it: Any) -> int:
    return sum([len(b) async for b in it])


def measure(route: Any, n: int, logprobs: bool) -> dict[str, float]:
    """The best of :data:`RUNS`: microseconds and bytes per token."""
    best, size = float("inf"), 0
    for _ in range(RUNS):
        events, c = answer_events(n, logprobs), completion(n, logprobs)
        t0 = time.perf_counter()
        size = asyncio.run(drain(route(events, c)))
        best = min(best, time.perf_counter() - t0)
    return {"us_per_token": best / n * 1e6, "bytes_per_token": size / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out", type=pathlib.Path, default=None)
    args = ap.parse_args()
    rows = []
    for logprobs in (False, True):
        for name, route in (("chat.completions", chat_stream), ("responses", responses_stream)):
            rows.append({"route": name, "logprobs": logprobs,
                         **measure(route, args.tokens, logprobs)})
    print(f"{'route':<18} {'logprobs':<9} {'us/token':>9} {'bytes/token':>12}")
    for r in rows:
        print(f"{r['route']:<18} {str(r['logprobs']):<9} {r['us_per_token']:>9.1f} "
              f"{r['bytes_per_token']:>12.0f}")
    if args.out:
        args.out.write_text(json.dumps({"tokens": args.tokens, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
