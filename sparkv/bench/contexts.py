"""``sparkv bench contexts``: many contexts under one memory budget, switched (LLMS's method,
docs/device-service.md).

Workload (SmolLM2, seeded): ``--contexts`` contexts, each a system turn holding a slice of the
bundled text (lengths uniform in ``--context-tokens``, 1024-4096 by default) and a first user
turn that plants a pass key, prefilled once and adopted by every system (:class:`Prototypes`);
then a trace of ``--calls`` calls with Poisson arrivals (the arrival times are recorded; calls run
one after another, as a phone's LLM service does) over the contexts in one of three patterns:

* ``random``: every context equally likely;
* ``markov``: recency-biased (with probability 0.6 one of the two most recently called contexts);
* ``gaussian``: over context length (contexts near the median length are called most).

Each call is a turn of a multi-turn dialogue (prompts below), answered with ``--max-new-tokens``
greedy tokens that stay in the context (it grows with each call). At the end every context is
asked for its pass key.

Systems, same trace, same budget (the sum of every memory's own account, working memory
included): ``lmk`` (kill, then recompute), ``swap`` (whole-context swapping), ``vllm-s`` (16-token
chunks swapped, fp), ``vllm-sq`` (the same at int8), ``llms`` (the full service) and its ablations
``llms-no-compression``, ``llms-no-pipeline``, ``llms-no-lifecycle``; ``unlimited`` (the service
with a budget that never evicts, fp) is the quality reference. The budget is
``--memory-budget-fraction`` (25% or 50%) of the contexts' total fp KV at their final lengths,
never below one working memory of the longest context plus its int8 KV (:func:`budget_for`).

Metrics: mean and p99 switching latency (reclaim + load, until the context is ready, excluding the
calls that create contexts); answers identical to the unlimited run's; pass-key accuracy; and the
largest number of active contexts (``--sweep`` counts, the same budget) whose mean switching
latency stays under ``--limit-ms``. Also the resident ``ask`` against the first ``ask`` (local
prefill; ``EdgeSession.ask(keep=True)``): TTFT ratio.
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sparkv.bench.common import add_run_args, format_table, write_result

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

DEFAULT_SYSTEMS = ("swap", "vllm-sq", "llms")
SYSTEMS = ("lmk", "swap", "vllm-s", "vllm-sq", "llms", "llms-no-compression",
           "llms-no-pipeline", "llms-no-lifecycle", "llms+host")
#: a system name's suffix: the service with a host-RAM tier (``--host-tier-mb``) between its
#: memory and flash (sparkv.device.hosttier)
HOST_SUFFIX = "+host"
PATTERNS = ("random", "markov", "gaussian")
DIALOGUE = [
    "Summarise the text above in one sentence.",
    "What is the main topic?",
    "Give one word that describes the tone.",
    "Who is this text written for?",
    "Name one thing the text forbids.",
    "Is there a date in the text?",
    "Write a title for it.",
    "What would you ask the author?",
    "List two key terms.",
    "Explain it to a child, briefly.",
]
#: the LLMS paper's figures (Llama2-7B / OPT-7B on Jetson and MI14), beside ours in the JSON
PAPER = {"vllm_sq_over_llms": "9.7x on average, up to 20x",
         "swap_over_llms": "1-2 orders of magnitude",
         "active_llms_over_vllm_sq": "1.99-2.85x"}
PASSKEY_Q = "What is the pass key I asked you to remember? Answer with the number only."


# ---- the workload --------------------------------------------------------------------------------
def parse_token_range(spec: str) -> tuple[int, int]:
    """``"1024-4096"`` -> ``(1024, 4096)``: the range of context text lengths, in tokens."""
    try:
        lo, hi = (int(x) for x in spec.split("-"))
    except ValueError:
        raise SystemExit(f"--context-tokens must be LO-HI (e.g. 1024-4096), not {spec!r}") from None
    if not 16 <= lo <= hi:
        raise SystemExit(f"--context-tokens must have 16 <= LO <= HI, not {spec!r}")
    return lo, hi


def make_contexts(lm: LoadedModel, count: int, tokens: tuple[int, int],
                  seed: int) -> list[dict[str, Any]]:
    """``count`` contexts: a slice of the bundled text (length uniform in ``tokens``, both ends
    included) and a pass key. The first ``n`` contexts of a larger ``count`` are the same."""
    from sparkv.runtime.generate import sample_context_ids

    rng = random.Random(seed)
    lo, hi = tokens
    text = sample_context_ids(lm, 2 * hi + 64)
    out = []
    for i in range(count):
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(text) - n)
        body = lm.decode_tokens(text[start:start + n])
        key = rng.randrange(10000, 99999)
        out.append({"index": i, "system": f"You answer questions about this text.\n{body}",
                    "key": str(key), "plant": f"Remember: the pass key is {key}. Say OK.",
                    "tokens": n})
    return out


class Prototypes:
    """Every context of the workload prefilled **once** (its system turn and the planted turn,
    answered ``OK``), with the attention densities the service records: each system then adopts
    it (:meth:`ContextService.import_context`), so a run times its calls, not a prefill of
    1-4K tokens per context and system. Kept at fp in an unlimited service."""

    def __init__(self, lm: LoadedModel, work: Path) -> None:
        from sparkv.device.service import ContextService, ServiceConfig

        self.lm = lm
        self.svc = ContextService(lm, 1 << 40, Path(tempfile.mkdtemp(prefix="proto-", dir=work)),
                                  config=ServiceConfig(name="prototypes", compression="fp",
                                                       journal=False, keep_working=False,
                                                       aot=False))
        self.made: dict[int, tuple[list[int], Any, tuple[Any, Any]]] = {}

    def get(self, c: dict[str, Any]) -> tuple[list[int], Any, tuple[Any, Any]]:
        """``(token ids, per-layer (K, V), (mass, rows))`` of context ``c``."""
        if c["index"] not in self.made:
            self.made[c["index"]] = self._make(c)
        return self.made[c["index"]]

    def _make(self, c: dict[str, Any]) -> tuple[list[int], Any, tuple[Any, Any]]:
        from sparkv.device.keeper import layer_kv

        cid = self.svc.new_context(c["system"])
        plant = self.lm.encode_text(f"<|im_start|>user\n{c['plant']}<|im_end|>\n"
                                    "<|im_start|>assistant\nOK<|im_end|>\n")
        self.svc.call(cid, prompt_ids=plant, max_new_tokens=0)
        ctx = self.svc.registry.get(cid)
        n, C = len(ctx.tokens), ctx.memory
        assert C is not None                         # a context between calls holds its memory
        layers = [tuple(x.unsqueeze(0).clone() for x in layer_kv(C, l, 0, n))
                  for l in range(C.geometry.num_layers)]  # noqa: E741
        out = (list(ctx.tokens), layers, (ctx.mass.clone(), ctx.rows.clone()))
        self.svc.delete(cid)
        return out


def make_trace(contexts: list[dict[str, Any]], calls: int, pattern: str, seed: int,
               rate_hz: float = 0.5) -> list[tuple[float, int]]:
    """``calls`` (arrival seconds, context index): Poisson arrivals, contexts by ``pattern``."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {PATTERNS}, not {pattern!r}")
    rng = random.Random(seed)
    n = len(contexts)
    order = sorted(range(n), key=lambda i: contexts[i]["tokens"])
    weights = [math.exp(-0.5 * ((r - (n - 1) / 2) / max(n / 4, 0.5)) ** 2) for r in range(n)]
    t = 0.0
    out: list[tuple[float, int]] = []
    recent: list[int] = []
    for _ in range(calls):
        t += rng.expovariate(rate_hz)
        if pattern == "random" or (pattern == "markov" and (len(recent) < 2
                                                            or rng.random() >= 0.6)):
            i = rng.randrange(n)
        elif pattern == "markov":
            i = rng.choice(recent[-2:])
        else:
            i = order[rng.choices(range(n), weights=weights)[0]]
        out.append((round(t, 3), i))
        recent = [x for x in recent if x != i] + [i]
    return out


def make_service(lm: LoadedModel, system: str, budget: int, swap_dir: Path,
                 ratio: float | None, host_bytes: int = 0) -> Any:
    """The service of ``system`` (a preset; ``NAME+host``: with a host tier of
    ``host_bytes``)."""
    from sparkv.device.service import ContextService, ServiceConfig

    if system == "unlimited":
        return ContextService(lm, 1 << 40, swap_dir, config=ServiceConfig(
            name="unlimited", compression="fp", journal=False))
    preset, host = system.removesuffix(HOST_SUFFIX), system.endswith(HOST_SUFFIX)
    return ContextService(lm, budget, swap_dir, config=ServiceConfig.preset(
        preset, ratio=ratio, journal=False, host_tier_bytes=host_bytes if host else 0))


def run_system(lm: LoadedModel, system: str, contexts: list[dict[str, Any]],
               trace: list[tuple[float, int]], budget: int, new_tokens: int,
               ratio: float | None, work: Path, protos: Prototypes,
               bar: Any = None, host_bytes: int = 0) -> dict[str, Any]:
    """One system over the trace (its contexts adopted from ``protos``); returns its row
    (latencies in ms) and its answers."""
    swap = Path(tempfile.mkdtemp(prefix=f"{system}-", dir=work))
    svc = make_service(lm, system, budget, swap, ratio, host_bytes)
    try:
        ids, answers, switch, first, total = [], [], [], [], []
        for c in contexts:
            tokens, layers, density = protos.get(c)
            ids.append(svc.import_context(tokens, layers, density=density))
            if bar is not None:
                bar.update(1)
        turn = [0] * len(contexts)
        for _, i in trace:
            prompt = DIALOGUE[turn[i] % len(DIALOGUE)]
            turn[i] += 1
            r = svc.call(ids[i], prompt, max_new_tokens=new_tokens)
            switch.append(r.switch_s * 1e3)
            first.append(r.first_token_s * 1e3)
            total.append(r.total_s * 1e3)
            answers.append(r.tokens)
            if bar is not None:
                bar.update(1)
        keys, key_answers = [], []
        for c, cid in zip(contexts, ids):
            r = svc.call(cid, PASSKEY_Q, max_new_tokens=10)
            key_answers.append(r.tokens)
            keys.append(c["key"] in r.text)
            if bar is not None:
                bar.update(1)
        st = svc.stats()
        st["ratio"] = svc.config.ratio if svc.config.compression == "tolerance" else None
        return {"system": system, "switch_ms": switch, "first_token_ms": first,
                "total_ms": total, "answers": answers, "passkey_answers": key_answers,
                "passkey_hits": keys, "stats": {k: st[k] for k in (
                    "peak_bytes", "budget_violations", "evicted_bytes", "reclaim_written_bytes",
                    "aot_written_bytes", "read_bytes", "read_chunks", "recomputed_chunks",
                    "host_chunks", "ratio")}}
    finally:
        del svc
        shutil.rmtree(swap, ignore_errors=True)


def _p99(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(math.ceil(0.99 * len(s))) - 1)]


def summarise(row: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    sw = row["switch_ms"]
    out = {"system": row["system"], "mean_switch_ms": sum(sw) / max(1, len(sw)),
           "median_switch_ms": statistics.median(sw) if sw else float("nan"),
           "p99_switch_ms": _p99(sw),
           "mean_first_token_ms": sum(row["first_token_ms"]) / max(1, len(sw)),
           "passkey_acc": sum(row["passkey_hits"]) / max(1, len(row["passkey_hits"])),
           **row["stats"]}
    if ref is not None:
        same = [a == b for a, b in zip(row["answers"], ref["answers"])]
        out["identical_answers"] = sum(same) / max(1, len(same))
        out["passkey_acc_unlimited"] = ref and (sum(ref["passkey_hits"])
                                                / max(1, len(ref["passkey_hits"])))
    return out


def final_tokens(contexts: list[dict[str, Any]], calls_per_context: float,
                 new_tokens: int) -> list[int]:
    """Each context's estimated final length: its text, the system and planted turns (~40
    tokens) and its share of the trace's turns (~24 tokens of prompt each, plus the answer)."""
    turn = 24 + new_tokens
    return [c["tokens"] + 40 + int(turn * (1 + calls_per_context)) for c in contexts]


def budget_for(lm: LoadedModel, contexts: list[dict[str, Any]], calls_per_context: float,
               new_tokens: int, fraction: float) -> dict[str, int]:
    """The budget every system gets: ``fraction`` of the contexts' total KV (fp, the model's
    dtype, at their final lengths), but never less than the **floor** a chunked system needs to
    run the longest call at all: one fp working memory of the longest context (its turn and 64
    spare slots) and that context's int8 KV. Returns ``budget_bytes``, ``total_kv_bytes`` and
    ``floor_bytes``. (The whole-context baselines grow their arena layer by layer,
    :func:`sparkv.device.loader.grow_arena`, so they need no second copy.)"""
    from sparkv.device.loader import payload_nbytes, working_nbytes
    from sparkv.layout import ChunkGeometry

    finals = final_tokens(contexts, calls_per_context, new_tokens)
    g = ChunkGeometry.from_config(lm.config, max(finals), 16)
    work = working_nbytes(g, 24 + new_tokens + 16 + 64, lm.dtype)
    kv = lm.config.num_key_value_heads
    d = lm.config.hidden_size // lm.config.num_attention_heads
    L = lm.config.num_hidden_layers
    total = sum(payload_nbytes("fp", kv * n, d, lm.dtype) * L for n in finals)
    floor = work + payload_nbytes("int8", kv * max(finals), d, lm.dtype) * L
    return {"budget_bytes": int(max(fraction * total, floor)), "total_kv_bytes": int(total),
            "floor_bytes": int(floor)}


# ---- the resident ask vs the first ask -------------------------------------------------------------
def resident_ask(lm: LoadedModel, tokens: int, work: Path, new_tokens: int) -> dict[str, Any]:
    """TTFT of a first ``ask`` (local prefill: the device holds the document) against a second
    one about the same context kept in a context service."""
    from sparkv.device import ContextService
    from sparkv.edge import AskOptions, EdgeSession, chat_context
    from sparkv.runtime.generate import sample_context_ids

    ids = chat_context(lm, sample_context_ids(lm, tokens))
    svc = ContextService(lm, 512 << 20, Path(tempfile.mkdtemp(prefix="kept-", dir=work)))
    out: dict[str, Any] = {"context_tokens": len(ids)}
    with EdgeSession.connect("http://127.0.0.1:9", model=lm, context_service=svc) as s:
        q = "What does the text say about warranty?"
        opts = AskOptions(strategy="local", backend="dense", max_new_tokens=new_tokens, keep=True)
        a = s.ask("bench-doc", q, opts, token_ids=ids)
        b = s.ask("bench-doc", q, opts, token_ids=ids)
        assert b.kept_id is not None                  # keep=True
        svc.swap_out(b.kept_id)
        c = s.ask("bench-doc", q, opts, token_ids=ids)
    out.update(first_ttft_s=a.ttft_s, resident_ttft_s=b.ttft_s, swapped_ttft_s=c.ttft_s,
               resident_ratio=a.ttft_s / max(b.ttft_s, 1e-9),
               swapped_ratio=a.ttft_s / max(c.ttft_s, 1e-9),
               bytes_streamed_second=b.breakdown.bytes_streamed,
               same_answer=a.tokens == b.tokens)
    return out


# ---- the command -------------------------------------------------------------------------------
def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("contexts", help="the on-device context service (LLMS) vs LMK, whole "
                                        "swapping, VLLM-S/SQ and ablations: switching latency, "
                                        "active contexts, quality")
    p.add_argument("--contexts", type=int, default=8, help="contexts of the main trace")
    p.add_argument("--calls", type=int, default=24, help="calls per trace")
    p.add_argument("--patterns", default=",".join(PATTERNS),
                   help="call patterns over the contexts (docs/device-service.md)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"systems compared: LLMS, its ablations and the baselines (of "
                        f"{','.join(SYSTEMS)}; lmk recomputes a 1-4K context per switch)")
    p.add_argument("--context-tokens", default="1024-4096",
                   help="context text lengths LO-HI in tokens (uniform; the issue's 1K-4K)")
    p.add_argument("--max-new-tokens", type=int, default=8,
                   help="answer tokens per call")
    p.add_argument("--memory-budget-fraction", type=float, default=0.25,
                   help="the budget as a share of the contexts' total KV (fp, final lengths); "
                        "never below one working memory of the longest context and its int8 KV")
    p.add_argument("--memory-budget-mb", type=float, default=None,
                   help="the budget in MB (10^6 bytes), instead of --memory-budget-fraction")
    p.add_argument("--ratio", type=float, default=None,
                   help="LLMS's global compression ratio (bytes relative to int8; the first "
                        "chunk, the attention sinks, is kept at fp outside it); default: the "
                        "model's quality table's (the service's default), else 1.0")
    p.add_argument("--sweep", default="2,4,8,16",
                   help="context counts for the active-contexts metric ('' to skip)")
    p.add_argument("--sweep-systems", default="vllm-sq,llms",
                   help="systems of the active-contexts sweep")
    p.add_argument("--limit-ms", type=float, default=200.0,
                   help="switching latency limit of the active-contexts sweep")
    p.add_argument("--ask-tokens", type=int, default=1024,
                   help="document tokens of the resident-ask measurement (0 to skip)")
    p.add_argument("--seed", type=int, default=0, help="seed of the contexts and the calls")
    p.add_argument("--device", default="cpu",
                   help="where the model and the contexts' KV memory live: cpu, cuda[:N], auto")
    p.add_argument("--host-tier-mb", type=float, default=None,
                   help="the host-RAM tier of the NAME+host systems, MB (default: 4x the budget)")
    p.add_argument("--quick", action="store_true",
                   help="6 contexts of 256-768 tokens, 12 calls, the markov pattern, sweep 2,4 "
                        "(a smoke run)")
    add_run_args(p, "contexts", threads=1, quick=True,
                 threads_help="torch threads (1: the fastest on a loaded machine)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch
    from sparkv.logs import progress_bar

    from sparkv.runtime.model import load_model
    from sparkv.runtime.heap import settle

    systems, patterns, sweep, sweep_systems = _settings(args)
    torch.set_num_threads(max(1, args.threads))
    lm = load_model(args.model, device=args.device)
    settle()             # the model for good: out of full collections (sparkv.runtime.heap)
    work = Path(tempfile.mkdtemp(prefix="sparkv-contexts-"))
    t0 = time.perf_counter()
    tokens = parse_token_range(args.context_tokens)
    contexts = make_contexts(lm, max([args.contexts] + sweep), tokens, args.seed)
    budget = _budget(lm, contexts[:args.contexts], args)
    per_run = 2 * args.contexts + args.calls
    total = len(patterns) * (len(systems) + 1) * per_run
    total += sum(len(sweep_systems) * (2 * n + args.calls) for n in sweep)
    bar = progress_bar(total=total, desc="contexts bench", unit="call")
    results: dict[str, Any] = {"patterns": {}, "sweep": {}}
    protos = Prototypes(lm, work)
    run_one = functools.partial(run_system, lm, budget=budget["budget_bytes"],
                                new_tokens=args.max_new_tokens, ratio=args.ratio, work=work,
                                protos=protos, bar=bar,
                                host_bytes=_host_bytes(args, budget["budget_bytes"]))
    try:
        for pattern in patterns:
            results["patterns"][pattern] = _pattern_runs(run_one, contexts[:args.contexts],
                                                         systems, pattern, args)
        for n in sweep:
            _sweep_runs(run_one, contexts[:n], sweep_systems, n, args, results["sweep"])
        bar.close()
        if args.ask_tokens:
            results["resident_ask"] = resident_ask(lm, args.ask_tokens, work, 8)
    finally:
        bar.close()
        shutil.rmtree(work, ignore_errors=True)
    active = {s: max([n for n, v in d.items() if v["mean_switch_ms"] <= args.limit_ms],
                     default=0) for s, d in results["sweep"].items()}
    results["max_active_contexts"] = active
    results["ratios"] = _ratios(results, active)
    results["paper"] = PAPER
    results.update(budget)
    results["settings"] = _workload(contexts[:args.contexts], budget, args)
    results["seconds"] = time.perf_counter() - t0
    results["note"] = (f"torch threads {args.threads}; latencies are wall clock; every system "
                       "adopts the same prefilled contexts (Prototypes)")
    path = None
    if args.json or args.out:    # written before the table: a long run is never lost to it
        path = write_result("contexts", results, config={
            k: v for k, v in vars(args).items() if k != "func"}, path=args.out, quick=args.quick)
    _print(results, args)
    if path is not None:
        print(f"wrote {path}")
    return 0


def _budget(lm: LoadedModel, contexts: list[dict[str, Any]],
            args: argparse.Namespace) -> dict[str, int]:
    """The run's budget (:func:`budget_for`), or ``--memory-budget-mb``."""
    b = budget_for(lm, contexts, args.calls / args.contexts, args.max_new_tokens,
                   args.memory_budget_fraction)
    if args.memory_budget_mb:
        b["budget_bytes"] = int(args.memory_budget_mb * 1e6)
    return b


def _workload(contexts: list[dict[str, Any]], budget: dict[str, int],
              args: argparse.Namespace) -> dict[str, Any]:
    """The workload's settings, as the JSON records them."""
    lengths = [c["tokens"] for c in contexts]
    return {"contexts": args.contexts, "calls": args.calls, "context_tokens": args.context_tokens,
            "text_tokens": lengths, "mean_text_tokens": sum(lengths) / len(lengths),
            "max_new_tokens": args.max_new_tokens, "budget_fraction": args.memory_budget_fraction,
            "budget_of_total_kv": budget["budget_bytes"] / max(1, budget["total_kv_bytes"]),
            "budget_floor_applied": budget["budget_bytes"] == budget["floor_bytes"],
            "ratio": args.ratio if args.ratio is not None else "the quality table's (else 1.0)",
            "limit_ms": args.limit_ms, "seed": args.seed}


def _host_bytes(args: argparse.Namespace, budget: int) -> int:
    """The ``+host`` systems' host tier: ``--host-tier-mb``, else four times the budget."""
    return int(args.host_tier_mb * 1e6) if args.host_tier_mb is not None else 4 * budget


def _settings(args: argparse.Namespace) -> tuple[list[str], list[str], list[int], list[str]]:
    """Applies ``--quick`` and checks the options: ``(systems, patterns, sweep context counts,
    sweep systems)``."""
    if args.quick:
        args.contexts, args.calls, args.patterns = 6, 12, "markov"
        args.sweep = "2,4" if args.sweep == "2,4,8,16" else args.sweep
        args.context_tokens = ("256-768" if args.context_tokens == "1024-4096"
                               else args.context_tokens)
        args.ask_tokens = min(args.ask_tokens, 1024)
    systems = [s for s in args.systems.split(",") if s]
    patterns = [s for s in args.patterns.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    if args.contexts < 1 or args.calls < 1:
        raise SystemExit("--contexts and --calls must be >= 1")
    if not 0.0 < args.memory_budget_fraction <= 1.0:
        raise SystemExit("--memory-budget-fraction must be in (0, 1]")
    sweep = [int(x) for x in args.sweep.split(",") if x]
    sweep_systems = [s for s in args.sweep_systems.split(",") if s]
    return systems, patterns, sweep, sweep_systems


def _pattern_runs(run_one: Any, contexts: Any, systems: list[str], pattern: str,
                  args: argparse.Namespace) -> dict[str, Any]:
    """One access pattern's trace, run unlimited (the reference) and by every system (a system
    refusing the budget is reported, not fatal: the others still run)."""
    from sparkv.device import BudgetTooSmall

    trace = make_trace(contexts, args.calls, pattern, args.seed + 1)
    ref = run_one("unlimited", contexts, trace)
    rows = []
    for s in systems:
        try:
            rows.append(summarise(run_one(s, contexts, trace), ref))
        except BudgetTooSmall as e:
            rows.append({"system": s, "refused": str(e)})
    return {"trace": trace, "rows": rows, "unlimited": summarise(ref, None)}


def _sweep_runs(run_one: Any, cs: Any, sweep_systems: list[str], n: int,
                args: argparse.Namespace, sweep: dict[str, Any]) -> None:
    """A random trace over ``n`` contexts, run by every sweep system: its switching latencies
    into ``sweep[system][n]`` (infinite where the system refuses the budget)."""
    from sparkv.device import BudgetTooSmall

    trace = make_trace(cs, args.calls, "random", args.seed + 2)
    for s in sweep_systems:
        try:
            r = summarise(run_one(s, cs, trace), None)
        except BudgetTooSmall as e:
            sweep.setdefault(s, {})[n] = {"refused": str(e), "mean_switch_ms": math.inf,
                                          "p99_switch_ms": math.inf}
            continue
        sweep.setdefault(s, {})[n] = {"mean_switch_ms": r["mean_switch_ms"],
                                      "p99_switch_ms": r["p99_switch_ms"]}


def _ratios(results: dict[str, Any], active: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pattern, d in results["patterns"].items():
        by = {r["system"]: r for r in d["rows"] if "refused" not in r}
        if "llms" not in by:
            continue
        m = by["llms"]["mean_switch_ms"]
        out[pattern] = {f"mean_switch_{b}_over_llms": by[b]["mean_switch_ms"] / max(m, 1e-9)
                        for b in ("lmk", "swap", "vllm-s", "vllm-sq") if b in by}
        med = by["llms"]["median_switch_ms"]
        out[pattern].update({f"median_switch_{b}_over_llms":
                             by[b]["median_switch_ms"] / max(med, 1e-9)
                             for b in ("lmk", "swap", "vllm-s", "vllm-sq") if b in by})
        out[pattern]["llms_identical_answers"] = by["llms"].get("identical_answers")
        out[pattern]["llms_passkey_acc"] = by["llms"]["passkey_acc"]
        out[pattern]["llms_ratio"] = by["llms"].get("ratio")
        out[pattern]["unlimited_passkey_acc"] = d["unlimited"]["passkey_acc"]
    if active.get("vllm-sq") is not None and "llms" in active:
        out["active_llms_over_vllm_sq"] = active["llms"] / max(active["vllm-sq"], 1)
    return out


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    for pattern, d in results["patterns"].items():
        print(f"\npattern {pattern}: {args.contexts} contexts, {args.calls} calls, budget "
              f"{results['budget_bytes'] / 1e6:.1f} MB "
              f"({results['settings']['budget_of_total_kv']:.0%} of their KV)")
        rows = [[r["system"], r["mean_switch_ms"], r["median_switch_ms"], r["p99_switch_ms"],
                 r.get("identical_answers", float("nan")), r["passkey_acc"],
                 r["peak_bytes"] / 1e6, r["reclaim_written_bytes"] / 1e6, r["read_chunks"],
                 r["recomputed_chunks"]] if "refused" not in r else
                [r["system"], "refused"] + [""] * 8 for r in d["rows"]]
        u = d["unlimited"]
        rows.append(["unlimited", u["mean_switch_ms"], u["median_switch_ms"], u["p99_switch_ms"],
                     1.0, u["passkey_acc"], u["peak_bytes"] / 1e6, 0.0, 0, 0])
        print(format_table(["system", "mean switch ms", "median ms", "p99 ms", "identical",
                            "pass key",
                            "peak MB", "reclaim MB written", "chunks read", "recomputed"], rows))
    if results["sweep"]:
        ns = sorted({n for d in results["sweep"].values() for n in d})
        print(f"\nmean switching latency (ms) by active contexts (limit {args.limit_ms:g} ms)")
        print(format_table(["system"] + [str(n) for n in ns] + ["max active"],
                           [[s] + [d.get(n, {}).get("mean_switch_ms", float("nan"))
                                   for n in ns] + [results["max_active_contexts"][s]]
                            for s, d in results["sweep"].items()]))
    if "resident_ask" in results:
        r = results["resident_ask"]
        print(f"\nresident ask: first {r['first_ttft_s']:.3f} s, resident "
              f"{r['resident_ttft_s']:.3f} s ({r['resident_ratio']:.1f}x), after swap-out "
              f"{r['swapped_ttft_s']:.3f} s ({r['swapped_ratio']:.1f}x), "
              f"{r['bytes_streamed_second']} bytes streamed")
    for k, v in results["ratios"].items():
        print(f"{k}: {v}")
