"""A chat through the device service's OpenAI route, with and without its turn cache
(docs/device-service.md, "A conversation's turns, kept"): a real ``sparkv serve`` holding the
bundled story, two ``sparkv device serve`` processes (``--turn-cache-mb 64`` and ``0``), and
the ``openai`` client asking each the same questions in turn, every request the whole
conversation so far with ``keep`` (as a chat app sends it); the two services alternate request
by request, and every round is a new app (its own kept context and turns).

    python bench/chat_e2e.py [--turns 6] [--rounds 2] [--max-tokens 32] [--strategy local]
                             [--pause-s 0]
                             [--out bench/results/chat_e2e_cpu.json]

Per request: the service's time from submission to the first token (``sparkv.first_token_s``),
the client's wall time for the whole answer, ``usage.prompt_tokens`` and ``cached_tokens``, and
whether both services answered the same text. SmolLM2 (the bundled model), 2 torch threads per
process, wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import statistics
import tempfile
import time
from typing import Any, Iterator

CACHES_MB = (0, 64)


def _context(url: str) -> tuple[str, list[str]]:
    """The bundled story as a server context; its questions."""
    from sparkv.bench.qa import DATA_DIR, load_qa_set
    from sparkv.edge.client import EdgeClient

    qa = load_qa_set(DATA_DIR / "qa_story.json")
    with EdgeClient(url, None, timeout_s=900) as client:
        cid = client.create_context(text=qa.text(qa.items[0].slice), levels=["raw", "q8"],
                                    chunk_tokens=256)
    return cid, [i.question for i in qa.items]


def _client(dev: Any, app: str) -> Any:
    import httpx
    import openai

    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(dev.socket)), timeout=900)
    return openai.OpenAI(base_url="http://localhost/v1", api_key=dev.app_token(app),
                         http_client=http, max_retries=0)


def _request(oa: Any, cid: str, url: str, messages: list[dict[str, str]], max_tokens: int,
             strategy: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    r = oa.chat.completions.create(model=cid, max_tokens=max_tokens, messages=messages,
                                   extra_body={"sparkv": {"server": url, "keep": True,
                                                          "strategy": strategy}})
    wall = time.perf_counter() - t0
    sp = r.model_extra["sparkv"]
    return {"text": r.choices[0].message.content, "wall_ms": wall * 1e3,
            "first_token_ms": sp["first_token_s"] * 1e3, "strategy": sp["stats"]["strategy"],
            "prompt_tokens": r.usage.prompt_tokens,
            "cached_tokens": r.usage.prompt_tokens_details.cached_tokens}


@contextlib.contextmanager
def served(prefix: str, services: dict[Any, list[str]]
           ) -> Iterator[tuple[Any, str, list[str], dict[Any, Any]]]:
    """A real ``sparkv serve`` holding the bundled story and a started ``sparkv device serve``
    (400 MB, 2 torch threads) per entry of ``services`` (its extra arguments), all stopped
    after: the server, the context's id, its questions and the devices by key."""
    from sparkv.device.client import DeviceProcess
    from sparkv.server.process import ServerProcess, write_config

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        write_config(f"{tmp}/server.yaml", None, allow_anonymous=True)
        with ServerProcess(f"{tmp}/server.yaml", f"file://{tmp}/store",
                           log_path=f"{tmp}/server.log", torch_threads=2) as srv:
            cid, questions = _context(srv.url)
            devs = {key: DeviceProcess(pathlib.Path(tmp) / f"dev{key}", 400, torch_threads=2,
                                       extra_args=args).start()
                    for key, args in services.items()}
            try:
                yield srv, cid, questions, devs
            finally:
                for d in devs.values():
                    d.stop()


def choices_request(oa: Any, cid: str, url: str, question: str, n: int, max_tokens: int,
                    seed: int, keep: bool = True) -> tuple[Any, list[dict[str, Any]], float]:
    """One request of ``n`` sampled choices (temperature 0.8, ``seed``, kept unless ``keep`` is
    off, every choice ``max_tokens`` long): the response, each choice's ``sparkv`` extension,
    the wall time."""
    t0 = time.perf_counter()
    r = oa.chat.completions.create(model=cid, max_tokens=max_tokens, n=n, temperature=0.8,
                                   seed=seed, messages=[{"role": "user", "content": question}],
                                   extra_body={"sparkv": {"server": url, "keep": keep,
                                                          "stop_at_eos": False}})
    sp = r.model_extra["sparkv"]
    return r, sp.get("choices", [sp]), time.perf_counter() - t0


def choices_args(n_default: str, description: str, link: bool = False) -> argparse.Namespace:
    """The flags of the benches that send requests of ``n`` choices (``choices_kept.py``,
    ``choices_fresh.py``, ``choices_unkept.py``), parsed; ``link``: ``--link-mbps`` too."""
    p = argparse.ArgumentParser(description=description)
    if link:
        p.add_argument("--link-mbps", type=float, default=None,
                       help="the device service's emulated link (sparkv device serve "
                            "--link-mbps; default: unshaped)")
    p.add_argument("--n", default=n_default, help="choices per request")
    p.add_argument("--rounds", type=int, default=3, help="requests of each n on each service")
    p.add_argument("--max-tokens", type=int, default=24, help="each choice's most tokens")
    p.add_argument("--dtype", default="auto",
                   help="both services' compute configuration (sparkv device serve --dtype)")
    p.add_argument("--out", default=None, help="write every request's figures here (JSON)")
    return p.parse_args()


def write_out(path: str | None, res: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Every request's figures and the summary ``rows``, as JSON at ``path`` (if any)."""
    if path:
        pathlib.Path(path).write_text(json.dumps({**res, "summary": rows}, indent=1) + "\n")
        print(f"wrote {path}")


def run(turns: int, rounds: int, max_tokens: int, strategy: str, pause_s: float = 0.0
        ) -> dict[str, Any]:
    """``rounds`` conversations of ``turns`` requests on each service, alternated."""
    out: dict[str, Any] = {str(mb): [] for mb in CACHES_MB}
    with served("sparkv-chat-e2e-", {mb: ["--turn-cache-mb", str(mb)] for mb in CACHES_MB}
                ) as (srv, cid, questions, devs):
        for r in range(rounds):
            clients = {mb: _client(d, f"chat{r}") for mb, d in devs.items()}
            msgs: dict[int, list[dict[str, str]]] = {mb: [] for mb in CACHES_MB}
            convs: dict[int, list[dict[str, Any]]] = {mb: [] for mb in CACHES_MB}
            for q in questions[:turns]:
                for mb in (CACHES_MB if r % 2 == 0 else CACHES_MB[::-1]):
                    time.sleep(pause_s)          # what the last answer left running
                    msgs[mb].append({"role": "user", "content": q})
                    got = _request(clients[mb], cid, srv.url, msgs[mb], max_tokens, strategy)
                    msgs[mb].append({"role": "assistant", "content": got["text"]})
                    convs[mb].append(got)
            for mb in CACHES_MB:
                out[str(mb)].append(convs[mb])
                clients[mb].close()
            print(f"round {r + 1}/{rounds} done", flush=True)
    return {"context_id": cid, "strategy": strategy, "runs": out}


def summary(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per request: tokens, cached tokens, each side's median first-token and wall times."""
    rows = []
    off, on = res["runs"]["0"], res["runs"]["64"]
    for t in range(len(off[0])):
        a, b = [c[t] for c in off], [c[t] for c in on]
        fa = statistics.median(x["first_token_ms"] for x in a)
        fb = statistics.median(x["first_token_ms"] for x in b)
        rows.append({"request": t + 1, "strategy": b[0]["strategy"],
                     "prompt_tokens": b[0]["prompt_tokens"],
                     "cached_off": a[0]["cached_tokens"], "cached_on": b[0]["cached_tokens"],
                     "first_token_ms_off": round(fa, 1), "first_token_ms_on": round(fb, 1),
                     "ratio": round(fb / fa, 3),
                     "wall_ms_off": round(statistics.median(x["wall_ms"] for x in a), 1),
                     "wall_ms_on": round(statistics.median(x["wall_ms"] for x in b), 1),
                     "same_text": len({x["text"] for x in a + b}) == 1})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=6, help="requests in the conversation")
    p.add_argument("--rounds", type=int, default=2, help="conversations on each service")
    p.add_argument("--max-tokens", type=int, default=32, help="each answer's most tokens")
    p.add_argument("--strategy", default="local",
                   help="the first request's (it loads the context; later ones are answered "
                        "from memory); local: the same KV every round, so that the answers of "
                        "both services can be compared (sparkv's plan follows the link)")
    p.add_argument("--pause-s", type=float, default=0.0,
                   help="seconds between requests (a service's work after an answer, such as "
                        "writing a kept context to flash, then overlaps no other request)")
    p.add_argument("--out", default=None, help="write every request's figures here (JSON)")
    a = p.parse_args()
    res = run(a.turns, a.rounds, a.max_tokens, a.strategy, a.pause_s)
    rows = summary(res)
    print(f"{'req':>3} {'strategy':>8} {'prompt':>6} {'cached off/on':>13} "
          f"{'1st token off':>13} {'on':>7} {'ratio':>6} {'wall off':>8} {'on':>7}  same")
    for r in rows:
        print(f"{r['request']:>3} {r['strategy']:>8} {r['prompt_tokens']:>6} "
              f"{r['cached_off']:>6}/{r['cached_on']:<6} {r['first_token_ms_off']:>13.0f} "
              f"{r['first_token_ms_on']:>7.0f} {r['ratio']:>6.3f} {r['wall_ms_off']:>8.0f} "
              f"{r['wall_ms_on']:>7.0f}  {r['same_text']}")
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"bench": "chat_e2e", "rows": rows, **res},
                                                  indent=1) + "\n")
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
