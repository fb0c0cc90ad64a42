"""CLI of the device side: ``sparkv ask`` and ``sparkv demo`` (the README's main job)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sparkv.edge.ask import STRATEGIES

DEMO_QUESTION = "What does this text say about warranty? Answer in one sentence."


def _link_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="emulate a link following this CSV trace (time_s,mbps[,rtt_ms]) or a "
                        "bundled one: wifi, lte, deep_fade")
    p.add_argument("--mbps", type=float, default=None, help="emulate a constant link (Mbit/s)")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="emulated round trip (ms)")


def _shaper(args: argparse.Namespace) -> Any:
    from sparkv.edge.shaper import LinkShaper
    from sparkv.scheduler.trace import Trace

    if args.trace:
        if args.trace in ("wifi", "lte", "deep-fade"):
            trace = Trace.sample(args.trace)
        else:
            trace = Trace.from_csv(args.trace)
        return LinkShaper(trace, rtt_s=args.rtt_ms / 1e3)
    if args.mbps:
        return LinkShaper.constant(args.mbps, args.rtt_ms)
    return LinkShaper.unlimited()


def register(sub: "argparse._SubParsersAction") -> None:
    a = sub.add_parser("ask", help="answer a question about a context stored on a server")
    a.add_argument("question")
    a.add_argument("--server", required=True, help="e.g. http://127.0.0.1:8080")
    a.add_argument("--context", required=True, help="context id (32 hex digits)")
    a.add_argument("--api-key", default=os.environ.get("SPARKV_API_KEY"),
                   help="the tenant's key (default: $SPARKV_API_KEY)")
    a.add_argument("--strategy", choices=sorted(STRATEGIES), default="sparkv")
    a.add_argument("--level", default="auto", help="auto, or one codec level (raw, q8, q5, ...)")
    a.add_argument("--backend", default="auto", help="attention: auto, block_sparse, dense")
    a.add_argument("--model", default=None, help="local checkpoint (default: bundled SmolLM2)")
    a.add_argument("--max-new-tokens", type=int, default=64)
    a.add_argument("--key", default=None, help="encryption key of an encrypted context")
    a.add_argument("--no-cache", action="store_true",
                   help="do not keep manifests and token ids under the cache dir")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    _link_args(a)
    a.set_defaults(func=_ask)

    d = sub.add_parser("demo", help="the main job: a server on loopback, the sample context, every "
                                    "strategy under a link trace, a TTFT table and a plot")
    d.add_argument("--model", default=None)
    d.add_argument("--tokens", type=int, default=2048, help="context tokens (of the sample text)")
    d.add_argument("--chunk-tokens", type=int, default=512)
    d.add_argument("--levels", default="raw,q8,q5", help="levels the server encodes")
    d.add_argument("--question", default=DEMO_QUESTION)
    d.add_argument("--new-tokens", type=int, default=40)
    d.add_argument("--strategies", default="local,stream,hybrid,sparkv")
    d.add_argument("--out", default="sparkv-demo", help="directory for the plot and JSON")
    d.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    _link_args(d)
    d.set_defaults(func=_demo, trace="lte")


def _ask(args: argparse.Namespace) -> int:
    from sparkv.edge.client import EdgeClient
    from sparkv.runtime.model import cache_dir

    cache = None if args.no_cache else cache_dir() / "edge"
    with EdgeClient(args.server, args.api_key, args.model, shaper=_shaper(args),
                    cache_dir=cache) as client:
        if args.key:
            client.encryption_keys[args.context] = args.key
        res = client.ask(args.context, args.question, strategy=args.strategy, level=args.level,
                         backend=args.backend, max_new_tokens=args.max_new_tokens)
    if args.json:
        print(json.dumps({"answer": res.answer, "tokens": res.tokens,
                          "breakdown": res.breakdown.to_dict(),
                          "plan": res.plan.counts() if res.plan else None}, indent=1))
    else:
        print(res.answer.strip())
        print()
        print(res.breakdown.table())
    return 0


def _demo(args: argparse.Namespace) -> int:
    import torch

    from sparkv.bench.common import format_table
    from sparkv.edge.ask import chat_context, question_suffix
    from sparkv.edge.client import EdgeClient
    from sparkv.edge.plots import plot_timelines, timeline_of
    from sparkv.runtime import load_model, sample_context_ids
    from sparkv.runtime.generate import greedy_agreement, reference_generate
    from sparkv.server.process import ServerProcess

    if args.threads:
        torch.set_num_threads(args.threads)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        from sparkv.errors import SparkvError
        raise SparkvError(f"unknown strategies {bad}; choose from {sorted(STRATEGIES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("sparkv demo: loading the model ...", flush=True)
    lm = load_model(args.model)
    context = chat_context(lm, sample_context_ids(lm, args.tokens))
    link = (f"trace {args.trace!r}" if args.trace else
            f"{args.mbps:g} Mbit/s" if args.mbps else "unshaped loopback")
    with tempfile.TemporaryDirectory(prefix="sparkv-demo-") as tmp:
        config = None
        if args.model:  # the server encodes with the same checkpoint as the device
            from sparkv.server.process import write_config
            config = f"{tmp}/server.yaml"
            write_config(config, None, models={"custom": str(args.model)},
                         default_model="custom")
        server = ServerProcess(config, f"file://{tmp}/store", log_path=f"{tmp}/server.log",
                               torch_threads=max(1, torch.get_num_threads()))
        print("starting the server on loopback ...", flush=True)
        with server:
            client = EdgeClient(server.url, model=lm)
            t0 = time.perf_counter()
            cid = client.create_context(token_ids=context, chunk_tokens=args.chunk_tokens,
                                        levels=[x for x in args.levels.split(",") if x],
                                        progress=True)
            print(f"context {cid}: {len(context)} tokens encoded by the server in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
            suffix = question_suffix(lm, args.question)
            print(f"question: {args.question!r}; link: {link}\n", flush=True)
            ref = reference_generate(lm, context + suffix, args.new_tokens)
            runs = []
            rows = []
            for strat in strategies:
                client.shaper = _shaper(args)    # each strategy meets the trace from its start
                client.bandwidth_estimate_Bps = None
                res = client.ask(cid, args.question, strategy=strat,
                                 max_new_tokens=args.new_tokens, use_cache=False)
                bd = res.breakdown
                runs.append((f"{strat}: TTFT {bd.ttft_s:.2f} s", res))
                rows.append([strat, bd.ttft_s, bd.loading_s, bd.streaming_s, bd.local_compute_s,
                             bd.question_prefill_s, bd.bytes_streamed / 1e6,
                             f"{bd.chunks_streamed}/{bd.chunks_computed}", bd.migrations,
                             greedy_agreement(ref, res.tokens)])
                print(f"[{strat:>6}] {res.answer.strip()}", flush=True)
            client.close()
    print(f"[reference, dense full prefill] {lm.decode_tokens(ref).strip()}\n")
    print(format_table(["strategy", "TTFT_s", "loading_s", "link_s", "compute_s", "question_s",
                        "MB", "streamed/computed", "migr", "agree"], rows))
    best = min(r[1] for r in rows if r[0] != "sparkv") if len(rows) > 1 else None
    sp = [r[1] for r in rows if r[0] == "sparkv"]
    if best and sp:
        print(f"\nsparkv TTFT / best baseline = {sp[0] / best:.2f}")
    png = plot_timelines([(label, timeline_of(res)) for label, res in runs], out / "timeline.png",
                         title=f"{len(context)} tokens, {link}: both paths per strategy")
    (out / "demo.json").write_text(json.dumps({
        "context_tokens": len(context), "link": link, "question": args.question,
        "rows": [dict(zip(["strategy", "ttft_s", "loading_s", "link_s", "compute_s",
                           "question_s", "MB", "streamed_computed", "migrations", "agreement"], r))
                 for r in rows],
        "answers": {label: res.answer for label, res in runs}}, indent=1))
    print(f"timeline plot: {png}")
    sys.stdout.flush()
    return 0
