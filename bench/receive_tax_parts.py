"""What the learned receive tax holds (docs/scheduler.md, "What the learned receive tax holds"),
paired in one process on SmolLM2 at 2K tokens (T=512):

1. **Interference.** Every layer step of the context run one at a time (as sparkv and Strong
   Hybrid run them beside a receive), alone and beside a background receive through the edge's
   own link path (:class:`~sparkv.edge.http_source.HttpChunkSource`, the in-process shaper, the
   server on loopback) at each of ``--mbps``, in turn, the order reversed every other round.
2. **The cost model's shape.** Each step alone against :class:`~sparkv.predictor.measured.
   MeasuredSteps` (calibrated afresh each round): measured / predicted per token chunk, the
   part of a load's tax that is no receive at all.
3. **The link path's CPU.** The receiving thread's and the server's CPU per second of a receive
   at each rate, and this machine's CPU per timed wait (a thread that sleeps and wakes, as the
   shaper's reader does once per piece).

    python bench/receive_tax_parts.py --mbps 100,300 --rounds 8 \\
        --out bench/results/receive_tax_parts_s79.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics as st
import threading
import time
from typing import Any, Callable

from sparkv.cli import passive_openmp_waits

passive_openmp_waits()          # before torch loads, as the sparkv command does

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402

from sparkv.bench.served import served_context  # noqa: E402
from sparkv.edge.client import EdgeClient  # noqa: E402
from sparkv.edge.shaper import LinkShaper  # noqa: E402
from sparkv.edge.transport import FetchItem  # noqa: E402
from sparkv.layout import StepId  # noqa: E402
from sparkv.predictor.dtypes import load_model_in_dtype  # noqa: E402
from sparkv.predictor.measured import MeasuredSteps  # noqa: E402
from sparkv.runtime import LayerStepper  # noqa: E402
from sparkv.runtime.heap import settle  # noqa: E402
from sparkv.runtime.threads import use_threads  # noqa: E402


class Receiver:
    """A background thread fetching the context's raw frames through the edge's link path, in
    batches of 8, over a link of ``mbps`` (20 ms round trip), until :meth:`stop`."""

    def __init__(self, url: str, cid: str, mbps: float) -> None:
        self.client = EdgeClient(url, shaper=LinkShaper.constant(mbps, rtt_ms=20.0))
        m = self.client.manifest(cid)
        self.items = [FetchItem(c.id, "raw", c.levels["raw"].bytes) for c in m.chunks]
        self.source = self.client.chunk_source(cid)
        self.bytes = 0
        self.cpu_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        t0 = time.thread_time()
        self.source.start()
        while not self._stop.is_set():
            for i in range(0, len(self.items), 8):
                stream = await self.source.open(self.items[i:i + 8])
                async for piece in stream:
                    self.bytes += len(piece.data)
                if self._stop.is_set():
                    break
        await self.source.aclose()
        self.cpu_s = time.thread_time() - t0

    def start(self) -> "Receiver":
        self._thread.start()
        time.sleep(0.3)              # its first responses under way
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.client.close()


def single_steps(lm: Any, ids: list[int]) -> tuple[np.ndarray, Any]:
    """Seconds of every layer step ``[t, l]`` run one at a time, token chunk by token chunk, and
    the context's geometry."""
    stepper = LayerStepper(lm, ids, 512, lazy=True)
    g = stepper.geometry
    out = np.zeros((g.num_token_chunks, g.num_layers))
    with torch.inference_mode():
        for t in range(g.num_token_chunks):
            for layer in range(g.num_layers):
                out[t, layer] = stepper.run_step(StepId(t, layer)).seconds
    return out, g


def wait_cpu_us(wait: Callable[[], Any], n: int = 200) -> float:
    """This thread's CPU microseconds per call of ``wait``."""
    t0 = time.thread_time()
    for _ in range(n):
        wait()
    return (time.thread_time() - t0) / n * 1e6


def link_cpu(url: str, cid: str, mbps: float, server: list[psutil.Process],
             seconds: float = 3.0) -> dict[str, float]:
    """The receiving thread's and the server's share of a core while the link receives."""
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in server)
    w0 = time.perf_counter()
    rx = Receiver(url, cid, mbps).start()
    time.sleep(seconds)
    rx.stop()
    wall = time.perf_counter() - w0
    cpu = sum(sum(p.cpu_times()[:2]) for p in server) - cpu0
    return {"mbps": mbps, "received_mbps": rx.bytes * 8 / 1e6 / wall,
            "link_thread_core_share": rx.cpu_s / wall, "server_core_share": cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mbps", default="100,300")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--out", default="bench/results/receive_tax_parts.json")
    args = ap.parse_args()
    rates = [float(x) for x in args.mbps.split(",")]
    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    settle()
    use_threads(2)
    modes = ["alone"] + [f"{r:g} Mbit/s" for r in rates]
    totals: dict[str, list[float]] = {m: [] for m in modes}
    shape: list[list[float]] = []
    with served_context(lm, tokens=2048, warm=()) as (s, cid):
        url, ids = s.client.base_url, s.client.tokens(cid)
        single_steps(lm, ids)                                   # allocations, first calls
        for rnd in range(args.rounds):
            model = MeasuredSteps.measure(lm)
            for mode in (modes if rnd % 2 == 0 else modes[::-1]):
                rx = None if mode == "alone" else Receiver(url, cid, float(mode.split()[0]))
                if rx is not None:
                    rx.start()
                steps, g = single_steps(lm, ids)
                if rx is not None:
                    rx.stop()
                totals[mode].append(float(steps.sum()))
                if mode == "alone":
                    ratio = steps[:, :-1] / model.t_comp(g, sparse=False, utilisation=0.0)[:, :-1]
                    shape.append([float(np.median(row)) for row in ratio])
                print(f"round {rnd} {mode:>12s}: every step {steps.sum():.3f} s", flush=True)
        server = psutil.Process().children(recursive=True)
        cpu = [link_cpu(url, cid, r, server) for r in rates]
    waits = {"time.sleep(5 ms)": wait_cpu_us(lambda: time.sleep(0.005)),
             "asyncio.sleep(5 ms)": asyncio.run(_async_wait_cpu_us())}
    slow = {m: {"median": st.median(r), "min": min(r), "max": max(r)}
            for m in modes[1:] for r in [[a / b for a, b in zip(totals[m], totals["alone"])]]}
    per_chunk = [st.median(col) for col in zip(*shape)]
    print("\nsteps beside a receive / alone (paired rounds):")
    for m, v in slow.items():
        print(f"  {m:>12s}: median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f})")
    print("steps alone, measured / MeasuredSteps per token chunk (median over rounds): "
          + " ".join(f"{x:.2f}" for x in per_chunk)
          + f"; spread within a round, median {st.median(max(r) - min(r) for r in shape):.2f}")
    for c in cpu:
        print(f"link at {c['mbps']:g} Mbit/s (got {c['received_mbps']:.0f}): link thread "
              f"{100 * c['link_thread_core_share']:.1f}% of a core, server "
              f"{100 * c['server_core_share']:.1f}%")
    print("CPU per timed wait: " + ", ".join(f"{k} {v:.0f} us" for k, v in waits.items()))
    with open(args.out, "w") as f:
        json.dump({"config": {"mbps": rates, "rounds": args.rounds, "tokens": 2048,
                              "chunk_tokens": 512, "threads": torch.get_num_threads()},
                   "steps_s": totals, "beside_receive_over_alone": slow,
                   "alone_over_measured_steps_per_chunk": shape,
                   "alone_over_measured_steps_median": per_chunk,
                   "link_cpu": cpu, "cpu_per_wait_us": waits}, f, indent=1)
    print(f"wrote {args.out}")


async def _async_wait_cpu_us(n: int = 200) -> float:
    t0 = time.thread_time()
    for _ in range(n):
        await asyncio.sleep(0.005)
    return (time.thread_time() - t0) / n * 1e6


if __name__ == "__main__":
    main()
