"""LLMS's tolerance-aware compression, judged by perplexity (llms.md, Figure 6b: language
modelling at a 50% global ratio against LMDeploy's 8-bit and 4-bit KV): the bundled licences'
text, its first ``--tokens`` tokens kept by the device's context service (``sparkv.device``), the
context swapped out to flash at each policy's levels and read back (no recompute, no kept
working memory: every chunk is its flash copy), then the next ``--continuation`` tokens scored
after it in one pass (:mod:`sparkv.runtime.promptscore`, what ``echo`` with ``logprobs``
returns). Policies:

* ``fp`` (no compression: the reference), ``int8`` (every chunk: LMDeploy's 8-bit),
  ``int4 uniform`` (every chunk but the attention sink's at int4: LMD-4bits; the bench sets
  the levels, no service policy is uniform int4);
* ``tolerance`` at global ratios 1.0, 0.75, 0.5 (the paper's 50%) and 0.25 of int8's bytes:
  chunks at fp / int8 / int4 / int2 by their measured information density
  (docs/device-service.md);
* ``linear`` 0.75 and 0.5: the planner as it was before session 111, each level's error taken
  as its step (not squared: :func:`~sparkv.device.density.plan_levels`' ``weights``), which
  puts more chunks at int2.

Per policy: the continuation's perplexity (exp of the mean negative log-likelihood per token,
the first token left out), its difference from ``fp``'s in nats a token, the levels' chunk
counts and the context's KV bytes relative to int8's. The bundled SmolLM2 (float32), 2 torch
threads.

    PYTHONPATH=$PWD python bench/llms_perplexity.py [--tokens 2048] [--continuation 512]
        [--only "fp,int8"] [--text F.txt] [--out bench/results/llms_perplexity.json]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import tempfile
from typing import Any

POLICIES: dict[str, dict[str, Any]] = {
    "fp": {"compression": "fp"},
    "int8": {"compression": "int8"},
    "int4 uniform": {"compression": "int8", "uniform": "int4"},
    "int2 uniform": {"compression": "int8", "uniform": "int2"},
    "tolerance 1.0": {"compression": "tolerance", "ratio": 1.0},
    "tolerance 0.5": {"compression": "tolerance", "ratio": 0.5},
    "tolerance 0.25": {"compression": "tolerance", "ratio": 0.25},
    "tolerance 0.75": {"compression": "tolerance", "ratio": 0.75},
    "linear 0.75": {"compression": "tolerance", "ratio": 0.75, "weights": "linear"},
    "linear 0.5": {"compression": "tolerance", "ratio": 0.5, "weights": "linear"},
}


def score(lm: Any, doc: list[int], cont: list[int], root: pathlib.Path, name: str,
          policy: dict[str, Any]) -> dict[str, Any]:
    """The continuation's scores after the context kept, swapped out and read back under
    ``policy``."""
    from sparkv.device import ContextService
    from sparkv.runtime.promptscore import PromptScorer, scoring

    import sparkv.device.levels as levels_mod
    from sparkv.device.density import LEVEL_STEP, plan_levels

    policy = dict(policy)
    uniform = policy.pop("uniform", None)
    linear = policy.pop("weights", None) == "linear"
    levels_mod.plan_levels = (  # type: ignore[assignment]
        (lambda *a, **k: plan_levels(*a, weights=LEVEL_STEP, **k)) if linear else plan_levels)
    svc = ContextService(lm, 512 << 20, root / name.replace(" ", "-"), journal=False,
                         pipeline=False, keep_working=False, aot=False, **policy)
    try:
        if uniform is not None:
            svc.levels.assign = lambda ctx, g: (["fp"] + [uniform] * (g.num_token_chunks - 1))
        cid = svc.new_context(system_ids=doc)
        svc.swap_out(cid)
        scorer = PromptScorer(tuple(cont))
        with scoring(scorer):
            svc.call(cid, prompt_ids=cont, max_new_tokens=1, grow=False)
        info = svc.describe(cid)
    finally:
        svc.close()
    assert scorer.scores is not None
    nll = [-s.logprob for s in scorer.scores[1:] if s is not None]
    return {"policy": name, "nll": sum(nll) / len(nll), "ppl": math.exp(sum(nll) / len(nll)),
            "scored_tokens": len(nll), "levels": info.levels}


def main() -> None:
    import torch

    from sparkv.device.loader import payload_nbytes
    from sparkv.runtime import load_model, promptscore
    from sparkv.runtime.generate import sample_text

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--continuation", type=int, default=512)
    p.add_argument("--only", default=None, help="comma-separated policies (default: all)")
    p.add_argument("--text", default=None, help="a UTF-8 text file (default: the bundled "
                   "licences, sparkv/data/sample_context.txt)")
    p.add_argument("--out", default=None, help="write the rows here (JSON)")
    a = p.parse_args()
    torch.set_num_threads(2)
    lm = load_model(progress=False)
    promptscore.install(lm.model)
    ids = lm.encode_text(pathlib.Path(a.text).read_text(encoding="utf-8") if a.text
                         else sample_text())
    if len(ids) < a.tokens + a.continuation:
        raise SystemExit(f"the text has {len(ids)} tokens: fewer than --tokens + --continuation")
    doc, cont = ids[:a.tokens], ids[a.tokens:a.tokens + a.continuation]
    cfg = lm.config
    rows = cfg.num_key_value_heads * 16
    hd = cfg.hidden_size // cfg.num_attention_heads
    bytes_of = {lv: payload_nbytes(lv, rows, hd, lm.dtype) / payload_nbytes("int8", rows, hd,
                                                                            lm.dtype)
                for lv in ("fp", "int8", "k8v4", "int4", "int2")}
    out = []
    with tempfile.TemporaryDirectory(prefix="llms-ppl-") as tmp:
        names = a.only.split(",") if a.only else list(POLICIES)
        for name in ["fp", *[n for n in names if n != "fp"]]:
            policy = POLICIES[name]
            r = score(lm, doc, cont, pathlib.Path(tmp), name, policy)
            n = sum(r["levels"].values())
            r["bytes_vs_int8"] = sum(bytes_of[lv] * c for lv, c in r["levels"].items()) / n
            out.append(r)
    base = out[0]["nll"]
    print(f"{'policy':16s} {'ppl':>8s} {'dNLL':>8s} {'bytes/int8':>10s}  levels")
    for r in out:
        r["dnll_vs_fp"] = r["nll"] - base
        print(f"{r['policy']:16s} {r['ppl']:8.3f} {r['dnll_vs_fp']:+8.4f} "
              f"{r['bytes_vs_int8']:10.3f}  {r['levels']}")
    if not a.out:
        return
    path = pathlib.Path(a.out)
    path.write_text(json.dumps({"model": lm.name, "text": a.text or "sample_context.txt",
                                "context_tokens": len(doc),
                                "continuation_tokens": len(cont), "paper": "llms.md Figure 6b",
                                "rows": out}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
