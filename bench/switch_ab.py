"""The 4K switch's load path, two source trees side by side (issue 43): one child process per
tree (``PYTHONPATH`` = the tree) holds bench/segments_read.py's context (SmolLM2-135M's
geometry at int8, 4,096 tokens, one segment on flash, 50 MB of records) and, on the parent's
word, times the reads alone (4 threads, ``O_DIRECT``, in the tree's own runs: its
``RUN_BYTES``) or one flash load
(``loader.load``: read, check, swap into the pages, fill the working memory; 4 readers, no
recomputation). The parent alternates the trees (and their order) round after round, so both
see the same machine load; each load is set against the reads of the same round.

    python bench/switch_ab.py BEFORE_TREE AFTER_TREE [--tokens 4096] [--rounds 9] [--with-alloc] [--out F.json]
    python bench/switch_ab.py TREE TREE --after-env THP_MEM_ALLOC_ENABLE=1 --with-alloc

``--after-env NAME=VALUE`` (repeatable) sets a variable in the second tree's process only (and
``NAME=0`` in the first's): one tree twice then compares an environment setting.

``--with-alloc`` times the working memory's making (``ContextKV(...)``) with the load, as a
switch pays it.

Wall clock on whatever machine runs it: the load average is recorded, only the ratios count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any


def child(tokens: int, with_alloc: bool = False) -> None:
    """Serves ``read`` / ``load`` lines on stdin with one JSON line each on stdout."""
    import shutil
    import tempfile
    import time
    import types

    import torch
    sys.path.insert(0, os.environ["PYTHONPATH"] + "/bench")
    import segments_read as sr

    from sparkv.cache import ContextKV
    from sparkv.device.flashio import RUN_BYTES
    from sparkv.device.loader import LoadOptions, LoadRequest, load, token_chunk_ids

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="switch-ab-"))
    try:
        _, ctx = sr.make_context(root, tokens, True)
        C = ctx.memory
        g = C.geometry
        lm = types.SimpleNamespace(device=torch.device("cpu"))
        every = [c for t in range(g.num_token_chunks) for c in token_chunk_ids(g, t)]
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            what = line.strip()
            if what == "read":
                dt, reads, nbytes = sr.read_only(ctx, 4, RUN_BYTES)  # the tree's own runs
                out: dict[str, Any] = {"read_s": dt, "reads": reads, "bytes": nbytes}
            elif what == "load":
                if with_alloc:                        # the working memory's making timed too
                    t0 = time.perf_counter()
                    W = ContextKV(g, torch.float32, "cpu")
                else:
                    W = ContextKV(g, torch.float32, "cpu")
                    t0 = time.perf_counter()
                s = load(lm, ctx.tokens, C, W, ctx.tier,
                         LoadRequest(read=range(g.num_token_chunks)),
                         LoadOptions(pipeline=False, io_threads=4))
                dt = time.perf_counter() - t0
                assert s.faults == 0 and s.read_chunks == g.num_token_chunks
                C.drop_many(every)                    # swapped out again, nothing written
                out = {"load_s": dt, "reads": s.reads, "bytes": s.bytes_read}
            else:
                break
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Tree:
    def __init__(self, path: str, tokens: int, with_alloc: bool = False,
                 extra_env: dict[str, str] | None = None) -> None:
        self.path = str(Path(path).resolve())
        env = dict(os.environ, PYTHONPATH=self.path, **(extra_env or {}))
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", "--tokens", str(tokens),
                                      *(["--with-alloc"] if with_alloc else [])],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=self.path)
        self.ask_line = lambda: json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def ask(self, what: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trees", nargs="*")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--with-alloc", action="store_true",
                    help="time the working memory's making with the load (a switch makes one)")
    ap.add_argument("--after-env", action="append", default=[], metavar="NAME=VALUE",
                    help="set in the second tree's process only (NAME=0 in the first's)")
    a = ap.parse_args()
    if a.child:
        child(a.tokens, a.with_alloc)
        return
    names = ["before", "after"]
    res: dict[str, Any] = {"command": "python bench/switch_ab.py " + " ".join(sys.argv[1:]),
                           "trees": dict(zip(names, a.trees)), "tokens": a.tokens,
                           "load_average_start": os.getloadavg(),
                           "rounds": {n: [] for n in names}}
    after = dict(kv.split("=", 1) for kv in a.after_env)
    res["after_env"] = after
    envs = [{k: "0" for k in after}, after]
    trees = [Tree(p, a.tokens, a.with_alloc, e) for p, e in zip(a.trees, envs)]
    try:
        for t in trees:
            assert t.ask_line().get("ready")
        for t in trees:                               # warm: numba caches, first allocations
            t.ask("read"), t.ask("load")
        for i in range(a.rounds):
            order = list(range(len(trees)))[::1 if i % 2 == 0 else -1]
            for j in order:
                r = trees[j].ask("read")
                l_ = trees[j].ask("load")
                res["rounds"][names[j]].append({"read_ms": r["read_s"] * 1e3,
                                                "load_ms": l_["load_s"] * 1e3,
                                                "ratio": l_["load_s"] / r["read_s"],
                                                "bytes": l_["bytes"], "reads": l_["reads"]})
                print(names[j], {k: round(v, 2) for k, v in res["rounds"][names[j]][-1].items()},
                      flush=True)
    finally:
        for t in trees:
            t.close()
    res["load_average_end"] = os.getloadavg()
    for n in names:
        rows = res["rounds"][n]
        res[n] = {k: statistics.median(r[k] for r in rows) for k in ("read_ms", "load_ms", "ratio")}
    res["after_vs_before_load"] = res["after"]["load_ms"] / res["before"]["load_ms"]
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
