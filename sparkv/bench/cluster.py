"""``sparkv bench cluster``: the cluster of deploy/cluster.sh on loopback (docs/cluster.md).

* Frame reads (``GET .../chunks/...`` through nginx) per second, Gbit/s and p50/p99 latency at
  1, 2 and 4 API replicas, with the cache bypassed (``cold``: every read goes to a replica) and
  hot (every frame already cached), at 32 and 256 concurrent clients; plus one replica read
  directly (no nginx), the baseline of the 5x target.
* Encode throughput (context tokens/s) with 1 and 2 workers.
* Recovery: the errors and the worst latency when an API replica is SIGKILLed under load; the
  time until a SIGKILLed worker's job is taken over and finished.

The load generator is raw HTTP/1.1 keep-alive over asyncio (uvloop when installed) in two
processes; it has no retries, so every error it counts is one a client would see. Every frame's
size is checked, and one in 16 its checksum.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkv.bench.common import add_output_args, format_table, percentile, wait_job, write_result

LEVEL = "q8"


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("cluster", help="nginx + API replicas + workers on loopback: frame reads, "
                                       "cache, encode workers, recovery")
    p.add_argument("--replicas", default="1,2,4", help="API replica counts")
    p.add_argument("--clients", default="32,256", help="concurrent clients")
    p.add_argument("--duration-s", type=float, default=3.0,
                   help="seconds per configuration")
    p.add_argument("--tokens", type=int, default=1024, help="tokens of the served context")
    p.add_argument("--encode-tokens", type=int, default=512,
                   help="tokens of each context of the encode runs")
    p.add_argument("--loadgen-procs", type=int, default=2, help="load generator processes "
                   "(threads with wrk)")
    p.add_argument("--loadgen", choices=["auto", "wrk", "python"], default="auto",
                   help="frame-read load generator (auto: wrk when installed, else Python)")
    p.add_argument("--skip-encode", action="store_true", help="frame reads only")
    add_output_args(p, "cluster")
    p.set_defaults(func=run)


def _texts(n_tokens: int, seed: int) -> str:
    from sparkv.runtime import sample_text

    base = sample_text()
    words = base.split()
    # distinct contexts: rotate the sample by seed; about 1.3 tokens per word
    k = max(8, int(n_tokens / 1.3))
    rot = words[seed * 97 % len(words):] + words
    return " ".join((rot * (k // len(rot) + 1))[:k])


# ------------------------------------------------------------------------------------------------
# load generator (python -c "...; _loadgen_main()", config on stdin, result on stdout)
# ------------------------------------------------------------------------------------------------
def _loadgen(cfg: dict[str, Any], procs: int) -> dict[str, Any]:
    code = "from sparkv.bench.cluster import _loadgen_main; _loadgen_main()"
    ps = []
    for i in range(procs):
        fd, out_path = tempfile.mkstemp(prefix="sparkv-loadgen-", suffix=".json")
        os.close(fd)
        c = {**cfg, "clients": cfg["clients"] // procs + (1 if i < cfg["clients"] % procs else 0),
             "seed": i, "out": out_path}
        p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert p.stdin is not None                  # stdin=PIPE
        p.stdin.write(json.dumps(c))
        p.stdin.close()
        p.stdin = None  # communicate() must not touch it again
        ps.append((p, Path(out_path)))
    if cfg.get("kill_pid"):
        time.sleep(cfg["kill_at"])
        os.kill(cfg["kill_pid"], signal.SIGKILL)
        kill_t = time.time()
    else:
        kill_t = None
    outs = []
    for p, path in ps:
        _, err = p.communicate(timeout=cfg["duration"] + 120)
        try:
            if p.returncode != 0:
                raise RuntimeError(f"load generator failed:\n{err[-3000:]}")
            outs.append(json.loads(path.read_text()))
        finally:
            path.unlink(missing_ok=True)
    lat = [x for o in outs for x in o["lat"]]
    span = max(o["wall"] for o in outs)
    res = {"clients": cfg["clients"], "requests": sum(o["requests"] for o in outs),
           "errors": sum(o["errors"] for o in outs), "bytes": sum(o["bytes"] for o in outs),
           "wall_s": span, "error_samples": [e for o in outs for e in o["error_samples"]][:5]}
    res["reads_per_s"] = res["requests"] / span if span else 0.0
    res["gbit_s"] = res["bytes"] * 8 / span / 1e9 if span else 0.0
    res["p50_ms"] = percentile(lat, 50) * 1e3
    res["p99_ms"] = percentile(lat, 99) * 1e3
    if kill_t is not None:
        around = [lt for o in outs for (t_end, lt) in o["ends"] if abs(t_end - kill_t) < 2.0]
        res["max_latency_around_kill_ms"] = max(around) * 1e3 if around else 0.0
        res["errors_after_kill"] = sum(1 for o in outs for t in o["error_times"] if t >= kill_t)
    return res


_WRK_SCRIPT = """
local paths = {%(paths)s}
local n = #paths
math.randomseed(%(seed)d)
%(headers)s
request = function()
  return wrk.format("GET", paths[math.random(n)])
end
done = function(summary, latency, requests)
  io.write(string.format('WRKJSON{"requests":%%d,"bytes":%%d,"duration_us":%%d,' ..
    '"connect":%%d,"read":%%d,"write":%%d,"status":%%d,"timeout":%%d,"p50_us":%%d,' ..
    '"p99_us":%%d}\\n', summary.requests, summary.bytes, summary.duration,
    summary.errors.connect, summary.errors.read, summary.errors.write, summary.errors.status,
    summary.errors.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


def _wrk(cfg: dict[str, Any], threads: int, workdir: Path) -> dict[str, Any]:
    """The same measurement with wrk (C, far less CPU per request than Python): sizes and
    checksums are not checked here (the Python generator and the tests check them); every
    non-2xx answer and socket error is counted."""
    import shutil

    headers = {"Authorization": f"Bearer {cfg['key']}", **cfg.get("headers", {})}
    script = _WRK_SCRIPT % {
        "paths": ", ".join(json.dumps(i[0]) for i in cfg["items"]),
        "seed": int(time.time()) % 100000,
        "headers": "\n".join(f'wrk.headers["{k}"] = {json.dumps(v)}' for k, v in headers.items())}
    lua = workdir / "wrk.lua"
    lua.write_text(script)
    clients = cfg["clients"]
    p = subprocess.run([shutil.which("wrk") or "wrk", "-t", str(min(threads, clients)), "-c",
                        str(clients), "-d", f"{max(1, round(cfg['duration']))}s", "--timeout", "10s", "-s",
                        str(lua), cfg["url"]], capture_output=True, text=True,
                       timeout=cfg["duration"] + 60)
    line = next((x for x in p.stdout.splitlines() if x.startswith("WRKJSON")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed ({p.returncode}): {p.stderr[-2000:]}{p.stdout[-2000:]}")
    w = json.loads(line[len("WRKJSON"):])
    span = w["duration_us"] / 1e6
    errors = w["connect"] + w["read"] + w["write"] + w["status"] + w["timeout"]
    return {"clients": clients, "requests": w["requests"], "errors": errors,
            "bytes": w["bytes"], "wall_s": span, "reads_per_s": w["requests"] / span,
            "gbit_s": w["bytes"] * 8 / span / 1e9, "p50_ms": w["p50_us"] / 1e3,
            "p99_ms": w["p99_us"] / 1e3, "loadgen": "wrk"}


def _loadgen_main() -> None:
    from sparkv.bench.common import run_event_loop

    cfg = json.loads(sys.stdin.read())
    result = run_event_loop(_load(cfg))
    Path(cfg["out"]).write_text(json.dumps(result))


async def _load(cfg: dict[str, Any]) -> dict[str, Any]:
    import asyncio
    import random
    from urllib.parse import urlsplit

    from sparkv.protocol.digests import checksum

    u = urlsplit(cfg["url"])
    host, port = u.hostname, u.port
    items = cfg["items"]
    extra = "".join(f"{k}: {v}\r\n" for k, v in cfg.get("headers", {}).items())
    stats = {"requests": 0, "errors": 0, "bytes": 0}
    lat: list[float] = []
    ends: list[tuple[float, float]] = []
    error_times: list[float] = []
    samples: list[str] = []
    track = bool(cfg.get("kill_pid"))

    async def client(i: int, deadline: float) -> None:
        rng = random.Random(cfg["seed"] * 100003 + i)
        reader: asyncio.StreamReader | None = None
        writer: asyncio.StreamWriter | None = None
        n = 0
        while time.perf_counter() < deadline:
            path, size, digest = items[rng.randrange(len(items))]
            t0 = time.perf_counter()
            try:
                if reader is None or writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                             f"Authorization: Bearer {cfg['key']}\r\n{extra}\r\n".encode())
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                close = False
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    k = k.strip().lower()
                    if k == b"content-length":
                        length = int(v)
                    elif k == b"connection" and v.strip().lower() == b"close":
                        close = True
                body = await reader.readexactly(length)
                if close:
                    writer.close()
                    writer = None
                if status != 200 or len(body) != size:
                    raise ValueError(f"status {status}, {len(body)} bytes (expected {size})")
                n += 1
                if n % 16 == 0 and checksum(body) != digest:
                    raise ValueError("checksum mismatch")
                dt = time.perf_counter() - t0
                stats["requests"] += 1
                stats["bytes"] += len(body)
                lat.append(dt)
                if track:
                    ends.append((time.time(), dt))
            except (OSError, ValueError, asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError) as e:
                stats["errors"] += 1
                error_times.append(time.time())
                if len(samples) < 5:
                    samples.append(f"{type(e).__name__}: {e}")
                if writer is not None:
                    writer.close()
                writer = None
        if writer is not None:
            writer.close()

    start = time.perf_counter()
    deadline = start + cfg["duration"]
    await asyncio.gather(*[client(i, deadline) for i in range(cfg["clients"])])
    return {**stats, "lat": lat, "wall": time.perf_counter() - start, "ends": ends,
            "error_times": error_times, "error_samples": samples}


# ------------------------------------------------------------------------------------------------
def _encode_runs(cluster: Any, key: str, args: argparse.Namespace) -> dict[str, Any]:
    """2 workers: two contexts at once, then a worker killed mid-job; 1 worker: two contexts."""
    import httpx

    out: dict[str, Any] = {}
    h = {"Authorization": f"Bearer {key}"}
    seed = [int(time.time()) % 1000]
    # warm-up: each worker loads the model on its first job; not measured
    with httpx.Client(base_url=cluster.url, headers=h, timeout=120) as c:
        warm = [c.post("/v1/contexts", json={"text": f"warm-up {i} " * 8}).json()
                for i in range(2)]
        for w in warm:
            wait_job(c, w["job_id"])
    print("bench cluster: encode, 2 workers, 2 contexts at once ...", flush=True)
    out["workers_2"] = _encode_batch(cluster.url, h, args.encode_tokens, seed, 2)
    print(f"  {out['workers_2']['tokens_per_s']:.1f} tokens/s", flush=True)
    print("bench cluster: a worker SIGKILLed mid-job ...", flush=True)
    out["worker_kill"] = _worker_kill(cluster, h, args.encode_tokens, seed)
    kill = out["worker_kill"]
    print(f"  taken over {kill['kill_to_takeover_s']:.1f} s after the kill, done "
          f"after {kill['job_wall_s']:.1f} s ({kill['state']})", flush=True)
    print("bench cluster: encode, 1 worker, 2 contexts ...", flush=True)
    out["workers_1"] = _encode_batch(cluster.url, h, args.encode_tokens, seed, 2)
    print(f"  {out['workers_1']['tokens_per_s']:.1f} tokens/s", flush=True)
    single = out["workers_1"]["job_s_mean"]
    kill["one_job_encode_s"] = single
    kill["target_s"] = single + 10.0
    kill["target_met"] = (kill["state"] == "done" and kill["job_wall_s"] <= single + 10.0)
    return out


def _encode_batch(url: str, headers: dict[str, str], tokens: int, seed: list[int], n: int
                  ) -> dict[str, Any]:
    """``n`` contexts of ``tokens`` posted at once (new texts: ``seed[0]`` is advanced), timed
    until every job ends."""
    import httpx

    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        t0 = time.perf_counter()
        jobs = []
        for _ in range(n):
            seed[0] += 1
            r = c.post("/v1/contexts", json={"text": _texts(tokens, seed[0])})
            r.raise_for_status()
            jobs.append(r.json())
        done = [wait_job(c, j["job_id"]) for j in jobs]
        wall = time.perf_counter() - t0
    n_tokens = sum(j["num_tokens"] for j in jobs)
    bad = [j for j in done if j["state"] != "done"]
    job_s = [d["finished_unix"] - d["started_unix"] for d in done if d["started_unix"]]
    return {"contexts": n, "tokens": n_tokens, "wall_s": wall, "tokens_per_s": n_tokens / wall,
            "job_s_mean": sum(job_s) / len(job_s) if job_s else 0.0, "failed": len(bad)}


def _job_record(store: Any, job_id: str) -> dict[str, Any]:
    """The store's record of the benchmark tenant's job ``job_id``."""
    raw = store.jobs.get("bench", job_id)
    if raw is None:
        raise RuntimeError(f"job {job_id} is not in the store")
    return json.loads(raw)


def _worker_kill(cluster: Any, headers: dict[str, str], tokens: int, seed: list[int]
                 ) -> dict[str, Any]:
    """A worker SIGKILLed mid-job: the other takes the job over and finishes it. Returns the
    victim, the job's final state and attempts, and the times from the kill."""
    import httpx

    from sparkv.server.stores import open_store

    store = open_store(cluster.redis_url)
    with httpx.Client(base_url=cluster.url, headers=headers, timeout=120) as c:
        seed[0] += 1
        t0 = time.time()
        r = c.post("/v1/contexts", json={"text": _texts(tokens, seed[0])}).json()
        job_id = r["job_id"]
        running_since = None
        while True:  # mid-job: some frames stored, or (a fast machine) well into the prefill
            job = c.get(f"/v1/jobs/{job_id}").json()
            if job["state"] == "running":
                running_since = running_since or time.monotonic()
                if job["progress"]["done"] >= 1 or time.monotonic() - running_since > 0.5:
                    break
            if job["state"] not in ("queued", "running"):
                raise RuntimeError(f"the job ended before the kill: {job}")
            time.sleep(0.02)
        victim = _job_record(store, job_id)["worker"]
        kill_t = time.time()
        cluster.kill(victim)
        taken = None
        while True:
            rec = _job_record(store, job_id)
            if taken is None and rec.get("worker") != victim:
                taken = time.time()
            if rec["state"] not in ("queued", "running"):
                break
            time.sleep(0.05)
        done_t = time.time()
    return {"victim": victim, "state": rec["state"], "attempts": rec["attempts"],
            "frames_reused": (rec.get("timings") or {}).get("frames_reused"),
            "job_wall_s": done_t - t0, "kill_to_takeover_s": (taken or done_t) - kill_t,
            "kill_to_done_s": done_t - kill_t}


def _warm(url: str, key: str, items: list[list[Any]]) -> None:
    """Reads every frame once through nginx, so that the cache holds all of them (and checks
    the second read is a cache hit with the same bytes)."""
    import httpx

    from sparkv.protocol.digests import checksum

    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"},
                      timeout=120) as c:
        for path, size, digest in items:
            for _ in range(2):
                r = c.get(path)
                if r.status_code != 200 or len(r.content) != size or \
                        checksum(r.content) != digest:
                    raise RuntimeError(f"warm-up read of {path}: {r.status_code}")
            if r.headers.get("x-cache-status") != "HIT":
                raise RuntimeError(f"{path} is not cached after two reads "
                                   f"({r.headers.get('x-cache-status')})")


def run(args: argparse.Namespace) -> int:
    import shutil

    from sparkv.server.cluster import cluster_available
    from sparkv.server.process import write_config

    why = cluster_available()
    if why:
        print(f"bench cluster: {why}", file=sys.stderr)
        return 2
    replicas = [int(x) for x in args.replicas.split(",") if x]
    clients = [int(x) for x in args.clients.split(",") if x]
    if not replicas or min(replicas) < 1 or not clients or min(clients) < 1:
        print("bench cluster: --replicas and --clients need positive integers", file=sys.stderr)
        return 2
    use_wrk = args.loadgen == "wrk" or (args.loadgen == "auto" and shutil.which("wrk"))
    if args.loadgen == "wrk" and not shutil.which("wrk"):
        print("bench cluster: wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {"loadgen": "wrk" if use_wrk else "python"}
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-cluster-") as tmp:
        tmpd = Path(tmp)
        keys = write_config(tmpd / "s.yaml", ["bench"], default_levels=[LEVEL],
                            default_chunk_tokens=256, queue_claim_idle_s=2.0,
                            max_context_tokens=8192, max_streams_per_tenant=512)
        key = keys["bench"]
        items: list[list[Any]] = []
        for n in replicas:
            items = _replica_runs(args, tmpd, key, n, replicas, clients, bool(use_wrk), items,
                                  rows, extra)
        if not args.skip_encode:
            _encode_phase(args, tmpd, key, extra)
    summary = _summary(rows, clients, extra)
    _report(rows, summary, extra)
    if args.json or args.out:
        path = write_result("cluster", {"summary": summary, "results": rows, **extra},
                            config=vars(args) | {"func": None}, path=args.out)
        print(f"wrote {path}")
    return 0


def _replica_runs(args: argparse.Namespace, tmpd: Path, key: str, n: int, replicas: list[int],
                  clients: list[int], use_wrk: bool, items: list[list[Any]],
                  rows: list[dict[str, Any]], extra: dict[str, Any]) -> list[list[Any]]:
    """Starts the cluster with ``n`` API replicas (and, the first time, one worker that encodes
    the served context: ``items`` is empty until then), warms the cache, appends one row per
    (cache mode, clients) to ``rows`` and, at the second replica count, the replica-kill run to
    ``extra``. Returns the frames read: ``[path, bytes, checksum]`` each."""
    from sparkv.logs import progress_bar

    from sparkv.server.cluster import LocalCluster

    cluster = LocalCluster(tmpd / "c", tmpd / "s.yaml", api_replicas=n,
                           workers=0 if items else 1, redis_aof=True)
    print(f"bench cluster: starting {n} API replicas ...", flush=True)
    cluster.start()
    try:
        if not items:
            items = _serve_context(cluster.url, key, args.tokens)
            extra["frames"] = len(items)
            extra["frame_bytes_mean"] = sum(i[1] for i in items) / len(items)
        confs = [(mode, k) for mode in ("cold", "hot") for k in clients]
        if n == 1:
            confs = [("direct", k) for k in clients] + confs
        # warm the cache: every frame once, checked
        _warm(cluster.url, key, items)
        for mode, k in progress_bar(confs, desc=f"{n} replicas", unit="run", file=sys.stderr):
            url = (f"http://127.0.0.1:{cluster.api_ports[0]}" if mode == "direct"
                   else cluster.url)
            headers = {"X-Sparkv-Cache-Bypass": "1"} if mode == "cold" else {}
            cfg = {"url": url, "key": key, "items": items, "clients": k,
                   "duration": args.duration_s, "headers": headers}
            res = (_wrk(cfg, args.loadgen_procs, tmpd) if use_wrk else
                   _loadgen(cfg, args.loadgen_procs))
            if not res["errors"]:
                res.pop("error_samples", None)
            rows.append({"replicas": n, "cache": mode, **res})
        if n == max(2, min(replicas)) and n > 1:  # a replica killed under load
            print("bench cluster: SIGKILL of api-1 under load (cache bypassed) ...", flush=True)
            res = _loadgen({"url": cluster.url, "key": key, "items": items,
                            "clients": 32, "duration": args.duration_s + 1,
                            "headers": {"X-Sparkv-Cache-Bypass": "1"},
                            "kill_pid": cluster.pid("api-1"),
                            "kill_at": 1.5}, args.loadgen_procs)
            extra["replica_kill"] = {"replicas": n, **res}
    finally:
        cluster.stop()
    return items


def _serve_context(url: str, key: str, tokens: int) -> list[list[Any]]:
    """Encodes the served context of ``tokens`` through the cluster; its frames at
    :data:`LEVEL`: ``[path, bytes, checksum]`` each."""
    import httpx

    with httpx.Client(base_url=url, timeout=120,
                      headers={"Authorization": f"Bearer {key}"}) as c:
        print(f"bench cluster: encoding a {tokens}-token context ...", flush=True)
        r = c.post("/v1/contexts", json={"text": _texts(tokens, 0)})
        r.raise_for_status()
        job = wait_job(c, r.json()["job_id"])
        if job["state"] != "done":
            raise RuntimeError(f"encode failed: {job}")
        cid = r.json()["context_id"]
        m = c.get(f"/v1/contexts/{cid}").json()
    return [[f"/v1/contexts/{cid}/chunks/{ch['t']}/{ch['l']}/{ch['g']}?level={LEVEL}",
             ch["levels"][LEVEL]["bytes"], ch["levels"][LEVEL]["checksum"]]
            for ch in m["chunks"]]


def _encode_phase(args: argparse.Namespace, tmpd: Path, key: str, extra: dict[str, Any]) -> None:
    """One API replica and 2 workers: :func:`_encode_runs` into ``extra["encode"]`` (or its
    failure into ``extra["encode_error"]``, keeping the read results)."""
    from sparkv.server.cluster import LocalCluster

    cluster = LocalCluster(tmpd / "c", tmpd / "s.yaml", api_replicas=1, workers=2,
                           redis_aof=True)
    print("bench cluster: starting 1 API replica and 2 workers ...", flush=True)
    cluster.start()
    try:
        extra["encode"] = _encode_runs(cluster, key, args)
    except (RuntimeError, TimeoutError) as exc:  # keep the read results
        print(f"bench cluster: the encode runs failed: {exc}", file=sys.stderr)
        extra["encode_error"] = str(exc)
    finally:
        cluster.stop()


def _summary(rows: list[dict[str, Any]], clients: list[int], extra: dict[str, Any]
             ) -> dict[str, Any]:
    """Gives each row its ratio to one uncached replica; the summary and its targets."""
    base = next((r["reads_per_s"] for r in rows if r["replicas"] == 1 and r["cache"] == "cold"
                 and r["clients"] == min(clients)), 0.0)
    for r in rows:
        r["x_one_replica_uncached"] = r["reads_per_s"] / base if base else 0.0
    hot = [r for r in rows if r["cache"] == "hot"]
    summary = {
        "cores": os.cpu_count(),
        "note": "one machine, loopback; the cores are shared by nginx, the replicas, Redis, the "
                "load generator and other work running at the same time (the machine was loaded)",
        "one_replica_uncached_reads_per_s": base,
        "best_hot_reads_per_s": max((r["reads_per_s"] for r in hot), default=0.0),
        "best_hot_gbit_s": max((r["gbit_s"] for r in hot), default=0.0),
        "errors_at_256": sum(r["errors"] for r in rows if r["clients"] == 256),
    }
    summary["hot_x_one_replica"] = (summary["best_hot_reads_per_s"] / base) if base else 0.0
    summary["targets"] = {"hot_5x_one_replica": summary["hot_x_one_replica"] >= 5.0,
                          "hot_5_gbit_s": summary["best_hot_gbit_s"] >= 5.0,
                          "zero_errors_at_256": summary["errors_at_256"] == 0}
    if "encode" in extra:
        summary["targets"]["worker_kill_within_one_job_plus_10s"] = \
            extra["encode"]["worker_kill"]["target_met"]
    return summary


def _report(rows: list[dict[str, Any]], summary: dict[str, Any], extra: dict[str, Any]) -> None:
    print()
    print(format_table(
        ["replicas", "cache", "clients", "reads/s", "Gbit/s", "p50 ms", "p99 ms", "errors",
         "x 1 replica"],
        [[r["replicas"], r["cache"], r["clients"], f"{r['reads_per_s']:.0f}",
          f"{r['gbit_s']:.2f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", r["errors"],
          f"{r['x_one_replica_uncached']:.1f}"] for r in rows]))
    if "replica_kill" in extra:
        k = extra["replica_kill"]
        print(f"replica SIGKILL under load ({k['replicas']} replicas, 32 clients, uncached): "
              f"{k['errors']} errors, worst latency around the kill "
              f"{k['max_latency_around_kill_ms']:.0f} ms")
    if "encode" in extra:
        e = extra["encode"]
        kill = e["worker_kill"]
        print(f"encode: 1 worker {e['workers_1']['tokens_per_s']:.1f} tokens/s, 2 workers "
              f"{e['workers_2']['tokens_per_s']:.1f} tokens/s; worker SIGKILL: taken over after "
              f"{kill['kill_to_takeover_s']:.1f} s, job {kill['state']} "
              f"in {kill['job_wall_s']:.1f} s (one job {kill['one_job_encode_s']:.1f} s "
              f"+ 10 s = {kill['target_s']:.1f} s)")
    print(f"cores: {summary['cores']} (shared; loaded machine). targets: {summary['targets']}")
