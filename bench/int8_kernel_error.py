"""Why no configuration uses torch's int8 matmul kernel on this CPU (issue 44, docs/dtypes.md
"Error attribution").

torch's CPU int8 kernel is fbgemm's dynamic-quantized linear
(``torch.ops.quantized.linear_dynamic``): int8 weights per output channel and the input
quantized per call to 8 bits with one scale per tensor. Without AVX512-VNNI the kernel multiplies
with ``vpmaddubsw``, whose 16-bit sums saturate, so the input must keep 7 bits (``reduce_range``).
This measures, on held-out text (Python's reference documentation, as
``sparkv bench layer-precision``), the mean KL per position against SmolLM2's float32 forward
and the share of argmaxes kept for

* every projection through the kernel, with 7-bit and 8-bit inputs;
* one kind of projection at a time (attention q/k/v, o, MLP gate/up, down);
* SmoothQuant's per-input-channel scaling (``s = amax_x^a / amax_w^(1-a)``, calibrated on the
  768 tokens before the evaluated ones), which moves the activations' outlier channels into the
  weights, at a = 0.5, 0.7, 0.85;

and the layer stepper's 1K prefill, float32 against every projection through the kernel,
alternated (the load average beside each).

    PYTHONPATH=. python bench/int8_kernel_error.py > bench/results/int8_kernel_error.json
"""
import copy
import json
import os
import time
import warnings

import torch
from torch import nn

from sparkv.bench.layerprec import calibration_ids
from sparkv.runtime import LayerStepper, LoadedModel, load_model
from sparkv.runtime.linears import LINEAR_PARENTS, WeightLinear

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class DynamicInt8Linear(WeightLinear):
    """fbgemm's dynamic int8 linear: int8 weight per output channel, the input quantized per
    call (per tensor); ``smooth``: SmoothQuant's per-input-channel scales."""

    def __init__(self, linear, reduce_range=True, smooth=None):
        super().__init__(linear)
        w = linear.weight.detach().float()
        self.inv = None
        if smooth is not None:
            w, self.inv = w * smooth[None, :], 1.0 / smooth
        scale = w.abs().amax(1).clamp_min(1e-12) / 127.0
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long),
                                        0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.reduce_range = reduce_range

    def matmul(self, x):
        x = x.float() if self.inv is None else x.float() * self.inv
        return torch.ops.quantized.linear_dynamic(x.contiguous(), self.packed, self.reduce_range)


def linears(model):
    for li, layer in enumerate(model.model.layers):
        for pn in LINEAR_PARENTS:
            parent = getattr(layer, pn)
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    yield (li, pn, name), parent, child


base = load_model(dtype="float32", progress=False)
ids = calibration_ids(base, 1536)
calib, x = torch.tensor([ids[:768]]), torch.tensor([ids[768:]])
amax, hooks = {}, []
for key, _, child in linears(base.model):
    def hook(mod, inp, out, key=key):
        a = inp[0].detach().abs().reshape(-1, inp[0].shape[-1]).amax(0)
        amax[key] = torch.maximum(amax[key], a) if key in amax else a
    hooks.append(child.register_forward_hook(hook))
with torch.inference_mode():
    base.model(input_ids=calib)
for h in hooks:
    h.remove()


@torch.inference_mode()
def logits(lm):
    return lm.model(input_ids=x).logits[0].float()


def converted(ops=ALL, reduce_range=True, alpha=None):
    lm = LoadedModel(copy.deepcopy(base.model), base.tokenizer, base.name, base.fingerprint,
                     {"base_fingerprint": base.base_fingerprint})
    for key, parent, child in linears(lm.model):
        if key[2] in ops:
            smooth = None
            if alpha is not None:
                wmax = child.weight.detach().abs().amax(0).clamp_min(1e-5)
                smooth = amax[key].clamp_min(1e-5) ** alpha / wmax ** (1 - alpha)
            setattr(parent, key[2], DynamicInt8Linear(child, reduce_range, smooth))
    return lm


ref = logits(base)
rows = []
cases = [("all, 7-bit input", {}), ("all, 8-bit input (overflows)", {"reduce_range": False}),
         ("q/k/v only", {"ops": ALL[:3]}), ("o only", {"ops": ("o_proj",)}),
         ("gate/up only", {"ops": ALL[4:6]}), ("down only", {"ops": ("down_proj",)})]
cases += [(f"all, SmoothQuant a={a}", {"alpha": a}) for a in (0.5, 0.7, 0.85)]
for name, kw in cases:
    out = logits(converted(**kw))
    p, q = torch.log_softmax(ref, -1), torch.log_softmax(out, -1)
    rows.append({"name": name, "kl": float((p.exp() * (p - q)).sum(-1).mean()),
                 "argmax_kept": float((ref.argmax(-1) == out.argmax(-1)).float().mean())})

fast, prefill = converted(), []
ids_1k = calibration_ids(base, 1024)
for rnd in range(2):
    for name, lm in (("float32", base), ("int8 kernel", fast)) if rnd % 2 == 0 else \
            (("int8 kernel", fast), ("float32", base)):
        t0 = time.perf_counter()
        with torch.inference_mode():
            LayerStepper(lm, ids_1k, 512).complete()
        prefill.append({"round": rnd, "config": name, "wall_s": time.perf_counter() - t0,
                        "load_avg": os.getloadavg()[0]})
walls = {c: [r["wall_s"] for r in prefill if r["config"] == c] for c in ("float32", "int8 kernel")}
print(json.dumps({
    "benchmark": "int8_kernel_error", "created_unix": time.time(), "tokens": 768,
    "text": "pydoc_data.topics", "model": base.name,
    "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
    "reference": "float32 full forward, 1 thread", "rows": rows,
    "prefill_1k": prefill,
    "prefill_1k_speedup": [f / i for f, i in zip(walls["float32"], walls["int8 kernel"])],
}, indent=1))
