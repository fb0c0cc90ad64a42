"""What numba's thread pool did to torch's thread count, and what it cost two neighbours.

Two processes at once, each set to one torch thread (``--threads 1``, two apps on a 2-core
device), each with the bundled SmolLM2 in ``int4``: 24 greedy answer tokens (the Q4_1 kernels:
numba's pool starts), then a 512-token prefill timed ``--rounds`` times. Two variants, one after
the other:

* ``numba's start``: the pool started as numba starts it (``numba.get_num_threads()`` just before
  the answer, as the first parallel kernel did), which sets the starting thread's OpenMP count,
  the one torch's kernels use, to every core: sparkv before this change;
* ``sparkv's start``: the pool started by :func:`sparkv.kernels.start_pool`, which keeps it.

The table gives each variant's torch count after the answer and the prefill's median wall
seconds (both processes' rounds), and the ratio.

    PYTHONPATH=$PWD python bench/pool_threads.py [--procs 2] [--rounds 3]
                                                 [--out bench/results/pool_threads.json]
"""
import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from sparkv.runtime import load_model, sample_context_ids
from sparkv.runtime.generate import reference_generate
lm = load_model(dtype="int4", progress=False)
ids = sample_context_ids(lm, 512)
if sys.argv[1] == "numba":      # where the first answer token's kernel would start it
    import numba
    numba.get_num_threads()
reference_generate(lm, ids, 24)
after = torch.get_num_threads()
walls = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    walls.append(time.perf_counter() - t0)
print(json.dumps({"threads_after": after, "walls": walls}))
"""

VARIANTS = {"numba's start": "numba", "sparkv's start": "sparkv"}


def run_variant(how: str, procs: int, rounds: int) -> dict:
    """``procs`` children at once; their torch counts after the answer and their walls."""
    children = [subprocess.Popen([sys.executable, "-c", _CHILD, how, str(rounds)],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                for _ in range(procs)]
    docs = []
    for c in children:
        out, _ = c.communicate(timeout=1800)
        if c.returncode != 0:
            raise SystemExit(f"a {how} child failed (rc {c.returncode})")
        docs.append(json.loads(out.strip().splitlines()[-1]))
    walls = [w for d in docs for w in d["walls"][1:]]       # the first round warms up
    return {"threads_after": sorted({d["threads_after"] for d in docs}),
            "prefill_s": round(statistics.median(walls), 3), "walls": walls}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2, help="processes at once")
    p.add_argument("--rounds", type=int, default=3, help="prefills a process (the first warms)")
    p.add_argument("--out", default=None, help="write the rows here (JSON)")
    a = p.parse_args()
    rows = {name: run_variant(how, a.procs, max(2, a.rounds)) for name, how in VARIANTS.items()}
    base = rows["numba's start"]["prefill_s"]
    print(f"{a.procs} processes at once, torch set to 1 thread each; SmolLM2 int4, a 512-token "
          f"prefill after 24 answer tokens")
    print(f"{'variant':<16} {'torch threads after':>20} {'prefill s':>10} {'speed-up':>9}")
    for name, r in rows.items():
        print(f"{name:<16} {str(r['threads_after']):>20} {r['prefill_s']:>10.3f} "
              f"{base / r['prefill_s']:>8.2f}x")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"procs": a.procs, "rounds": a.rounds,
                                           "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
