"""``n`` sampled choices about a context their app has not kept yet (docs/asks.md, "A request's
choices about a new context"): a real ``sparkv serve`` holding the bundled story and two
``sparkv device serve`` processes, one as it runs by default (the choice that loads the context
keeps it before answering, because the others wait for it: ``--ask-early-keep on``) and one with
``--ask-early-keep off`` (it keeps it after its answer, so the others start one answer later).
Each request comes from a new app, so that its first choice loads the context (the server's
stream or local compute, as the ask's plan says) and the others wait for that load; the services
alternate request by request, through the ``openai`` client (temperature 0.8, a seed per
request, every choice running to ``--max-tokens`` past an end of sequence).

    python bench/choices_fresh.py [--n 2,4] [--rounds 3] [--max-tokens 24] [--dtype auto]
                                  [--out bench/results/choices_fresh_cpu.json]

Per request: its wall time, the loader's first token and the last of the other choices' first
tokens, the seconds the loader's keeping took at its first token, and how many choices equal the
other service's. Not all are expected to: which choice loads is whichever asks first (it answers
from its loaded cache, the others from the kept copy), the other choices' question rows are the
loader's kept turn after its answer (``after``) or their own over the kept copy (``early``), and
the adaptive plan may load other chunks. SmolLM2 (the
bundled model), 2 torch threads per process, wall clock on whatever machine runs it. No paper
figure: the many-apps issue's "many asks at once", for the asks about a context not yet kept.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from chat_e2e import _client, choices_args, choices_request, served, write_out  # noqa: E402

MODES = {"early": ["--ask-early-keep", "on"], "after": ["--ask-early-keep", "off"]}


def ask(oa: Any, cid: str, url: str, question: str, n: int, max_tokens: int, seed: int
        ) -> dict[str, Any]:
    """One request of ``n`` choices; its figures."""
    r, each, wall_s = choices_request(oa, cid, url, question, n, max_tokens, seed)
    early = [c["stats"].get("kept_early_s") for c in each]
    loader = [c["first_token_s"] for c in each if c["stats"]["strategy"] != "kept"]
    readers = [c["first_token_s"] for c in each if c["stats"]["strategy"] == "kept"]
    return {"wall_s": wall_s,
            "loader_first_s": loader[0] if loader else None,
            "readers_first_s": max(readers) if readers else None,
            "texts": [c.message.content for c in r.choices],
            "tokens": r.usage.completion_tokens,
            "kept_early_s": next((b for b in early if b is not None), None),
            "strategies": [c["stats"]["strategy"] for c in each]}


def run(ns: list[int], rounds: int, max_tokens: int, extra: tuple[str, ...] = ()
        ) -> dict[str, Any]:
    res: dict[str, Any] = {m: {str(n): [] for n in ns} for m in MODES}
    modes = {m: [*args, *extra] for m, args in MODES.items()}
    with served("sparkv-choices-fresh-", modes) as (srv, cid, questions, devs):
        for m, d in devs.items():             # warm: the first ask of a process, not measured
            ask(_client(d, "warm"), cid, srv.url, questions[0], 1, 4, 0)
        for r in range(rounds):
            for n in ns:
                q = questions[1 + (r % (len(questions) - 1))]
                for m in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
                    oa = _client(devs[m], f"app-{r}-{n}")        # a new app: nothing kept
                    res[m][str(n)].append(ask(oa, cid, srv.url, q, n, max_tokens, 100 + r))
            print(f"round {r + 1}/{rounds} done", flush=True)
    return {"context_id": cid, "max_tokens": max_tokens, "device_args": list(extra), "runs": res}


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per ``n``: each mode's median wall time and first token, the ratio, the loader's median
    keeping before its answer, and how many choices both services answered alike."""
    rows = []
    for n in res["runs"]["early"]:
        row: dict[str, Any] = {"n": int(n)}
        for m in MODES:
            reqs = res["runs"][m][n]
            row[f"wall_s_{m}"] = round(statistics.median(r["wall_s"] for r in reqs), 3)
            for k in ("loader_first_s", "readers_first_s"):
                got = [r[k] for r in reqs if r[k] is not None]
                row[f"{k}_{m}"] = round(statistics.median(got), 3) if got else None
        kept = [r["kept_early_s"] for r in res["runs"]["early"][n]
                if r["kept_early_s"] is not None]
        row["kept_early_s"] = round(statistics.median(kept), 3) if kept else None
        row["kept_early"] = f"{len(kept)}/{len(res['runs']['early'][n])}"
        row["wall_ratio"] = round(row["wall_s_early"] / row["wall_s_after"], 3)
        pairs = [(a, b) for x, y in zip(res["runs"]["early"][n], res["runs"]["after"][n])
                 for a, b in zip(x["texts"], y["texts"])]
        row["same_answers"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        rows.append(row)
    return rows


def _pair(row: dict[str, Any], key: str) -> str:
    a, b = row[f"{key}_early"], row[f"{key}_after"]
    return f"{a:.2f}/{b:.2f}" if a is not None and b is not None else "-"


def main() -> int:
    a = choices_args("2,4", __doc__.split("\n\n")[0])
    res = run([int(x) for x in a.n.split(",")], a.rounds, a.max_tokens, ("--dtype", a.dtype))
    rows = summary(res)
    print(f"{'n':>3} {'wall early/after':>22} {'loader 1st token':>17} "
          f"{'readers 1st token':>18} {'kept early':>11} {'early':>6} {'same':>6}")
    for r in rows:
        kb = f"{r['kept_early_s']:.3f} s" if r["kept_early_s"] is not None else "-"
        print(f"{r['n']:>3} {r['wall_s_early']:>8.2f}/{r['wall_s_after']:<6.2f}"
              f"({r['wall_ratio']:.2f}x) {_pair(r, 'loader_first_s'):>17} "
              f"{_pair(r, 'readers_first_s'):>18} {kb:>11} {r['kept_early']:>6} "
              f"{r['same_answers']:>6}")
    write_out(a.out, res, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
