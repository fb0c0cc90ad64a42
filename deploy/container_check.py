"""The host's side of ``deploy/container.sh test`` (docs/server.md, "Containers").

Against the containers' nginx it: encodes a short context (``POST /v1/contexts``, the job polled to
``done``), runs ``sparkv ask`` from the host's venv on it with the bundled model, then puts load on
the cluster (frame readers, half of them past nginx's cache, and posters of new contexts), kills
one API container mid-load (``--kill``) and checks that nothing is lost: every request succeeded,
at once or on a retry; every posted context's job is ``done`` and its manifest and frames are
there. It prints a summary and writes it as JSON with the facts ``container.sh`` collected (one
``KEY=VALUE`` a line: phase times in seconds, image sizes in bytes, versions).

Run by ``container.sh``; by hand: ``python deploy/container_check.py --url URL --key-file FILE
--kill 'podman kill sparkv-ct-api-1' --json out.json``. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

RETRYABLE = {429, 502, 503, 504}
BYPASS = {"X-Sparkv-Cache-Bypass": "1"}
ASK_TEXT = ("The lighthouse on Gull Rock was built in 1887. Its keeper, Mara Lind, kept a log of "
            "every ship that passed. The lamp burned whale oil until 1923, then kerosene.")
QUESTION = "Who kept the log at the lighthouse?"


@dataclass
class Tally:
    """Requests of the load phase: first-try successes, successes after retries, failures."""
    ok_first: int = 0
    ok_retried: int = 0
    lost: list[str] = field(default_factory=list)
    retry_causes: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, attempts: int, causes: list[str], error: str | None) -> None:
        with self.lock:
            for cause in causes:
                self.retry_causes[cause] = self.retry_causes.get(cause, 0) + 1
            if error is not None:
                self.lost.append(error)
            elif attempts == 1:
                self.ok_first += 1
            else:
                self.ok_retried += 1


def request(client: httpx.Client, tally: Tally | None, method: str, url: str,
            tries: int = 6, **kw: Any) -> httpx.Response:
    """One request, retried on a transport error or a retryable status (a replica that died
    answers 502 through nginx for a POST, which nginx never retries itself)."""
    causes: list[str] = []
    for attempt in range(1, tries + 1):
        try:
            r = client.request(method, url, **kw)
            if r.status_code not in RETRYABLE:
                if tally is not None:
                    err = None if r.is_success else f"{method} {url}: {r.status_code} {r.text[:200]}"
                    tally.record(attempt, causes, err)
                r.raise_for_status()
                return r
            causes.append(str(r.status_code))
        except httpx.TransportError as e:
            causes.append(type(e).__name__)
        time.sleep(0.2 * attempt)
    if tally is not None:
        tally.record(tries, causes, f"{method} {url}: gave up after {causes}")
    raise RuntimeError(f"{method} {url}: gave up after {causes}")


def wait_job(client: httpx.Client, job_id: str, timeout_s: float = 600.0) -> dict[str, Any]:
    """Polls a job until it leaves queued/running (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = request(client, None, "GET", f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} still running after {timeout_s} s")


def encode(client: httpx.Client, text: str, tally: Tally | None = None) -> tuple[str, str]:
    """Posts a context and returns (context id, job id)."""
    r = request(client, tally, "POST", "/v1/contexts", json={"text": text})
    return r.json()["context_id"], r.json()["job_id"]


def ask(url: str, key: str, cid: str) -> dict[str, Any]:
    """``sparkv ask`` from the host's venv (the same interpreter), as a user runs it."""
    cmd = [sys.executable, "-m", "sparkv.cli", "ask", "--server", url, "--context", cid,
           "--api-key", key, "--device", "cpu", "--max-new-tokens", "24", "--json", QUESTION]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"sparkv ask failed ({out.returncode}): {out.stderr[-2000:]}")
    result = json.loads(out.stdout)
    return {"command": "sparkv ask --server URL --context CID --device cpu --max-new-tokens 24 "
                       f"--json {shlex.quote(QUESTION)}",
            "seconds": round(time.monotonic() - t0, 1), "answer": result.get("text"),
            "tokens": result.get("tokens"), "stats": result.get("stats"),
            "plan": result.get("plan")}


def reader(client: httpx.Client, tally: Tally, cid: str, chunks: list[dict[str, Any]],
           stop: threading.Event, seed: int, bypass: bool) -> None:
    """Reads random frames of ``cid`` until ``stop``."""
    rng = random.Random(seed)
    headers = BYPASS if bypass else {}
    while not stop.is_set():
        ch = rng.choice(chunks)
        url = f"/v1/contexts/{cid}/chunks/{ch['t']}/{ch['l']}/{ch['g']}?level=q8"
        try:
            request(client, tally, "GET", url, headers=headers)
        except Exception:  # noqa: BLE001 - already tallied as lost
            pass


def poster(client: httpx.Client, tally: Tally, posted: list[tuple[str, str]], n: int,
           seed: int, stop: threading.Event) -> None:
    """Posts ``n`` new contexts (distinct texts), one after the other, until ``stop``."""
    for i in range(n):
        if stop.is_set():
            return
        text = " ".join(f"poster{seed} record{i}.{k} holds {(k * 7 + i) % 13}" for k in range(24))
        try:
            posted.append(encode(client, text, tally))
        except Exception:  # noqa: BLE001 - already tallied as lost
            pass
        time.sleep(0.3)


def verify(client: httpx.Client, posted: list[tuple[str, str]]) -> list[str]:
    """Every posted context: its job done, its manifest there, its frames readable."""
    problems = []
    for cid, job_id in posted:
        job = wait_job(client, job_id)
        if job["state"] != "done":
            problems.append(f"job {job_id} of {cid}: {job['state']} {job.get('error')}")
            continue
        m = request(client, None, "GET", f"/v1/contexts/{cid}").json()
        for ch in m["chunks"]:
            url = f"/v1/contexts/{cid}/chunks/{ch['t']}/{ch['l']}/{ch['g']}?level=q8"
            request(client, None, "GET", url, headers=BYPASS)
    return problems


def under_load(url: str, key: str, cid: str, kill: str, load_s: float) -> dict[str, Any]:
    """The kill-one-replica phase; returns its counts."""
    h = {"Authorization": f"Bearer {key}"}
    clients = [httpx.Client(base_url=url, headers=h, timeout=120) for _ in range(6)]
    chunks = request(clients[0], None, "GET", f"/v1/contexts/{cid}").json()["chunks"]
    tally, posted, stop = Tally(), [], threading.Event()
    threads = [threading.Thread(target=reader, args=(clients[i], tally, cid, chunks, stop, i,
                                                     i % 2 == 0), daemon=True) for i in range(4)]
    threads += [threading.Thread(target=poster, args=(clients[4 + i], tally, posted, 4, i, stop),
                                 daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(load_s / 3)
    killed = subprocess.run(shlex.split(kill), capture_output=True, text=True, timeout=60)
    time.sleep(2 * load_s / 3)
    stop.set()
    for t in threads:
        t.join(300)
    t0 = time.monotonic()
    problems = verify(clients[0], posted)
    for c in clients:
        c.close()
    return {"kill_command": kill, "kill_rc": killed.returncode,
            "requests": tally.ok_first + tally.ok_retried + len(tally.lost),
            "ok_first_try": tally.ok_first, "ok_after_retry": tally.ok_retried,
            "lost": len(tally.lost), "lost_examples": tally.lost[:5],
            "retry_causes": tally.retry_causes, "contexts_posted": len(posted),
            "contexts_verified": len(posted) - len(problems), "problems": problems,
            "load_s": load_s, "verify_s": round(time.monotonic() - t0, 1),
            "killed_after_s": round(load_s / 3, 1)}


def read_facts(path: Path | None) -> dict[str, Any]:
    """``KEY=VALUE`` lines (numbers parsed) from container.sh."""
    facts: dict[str, Any] = {}
    if path is None or not path.exists():
        return facts
    for line in path.read_text().splitlines():
        key, _, value = line.partition("=")
        try:
            facts[key] = float(value) if "." in value else int(value)
        except ValueError:
            facts[key] = value
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="nginx, e.g. http://127.0.0.1:18080")
    p.add_argument("--key-file", type=Path, required=True, help="the tenant's API key")
    p.add_argument("--kill", required=True, help="command that kills one API container")
    p.add_argument("--facts", type=Path, help="container.sh's KEY=VALUE facts")
    p.add_argument("--json", type=Path, help="write the summary here")
    p.add_argument("--load-s", type=float, default=9.0, help="seconds of load around the kill")
    a = p.parse_args(argv)
    key = a.key_file.read_text().strip()
    summary: dict[str, Any] = {"facts": read_facts(a.facts)}
    with httpx.Client(base_url=a.url, headers={"Authorization": f"Bearer {key}"},
                      timeout=120) as c:
        t0 = time.monotonic()
        cid, job_id = encode(c, ASK_TEXT)
        job = wait_job(c, job_id)
        if job["state"] != "done":
            raise SystemExit(f"the first context's job ended {job['state']}: {job}")
        summary["encode"] = {"context_id": cid, "seconds": round(time.monotonic() - t0, 1)}
    summary["ask"] = ask(a.url, key, cid)
    summary["kill_under_load"] = under_load(a.url, key, cid, a.kill, a.load_s)
    k = summary["kill_under_load"]
    passed = (k["kill_rc"] == 0 and k["lost"] == 0 and not k["problems"]
              and k["contexts_posted"] > 0 and bool(summary["ask"]["answer"]))
    summary["passed"] = passed
    if "started_at" in summary["facts"]:  # build + up + these checks (down follows)
        summary["test_s_before_down"] = round(time.time() - summary["facts"]["started_at"], 1)
    text = json.dumps(summary, indent=2)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
