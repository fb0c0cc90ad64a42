"""lm-evaluation-harness's own ``local-completions`` model asking the device service: its
log-likelihood requests (the context and a continuation as one token id prompt, ``echo``,
``max_tokens`` 1, ``logprobs`` 1; docs/asks.md, "The prompt's log-probabilities") over a
multiple-choice task made from the bundled QA set: the story's first QUESTIONS questions, after
the story (a server context), each with CHOICES choices (its first keyword, and the next
questions' as distractors).

A real ``sparkv serve`` holds the story, a real ``sparkv device serve`` (on a TCP port, its
default server the story's, default ask options: the service's plan, its memory keeping the
context) answers lm-eval's HTTP requests; the same prompts through the ``openai`` client with a
``local``, ``dense``, ``raw`` ask are the reference. Prints each question's choice under both and
the largest log-likelihood difference (``--out``: every row, as JSON).

    pip install --target .lmeval --no-deps lm-eval==0.4.13     # lm-eval itself, no extras
    pip install --target .lmeval tenacity aiohttp sqlitedict more_itertools   # its API model's
    PYTHONPATH=$PWD:$PWD/.lmeval python bench/lm_eval_check.py [--out F.json]
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import socket
import tempfile
import time
from typing import Any

DENSE = {"strategy": "local", "backend": "dense", "level": "raw", "keep": False}
QUESTIONS = int(os.environ.get("QUESTIONS", "6"))
CHOICES = int(os.environ.get("CHOICES", "4"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _task() -> tuple[str, list[tuple[str, list[str], int]]]:
    """The story and its questions: (context text, choices, the right one's index)."""
    from sparkv.bench.qa import DATA_DIR, load_qa_set

    qa = load_qa_set(DATA_DIR / "qa_story.json")
    items = [i for i in qa.items if i.slice == qa.items[0].slice]
    answers = [" " + i.keywords[0] for i in items]
    out = []
    for k, item in enumerate(items[:QUESTIONS]):
        picks = [(k + j) % len(items) for j in range(CHOICES)]     # the right one first
        out.append((f"\n\nQuestion: {item.question}\nAnswer:", [answers[p] for p in picks], 0))
    return qa.text(items[0].slice), out


def _lm_eval(port: int, cid: str, token: str, tokenizer: str) -> Any:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    os.environ["OPENAI_API_KEY"] = token
    return LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model=cid,
                               tokenizer_backend="huggingface", tokenizer=tokenizer,
                               num_concurrent=1, max_retries=1, tokenized_requests=True,
                               timeout=900)


def _dense(oa: Any, cid: str, ids: list[int], ctxlen: int) -> float:
    r = oa.completions.create(model=cid, prompt=[ids], echo=True, max_tokens=1, logprobs=1,
                              extra_body={"sparkv": DENSE})
    return float(sum(r.choices[0].logprobs.token_logprobs[ctxlen:-1]))


def main() -> None:
    import httpx
    import openai
    from lm_eval.api.instance import Instance

    from sparkv.device.client import DeviceProcess
    from sparkv.edge.client import EdgeClient
    from sparkv.runtime.model import converted_dir
    from sparkv.server.process import ServerProcess, write_config

    story, questions = _task()
    tokenizer = str(converted_dir())            # the bundled model's tokenizer (sparkv warm)
    rows, t0 = [], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sparkv-lmeval-") as tmp:
        write_config(f"{tmp}/server.yaml", None, allow_anonymous=True)
        with ServerProcess(f"{tmp}/server.yaml", f"file://{tmp}/store",
                           log_path=f"{tmp}/server.log", torch_threads=2) as srv:
            with EdgeClient(srv.url, None, timeout_s=900) as client:
                cid = client.create_context(text=story, levels=["raw", "q8"], chunk_tokens=256)
            port = _free_port()
            dev = DeviceProcess(pathlib.Path(tmp) / "dev", 400, torch_threads=2, port=port,
                                extra_args=["--ask-server", srv.url]).start()
            try:
                token = dev.app_token("lmeval")
                lm = _lm_eval(port, cid, token, tokenizer)
                oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token,
                                   http_client=httpx.Client(timeout=900), max_retries=0)
                for q, (context, choices, right) in enumerate(questions):
                    reqs = [Instance("loglikelihood", {}, (context, c), i)
                            for i, c in enumerate(choices)]
                    got = lm.loglikelihood(reqs, disable_tqdm=True)
                    ref = []
                    for c in choices:
                        ctx_ids, cont_ids = lm._encode_pair(context, c)
                        ref.append(_dense(oa, cid, ctx_ids + cont_ids, len(ctx_ids)))
                    lls = [ll for ll, _ in got]
                    rows.append({"question": q, "right": right,
                                 "chosen": lls.index(max(lls)), "chosen_dense": ref.index(max(ref)),
                                 "loglikelihoods": lls, "dense": ref,
                                 "max_abs_diff": max(abs(a - b) for a, b in zip(lls, ref))})
                    r = rows[-1]
                    print(f"question {q}: chosen {r['chosen']} (dense {r['chosen_dense']}, "
                          f"right {right}), largest |ll - dense| {r['max_abs_diff']:.4f}",
                          flush=True)
            finally:
                dev.stop()
    n = len(rows)
    summary = {"questions": n, "choices": len(questions[0][1]),
               "accuracy": sum(r["chosen"] == r["right"] for r in rows) / n,
               "accuracy_dense": sum(r["chosen_dense"] == r["right"] for r in rows) / n,
               "same_choice": sum(r["chosen"] == r["chosen_dense"] for r in rows) / n,
               "max_abs_diff": max(r["max_abs_diff"] for r in rows),
               "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    if "--out" not in sys.argv:
        return
    out = pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
    out.write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
