"""``sparkv bench server``: chunk serving throughput and latency on loopback, and encode speed.

One ``sparkv serve`` process (file store in a temp dir) encodes a SmolLM2 context through its own
REST API (``POST /v1/contexts``), then a load generator in a separate process (aiohttp, keep-alive,
one connection per client) pulls chunks for a fixed time with 1, 8 and 32 concurrent clients in two
ways: single ``GET /v1/contexts/{id}/chunks/{t}/{l}/{g}`` requests, and ``POST .../stream``
requests of ``--stream-frames`` frames each. Every response is checked (status, byte count; for
streams every length prefix against the manifest's sizes, in order); any mismatch is an error.

Reported per (mode, level, clients): Gbit/s of frame bytes, requests/s, latency p50/p99 per
request (a GET, or a whole stream) and time to the first byte, errors, and the CPU seconds the
server and the load generator used. Encode: tokens/s of the whole job and frames/s of the codec
alone. Mode ``stalled``: ``GET /healthz`` latency (p50/p99) while ``--stalled-streams`` stream
responses are open to clients that never read (target: p99 < 100 ms: a stalled stream must not
block the event loop), with the server's buffered stream bytes at that moment. Everything stays
on 127.0.0.1. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkv.bench.common import (add_output_args, format_table, percentile, wait_job,
                                 write_result)

TARGET_GBIT_S = 1.0
TARGET_CLIENTS = 32
TARGET_HEALTHZ_MS = 100.0
STALLED_STREAM_BYTES = 200_000_000
"""Bytes each stalled stream asks for (repeating the context's frames; under max_stream_bytes)."""
HEALTHZ_SAMPLES = 200


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("server", help="REST serving throughput/latency on loopback, encode speed")
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2)")
    p.add_argument("--tokens", type=int, default=2048, help="context tokens")
    p.add_argument("--chunk-tokens", type=int, default=256,
                   help="T the server encodes with (the server's default T)")
    p.add_argument("--levels", default="q5,raw", help="levels to encode and serve")
    p.add_argument("--clients", default="1,8,32", help="concurrent clients")
    p.add_argument("--modes", default="get,stream,stalled",
                   help="get, stream (throughput per level and clients) and stalled (/healthz "
                        "latency while streams are stalled)")
    p.add_argument("--stalled-streams", type=int, default=16,
                   help="stream responses kept open to clients that never read (mode stalled)")
    p.add_argument("--duration-s", type=float, default=3.0,
                   help="seconds per configuration")
    p.add_argument("--stream-frames", type=int, default=60, help="frames per stream request")
    p.add_argument("--threads", type=int, default=0,
                   help="server's PyTorch threads "
                   "(0: all cores)")
    add_output_args(p, "server")
    p.set_defaults(func=run)


# ------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------
def _context_ids(model: str | None, n: int) -> list[int]:
    from transformers import AutoTokenizer

    from sparkv.runtime import sample_text
    from sparkv.runtime.model import default_checkpoint

    tok = AutoTokenizer.from_pretrained(model or default_checkpoint())
    base = tok.encode(sample_text(), add_special_tokens=False)
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(base)
    return ids[:n]


def _cpu_seconds(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def run(args: argparse.Namespace) -> int:
    import httpx

    from sparkv.server.process import ServerProcess, write_config

    levels = [x for x in args.levels.split(",") if x]
    clients = [int(x) for x in args.clients.split(",") if x]
    modes = [x for x in args.modes.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-server-") as tmp:
        tmpd = Path(tmp)
        keys = write_config(tmpd / "server.yaml", ["bench"], models={"bench": args.model},
                            default_model="bench", max_context_tokens=max(args.tokens, 8192),
                            max_body_bytes=16 * 1024 * 1024,
                            max_streams_per_tenant=max(clients + [args.stalled_streams, 8]))
        threads = args.threads or (os.cpu_count() or 1)
        print(f"bench server: starting the server (torch threads {threads}) ...", flush=True)
        server = ServerProcess(tmpd / "server.yaml", f"file://{tmpd}/store",
                               log_path=tmpd / "server.log", torch_threads=threads).start(300)
        try:
            headers = {"Authorization": f"Bearer {keys['bench']}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=600) as c:
                encode = _encode(c, args, levels)
                manifest = c.get(f"/v1/contexts/{encode['context_id']}").json()
            rows = []
            stalled = None
            for level in levels:
                for mode in [m for m in modes if m in ("get", "stream")]:
                    for n in clients:
                        cfg = {"url": server.url, "key": keys["bench"], "mode": mode,
                               "level": level, "clients": n, "duration": args.duration_s,
                               "stream_frames": args.stream_frames,
                               "context_id": encode["context_id"],
                               "items": [[ch["t"], ch["l"], ch["g"], ch["levels"][level]["bytes"]]
                                         for ch in manifest["chunks"]]}
                        assert server.proc is not None          # started above
                        cpu0 = _cpu_seconds(server.proc.pid)
                        res = _loadgen(cfg)
                        res["server_cpu_s"] = _cpu_seconds(server.proc.pid) - cpu0
                        rows.append(res)
                        print(f"  {mode:6s} {level:4s} clients={n:3d}: {res['gbit_s']:.3f} Gbit/s, "
                              f"p50 {res['latency_p50_ms']:.2f} ms, p99 "
                              f"{res['latency_p99_ms']:.2f} ms, errors {res['errors']}",
                              flush=True)
            if "stalled" in modes:
                stalled = _stalled_healthz(server.url, server.port, keys["bench"], manifest,
                                           encode["context_id"], levels[0],
                                           args.stalled_streams)
            server_log = server.log()
        finally:
            server.stop()
    _print(encode, rows, stalled)
    stream32 = [r for r in rows if r["mode"] == "stream" and r["clients"] == TARGET_CLIENTS]
    targets: dict[str, Any] = {}
    if stream32:
        best = max(r["gbit_s"] for r in stream32)
        met32 = best >= TARGET_GBIT_S and all(r["errors"] == 0 for r in stream32)
        targets["stream_gbit_s_at_32_clients"] = {
            "target": f">= {TARGET_GBIT_S}", "measured": best,
            "errors": sum(r["errors"] for r in stream32), "met": met32}
        print(f"\ntarget: >= {TARGET_GBIT_S} Gbit/s through the stream endpoint at "
              f"{TARGET_CLIENTS} clients with no errors: best {best:.3f} Gbit/s -> "
              f"{'met' if met32 else 'NOT met'}")
    if stalled is not None:
        met = stalled["healthz_p99_ms"] < TARGET_HEALTHZ_MS and stalled["errors"] == 0
        targets["healthz_p99_ms_with_stalled_streams"] = {
            "target": f"< {TARGET_HEALTHZ_MS:g}", "streams": stalled["streams"],
            "measured": stalled["healthz_p99_ms"], "met": met}
        print(f"target: /healthz p99 < {TARGET_HEALTHZ_MS:g} ms with {stalled['streams']} "
              f"stalled streams: {stalled['healthz_p99_ms']:.1f} ms -> "
              f"{'met' if met else 'NOT met'}")
    if "Traceback" in server_log:
        print("warning: the server logged a traceback:\n" + server_log[-2000:], file=sys.stderr)
    if args.json or args.out:
        config = {k: v for k, v in vars(args).items() if k != "func"}
        path = write_result("server", {"encode": encode, "results": rows,
                                       "stalled_streams": stalled, "targets": targets},
                            config, args.out)
        print(f"wrote {path}")
    return 0


def _encode(c: Any, args: argparse.Namespace, levels: list[str]) -> dict[str, Any]:
    """Warm the codec up on a small context, then time a full encode job."""
    ids = _context_ids(args.model, args.tokens)
    warm = c.post("/v1/contexts", json={"token_ids": ids[:args.chunk_tokens],
                                        "chunk_tokens": args.chunk_tokens, "levels": levels})
    warm.raise_for_status()
    if warm.json()["job_id"]:
        wait_job(c, warm.json()["job_id"], what="encode job")
    print(f"bench server: encoding {len(ids)} tokens at {','.join(levels)} ...", flush=True)
    t0 = time.perf_counter()
    r = c.post("/v1/contexts", json={"token_ids": ids, "chunk_tokens": args.chunk_tokens,
                                     "levels": levels})
    r.raise_for_status()
    out = r.json()
    job = wait_job(c, out["job_id"], what="encode job") if out["status"] != "done" else None
    wall = time.perf_counter() - t0
    if job is not None and job["state"] != "done":
        raise RuntimeError(f"encode job failed: {job['error']}")
    tm = job["timings"] if job else {}
    frames = tm.get("frames_encoded", 0)
    m = c.get(f"/v1/contexts/{out['context_id']}").json()
    return {
        "context_id": out["context_id"], "tokens": len(ids), "chunk_tokens": args.chunk_tokens,
        "levels": levels, "chunks": out["num_chunks"], "frames": frames,
        "wall_s": wall, "prefill_s": tm.get("prefill_s"), "codec_s": tm.get("codec_s"),
        "describe_s": tm.get("describe_s"), "store_s": tm.get("store_s"),
        "job_s": tm.get("encode_total_s"),
        "tokens_per_s": len(ids) / wall,
        "prefill_tokens_per_s": len(ids) / tm["prefill_s"] if tm.get("prefill_s") else None,
        "codec_chunks_per_s": frames / tm["codec_s"] if tm.get("codec_s") else None,
        "bytes_per_level": m["total_bytes"],
    }


def _print(encode: dict[str, Any], rows: list[dict[str, Any]],
           stalled: dict[str, Any] | None = None) -> None:
    print("\nencode (one job through the REST API):")
    print(format_table(
        ["tokens", "T", "frames", "wall_s", "prefill_s", "codec_s", "describe_s", "store_s",
         "tokens/s", "codec frames/s"],
        [[encode["tokens"], encode["chunk_tokens"], encode["frames"], encode["wall_s"],
          encode["prefill_s"] or 0.0, encode["codec_s"] or 0.0, encode["describe_s"] or 0.0,
          encode["store_s"] or 0.0, encode["tokens_per_s"], encode["codec_chunks_per_s"] or 0.0]]))
    print("\nserving on loopback (one server process):")
    print(format_table(
        ["mode", "level", "clients", "Gbit/s", "req/s", "frames/s", "p50_ms", "p99_ms",
         "ttfb_p50_ms", "errors", "server_cpu_s", "client_cpu_s"],
        [[r["mode"], r["level"], r["clients"], r["gbit_s"], r["requests_per_s"],
          r["frames_per_s"], r["latency_p50_ms"], r["latency_p99_ms"], r["ttfb_p50_ms"],
          r["errors"], r["server_cpu_s"], r["client_cpu_s"]] for r in rows]))
    if stalled is not None:
        print(f"\n/healthz latency, idle and with {stalled['streams']} stalled streams "
              f"({stalled['stream_mbytes']:.0f} MB asked each, level {stalled['level']}):")
        print(format_table(
            ["streams", "samples", "idle_p50_ms", "idle_p99_ms", "p50_ms", "p99_ms", "max_ms",
             "errors", "buffered_MB"],
            [[stalled["streams"], stalled["samples"], stalled["idle_p50_ms"],
              stalled["idle_p99_ms"], stalled["healthz_p50_ms"], stalled["healthz_p99_ms"],
              stalled["healthz_max_ms"], stalled["errors"],
              stalled["buffered_bytes"] / 1e6]]))


# ------------------------------------------------------------------------------------------------
# /healthz while streams are stalled
# ------------------------------------------------------------------------------------------------
def _server_metric(client: Any, name: str) -> float:
    total = 0.0
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _healthz_latencies(client: Any, n: int) -> tuple[list[float], int]:
    lat: list[float] = []
    errors = 0
    for _ in range(n):
        t0 = time.perf_counter()
        try:
            ok = client.get("/healthz").status_code == 200
        except Exception:  # noqa: BLE001 - counted
            ok = False
        lat.append(time.perf_counter() - t0)
        errors += not ok
        time.sleep(0.005)
    return lat, errors


def _stalled_healthz(url: str, port: int, key: str, manifest: dict[str, Any], context_id: str,
                     level: str, streams: int) -> dict[str, Any]:
    """``/healthz`` latency (keep-alive, sequential) with no stream open, then with ``streams``
    stream responses open to raw-socket clients that sent their request and never read (a 4 KiB
    receive buffer, so the kernel absorbs little); the clients then reset their connections."""
    import socket
    import struct

    import httpx

    chunks = manifest["chunks"]
    per_pass = sum(4 + ch["levels"][level]["bytes"] for ch in chunks)
    repeat = max(1, min(STALLED_STREAM_BYTES // per_pass, 65536 // len(chunks)))
    body = json.dumps({"level": level, "chunks": [{"t": ch["t"], "l": ch["l"], "g": ch["g"]}
                                                  for ch in chunks] * repeat}).encode()
    request = (f"POST /v1/contexts/{context_id}/stream HTTP/1.1\r\nHost: bench\r\n"
               f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    socks: list[socket.socket] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        _healthz_latencies(c, 20)  # warm the connection
        idle, idle_errors = _healthz_latencies(c, HEALTHZ_SAMPLES)
        print(f"bench server: opening {streams} stalled streams ({per_pass * repeat / 1e6:.0f} "
              f"MB each) ...", flush=True)
        try:
            for _ in range(streams):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", port))
                s.sendall(request)
                socks.append(s)
            deadline = time.monotonic() + 120
            while _server_metric(c, "sparkv_streams_active") < streams:
                if time.monotonic() > deadline:
                    raise RuntimeError("the stalled streams did not all start")
                time.sleep(0.05)
            time.sleep(0.5)  # let the streams fill their socket buffers and stall
            lat, errors = _healthz_latencies(c, HEALTHZ_SAMPLES)
            buffered = _server_metric(c, "sparkv_stream_buffered_bytes")
            active = _server_metric(c, "sparkv_streams_active")
        finally:
            for s in socks:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
        deadline = time.monotonic() + 60
        while _server_metric(c, "sparkv_streams_active") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        released = _server_metric(c, "sparkv_streams_active") == 0
    out = {"streams": streams, "level": level, "stream_mbytes": per_pass * repeat / 1e6,
           "samples": len(lat), "streams_active": active, "buffered_bytes": buffered,
           "idle_p50_ms": percentile(idle, 50) * 1e3, "idle_p99_ms": percentile(idle, 99) * 1e3,
           "healthz_p50_ms": percentile(lat, 50) * 1e3,
           "healthz_p99_ms": percentile(lat, 99) * 1e3,
           "healthz_max_ms": max(lat) * 1e3 if lat else 0.0,
           "errors": errors + idle_errors, "slots_released": released}
    print(f"  stalled x{streams}: /healthz p50 {out['healthz_p50_ms']:.2f} ms, p99 "
          f"{out['healthz_p99_ms']:.2f} ms (idle p99 {out['idle_p99_ms']:.2f} ms), buffered "
          f"{buffered / 1e6:.1f} MB, slots released {released}", flush=True)
    return out


# ------------------------------------------------------------------------------------------------
# the load generator (a separate process: python -c "...; _loadgen_main()")
# ------------------------------------------------------------------------------------------------
def _loadgen(cfg: dict[str, Any]) -> dict[str, Any]:
    code = "from sparkv.bench.server import _loadgen_main; _loadgen_main()"
    p = subprocess.run([sys.executable, "-c", code], input=json.dumps(cfg), text=True,
                       capture_output=True, timeout=cfg["duration"] + 300)
    if p.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout)


def _loadgen_main() -> None:
    from sparkv.bench.common import run_event_loop

    cfg = json.loads(sys.stdin.read())
    print(json.dumps(run_event_loop(_load(cfg))))


class _FrameChecker:
    """Walks a stream body chunk by chunk, checking every length prefix against the sizes the
    manifest promises, in the requested order."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self.i = 0
        self.remaining = 0  # bytes left in the current frame
        self.prefix = b""
        self.ok = True

    def feed(self, data: bytes) -> None:
        pos, n = 0, len(data)
        while pos < n and self.ok:
            if self.remaining:
                take = min(self.remaining, n - pos)
                self.remaining -= take
                pos += take
                continue
            need = 4 - len(self.prefix)
            self.prefix += data[pos:pos + need]
            pos += min(need, n - pos)
            if len(self.prefix) == 4:
                size = int.from_bytes(self.prefix, "little")
                self.prefix = b""
                if self.i >= len(self.sizes) or size != self.sizes[self.i]:
                    self.ok = False
                    return
                self.i += 1
                self.remaining = size

    def done(self) -> bool:
        return self.ok and self.i == len(self.sizes) and not self.remaining and not self.prefix


class _LoadTally:
    """What the workers of one load run measure: per-request latencies and times to the first
    byte (seconds), and the totals. State only; the workers share it on one event loop (no
    lock needed)."""

    def __init__(self) -> None:
        self.lat: list[float] = []
        self.ttfb: list[float] = []
        self.totals = {"bytes": 0, "frames": 0, "errors": 0, "requests": 0}


async def _load(cfg: dict[str, Any]) -> dict[str, Any]:
    """One load run: ``cfg["clients"]`` workers (one keep-alive connection each, opened before
    the clock starts) for ``cfg["duration"]`` seconds, ``get`` or ``stream`` mode."""
    import resource

    from sparkv.extras import require

    aiohttp = require("aiohttp", feature="the serving load generator")

    headers = {"Authorization": f"Bearer {cfg['key']}"}
    tally = _LoadTally()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(cfg["url"], headers=headers, connector=connector,
                                     timeout=timeout, auto_decompress=False) as session:
        # one connection per client, opened before the clock starts
        await asyncio_gather(*[session.get("/healthz") for _ in range(cfg["clients"])])
        start = time.perf_counter()
        deadline = start + cfg["duration"]
        worker = _get_worker if cfg["mode"] == "get" else _stream_worker
        await asyncio_gather(*[worker(session, cfg, tally, w, deadline)
                               for w in range(cfg["clients"])])
        elapsed = time.perf_counter() - start
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    client_cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    totals, lat, ttfb = tally.totals, tally.lat, tally.ttfb
    return {
        "mode": cfg["mode"], "level": cfg["level"], "clients": cfg["clients"],
        "seconds": elapsed, "requests": totals["requests"], "errors": totals["errors"],
        "bytes": totals["bytes"], "frames": totals["frames"],
        "gbit_s": totals["bytes"] * 8 / elapsed / 1e9,
        "mbyte_s": totals["bytes"] / elapsed / 1e6,
        "requests_per_s": totals["requests"] / elapsed,
        "frames_per_s": totals["frames"] / elapsed,
        "latency_p50_ms": percentile(lat, 50) * 1e3,
        "latency_p99_ms": percentile(lat, 99) * 1e3,
        "ttfb_p50_ms": percentile(ttfb, 50) * 1e3 if ttfb else None,
        "stream_frames": cfg["stream_frames"] if cfg["mode"] == "stream" else 1,
        "client_cpu_s": client_cpu,
    }


async def _get_worker(session: Any, cfg: dict[str, Any], tally: _LoadTally, w: int,
                      deadline: float) -> None:
    """Single-frame ``GET``s until ``deadline``, worker ``w`` starting at its own frame."""
    from sparkv.extras import require

    aiohttp = require("aiohttp", feature="the serving load generator")

    cid, level, items = cfg["context_id"], cfg["level"], cfg["items"]
    i = w * 7919
    while time.perf_counter() < deadline:
        t, layer, g, size = items[i % len(items)]
        i += 1
        t0 = time.perf_counter()
        try:
            async with session.get(f"/v1/contexts/{cid}/chunks/{t}/{layer}/{g}",
                                   params={"level": level}) as r:
                data = await r.read()
                ok = r.status == 200 and len(data) == size
        except aiohttp.ClientError:
            ok, data = False, b""
        tally.lat.append(time.perf_counter() - t0)
        tally.totals["requests"] += 1
        tally.totals["bytes"] += len(data)
        if ok:
            tally.totals["frames"] += 1
        else:
            tally.totals["errors"] += 1


async def _stream_worker(session: Any, cfg: dict[str, Any], tally: _LoadTally, w: int,
                         deadline: float) -> None:
    """``POST .../stream`` requests of ``cfg["stream_frames"]`` frames until ``deadline``, every
    length prefix checked (:class:`_FrameChecker`)."""
    from sparkv.extras import require

    aiohttp = require("aiohttp", feature="the serving load generator")

    cid, level, items = cfg["context_id"], cfg["level"], cfg["items"]
    k = cfg["stream_frames"]
    i = (w * 37) % len(items)
    while time.perf_counter() < deadline:
        batch = [items[(i + j) % len(items)] for j in range(k)]
        i = (i + k) % len(items)
        body = {"level": level, "chunks": [{"t": t, "l": layer, "g": g}
                                           for t, layer, g, _ in batch]}
        checker = _FrameChecker([b[3] for b in batch])
        t0 = time.perf_counter()
        first = None
        n = 0
        try:
            async with session.post(f"/v1/contexts/{cid}/stream", json=body) as r:
                ok = r.status == 200
                async for chunk in r.content.iter_any():
                    if first is None:
                        first = time.perf_counter() - t0
                    n += len(chunk)
                    checker.feed(chunk)
                ok = ok and checker.done()
        except aiohttp.ClientError:
            ok = False
        tally.lat.append(time.perf_counter() - t0)
        tally.ttfb.append(first if first is not None else 0.0)
        tally.totals["requests"] += 1
        tally.totals["bytes"] += n
        if ok:
            tally.totals["frames"] += checker.i
        else:
            tally.totals["errors"] += 1


async def asyncio_gather(*aws: Any) -> list[Any]:
    import asyncio

    results = await asyncio.gather(*aws)
    for r in results:  # release pooled connections of the warm-up requests
        release = getattr(r, "release", None)
        if release is not None:
            release()
    return results
