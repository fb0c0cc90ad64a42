"""``n`` sampled choices of a request that keeps nothing (``keep: false``; docs/asks.md, "A
request's choices about a new context"): a real ``sparkv serve`` holding the bundled story and
one ``sparkv device serve`` as it runs by default; requests of ``n`` choices through the
``openai`` client (temperature 0.8, a seed per request, every choice running to
``--max-tokens``), each from a new app, and after each the service's context list.

    python bench/choices_unkept.py [--n 2,4] [--rounds 3] [--max-tokens 24] [--dtype auto]
                                   [--link-mbps 200] [--out bench/results/choices_unkept_cpu.json]

Per request: its wall time, each choice's first token (``ttft_s``) and the question rows it
took from a kept turn (``reused``), how many of its choices loaded the context (streamed or
computed it rather than reading a copy), the bytes they streamed, and how many contexts the
service still holds after it (``keep: false``: none). Run it on two checkouts to compare
(before, every choice loaded the context for itself). ``--link-mbps``: the device service's
one emulated link, which every choice's stream shares (unshaped, a loopback link is free:
loading apart costs only the cores). SmolLM2 (the bundled model), 2 torch threads per process,
wall clock on whatever machine runs it. No paper figure: the many-apps issue's "many asks at once".
"""

from __future__ import annotations

import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from chat_e2e import _client, choices_args, choices_request, served, write_out  # noqa: E402


def ask(oa: Any, cid: str, url: str, question: str, n: int, max_tokens: int, seed: int
        ) -> dict[str, Any]:
    """One request of ``n`` unkept choices; its figures."""
    r, each, wall_s = choices_request(oa, cid, url, question, n, max_tokens, seed, keep=False)
    loads = [c for c in each if c["stats"]["strategy"] != "kept"]
    return {"wall_s": wall_s, "loads": len(loads),
            "bytes_streamed": sum(int(c["stats"].get("bytes_streamed") or 0) for c in each),
            "strategies": [c["stats"]["strategy"] for c in each],
            "ttft_s": [c["stats"].get("ttft_s") for c in each],
            "reused": [int(c["stats"].get("turn_tokens_reused") or 0) for c in each],
            "kept_ids": [c.get("kept_id") for c in each],
            "texts": [c.message.content for c in r.choices]}


def run(ns: list[int], rounds: int, max_tokens: int, extra: tuple[str, ...]) -> dict[str, Any]:
    res: dict[str, Any] = {str(n): [] for n in ns}
    with served("sparkv-choices-unkept-", {"dev": list(extra)}) as (srv, cid, questions, devs):
        dev = devs["dev"]
        ask(_client(dev, "warm"), cid, srv.url, questions[0], 1, 4, 0)     # not measured
        for r in range(rounds):
            for n in ns:
                q = questions[1 + (r % (len(questions) - 1))]
                oa = _client(dev, f"app-{r}-{n}")
                got = ask(oa, cid, srv.url, q, n, max_tokens, 100 + r)
                got["contexts_after"] = len(oa.models.list().data)
                res[str(n)].append(got)
            print(f"round {r + 1}/{rounds} done", flush=True)
    return {"context_id": cid, "max_tokens": max_tokens, "device_args": list(extra),
            "runs": res}


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for n, reqs in res["runs"].items():
        rows.append({"n": int(n),
                     "wall_s": round(statistics.median(r["wall_s"] for r in reqs), 3),
                     "loads": statistics.median(r["loads"] for r in reqs),
                     "last_first_token_s": round(statistics.median(
                         max(r["ttft_s"]) for r in reqs), 3),
                     "mb_streamed": round(statistics.median(r["bytes_streamed"]
                                                            for r in reqs) / 1e6, 3),
                     "contexts_after": max(r["contexts_after"] for r in reqs)})
    return rows


def main() -> int:
    a = choices_args("2,4", __doc__.split("\n\n")[0], link=True)
    link = ("--link-mbps", str(a.link_mbps)) if a.link_mbps else ()
    res = run([int(x) for x in a.n.split(",")], a.rounds, a.max_tokens,
              ("--dtype", a.dtype, *link))
    rows = summary(res)
    print(f"{'n':>3} {'wall':>8} {'last first token':>17} {'loads':>6} {'MB streamed':>12} "
          f"{'kept after':>11}")
    for r in rows:
        print(f"{r['n']:>3} {r['wall_s']:>6.2f} s {r['last_first_token_s']:>15.2f} s "
              f"{r['loads']:>6} {r['mb_streamed']:>12.2f} {r['contexts_after']:>11}")
    write_out(a.out, res, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
