"""What a streamed answer's token events cost (docs/asks.md, "Streamed text"): an
:class:`~sparkv.asks.tickets.AskTicket` given a 4,096-token answer one token at a time, its
text decoded a window at a time (:class:`~sparkv.runtime.textstream.TextStream`) against the
whole answer decoded after every token (what it did before), with and without stop strings.

    python bench/stream_text.py [--tokens 4096] [--out bench/results/stream_text_cpu.json]

Wall clock on whatever machine runs it; the bundled SmolLM2's tokenizer (no model run).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from typing import Any

from sparkv.runtime.textstream import TextStream


def answer_ids(lm: Any, n: int) -> list[int]:
    """``n`` tokens of the bundled sample text (repeated as needed)."""
    from sparkv.runtime.generate import sample_text

    ids: list[int] = []
    while len(ids) < n:
        ids += lm.encode_text(sample_text())
    return ids[:n]


def stream(lm: Any, ids: list[int], whole: bool, stop: tuple[str, ...]) -> dict[str, float]:
    """Seconds to give ``ids`` to a ticket one at a time, and at the last 256 tokens."""
    from sparkv.asks.tickets import AskRequest, AskTicket
    from sparkv.edge.options import AskOptions

    req = AskRequest("http://127.0.0.1:9", "a" * 32, "q", options=AskOptions(stop=stop))
    ticket = AskTicket("a1", "app", req, None, lm.decode_tokens)  # type: ignore[arg-type]
    if whole:                                   # before: the whole answer decoded every token
        ticket._answer = WholeText(lm.decode_tokens)
    t0 = time.perf_counter()
    for i, t in enumerate(ids):
        if i == len(ids) - 256:
            t_end = time.perf_counter()
        ticket.token(t)
    end = time.perf_counter()
    return {"total_s": end - t0, "last_256_ms_per_token": (end - t_end) / 256 * 1e3,
            "text_ok": ticket.streamed_text == lm.decode_tokens(ids)[:len(ticket.streamed_text)]}


class WholeText(TextStream):
    """What a ticket did before: the whole answer decoded after every token."""

    def add(self, token: int) -> str:
        self._ids.append(token)
        before, self.text = self.text, self._decode(self._ids)
        return self.text[len(before):]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="the answer's tokens")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    a = p.parse_args()
    from sparkv.runtime import load_model

    lm = load_model(progress=False)
    ids = answer_ids(lm, a.tokens)
    rows = []
    for stop in ((), ("<END>", "\n\n\n\n")):
        for whole in (True, False):
            r = stream(lm, ids, whole, stop)
            rows.append({"decode": "whole answer" if whole else "window", "stops": len(stop), **r})
            print(f"{rows[-1]['decode']:>12}  stops {len(stop)}  total {r['total_s']:7.3f} s  "
                  f"last 256: {r['last_256_ms_per_token']:.3f} ms/token  text ok {r['text_ok']}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"bench": "stream_text", "tokens": a.tokens,
                                                   "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
