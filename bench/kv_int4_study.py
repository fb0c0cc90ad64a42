"""Why int4 fails the quality table, and what would pass it: the device service's int4 (one
group per token and head, ``head_dim`` values, made from the int8 base: docs/device-service.md)
set against int4 schemes that keep the same bytes, on the quality table's QA questions, judged as
the table judges (teacher-forced agreement and first-token KL against the dense fp32 answer).

Every scheme keeps the sink chunk (the first 16 tokens) fp, as the service's policy does, and
quantizes every other token chunk of 16 tokens. Schemes (``--only`` picks some):

* ``int8`` (the service's level), ``int4`` (the service's level: K and V per token);
* ``k8 v4`` / ``k4 v8``: which side's int4 costs the answer; ``k8 v2``: V at int2;
* ``int4 kc-ctx``: K less its per-channel mean over the context (one value per layer, KV head
  and channel: free) quantized per token, the mean added back on reading; V per token;
* ``int4 kc-chunk``: K centred by each chunk's per-channel mean (64 more fp16 per chunk, head and
  layer: +22% of int4's bytes);
* ``int4 had-k`` / ``int4 had-kv``: QuaRot's rotation: K (and V) times the orthonormal
  Hadamard matrix before the per-token quantizer, rotated back on reading (the same bytes);
  ``int4 kc-ctx had``: K centred, then rotated (V rotated);
* ``device@0.75``, ``device@0.5``: the quality table's device rows (``DeviceVariant``: the
  service's own levels by density, its pages and fill), for a paired comparison on the same
  questions;
* ``int4 kivi``: KIVI's layout: K quantized per channel over the chunk's 16 tokens (a scale and
  a zero per channel: 64 of each per chunk and head where per token has 16, K's bytes +33%), V
  per token;
* ``k8 v4-had``, ``k8 v4-c``, ``k8 v4-c-had``: V at int4 rotated, centred by its context mean
  (exact: attention weights sum to 1), or both;
* ``int4 k-out4`` / ``int4 k-out8``: K's 4 or 8 largest channels per layer and head kept fp16,
  the others per token (KVQuant's dense-and-sparse split); ``int4 k-smooth``: K's channels
  divided by their magnitude's square root before the quantizer (SmoothQuant's migration),
  ``int4 k-smooth-had``: then rotated;
* ``k8v4@R``: the service's own levels at ratio R (its density planner's choice of the token
  chunks that go low, as ``device@R``) with every chunk's K at int8: an int4 chunk held as K int8
  / V int4, an int2 one as K int8 / V int2 (bytes measured per context).

Bytes are given per token and head against int8's (68 + 68 at ``head_dim`` 64: codes, an fp16
scale and zero per row), the sink chunk aside.

    PYTHONPATH=$PWD python bench/kv_int4_study.py [--questions 24] [--only "int4,int4 kivi"]
        [--out bench/results/kv_int4_study.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Callable

import numpy as np
import torch

CHUNK = 16
Layer = tuple[torch.Tensor, torch.Tensor]


def per_token(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [h, n, d]`` through the service's quantizer (int8 base, lower levels from it)."""
    from sparkv.cache.levels import dequantize, quantize, requantize

    h, n, d = x.shape
    t = quantize(x.reshape(h * n, d), 8)
    if bits != 8:
        t = requantize(t, bits)
    return dequantize(t).reshape(h, n, d)


def by_chunk(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``fn`` applied to each chunk of :data:`CHUNK` tokens of ``x [h, n, d]``."""
    out = torch.empty_like(x)
    for a in range(0, x.shape[1], CHUNK):
        out[:, a:a + CHUNK] = fn(x[:, a:a + CHUNK])
    return out


def per_channel(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [h, n, d]`` quantized per channel over each chunk of :data:`CHUNK` tokens (the same
    quantizer, on the transposed chunk)."""
    return by_chunk(x, lambda c: per_token(c.transpose(1, 2).contiguous(), bits).transpose(1, 2))


def centred(x: torch.Tensor, quant: Callable[[torch.Tensor], torch.Tensor],
            fp16_mean: bool = True) -> torch.Tensor:
    """``x`` less its per-channel mean over its tokens through ``quant``, the mean added back;
    ``fp16_mean``: the mean rounded as a stored fp16 one would be."""
    mu = x.mean(dim=1, keepdim=True)
    if fp16_mean:
        mu = mu.half().float()
    return quant(x - mu) + mu


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard matrix of order ``d`` (a power of two)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / h.shape[0] ** 0.5


def rotated(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` rotated by the Hadamard matrix, quantized per token, rotated back (QuaRot's
    rotation: the channels' outliers spread over every channel of the token)."""
    r = hadamard(x.shape[-1])
    return per_token(x @ r, bits) @ r.T


def outliers_apart(x: torch.Tensor, bits: int, m: int) -> torch.Tensor:
    """``x [h, n, d]`` with each head's ``m`` largest channels (by their largest magnitude over
    the tokens: ``m`` indices per layer and head, chosen from the context) kept in fp16 and the
    other ``d - m`` quantized per token (one group of ``d - m`` values): KVQuant's dense-and-
    sparse split with a fixed set of outlier channels."""
    h, n, d = x.shape
    top = x.abs().amax(dim=1).topk(m, dim=1).indices                       # [h, m]
    rest = torch.ones(h, d, dtype=torch.bool)
    rest[torch.arange(h)[:, None], top] = False
    idx = torch.stack([torch.nonzero(r).flatten() for r in rest])          # [h, d - m]
    gather = idx[:, None, :].expand(h, n, d - m)
    out = x.half().float()
    out.scatter_(2, gather, per_token(torch.gather(x, 2, gather).contiguous(), bits))
    return out


def smoothed(x: torch.Tensor, quant: Callable[[torch.Tensor], torch.Tensor],
             alpha: float = 0.5) -> torch.Tensor:
    """``x`` divided per channel by ``s = amax^alpha`` (each layer's and head's channel
    magnitudes over the context, in fp16: free) through ``quant``, multiplied back
    (SmoothQuant's migration, here within K: the query would carry ``s`` at no cost)."""
    s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-6).pow(alpha).half().float()
    return quant(x / s) * s


Side = Callable[[torch.Tensor], torch.Tensor]
SCHEMES: dict[str, tuple[Side, Side]] = {
    "int8": (lambda k: per_token(k, 8), lambda v: per_token(v, 8)),
    "int4": (lambda k: per_token(k, 4), lambda v: per_token(v, 4)),
    "k8 v4": (lambda k: per_token(k, 8), lambda v: per_token(v, 4)),
    "k4 v8": (lambda k: per_token(k, 4), lambda v: per_token(v, 8)),
    "int4 kc-ctx": (lambda k: centred(k, lambda y: per_token(y, 4)), lambda v: per_token(v, 4)),
    "int4 kc-chunk": (lambda k: by_chunk(k, lambda c: centred(c, lambda y: per_token(y, 4))),
                      lambda v: per_token(v, 4)),
    "int4 kivi": (lambda k: per_channel(k, 4), lambda v: per_token(v, 4)),
    "k8 v2": (lambda k: per_token(k, 8), lambda v: per_token(v, 2)),
    "k8 v4-had": (lambda k: per_token(k, 8), lambda v: rotated(v, 4)),
    "k8 v4-c": (lambda k: per_token(k, 8), lambda v: centred(v, lambda y: per_token(y, 4))),
    "k8 v4-c-had": (lambda k: per_token(k, 8),
                    lambda v: centred(v, lambda y: rotated(y, 4), fp16_mean=False)),
    "int4 had-k": (lambda k: rotated(k, 4), lambda v: per_token(v, 4)),
    "int4 had-kv": (lambda k: rotated(k, 4), lambda v: rotated(v, 4)),
    "int4 kc-ctx had": (lambda k: centred(k, lambda y: rotated(y, 4), fp16_mean=False),
                        lambda v: rotated(v, 4)),
    "int4 k-out4": (lambda k: outliers_apart(k, 4, 4), lambda v: per_token(v, 4)),
    "int4 k-out8": (lambda k: outliers_apart(k, 4, 8), lambda v: per_token(v, 4)),
    "int4 k-smooth": (lambda k: smoothed(k, lambda y: per_token(y, 4)),
                      lambda v: per_token(v, 4)),
    "int4 k-smooth-had": (lambda k: smoothed(k, lambda y: rotated(y, 4)),
                          lambda v: per_token(v, 4)),
}


#: bytes per token and head against int8's (module docstring); device@R: its ratio
BYTES = {"int8": 1.0, "int4": 72 / 136, "k8 v4": 104 / 136, "k4 v8": 104 / 136,
         "int4 kc-ctx": 72 / 136, "int4 kc-chunk": 80 / 136, "int4 kivi": 84 / 136,
         "k8 v2": 88 / 136, "k8 v4-had": 104 / 136, "k8 v4-c": 104 / 136, "k8 v4-c-had": 104 / 136,
         "int4 had-k": 72 / 136, "int4 had-kv": 72 / 136, "int4 kc-ctx had": 72 / 136,
         "int4 k-out4": 78 / 136, "int4 k-out8": 84 / 136, "int4 k-smooth": 72 / 136,
         "int4 k-smooth-had": 72 / 136}

#: what ``--only`` runs by default (the run behind docs/device-service.md's table)
DEFAULT = ("int8,k8 v4,k8 v4-c-had,device@0.75,k8 v2,int4 kc-chunk,int4 kivi,int4,"
           "device@0.5")


def apply(layers: list[Layer], scheme: str) -> list[Layer]:
    """Each layer's K and V under ``scheme``, the sink chunk kept as it is."""
    fk, fv = SCHEMES[scheme]
    out = []
    for k, v in layers:
        k2, v2 = k.clone(), v.clone()
        k2[0, :, CHUNK:] = fk(k[0, :, CHUNK:].float()).to(k.dtype)
        v2[0, :, CHUNK:] = fv(v[0, :, CHUNK:].float()).to(v.dtype)
        out.append((k2, v2))
    return out


#: ``k8v4@R``: a level of the service's mix at ratio R -> the scheme its chunks are held in
#: (:data:`SCHEMES`, :data:`BYTES`); fp stays fp
K8_MIX = {"int8": "int8", "int4": "k8 v4", "int2": "k8 v2"}


def k8_mix(ref: Any, ratio: str) -> tuple[list[Layer], float]:
    """The service's levels at ``ratio`` (its density planner's choice of which token chunks go
    low) with every chunk's K kept at int8: an int4 chunk held as K int8 / V int4, an int2 one as
    K int8 / V int2. Returns the layers and the bytes against every chunk at int8 (fp chunks at
    the service's own fp ratio)."""
    from sparkv.bench.variants import DeviceVariant

    policy, g, levels = DeviceVariant(ratio).levels(ref)
    out = []
    for k, v in ref.layers:
        k2, v2 = k.clone(), v.clone()
        for t, level in enumerate(levels):
            if level == "fp":
                continue
            a, b = g.token_range(t)
            fk, fv = SCHEMES[K8_MIX[level]]
            k2[0, :, a:b] = fk(k[0, :, a:b].float()).to(k.dtype)
            v2[0, :, a:b] = fv(v[0, :, a:b].float()).to(v.dtype)
        out.append((k2, v2))
    fp = policy.fp_ratio(g)
    nbytes = [fp if lv == "fp" else BYTES[K8_MIX[lv]] for lv in levels]
    return out, float(np.mean(nbytes))


def variant_cache(ref: Any, scheme: str) -> tuple[Any, float | None]:
    """``scheme``'s cache of the reference's context and its bytes against int8 (``None``: as
    :data:`BYTES` gives them): ``device@R`` is the quality table's own device variant (the service's
    levels at ratio R, its pages, its fill), ``k8v4@R`` :func:`k8_mix`, any other a
    :data:`SCHEMES` entry applied to the reference's layers."""
    from sparkv.bench.variants import DeviceVariant

    if scheme.startswith("device@"):
        return DeviceVariant(scheme.split("@", 1)[1]).load(ref).kv, None
    if scheme.startswith("k8v4@"):
        return k8_mix(ref, scheme.split("@", 1)[1])
    return apply(ref.layers, scheme), None


def measure(lm: Any, questions: int, schemes: list[str]) -> dict[str, list[dict[str, float]]]:
    """Per scheme, one row per question: teacher-forced agreement and first-token KL."""
    from sparkv.bench.quality import build_contexts
    from sparkv.edge.prompts import question_suffix
    from sparkv.bench.variants import prefill_reference
    from sparkv.runtime.generate import (first_token_kl, greedy_generate,
                                         teacher_forced_agreement)
    from sparkv.logs import progress_bar

    rows: dict[str, list[dict[str, float]]] = {s: [] for s in schemes}
    # the table's QA contexts and questions (no retrieval task: no sizes)
    ctxs = build_contexts(lm, ["qa"], [], lambda family, size: 0, qa_questions=questions)
    bar = progress_bar(total=sum(len(c.probes) for c in ctxs) * len(schemes), desc="answers")
    for ctx in ctxs:
        ids = ctx.token_ids
        with torch.inference_mode():
            ref = prefill_reference(lm, ids, density=any(s.startswith(("device@", "k8v4@"))
                                                         for s in schemes))
            layers = ref.layers
            variants = {s: variant_cache(ref, s) for s in schemes}
            for probe in ctx.probes:
                suffix = question_suffix(lm, probe.question)
                dense = greedy_generate(lm, layers, len(ids), suffix, probe.new_tokens)
                for s, (kv, nbytes) in variants.items():
                    gen = greedy_generate(lm, kv, len(ids), suffix, 1)
                    rows[s].append({"bytes_vs_int8": nbytes,
                        "teacher_forced": teacher_forced_agreement(lm, kv, len(ids), suffix,
                                                                   dense.tokens),
                        "first_token_kl": max(0.0, first_token_kl(dense.first_logits,
                                                                  gen.first_logits))})
                    bar.update(1)
    bar.close()
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Means and the quality table's verdicts (paired bootstrap bounds against its margins)."""
    from sparkv.bench.verdict import (FIRST_TOKEN_KL_MAX, TEACHER_FORCED_MAX_DROP,
                                      paired_mean_verdict)

    drop = [1.0 - r["teacher_forced"] for r in rows]
    kl = [r["first_token_kl"] for r in rows]
    out: dict[str, Any] = {"n": len(rows), "bytes_vs_int8": None}
    for name, xs, margin in (("teacher_forced_drop", drop, TEACHER_FORCED_MAX_DROP),
                             ("first_token_kl", kl, FIRST_TOKEN_KL_MAX)):
        v = paired_mean_verdict(name, xs, margin)
        out[name] = statistics.mean(xs)
        out[name + "_interval"] = v.interval
        out[name + "_verdict"] = v.verdict
    return out


def paired_gain(rows: dict[str, list[dict[str, float]]], a: str, b: str) -> dict[str, Any]:
    """``b``'s teacher-forced drop less ``a``'s, question by question (the same questions in the
    same order): the mean and its 90% bootstrap interval."""
    from sparkv.bench.verdict import bootstrap_mean_interval

    diff = [ra["teacher_forced"] - rb["teacher_forced"] for ra, rb in zip(rows[a], rows[b])]
    lo, hi = bootstrap_mean_interval(np.asarray(diff), 0, 10_000)
    return {"a": a, "b": b, "mean": statistics.mean(diff), "interval": (lo, hi), "n": len(diff)}


#: the paired comparisons :func:`report` makes when both ran: (better, against)
PAIRS = (("k8 v4", "device@0.75"), ("k8 v4-c-had", "device@0.75"), ("k8 v4-c-had", "k8 v4"),
         ("int4 kivi", "int4"), ("int4 kc-chunk", "int4"), ("k8v4@0.75", "device@0.875"),
         ("k8v4@0.75", "device@0.9"), ("k8v4@0.5", "device@0.75"))


def report(rows: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """The table (printed) and the paired gains of :data:`PAIRS`."""
    table = {s: summary(r) for s, r in rows.items()}
    for s, t in table.items():
        measured = [r["bytes_vs_int8"] for r in rows[s] if r.get("bytes_vs_int8") is not None]
        t["bytes_vs_int8"] = statistics.mean(measured) if measured else \
            BYTES.get(s, float(s.split("@")[1]) if "@" in s else None)
    print(f"{'scheme':<16}{'n':>4}{'bytes':>7}  {'teacher-forced drop (<= 0.015)':<36}"
          f"{'first-token KL (<= 0.01)':<36}")
    for s, t in table.items():
        cells = [f"{t[m]:.4f} [{t[m + '_interval'][0]:.4f}, {t[m + '_interval'][1]:.4f}] "
                 f"{t[m + '_verdict']}" for m in ("teacher_forced_drop", "first_token_kl")]
        print(f"{s:<16}{t['n']:>4}{t['bytes_vs_int8']:>7.3f}  {cells[0]:<36}{cells[1]:<36}")
    out: dict[str, Any] = {"summary": table, "paired": []}
    for a, b in PAIRS:
        if a in rows and b in rows:
            g = paired_gain(rows, a, b)
            out["paired"].append(g)
            print(f"{a} against {b}, paired: {g['mean']:.4f} less teacher-forced drop "
                  f"[{g['interval'][0]:.4f}, {g['interval'][1]:.4f}] (n={g['n']})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--only", default=DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                    help="no run: the rows of earlier runs' --out files (the same --questions), "
                    "reported together")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.merge:
        rows: dict[str, list[dict[str, float]]] = {}
        for path in args.merge:
            with open(path) as f:
                earlier = json.load(f)
            rows.update(earlier["rows"])
            model = earlier["model"]
    else:
        from sparkv.runtime import load_model

        torch.set_num_threads(args.threads)
        lm = load_model()
        model = lm.name
        rows = measure(lm, args.questions, [s.strip() for s in args.only.split(",") if s.strip()])
    doc = {"model": model, "chunk_tokens": CHUNK, **report(rows), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
