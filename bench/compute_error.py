"""Where a compute configuration's error comes from, beside the spread between equally valid
float32 paths (issue 44, docs/dtypes.md "Error attribution").

Full forwards over held-out calibration text (Python's reference documentation, as
``sparkv bench layer-precision``), each against the float32 forward of the bundled SmolLM2 as
sparkv runs it (1 thread, the CPU flash kernel, sparkv's RMSNorm/RoPE/MLP forwards): the mean
KL per position and the share of positions whose argmax is kept, for

* float32 paths that are equally valid: 2 threads instead of 1; SDPA's math kernel instead of
  flash; transformers' own RMSNorm/RoPE/MLP forwards; the context prefilled by the layer stepper
  in chunks (split attention) with the last quarter teacher-forced over its cache;
* each configuration (``bfloat16``, ``mixed``, ``bf16-weights``, ``int8``, ``int4``,
  ``int4-kernel``);
* ``mixed`` per operation: only the attention's q/k/v projections, only ``o_proj``, only the
  MLP's gate/up, only ``down_proj`` in bf16.

    PYTHONPATH=. python bench/compute_error.py [TOKENS] > bench/results/compute_error.json
"""
import copy
import json
import os
import sys
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparkv.bench.layerprec import calibration_ids
from sparkv.predictor.dtypes import convert
from sparkv.runtime import LayerStepper, LoadedModel, load_model
from sparkv.runtime.fastops import uninstall_fast_ops
from sparkv.runtime.linears import Bf16Linear

tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 768
torch.set_num_threads(1)
base = load_model(dtype="float32")
ids = calibration_ids(base, tokens)
x = torch.tensor([ids])
tail = tokens // 4          # the chunked path is compared on the last quarter


@torch.inference_mode()
def logits(lm):
    return lm.model(input_ids=x).logits[0].float()


def compare(ref, out):
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    kl = float((p.exp() * (p - q)).sum(-1).mean())
    return {"kl": kl, "argmax_kept": float((ref.argmax(-1) == out.argmax(-1)).float().mean()),
            "max_abs_logit_diff": float((ref - out).abs().max())}


def copy_of(lm):
    return LoadedModel(copy.deepcopy(lm.model), lm.tokenizer, lm.name, lm.fingerprint,
                       {"base_fingerprint": lm.base_fingerprint})


@torch.inference_mode()
def chunked_tail(lm):
    """Logits of the last ``tail`` positions over a cache the layer stepper prefilled (T=128)."""
    from sparkv.cache import SparkvCache
    from sparkv.runtime.hfcache import model_call

    stepper = LayerStepper(lm, ids[:-tail], 128, spare_tokens=tail + 8)
    stepper.complete()
    n = tokens - tail
    pos = torch.arange(n, tokens)
    out = model_call(lm.model, input_ids=x[:, n:], cache=SparkvCache(stepper.kv),
                     position_ids=pos[None], cache_position=pos, use_cache=True)
    return out.logits[0].float()


rows = []
start = time.perf_counter()
ref = logits(base)


def record(group, name, result):
    rows.append({"group": group, "name": name, **result})
    print(f"{group:10s} {name:28s} KL {result['kl']:.3e}  argmax kept {result['argmax_kept']:.4f}"
          f"  max|dlogit| {result['max_abs_logit_diff']:.3g}", file=sys.stderr, flush=True)


torch.set_num_threads(2)
record("fp32 path", "2 threads", compare(ref, logits(base)))
torch.set_num_threads(1)
with sdpa_kernel([SDPBackend.MATH]):
    record("fp32 path", "SDPA math kernel", compare(ref, logits(base)))
plain = copy_of(base)
uninstall_fast_ops(plain.model)
record("fp32 path", "transformers' own ops", compare(ref, logits(plain)))
del plain
record("fp32 path", "stepper T=128 + tail", compare(ref[-tail:], chunked_tail(base)))
for name in ("bfloat16", "mixed", "bf16-weights", "int8", "int4", "int4-kernel"):
    lm = copy_of(base)
    convert(lm, name)
    record("config", name, compare(ref, logits(lm)))
    del lm
OPS = {"q_proj+k_proj+v_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
       "gate_proj+up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
for label, names in OPS.items():
    lm = copy_of(base)
    for layer in lm.decoder.layers:
        for parent in (layer.self_attn, layer.mlp):
            for child, mod in list(parent.named_children()):
                if child in names:
                    setattr(parent, child, Bf16Linear(mod))
    record("mixed op", label, compare(ref, logits(lm)))
    del lm
print(json.dumps({"benchmark": "compute_error", "created_unix": time.time(), "tokens": tokens,
                  "text": "pydoc_data.topics", "model": base.name,
                  "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "seconds": time.perf_counter() - start, "load_avg": os.getloadavg(),
                  "reference": "float32 full forward, 1 thread, sparkv's ops", "rows": rows},
                 indent=1))
