"""The body read's low water mark (docs/edge.md, "The kernel gathers a frame's bytes") over a
path the kernel shapes: the server in a network namespace, tc on its veth (root only,
docs/netns.md). Per link and round, in turn (the order reversed every other round): sparkv with
the low water mark, sparkv without it (every read wakes for a byte, as before), and local; the
link thread's CPU per streamed chunk and each TTFT. SmolLM2 2K, T=512, THREADS torch threads
(default 1; with 2 the steps share both cores with the link thread, as in the main job).

    python bench/receive_lowat.py MBPS[,MBPS...] ROUNDS OUT.json [THREADS]
"""
from __future__ import annotations

import collections
import json
import os
import statistics as st
import sys
from typing import Any

from sparkv.cli import passive_openmp_waits

passive_openmp_waits()          # before torch loads, as the sparkv command does

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from receive_path import LINK_CPU, count_link_cpu  # noqa: E402  (the link thread's CPU)

from sparkv.bench.served import fresh_ask, netns_served_context  # noqa: E402
from sparkv.edge import wire  # noqa: E402
from sparkv.predictor.dtypes import load_model_in_dtype  # noqa: E402
from sparkv.scheduler.trace import Trace  # noqa: E402

GATHERED = wire.Response._gathered


async def _byte_at_a_time(self: wire.Response, max_bytes: int, want: int) -> bytes:
    """The read before the low water mark: woken for any byte."""
    self._conn.low_water(1)
    return await self._conn.reader.read(max_bytes)


def run(links: list[float], rounds: int) -> dict[tuple[float, str], list[tuple[float, float]]]:
    lm = load_model_in_dtype(None, dtype="auto", device="cpu")
    res: dict[tuple[float, str], list[tuple[float, float]]] = collections.defaultdict(list)
    with netns_served_context(lm, warm=("stream",)) as (s, cid, shaped):
        for i in range(rounds):
            for mbps in links:
                for name in (["lowat", "none", "local"] if i % 2 == 0
                             else ["local", "none", "lowat"]):
                    setattr(wire.Response, "_gathered",
                            GATHERED if name == "lowat" else _byte_at_a_time)
                    b = fresh_ask(s, cid, "local" if name == "local" else "sparkv",
                                  Trace.constant(mbps), link=shaped).breakdown
                    cpu = LINK_CPU[-1] / b.chunks_streamed * 1e3 if b.chunks_streamed else 0.0
                    res[(mbps, name)].append((cpu, b.ttft_s))
                    print(mbps, name, round(b.ttft_s, 3), b.chunks_streamed, flush=True)
    setattr(wire.Response, "_gathered", GATHERED)
    return res


def main() -> None:
    links = [float(x) for x in sys.argv[1].split(",")]
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    torch.set_num_threads(threads)
    count_link_cpu()
    res = run(links, int(sys.argv[2]))
    out: dict[str, Any] = {"torch_threads": threads}
    for (mbps, name), v in res.items():
        local = [t for _, t in res[(mbps, "local")]]
        over = [t / lt for (_, t), lt in zip(v, local)]
        out[f"{mbps:g}mbps/{name}"] = dict(ttft=[t for _, t in v], over_local=over,
                                           link_ms_per_chunk=[c for c, _ in v])
        print(f"{mbps:g} Mbit/s {name:5s} TTFT {st.median(t for _, t in v):.3f} s, over local "
              f"{st.median(over):.3f}, link thread {st.median(c for c, _ in v):.3f} ms a chunk")
    with open(sys.argv[3], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
