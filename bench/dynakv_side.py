"""DynaKV, its baselines and the over-RAM baseline side by side in one process, on a saved 8K
prompt (helper dynakv, issue 43; for a loaded shared machine where ``sparkv bench dynakv``'s
prefill, reference decode and four builds do not fit the time).

The prompt's KV (``sparkv bench dynakv``'s 8K pass-key workload, saved by ``--save`` or a
previous run) is loaded, full KV decodes ``--tokens`` greedily (the reference stream), and every
policy is teacher-forced on it: ``stream`` (full KV streamed from flash every token), ``local``,
``dynakv``, ``dynakv-padded`` (DynaKV with the per-cluster tensors and padded attention of
before the row arena: ``ClusteredKV.arena = None``) and ``dynakv-inline`` (DynaKV with its
cluster upkeep inline, on the token's path, as before ``background_upkeep``; ``local-inline``
likewise; ``+field=value`` sets a ``DecodeConfig`` field, e.g. ``dynakv+merge_gap=1``) at each
RAM budget, recall probed. The
prefill k-means is computed once (remembered in the process). A row is written to ``--out``
as soon as it is measured.

    python bench/dynakv_side.py --ctx /tmp/ctx8192.pt --tokens 16 --out bench/results/dynakv_8k_side.json

``--ctx`` is made from ``sparkv bench dynakv``'s workload (``sparkv.bench.dynakv._workload``):
``torch.save(_workload(lm, argparse.Namespace(depth=0.3, seed=0), 8192), path)``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ctx", required=True, help="saved (task, ctx, q, follow, layers)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--budgets", default="0.25,0.1")
    p.add_argument("--policies", default="stream,local,dynakv,dynakv-padded")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--note", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from sparkv.decode import DecodeSession
    from sparkv.runtime import load_model

    lm = load_model(None, device="cpu", dtype="float32")
    _warm_up()
    task, ctx, q, follow, layers = torch.load(a.ctx, weights_only=False)
    final = len(ctx) + len(q) + a.tokens
    doc = {"benchmark": "dynakv_side", "config": {
        "prompt_tokens": len(ctx), "tokens": a.tokens, "budgets": a.budgets,
        "policies": a.policies, "threads": a.threads, "retrieval": 0.1,
        "load_avg_start": os.getloadavg(), "note": a.note,
        "reference": "full KV greedy; other policies teacher-forced on its tokens; ram budget "
                     "fractions of the final KV (prompt + question + tokens)"}, "results": []}

    def save() -> None:
        doc["config"]["load_avg_now"] = os.getloadavg()
        with open(a.out + ".tmp", "w") as f:
            json.dump(doc, f, indent=2, default=str)
        os.replace(a.out + ".tmp", a.out)

    ref: list[int] = []
    with DecodeSession(lm, layers, len(ctx), "full", final_tokens=final) as s:
        ref.append(int(s.prefill(q).argmax()))
        t0 = time.perf_counter()
        for _ in range(a.tokens - 1):
            ref.append(int(s.feed([ref[-1]]).argmax()))
        st = s.stats()
    doc["results"].append({"policy": "full", "budget_frac": None, "tokens_per_s": st.tokens_per_s,
                           "decode_s": st.decode_s, "recall": 1.0, "agreement": 1.0,
                           "load_avg": os.getloadavg()})
    save()
    print("full", st.tokens_per_s, flush=True)
    for b in [float(x) for x in a.budgets.split(",")]:
        for pol in a.policies.split(","):
            name, extra = _variant(pol)
            t0 = time.perf_counter()
            try:
                s = DecodeSession(lm, layers, len(ctx), name, final_tokens=final, probe=pol != "stream",
                                  ram_budget=b, budget=0.1, full_steps=0, **extra)
            except ValueError as e:
                doc["results"].append({"policy": pol, "budget_frac": b, "refused": str(e)})
                save()
                continue
            with s:
                logits = s.prefill(q)
                if pol.startswith("dynakv-padded"):       # the padded path of before
                    assert s.building is not None
                    s.building.wait().arena = None
                agree = int(int(logits.argmax()) == ref[0])
                for i in range(len(ref) - 1):
                    agree += int(int(s.feed([ref[i]]).argmax()) == ref[i + 1])
                st = s.stats()
            row = {**st.to_dict(), "policy": pol, "budget_frac": b, "agreement": agree / len(ref),
                   "wall_s": time.perf_counter() - t0, "load_avg": os.getloadavg()}
            if pol == "stream":
                row["recall"] = 1.0
            doc["results"].append(row)
            save()
            print(pol, b, f"tok/s {st.tokens_per_s:.3f} recall {row.get('recall')} io {st.io_s:.1f} "
                  f"att {st.attend_s:.1f} upd {st.update_s:.1f} (upkeep {st.upkeep_s:.1f}, "
                  f"waited {st.upkeep_wait_s:.1f}) sel {st.select_s:.1f} "
                  f"build {st.build_s:.1f}", flush=True)
    doc["config"]["load_avg_end"] = os.getloadavg()
    save()
    return 0


def _variant(pol: str) -> tuple[str, dict]:
    """``--policies`` item -> (policy name, DecodeConfig overrides): ``dynakv-padded``,
    ``*-inline`` (``background_upkeep=False``) and ``+field=value`` suffixes (``dynakv+merge_gap=1``)."""
    base, *sets = pol.split("+")
    extra: dict = {}
    for kv in sets:
        key, value = kv.split("=", 1)
        extra[key] = json.loads(value)
    if base.endswith("-inline"):
        base, extra["background_upkeep"] = base[:-len("-inline")], False
    if base == "dynakv-padded":
        base = "dynakv"
    return base, extra


def _warm_up() -> None:
    """Loads the numba kernels (fused attention, k-means) before anything is timed, so no
    policy's first step pays it."""
    import numpy as np

    from sparkv.decode.fused import fused_attention
    from sparkv.decode.kmeans import kmeans
    from sparkv.decode.rows import RowArena

    arena = RowArena(64, torch.float32)
    r = arena.put(torch.randn(4, 64), torch.randn(4, 64), np.arange(4))
    w = (torch.randn(1, 1, 64), torch.randn(1, 1, 64), torch.tensor([9]))
    fused_attention(torch.randn(1, 3, 1, 64), torch.tensor([9]), None, arena.k, arena.v,
                    arena.pos, np.array([[0, r.start, r.n, 1]]), w, (0, 9))
    kmeans(torch.randn(1, 40, 8), 4)


if __name__ == "__main__":
    raise SystemExit(main())
