"""CLI commands of the runtime: ``sparkv model`` (convert/inspect) and ``sparkv demo``.

``sparkv demo`` is the README's main job. Today it runs the device side on its own: the bundled
SmolLM2 answers a question about the bundled sample context after a local chunked prefill with each
attention backend, and prints the answers and a TTFT table. The edge issue extends it with the server
on loopback and the streaming strategies (stream-only, Strong Hybrid, SparKV).
"""

from __future__ import annotations

import argparse
import time

from sparkv.bench.common import format_table

DEMO_QUESTION = "What does this text say about warranty? Answer in one sentence."


def register(sub: "argparse._SubParsersAction") -> None:
    m = sub.add_parser("model", help="convert (first use) and describe a model")
    m.add_argument("--model", default=None, help="local HF checkpoint (default: bundled SmolLM2)")
    m.add_argument("--tokens", type=int, default=4096, help="context length for the geometry")
    m.add_argument("--chunk-tokens", type=int, default=1024)
    m.set_defaults(func=_model)

    d = sub.add_parser("demo", help="the main job: answer a question about the sample context, "
                                    "with a TTFT table")
    d.add_argument("--model", default=None)
    d.add_argument("--tokens", type=int, default=2048, help="context tokens (of the sample)")
    d.add_argument("--chunk-tokens", type=int, default=512)
    d.add_argument("--question", default=DEMO_QUESTION)
    d.add_argument("--new-tokens", type=int, default=40)
    d.set_defaults(func=_demo)


def _model(args: argparse.Namespace) -> int:
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime import load_model

    lm = load_model(args.model)
    g = ChunkGeometry.from_config(lm.config, args.tokens, args.chunk_tokens)
    n_params = sum(p.numel() for p in lm.model.parameters())
    print(f"model        {lm.name} ({lm.config.model_type}, {n_params / 1e6:.1f} M parameters)")
    print(f"fingerprint  {lm.fingerprint}")
    print(f"layers       {g.num_layers}, KV heads {g.num_kv_heads}, head_dim {g.head_dim}")
    print(f"context      {args.tokens} tokens -> {g.num_token_chunks} token chunks x "
          f"{g.num_layers} layers x {g.num_groups} groups = {g.num_chunks} KV chunks")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from sparkv.runtime import (BlockSparseAttention, DenseAttention, LayerStepper,
                                greedy_generate, load_model, sample_context_ids)
    from sparkv.runtime.generate import prompt_parts

    print("sparkv demo: loading the model ...", flush=True)
    lm = load_model(args.model)
    ids, question = prompt_parts(lm, sample_context_ids(lm, args.tokens), args.question)
    print(f"context: {len(ids)} tokens (the bundled sample text); question: "
          f"{args.question.strip()!r}\n", flush=True)
    rows = []
    answers = {}
    for name, backend in (("local (dense)", DenseAttention()),
                          ("local (block-sparse)", BlockSparseAttention())):
        start = time.perf_counter()
        stepper = LayerStepper(lm, ids, args.chunk_tokens, backend)
        results = stepper.complete()
        prefill = time.perf_counter() - start
        gen = greedy_generate(lm, stepper.kv.layer_kv(), len(ids), question, args.new_tokens)
        ttft = time.perf_counter() - start - (gen.total_s - gen.first_token_s)
        density = [r.stats.density for r in results if r.stats]
        rows.append([name, ttft, prefill, gen.first_token_s, 1.0 - sum(density) / len(density)])
        answers[name] = gen.text.strip()
        print(f"[{name}] {answers[name]}", flush=True)
    print()
    print(format_table(["strategy", "TTFT_s", "prefill_s", "question+first_s", "skipped"], rows))
    print("\n(streaming strategies - server on loopback, stream-only, Strong Hybrid, SparKV - are "
          "added by the edge client; see the issues)")
    return 0
