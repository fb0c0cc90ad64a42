"""Apps asking about their kept contexts at once (docs/device-service.md, "Calls at once"): a
real ``sparkv serve`` holding the bundled story, two ``sparkv device serve`` processes, one as it
runs by default (a call's turn gives the model lock back: calls on other contexts switch in and
answer meanwhile, their answer tokens batched) and one with ``--serial-turns`` (a call holds the
model for its whole answer, as before), and ``N`` apps on each, each with its own kept copy of
the context (its first ask loads and keeps it), then asking the same question at the same time
through the ``openai`` client. The services alternate batch by batch.

    python bench/kept_together.py [--apps 1,2,4] [--rounds 3] [--max-tokens 32]
                                  [--out bench/results/kept_together_cpu.json]

Per batch: each ask's first token (``sparkv.first_token_s``, from its submission) and wall time,
the batch's makespan, and how many answers are the one the other service gave (a near-tie
token may flip between two computations of the same prompt: a batched pass, or a turn's kept
KV reused, rounds otherwise). SmolLM2 (the
bundled model), greedy, 2 torch threads per process, wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from chat_e2e import _client, served, write_out  # noqa: E402

MODES = {"overlap": [], "serial": ["--serial-turns"]}


def _ask(oa: Any, cid: str, url: str, question: str, max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = oa.chat.completions.create(model=cid, max_tokens=max_tokens,
                                   messages=[{"role": "user", "content": question}],
                                   extra_body={"sparkv": {"server": url, "keep": True}})
    sp = r.model_extra["sparkv"]
    return {"text": r.choices[0].message.content, "wall_s": time.perf_counter() - t0,
            "first_token_s": sp["first_token_s"], "strategy": sp["stats"]["strategy"],
            "tokens": r.usage.completion_tokens}


def batch(clients: list[Any], cid: str, url: str, question: str, max_tokens: int
          ) -> dict[str, Any]:
    """Every app asks ``question`` at once; each ask's figures and the makespan."""
    out: list[dict[str, Any]] = [{}] * len(clients)
    go = threading.Barrier(len(clients))

    def one(i: int) -> None:
        go.wait()
        out[i] = _ask(clients[i], cid, url, question, max_tokens)

    t0 = time.perf_counter()
    ths = [threading.Thread(target=one, args=(i,)) for i in range(len(clients))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return {"asks": out, "makespan_s": time.perf_counter() - t0}


def run(apps: list[int], rounds: int, max_tokens: int) -> dict[str, Any]:
    res: dict[str, Any] = {m: {str(n): [] for n in apps} for m in MODES}
    with served("sparkv-kept-together-", MODES) as (srv, cid, questions, devs):
        clients = {m: [_client(d, f"app{i}") for i in range(max(apps))]
                   for m, d in devs.items()}
        for m in MODES:                      # each app keeps its copy
            for oa in clients[m]:
                _ask(oa, cid, srv.url, questions[0], 4)
        for r in range(rounds):
            for n in apps:
                q = questions[1 + (r % (len(questions) - 1))]
                for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    res[m][str(n)].append(batch(clients[m][:n], cid, srv.url, q, max_tokens))
            print(f"round {r + 1}/{rounds} done", flush=True)
    return {"context_id": cid, "max_tokens": max_tokens, "runs": res}


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per N: each mode's median makespan, median and slowest first token, and their ratios."""
    rows = []
    for n in res["runs"]["overlap"]:
        row: dict[str, Any] = {"apps": int(n)}
        for m in MODES:
            batches = res["runs"][m][n]
            firsts = [a["first_token_s"] for b in batches for a in b["asks"]]
            row[f"makespan_s_{m}"] = round(statistics.median(b["makespan_s"] for b in batches), 3)
            row[f"first_token_s_{m}"] = round(statistics.median(firsts), 3)
            row[f"last_first_token_s_{m}"] = round(statistics.median(
                max(a["first_token_s"] for a in b["asks"]) for b in batches), 3)
            row[f"kept_{m}"] = all(a["strategy"] == "kept" for b in batches for a in b["asks"])
        for k in ("makespan_s", "first_token_s", "last_first_token_s"):
            row[f"{k}_ratio"] = round(row[f"{k}_overlap"] / row[f"{k}_serial"], 3)
        pairs = [(a, b) for x, y in zip(res["runs"]["overlap"][n], res["runs"]["serial"][n])
                 for a, b in zip(x["asks"], y["asks"])]
        row["same_answers"] = f"{sum(a['text'] == b['text'] for a, b in pairs)}/{len(pairs)}"
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--apps", default="1,2,4", help="how many apps ask at once")
    p.add_argument("--rounds", type=int, default=3, help="batches of each size on each service")
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's most tokens")
    p.add_argument("--out", default=None, help="write every batch's figures here (JSON)")
    a = p.parse_args()
    res = run([int(x) for x in a.apps.split(",")], a.rounds, a.max_tokens)
    rows = summary(res)
    print(f"{'apps':>4} {'makespan overlap/serial':>24} {'first token (median)':>22} "
          f"{'last first token':>20} {'same':>6}")
    for r in rows:
        print(f"{r['apps']:>4} {r['makespan_s_overlap']:>9.2f}/{r['makespan_s_serial']:<6.2f}"
              f"({r['makespan_s_ratio']:.2f}x) {r['first_token_s_overlap']:>7.2f}/"
              f"{r['first_token_s_serial']:<5.2f}({r['first_token_s_ratio']:.2f}x) "
              f"{r['last_first_token_s_overlap']:>6.2f}/{r['last_first_token_s_serial']:<5.2f}"
              f"({r['last_first_token_s_ratio']:.2f}x) {r['same_answers']:>6}")
    write_out(a.out, res, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
