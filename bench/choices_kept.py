"""``n`` sampled choices about one kept context (docs/asks.md, "How concurrent asks share the
device"): a real ``sparkv serve`` holding the bundled story and two ``sparkv device serve``
processes, one as it runs by default (asks about one kept context read one working memory at
once: ``sparkv/device/readturns.py``) and one with ``--no-shared-reads`` (they take turns, as
before), each asked ``n`` = 1, 2, 4 sampled choices of one question through the ``openai``
client (temperature 0.8, a seed per request, so both services draw the same choices; every
choice runs to ``--max-tokens``, past an end of sequence, so that the two services decode the
same number of tokens; a request's choices share one ask slot and start together). The
services alternate request by request.

    python bench/choices_kept.py [--n 1,2,4] [--rounds 3] [--max-tokens 24]
                                 [--out bench/results/choices_kept_cpu.json]

Per request: its wall time, the first choice's first token, the completion tokens, and whether
every choice equals the other service's (a sampled token drawn near a tie may flip between two
computations: batched rows round otherwise). SmolLM2 (the bundled model), 2 torch threads per
process, wall clock on whatever machine runs it. No paper figure: LLMS (llms.md) runs its calls
one after another; the ratio answers the many-apps issue's "many asks at once" on one context.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from chat_e2e import _client, choices_args, choices_request, served, write_out  # noqa: E402

MODES = {"shared": [], "turns": ["--no-shared-reads"]}


def ask(oa: Any, cid: str, url: str, question: str, n: int, max_tokens: int, seed: int
        ) -> dict[str, Any]:
    """One request of ``n`` choices; its figures."""
    r, each, wall_s = choices_request(oa, cid, url, question, n, max_tokens, seed)
    return {"wall_s": wall_s, "first_token_s": each[0]["first_token_s"],
            "texts": [c.message.content for c in r.choices],
            "tokens": r.usage.completion_tokens,
            "joined": sum(bool(c["stats"].get("joined")) for c in each),
            "strategies": [c["stats"]["strategy"] for c in each]}


def run(ns: list[int], rounds: int, max_tokens: int, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    res: dict[str, Any] = {m: {str(n): [] for n in ns} for m in MODES}
    modes = {m: [*args, *extra] for m, args in MODES.items()}
    with served("sparkv-choices-kept-", modes) as (srv, cid, questions, devs):
        clients = {m: _client(d, "app") for m, d in devs.items()}
        for m in MODES:                                  # the app keeps its copy
            ask(clients[m], cid, srv.url, questions[0], 1, 4, 0)
        for r in range(rounds):
            for n in ns:
                q = questions[1 + (r % (len(questions) - 1))]
                for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    res[m][str(n)].append(ask(clients[m], cid, srv.url, q, n, max_tokens,
                                              100 + r))
            print(f"round {r + 1}/{rounds} done", flush=True)
    return {"context_id": cid, "max_tokens": max_tokens, "device_args": list(extra), "runs": res}


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ``n``: each mode's median wall time and first token, tokens per second, the ratios,
    and how many choices both services answered alike."""
    rows = []
    for n in res["runs"]["shared"]:
        row: dict[str, Any] = {"n": int(n)}
        for m in MODES:
            reqs = res["runs"][m][n]
            row[f"wall_s_{m}"] = round(statistics.median(r["wall_s"] for r in reqs), 3)
            row[f"first_token_s_{m}"] = round(statistics.median(r["first_token_s"]
                                                                for r in reqs), 3)
            row[f"tokens_per_s_{m}"] = round(sum(r["tokens"] for r in reqs)
                                             / sum(r["wall_s"] for r in reqs), 2)
            row[f"kept_{m}"] = all(s == "kept" for r in reqs for s in r["strategies"])
            row[f"joined_{m}"] = sum(r["joined"] for r in reqs)
        row["wall_ratio"] = round(row["wall_s_shared"] / row["wall_s_turns"], 3)
        row["tokens_per_s_ratio"] = round(row["tokens_per_s_shared"]
                                          / row["tokens_per_s_turns"], 3)
        pairs = [(a, b) for x, y in zip(res["runs"]["shared"][n], res["runs"]["turns"][n])
                 for a, b in zip(x["texts"], y["texts"])]
        row["same_answers"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        rows.append(row)
    return rows


def main() -> int:
    a = choices_args("1,2,4", __doc__.split("\n\n")[0])
    res = run([int(x) for x in a.n.split(",")], a.rounds, a.max_tokens, ("--dtype", a.dtype))
    rows = summary(res)
    print(f"{'n':>3} {'wall shared/turns':>22} {'tokens/s shared/turns':>24} "
          f"{'first token':>16} {'joined':>7} {'same':>6}")
    for r in rows:
        print(f"{r['n']:>3} {r['wall_s_shared']:>8.2f}/{r['wall_s_turns']:<6.2f}"
              f"({r['wall_ratio']:.2f}x) {r['tokens_per_s_shared']:>8.2f}/"
              f"{r['tokens_per_s_turns']:<6.2f}({r['tokens_per_s_ratio']:.2f}x) "
              f"{r['first_token_s_shared']:>6.2f}/{r['first_token_s_turns']:<6.2f} "
              f"{r['joined_shared']:>7} {r['same_answers']:>6}")
    write_out(a.out, res, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
