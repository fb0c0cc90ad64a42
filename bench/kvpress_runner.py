"""kvpress's presses on sparkv's prompts: the peer side of ``sparkv bench presses --kvpress``.

Runs in kvpress's own venv (``bash bench/setup_kvpress.sh``: kvpress needs transformers < 5.3),
so it imports nothing from sparkv. Reads a JSON job (model path, prompts as token ids,
``compression_ratios`` - the fraction removed, kvpress's meaning and sparkv's presses' constructor
argument alike, so nothing is converted here -, modes, press names, new tokens) and writes
``{"rows": [...]}``: per prompt, press, mode and compression ratio, the answer, the KV bytes the
cache holds after compression (kvpress's AdaKV only masks entries, so it holds everything) and the
prefill + compression seconds.

Each prompt is answered as kvpress's own pipeline does (``KVPressTextGenerationPipeline``):
the context is prefilled through ``model.model`` inside ``with press(model)``, then the question
and a greedy answer continue at the context's true positions. Question-aware: the question (but its
last token) is prefilled with the context, so kvpress's window (its last 64 tokens) holds it.

    python bench/kvpress_runner.py job.json out.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from kvpress import AdaKVPress, PyramidKVPress, SnapKVPress


def make(name: str, compression_ratio: float):
    if name == "snapkv":
        return SnapKVPress(compression_ratio=compression_ratio)
    if name == "pyramidkv":
        return PyramidKVPress(compression_ratio=compression_ratio)
    if name == "adakv":
        return AdaKVPress(SnapKVPress(compression_ratio=compression_ratio), alpha_safeguard=0.2)
    raise SystemExit(f"kvpress runner: unknown press {name!r}")


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))


@torch.inference_mode()
def answer(model, press, ctx: list[int], question: list[int], new_tokens: int, eos: set[int]
           ) -> tuple[list[int], int, float]:
    cache = DynamicCache()
    t0 = time.perf_counter()
    with press(model):
        model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
    prefill_s = time.perf_counter() - t0
    held = cache_bytes(cache)
    n = len(ctx)
    pos = torch.arange(n, n + len(question)).unsqueeze(0)
    out = model(input_ids=torch.tensor([question]), past_key_values=cache, position_ids=pos,
                logits_to_keep=1)
    ids = [int(out.logits[0, -1].argmax())]
    nxt = pos[:, -1:] + 1
    for i in range(new_tokens - 1):
        if ids[-1] in eos:
            break
        out = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache,
                    position_ids=nxt + i)
        ids.append(int(out.logits[0, -1].argmax()))
    return ids, held, prefill_s


def main(src: str, dst: str) -> None:
    job = json.loads(open(src).read())
    torch.set_num_threads(int(job.get("threads") or 2))
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(job["model"])
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, (list, tuple)) else ({int(eos)} if eos is not None else set())
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rows = []
    total = len(job["prompts"]) * len(job["modes"]) * len(job["compression_ratios"]) * \
        len(job["presses"])
    done = 0
    for p in job["prompts"]:
        for mode in job["modes"]:
            ctx, q = list(p["context_ids"]), list(p["question_ids"])
            if mode == "aware":
                ctx, q = ctx + q[:-1], q[-1:]
            full = 2 * len(ctx) * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
            for cr in job["compression_ratios"]:
                for name in job["presses"]:
                    ids, held, secs = answer(model, make(name, cr), ctx, q, job["new_tokens"],
                                             eos)
                    text = tok.decode([i for i in ids if i not in eos], skip_special_tokens=True)
                    rows.append({"task": p["task"], "press": f"kvpress:{name}", "mode": mode,
                                 "compression_ratio": cr, "answer": text,
                                 "kv_bytes": held, "bytes_ratio": held / full,
                                 "prefill_s": secs, "compress_s": 0.0})
                    done += 1
                    print(f"kvpress runner: {done}/{total} {name} {mode} {cr}: {text!r}",
                          file=sys.stderr, flush=True)
    with open(dst, "w") as f:
        json.dump({"rows": rows}, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: kvpress_runner.py JOB.json OUT.json")
    main(sys.argv[1], sys.argv[2])
