"""``sparkv bench dynakv``: long decoding with clustered KV on flash (docs/dynakv.md).

Workload (SmolLM2, seeded): a pass-key document of ``--prompt-tokens`` (RULER-style filler, the key
at ``--depth``) as the context, the turn "continue the text" as the question, then
``--max-new-tokens`` generated tokens, then a new user turn asking for the pass key and up to 16
answer tokens.

Full KV in RAM decodes first; its greedy tokens are the reference stream. Every other policy is
fed the same stream (teacher forcing), so all of them see identical tokens and their I/O is
comparable, and is measured on it:

* ``recall``: attention-mass recall of the attended entries (share of full attention's
  probability, every layer, query head and step; the probe's time is excluded from the speed);
* ``agreement``: share of steps whose argmax equals full KV's greedy token;
* ``passkey``: the answer to the pass-key turn (greedy, free-running) contains the key;
* flash bytes and read operations per token, mean entries per read operation (contiguity), write
  amplification (pages written / entry bytes asked to write, while decoding), cache hit rate
  (selected clusters found in the cache), decode tokens/s.

Each prompt size of ``--prompt-tokens`` (default 4096 and 8192) is one workload; rows carry
their ``prompt_tokens`` and the targets are per prompt size and RAM budget. The default policies
are the issue's comparison, ``local`` and ``dynakv`` (``--policies`` adds the others).

Policies under the same RAM budget (``--decode-budgets``, fractions of the final KV) and per-step
retrieval budget (``--retrieval``, a fraction of the entries a head holds): ``full``,
``nocluster``, ``static``, ``local``, ``dynakv`` and the ablations ``dynakv-eager`` (no delayed
split), ``dynakv-packed`` (no dual-head pools), ``dynakv-lru`` (LRU replacement). A policy whose
fixed RAM (window, buffers) exceeds a budget is reported as refused.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from sparkv.bench.common import (PeakRss, add_run_args, format_table, result_path,
                                 write_result)
from sparkv.cliflags import add_device_args

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

POLICIES = ("nocluster", "static", "local", "dynakv", "dynakv-eager", "dynakv-packed",
            "dynakv-lru", "stream")
#: what the issue's targets compare (full KV always runs first)
DEFAULT_POLICIES = ("local", "dynakv")
CONTINUE = "Continue the text above, writing as much as you can."


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("dynakv", help="long decoding with clustered KV on flash: DynaKV vs full, "
                                      "no clustering, static, local and ablations")
    p.add_argument("--prompt-tokens", default=None,
                   help="document tokens, comma-separated: one workload each (the pass key is "
                        "hidden in them; default 4096,8192, 1024 with --quick)")
    p.add_argument("--max-new-tokens", type=int, default=1024,
                   help="tokens the full-KV reference generates (64 with --quick)")
    p.add_argument("--decode-budgets", default="0.25,0.1",
                   help="RAM budgets, fractions of the final KV")
    p.add_argument("--retrieval", type=float, default=0.1,
                   help="entries retrieved per KV head per step, fraction of what it holds")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help="decode policies to compare with full KV (docs/dynakv.md; known: "
                        + ", ".join(POLICIES) + ")")
    p.add_argument("--depth", type=float, default=0.3, help="pass-key depth in the document")
    p.add_argument("--seed", type=int, default=0, help="seed of the document and its pass key")
    p.add_argument("--quick", action="store_true",
                   help="a 1024-token prompt and 64 generated tokens (a smoke run)")
    p.add_argument("--flash-dir", default=None,
                   help="where the clusters go (default: a new dir in the system's temp dir, "
                        "removed after; if that is a tmpfs, the \"flash\" is RAM)")
    p.add_argument("--note", default=None, help="a remark stored in the JSON's config (e.g. that "
                                                "the machine was loaded)")
    add_device_args(p)
    add_run_args(p, "dynakv", quick=True)
    p.set_defaults(func=run)


def _session_run(lm: LoadedModel, layers: Any, ctx: list[int], q: list[int], ref: list[int],
                 follow: list[int], task: Any, policy: str, ram_budget: float | None,
                 retrieval: float, flash_dir: str | None) -> dict[str, Any]:
    """One policy over the reference stream; returns its row."""
    from sparkv.decode import DecodeSession

    final = len(ctx) + len(q) + len(ref) + len(follow) + 16
    # full_steps=0: every step is the policy's (none over the full KV while the clusters build)
    kw: dict[str, Any] = {} if policy == "full" else {"ram_budget": ram_budget,
                                                      "budget": retrieval, "full_steps": 0}
    try:
        s = DecodeSession(lm, layers, len(ctx), policy, final_tokens=final, flash_dir=flash_dir,
                          probe=policy != "full", **kw)
        with s:
            logits = s.prefill(q)
            agree = int(int(logits.argmax()) == ref[0])
            tokens = [int(logits.argmax())]
            for i in range(len(ref) - 1):
                logits = s.feed([ref[i]])
                tokens.append(int(logits.argmax()))
                agree += int(tokens[-1] == ref[i + 1])
            logits = s.feed([ref[-1]] + follow)
            answer = [int(logits.argmax())]
            while len(answer) < 16 and answer[-1] not in lm.eos_ids:
                answer.append(int(s.feed([answer[-1]]).argmax()))
            text = lm.decode_tokens([t for t in answer if t not in lm.eos_ids])
            st = s.stats()
    except ValueError as e:
        if "ram_budget" not in str(e):
            raise
        return {"policy": policy, "budget_frac": ram_budget, "refused": str(e)}
    row = {"policy": policy, "ram_budget": ram_budget, "agreement": agree / len(ref),
           "passkey": task.score(text), "answer": text.strip(), "predicted": tokens}
    row.update(st.to_dict())
    row["budget_frac"] = ram_budget          # st.ram_budget is in bytes
    if policy == "full":
        row["recall"] = 1.0
    return row


def _targets(rows: list[dict[str, Any]], budgets: list[float]) -> dict[str, Any]:
    """The issue's targets, as ratios, per RAM budget (None where a run is missing), for the rows
    of one prompt size."""
    out: dict[str, Any] = {}
    full = next((r for r in rows if r["policy"] == "full"), None)
    for b in budgets:
        by = {r["policy"]: r for r in rows if r.get("budget_frac") == b and "refused" not in r}
        d = by.get("dynakv")
        t: dict[str, Any] = {}
        if d is None:
            out[str(b)] = t
            continue
        for other in ("static", "local"):
            o = by.get(other)
            if o is not None:
                t[f"recall_vs_{other}"] = d["recall"] / o["recall"]
                t[f"agreement_vs_{other}"] = (d["agreement"] / o["agreement"]
                                              if o["agreement"] else float("inf"))
                t[f"recall_and_agreement_at_least_{other}"] = bool(
                    d["recall"] >= o["recall"] and d["agreement"] >= o["agreement"])
        lo = by.get("local")
        if lo is not None and d["tokens_per_s"] > 0:
            t["latency_local_over_dynakv"] = d["tokens_per_s"] / lo["tokens_per_s"]
            t["latency_met"] = bool(t["latency_local_over_dynakv"] >= 1.3
                                    and d["recall"] >= lo["recall"])
            t["critical_read_ops_per_token_dynakv"] = d.get("critical_read_ops_per_token")
            t["critical_read_ops_per_token_local"] = lo.get("critical_read_ops_per_token")
        e = by.get("dynakv-eager")
        if e is not None:
            t["split_read_bytes_delayed"] = d["split_read_bytes"]
            t["split_read_bytes_eager"] = e["split_read_bytes"]
            t["split_bytes_delayed_over_eager"] = (d["split_read_bytes"] / e["split_read_bytes"]
                                                   if e["split_read_bytes"] else None)
            t["delayed_split_met"] = bool(d["split_read_bytes"] <= 0.5 * e["split_read_bytes"])
        pk = by.get("dynakv-packed")
        t["dual_head_write_amplification"] = d["write_amplification"]
        if pk is not None:
            t["packed_write_amplification"] = pk["write_amplification"]
        t["dual_head_met"] = bool(d["write_amplification"] <= 1.1)
        lru = by.get("dynakv-lru")
        if lru is not None:
            # None when LRU hits nothing (it thrashes: a step's clusters exceed the cache); the
            # ceiling is 1 - first uses / selections (first uses cannot hit under any policy)
            t["hit_rate_dynakv"], t["hit_rate_lru"] = d["hit_rate"], lru["hit_rate"]
            t["hit_rate_ceiling"] = d.get("hit_rate_ceiling")
            t["hit_rate_vs_lru"] = d["hit_rate"] / lru["hit_rate"] if lru["hit_rate"] else None
            t["hit_rate_met"] = bool(d["hit_rate"] >= 1.1 * lru["hit_rate"] and d["hit_rate"] > 0)
        if full is not None and full.get("tokens_per_s") and d["tokens_per_s"] > 0:
            t["speed_vs_full"] = d["tokens_per_s"] / full["tokens_per_s"]
            t["speed_vs_full_met"] = bool(t["speed_vs_full"] >= 1.0)
        if full is not None:
            t["passkey_dynakv"], t["passkey_full"] = d["passkey"], full["passkey"]
            t["passkey_met"] = bool(d["passkey"] == full["passkey"])
        out[str(b)] = t
    return out


def run(args: argparse.Namespace) -> int:
    import os
    import shutil
    import tempfile

    import torch

    from sparkv.runtime import load_model
    from sparkv.runtime.heap import settle

    if args.threads:
        torch.set_num_threads(args.threads)
    prompts, new_tokens, budgets, policies = _settings(args)
    out = result_path("dynakv", args.out, quick=args.quick) if args.json or args.out else None
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    settle()             # the model for good: out of full collections (sparkv.runtime.heap)
    flash_dir = args.flash_dir or tempfile.mkdtemp(prefix="sparkv-dynakv-")
    rows: list[dict[str, Any]] = []
    targets: dict[str, Any] = {}
    workloads = []
    try:
        for n in prompts:
            task, ctx, q, follow, layers = _workload(lm, args, n)
            part = _measure(lm, layers, ctx, q, follow, task, new_tokens, budgets, policies,
                            args.retrieval, flash_dir)
            del layers
            final = len(ctx) + len(q) + new_tokens + len(follow) + 16
            workloads.append({"prompt_tokens": len(ctx), "question_tokens": len(q),
                              "followup_tokens": len(follow), "passkey": task.answers[0],
                              "final_positions": final,
                              "beyond_model_window": bool(lm.max_positions
                                                          and final > lm.max_positions)})
            for r in part:
                r["prompt_tokens"] = len(ctx)
            rows += part
            targets[str(len(ctx))] = _targets(part, budgets)
            _print(part, targets[str(len(ctx))])
    finally:
        if not args.flash_dir:
            shutil.rmtree(flash_dir, ignore_errors=True)
    quality = _quality(rows, budgets)
    config = {"model": lm.name, "prompt_tokens": [w["prompt_tokens"] for w in workloads],
              "workloads": workloads, "new_tokens": new_tokens, "budgets": budgets,
              "retrieval": args.retrieval, "policies": ["full"] + policies,
              "depth": args.depth, "seed": args.seed,
              "reference": "full KV greedy; other policies teacher-forced on its tokens",
              "threads": torch.get_num_threads(), "quick": bool(args.quick),
              "load_avg_start": load_start,
              "load_avg_end": os.getloadavg() if hasattr(os, "getloadavg") else None}
    if args.note:
        config["note"] = args.note
    for r in rows:
        r.pop("predicted", None)
    if out is not None:
        path = write_result("dynakv", {"results": rows, "targets": targets, "quality": quality},
                            config, out, quick=args.quick)
        print(f"wrote {path}")
    return 0


def _quality(rows: list[dict[str, Any]], budgets: list[float]) -> dict[str, Any]:
    """The quality rule (sparkv.bench.verdict, docs/quality.md) of each clustered policy at each
    RAM budget against full KV: every prompt's pass-key answer is a retrieval probe and its
    teacher-forced stream one QA probe (agreement = the teacher-forced score). One workload per
    prompt size is far fewer probes than the rule needs to pass, so the verdict is mostly
    ``undecided`` with how many more it needs; a ``fail`` is a real failure."""
    from sparkv.bench.verdict import decide

    probes = []
    for r in rows:
        if "refused" in r:
            continue
        config = "dense" if r["policy"] == "full" else f"{r['policy']}@{r['budget_frac']:g}"
        n = r.get("prompt_tokens")
        probes.append({"probe": f"passkey/{n}", "family": "passkey", "config": config,
                       "group": r["policy"], "correct": bool(r["passkey"]), "error": None})
        probes.append({"probe": f"continue/{n}", "family": "qa", "config": config,
                       "group": r["policy"], "correct": False, "error": None,
                       "teacher_forced": r["agreement"], "greedy_agreement": r["agreement"]})
    out: dict[str, Any] = {}
    for config in dict.fromkeys(p["config"] for p in probes if p["config"] != "dense"):
        try:
            v = decide(probes, config)
        except ValueError:
            continue
        metrics = {k: {"estimate": m.estimate, "verdict": m.verdict, "n": m.n,
                       "interval": None if m.interval is None else list(m.interval)}
                   for k, m in v.metrics.items()}
        out[config] = {"verdict": v.verdict, "need_more": v.need_more, "metrics": metrics}
    return out


def _settings(args: argparse.Namespace) -> tuple[list[int], int, list[float], list[str]]:
    """``(prompt sizes, new tokens, RAM budgets, policies other than full)``, checked."""
    new_tokens = 64 if args.quick else args.max_new_tokens
    raw = args.prompt_tokens or ("1024" if args.quick else "4096,8192")
    try:
        prompts = [int(x) for x in str(raw).split(",") if x]
    except ValueError:
        raise SystemExit(f"--prompt-tokens takes integers, got {raw!r}") from None
    if new_tokens < 2 or not prompts or min(prompts) < 64:
        raise SystemExit("need --max-new-tokens >= 2 and --prompt-tokens >= 64")
    budgets = [float(x) for x in args.decode_budgets.split(",") if x]
    if any(not 0 < b <= 1 for b in budgets):
        raise SystemExit("--decode-budgets are fractions in (0, 1]")
    policies = [p for p in args.policies.split(",") if p and p != "full"]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    return prompts, new_tokens, budgets, policies


def _workload(lm: LoadedModel, args: argparse.Namespace, prompt_tokens: int
              ) -> tuple[Any, list[int], list[int], list[int], Any]:
    """The seeded pass-key task and its token ids: ``(task, context, the "continue" question,
    the pass-key turn, the context's prefilled KV)``."""
    from sparkv.bench.tasks import make_task
    from sparkv.runtime import reference_prefill
    from sparkv.runtime.generate import prompt_parts

    task = make_task("passkey", prompt_tokens, args.depth, args.seed,
                     lambda s: len(lm.encode_text(s)))
    ctx, q = prompt_parts(lm, lm.encode_text(task.document), CONTINUE)
    follow = lm.encode_text(f"<|im_end|>\n<|im_start|>user\n{task.question}<|im_end|>\n"
                            "<|im_start|>assistant\n")
    layers = reference_prefill(lm, ctx)
    return task, ctx, q, follow, layers


def _measure(lm: LoadedModel, layers: Any, ctx: list[int], q: list[int], follow: list[int],
             task: Any, new_tokens: int, budgets: list[float], policies: list[str],
             retrieval: float, flash_dir: str) -> list[dict[str, Any]]:
    """Full KV decodes the reference stream (free-running greedy), then every policy at every
    budget is fed it (:func:`_session_run`): one row each, ``full`` first."""
    from sparkv.logs import progress_bar

    from sparkv.decode import DecodeSession

    bar = progress_bar(total=1 + len(policies) * len(budgets), desc="dynakv bench", unit="run")
    with DecodeSession(lm, layers, len(ctx), "full") as s:
        ref = [int(s.prefill(q).argmax())]
        for _ in range(new_tokens - 1):
            ref.append(int(s.feed([ref[-1]]).argmax()))
    with PeakRss() as peak:
        rows = [_session_run(lm, layers, ctx, q, ref, follow, task, "full", None, retrieval,
                             flash_dir)]
    rows[0]["rss_peak_bytes"] = peak.bytes
    bar.update(1)
    for b in budgets:
        for pol in policies:
            bar.set_postfix_str(f"{pol} @ {b:g}")
            t0 = time.perf_counter()
            with PeakRss() as peak:
                row = _session_run(lm, layers, ctx, q, ref, follow, task, pol, b, retrieval,
                                   flash_dir)
            row["wall_s"] = time.perf_counter() - t0
            row["rss_peak_bytes"] = peak.bytes     # the whole process: model and prompt KV too
            rows.append(row)
            bar.update(1)
    bar.close()
    return rows


def _print(rows: list[dict[str, Any]], targets: dict[str, Any]) -> None:
    table = []
    for r in rows:
        if "refused" in r:
            table.append([r["policy"], r["budget_frac"], "refused"] + [""] * 11)
            continue
        table.append([r["policy"], "-" if r["budget_frac"] is None else r["budget_frac"],
                      r["recall"] if r["recall"] is not None else float("nan"),
                      r["agreement"], r["passkey"],
                      r["flash_read_bytes_per_token"] / 1e3, r["flash_read_ops_per_token"],
                      r["critical_read_ops_per_token"],
                      r["mean_run_entries"], r["write_amplification"], r["hit_rate"],
                      r["split_read_bytes"] / 1e3, r["tokens_per_s"],
                      (r.get("rss_peak_bytes") or float("nan")) / 1e6])
    print(format_table(["policy", "RAM", "recall", "agree", "passkey", "rd kB/tok", "ops/tok",
                        "crit ops", "run", "WA", "hit", "split kB", "tok/s", "RSS MB"], table))
    for b, t in targets.items():
        print(f"targets @ {b}: " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else
                                            f"{k}={v}" for k, v in t.items()))
