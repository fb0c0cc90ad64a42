"""Compute configurations (docs/dtypes.md, sparkv/runtime/compute.py): each one's layer steps
equal its own full forward within the tolerance it states, the weights are stored as it says
(SmolLM2's int4 is its own Q4_1 blocks, bit for bit), the per-layer selection, the fast
RMSNorm/RoPE/MLP forwards against transformers' own, and a context made under one configuration
read under another (cast once, or refused when unknown)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from sparkv.runtime.compute import CONFIGS, ComputeError, apply_compute, get_compute

CPU = torch.device("cpu")
CPU_CONFIGS = [name for name in CONFIGS if name != "float16"]


def _converted(lm, name, layers=None):
    from sparkv.runtime import LoadedModel

    other = LoadedModel.from_model(copy.deepcopy(lm.model), lm.tokenizer, lm.name)
    if get_compute(name).per_layer and layers is None:
        layers = [0, 2]
    apply_compute(other, name, layers)
    return other


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` relative to ``max |b|``."""
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-6)


def _steps_and_forward(lm, ids, chunk):
    from sparkv.runtime import LayerStepper
    from sparkv.runtime.hfcache import output_cache
    from sparkv.runtime.kvcache import from_dynamic_cache

    stepper = LayerStepper(lm, ids, chunk_tokens=chunk)
    stepper.complete()
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    return stepper.kv.layer_kv(), from_dynamic_cache(output_cache(out))


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_each_configuration_steps_equal_its_own_forward(tiny_llama, name):
    lm = _converted(tiny_llama, name)
    config = get_compute(name)
    assert lm.compute is config and lm.dtype == config.dtype
    ids = [int(x) for x in torch.randint(1, 128, (150,), generator=torch.Generator()
                                         .manual_seed(1))]
    steps, full = _steps_and_forward(lm, ids, 64)          # 3 chunks, the last one ragged
    for (ks, vs), (kf, vf) in zip(steps, full):
        assert ks.dtype == config.dtype
        assert _max_rel(ks, kf) <= config.stepper_tolerance
        assert _max_rel(vs, vf) <= config.stepper_tolerance


@pytest.mark.parametrize("name", ["mixed", "mixed-attn", "mixed-mlp", "int4"])
def test_smollm2_steps_equal_its_own_forward(smollm2, name):
    lm = _converted(smollm2, name)
    from sparkv.runtime import sample_context_ids

    ids = sample_context_ids(lm, 200)
    steps, full = _steps_and_forward(lm, ids, 64)
    tol = get_compute(name).stepper_tolerance
    for (ks, vs), (kf, vf) in zip(steps, full):
        assert _max_rel(ks, kf) <= tol and _max_rel(vs, vf) <= tol


def test_smollm2_int4_is_its_own_q41_blocks_bit_for_bit(smollm2):
    """The int4 configuration's blocks are the GGUF's (codes, scales and minima, with
    llama.cpp's query/key row order undone) and compute exactly what float32 computes (a pass
    of a few rows, within float32's rounding)."""
    import numpy as np
    from gguf import GGUFReader

    from sparkv.runtime import LayerStepper, sample_context_ids
    from sparkv.runtime.linears import Q41Linear
    from sparkv.runtime.model import SMOLLM2_GGUF, _smollm2_gguf_dir
    from sparkv.runtime.q41 import quantize_q41

    lm = _converted(smollm2, "int4")
    assert lm.extra["compute_info"]["exact"] is True
    assert lm.extra["compute_info"]["head"] == "Q80Linear"            # its Q8_0 embedding
    head = lm.model.get_output_embeddings()
    assert head.weight is lm.model.get_input_embeddings().weight      # still tied
    layer0 = lm.decoder.layers[0]
    assert isinstance(layer0.self_attn.q_proj, Q41Linear)
    tensors = {t.name: t for t in GGUFReader(str(_smollm2_gguf_dir() / SMOLLM2_GGUF)).tensors}
    for gname, module, heads in (("attn_q", smollm2.decoder.layers[0].self_attn.q_proj, 9),
                                 ("attn_k", smollm2.decoder.layers[0].self_attn.k_proj, 3),
                                 ("ffn_down", smollm2.decoder.layers[0].mlp.down_proj, None)):
        raw = np.asarray(tensors[f"blk.0.{gname}.weight"].data)
        rows, cols = module.weight.shape
        blocks = raw.reshape(rows, cols // 32, 20)
        codes = np.concatenate([blocks[..., 4:] & 15, blocks[..., 4:] >> 4], -1).reshape(rows,
                                                                                         cols)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        if heads:                                             # llama.cpp's rotary row order
            order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).ravel()
            codes, d = codes[order], d[order]
        mine = quantize_q41(module.weight)
        assert torch.equal(mine.codes, torch.from_numpy(codes.astype(np.uint8)))
        nonzero = torch.from_numpy(d.astype(np.float32)) != 0
        assert torch.equal(mine.d.float()[nonzero], torch.from_numpy(d.astype(np.float32))[nonzero])
    ids = sample_context_ids(smollm2, 130)
    a, b = LayerStepper(smollm2, ids, 64), LayerStepper(lm, ids, 64)
    a.complete()
    b.complete()
    for (k1, v1), (k2, v2) in zip(a.kv.layer_kv(), b.kv.layer_kv()):
        # chunks of 64 rows: float32's product bit for bit; the last chunk's 2 rows take the
        # blocks' kernel (Q41Linear.KERNEL_ROWS): the same weights, sums in another order
        assert torch.equal(k1[:, :, :128], k2[:, :, :128])
        assert torch.equal(v1[:, :, :128], v2[:, :, :128])
        torch.testing.assert_close(k2[:, :, 128:], k1[:, :, 128:], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v2[:, :, 128:], v1[:, :, 128:], atol=1e-4, rtol=1e-4)


def test_mixed_mlp_keeps_the_mlps_activations_in_bf16_between_its_matmuls(tiny_llama):
    """``mixed-mlp``'s MLP is the bf16 formula bit for bit (one input rounding, the gate's SiLU
    and the product in bf16, one cast of the output), not ``mixed-attn``'s (every matmul's
    output cast to float32 and the SiLU and product computed there), and within bf16 rounding
    of it; an MLP whose projections carry a bias is left as ``mixed`` computes it."""
    from torch.nn import functional as F

    from sparkv.runtime.fastops import MLP_DTYPE

    low, attn = _converted(tiny_llama, "mixed-mlp"), _converted(tiny_llama, "mixed-attn")
    assert low.extra["compute_info"]["mlp_layers"] == [0, 1, 2]
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(3))
    mlp = low.decoder.layers[1].mlp
    assert getattr(mlp, MLP_DTYPE) is torch.bfloat16
    assert getattr(attn.decoder.layers[1].mlp, MLP_DTYPE, None) is None
    with torch.inference_mode():
        xb = x.to(torch.bfloat16)
        g = F.silu(F.linear(xb, mlp.gate_proj.weight)) * F.linear(xb, mlp.up_proj.weight)
        want = F.linear(g, mlp.down_proj.weight).float()
        got, other = mlp(x), attn.decoder.layers[1].mlp(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(other, want) and _max_rel(other, want) < 0.03

    from sparkv.runtime import LoadedModel

    biased = LoadedModel.from_model(copy.deepcopy(tiny_llama.model), None, tiny_llama.name)
    with torch.no_grad():
        biased.decoder.layers[0].mlp.up_proj.bias = torch.nn.Parameter(torch.ones(128))
    other = _converted(biased, "mixed-mlp")
    assert other.extra["compute_info"]["mlp_layers"] == [1, 2]
    assert getattr(other.decoder.layers[0].mlp, MLP_DTYPE, None) is None


def test_layers_of_one_input_round_it_once_bit_for_bit():
    """``project_shared``: bf16 layers of one input (q/k/v) take it rounded once and compute
    each layer's own output bit for bit, a bias added after, as each layer does; layers that
    round differently (or not at all) each take the input as it is."""
    from sparkv.runtime.fastops import project_shared
    from sparkv.runtime.linears import Bf16Linear, Int8Linear

    torch.manual_seed(6)
    plain = [torch.nn.Linear(64, 32, bias=False), torch.nn.Linear(64, 16),
             torch.nn.Linear(64, 16)]
    bf16 = tuple(Bf16Linear(m) for m in plain)
    x = torch.randn(1, 50, 64)
    with torch.inference_mode():
        for layers in (bf16, (bf16[0], Int8Linear(plain[1])), tuple(plain)):
            got, want = project_shared(layers, x), [m(x) for m in layers]
            assert len(got) == len(layers)
            assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))


def test_weights_are_stored_as_each_configuration_says(tiny_llama):
    from sparkv.runtime.linears import WeightLinear

    sizes = {}
    for name in ("mixed", "bf16-weights", "int8", "int4", "int4-kernel"):
        lm = _converted(tiny_llama, name)
        mods = [m for m in lm.model.modules() if isinstance(m, WeightLinear)]
        assert len(mods) == 7 * 3                              # 7 projections x 3 layers
        assert all(isinstance(m, get_compute(name).linear) for m in mods)
        sizes[name] = lm.extra["compute_info"]["weight_bytes"]
        assert lm.model.lm_head.weight.dtype == torch.float32  # the head keeps its weights
    fp32 = sum(m.weight.numel() * 4 for layer in tiny_llama.decoder.layers
               for m in (*layer.self_attn.children(), *layer.mlp.children())
               if isinstance(m, torch.nn.Linear))
    assert sizes["mixed"] == sizes["bf16-weights"] == fp32 // 2
    assert sizes["int4"] < sizes["int8"] < sizes["mixed"]
    assert sizes["int4"] <= fp32 * 5 / 32 + 1                 # 4-bit codes + fp16 d, m per 32


def test_a_configuration_that_cannot_be_built_says_why(tiny_llama, tmp_path):
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime import DeviceUnavailable, load_model

    with pytest.raises(ComputeError, match="unknown compute configuration 'int3'"):
        get_compute("int3")
    lm = _converted(tiny_llama, "bfloat16")
    with pytest.raises(ComputeError, match="starts from a float32 model"):
        apply_compute(lm, "mixed")
    with pytest.raises(ComputeError, match="sensitivity allows"):
        apply_compute(_converted(tiny_llama, "float32"), "mixed-layers")
    ckpt = tmp_path / "ckpt"
    tiny_llama.model.save_pretrained(ckpt)
    with pytest.raises(DeviceUnavailable, match="float16 on the CPU"):
        load_model_in_dtype(ckpt, "float16", "cpu")
    with pytest.raises(DeviceUnavailable, match="sensitivity allows"):
        load_model(ckpt, dtype="mixed-layers")
    with pytest.raises(DeviceUnavailable, match="sparkv bench layer-precision"):
        load_model_in_dtype(ckpt, "mixed-layers", "cpu")       # no selection measured


def test_layer_precision_is_measured_selected_stored_and_used(tiny_llama, tmp_path,
                                                             monkeypatch):
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime.layerprec import (LayerPrecisionError, load_precision,
                                          measure_layer_precision, parse_precision,
                                          save_precision, select_layers)
    from sparkv.runtime.linears import Bf16Linear

    assert select_layers([3e-5, 1e-5, 2e-5, 9e-5], 3.5e-5) == [1, 2]
    assert select_layers([3e-5, 1e-5], 0.0) == []
    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path / "cache"))
    ckpt = tmp_path / "ckpt"
    tiny_llama.model.save_pretrained(ckpt)
    lm = load_model_in_dtype(ckpt, "float32", "cpu")
    ids = list(range(1, 97))
    rec = measure_layer_precision(lm, ids, budget_kl=1.0)      # every layer fits
    assert rec.bf16 == [0, 1, 2] and len(rec.layer_kl) == 3
    assert all(k >= 0 for k in rec.layer_kl) and 0 <= rec.selection_agreement <= 1
    assert all(type(m).__name__ != "Bf16Linear" for m in lm.model.modules())  # left as it was
    rec.bf16 = [1]
    save_precision(rec)
    assert load_precision(lm.fingerprint).bf16 == [1]
    mixed = load_model_in_dtype(ckpt, "mixed-layers", "cpu")
    assert mixed.compute.name == "mixed-layers" and mixed.extra["compute_info"]["layers"] == [1]
    assert isinstance(mixed.decoder.layers[1].mlp.up_proj, Bf16Linear)
    assert isinstance(mixed.decoder.layers[0].mlp.up_proj, torch.nn.Linear)
    with pytest.raises(LayerPrecisionError, match="outside"):
        parse_precision({**json.loads(json.dumps(rec.__dict__)), "bf16": [7]})


def test_fast_ops_equal_transformers_own_forward_in_every_family():
    """RMSNorm, RoPE and the MLP as sparkv runs them against the modules' original forwards,
    for a tiny model of each supported family (Qwen3: q_norm/k_norm; Qwen2: biases)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    from sparkv.runtime import LoadedModel

    common = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                  max_position_embeddings=512)
    ids = torch.randint(1, 96, (1, 70), generator=torch.Generator().manual_seed(2))
    for cfg_cls, model_cls in ((LlamaConfig, LlamaForCausalLM), (MistralConfig,
                               MistralForCausalLM), (Qwen2Config, Qwen2ForCausalLM),
                               (Qwen3Config, Qwen3ForCausalLM)):
        torch.manual_seed(0)
        model = model_cls(cfg_cls(**common)).eval()
        with torch.inference_mode():
            plain = model(input_ids=ids).logits
        lm = LoadedModel.from_model(model, None, cfg_cls.model_type)
        assert type(lm.decoder.layers[0].self_attn).__name__.startswith("Fast")
        with torch.inference_mode():
            fast = lm.model(input_ids=ids).logits
        assert _max_rel(fast, plain) < 1e-5, cfg_cls.model_type


def test_the_fast_decoder_layer_is_the_layers_own_forward_and_keeps_its_childrens_hooks():
    """The decoder layer's fast forward calls its children's forwards directly (no
    ``Module.__call__``) only where nothing could tell: bit for bit the layer's own forward; a
    hook on one child takes that child's module call again (the hook fires) and leaves the
    others direct; autograd takes every module call again."""
    from sparkv.runtime.fastops import DECODER_SUFFIX, _children, direct_calls

    from helpers import tiny_llama_model

    # a model of its own: the session's ``tiny_llama`` may carry hooks other tests left on
    # purpose (the device service's density recorder; transformers' output capture)
    model = tiny_llama_model(2, "fresh").model.model
    layer = model.layers[1]
    assert type(layer).__name__ == "Fast" + "Llama" + DECODER_SUFFIX
    own = type(layer).__mro__[1].forward
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(7)[None]
    emb = model.rotary_emb(x, position_ids=pos)
    norm1, attn, norm2, mlp = children = [layer.input_layernorm, layer.self_attn,
                                          layer.post_attention_layernorm, layer.mlp]
    with torch.inference_mode():
        assert direct_calls(children)
        assert _children(layer) == [m.forward for m in children]
        want = own(layer, x, position_ids=pos, position_embeddings=emb)
        assert torch.equal(layer(x, position_ids=pos, position_embeddings=emb), want)
    seen = []
    handle = attn.register_forward_hook(lambda *a: seen.append(1))
    try:
        with torch.inference_mode():
            assert not direct_calls(children)
            assert _children(layer) == [norm1.forward, attn, norm2.forward, mlp.forward]
            assert torch.equal(layer(x, position_ids=pos, position_embeddings=emb), want)
        assert seen == [1]
    finally:
        handle.remove()
    with torch.enable_grad():
        assert not direct_calls(children)
        assert _children(layer) == children
    with torch.inference_mode():
        assert direct_calls(children)


def test_a_few_rows_linear_is_torchs_within_rounding_and_one_row_bit_for_bit():
    """``fastops.linear``: 2-64 float32 rows as ``W @ x^T`` equal ``F.linear`` within float32
    rounding (with a bias too); one row, more rows and other dtypes are ``F.linear`` itself."""
    from torch.nn import functional as F

    from sparkv.runtime.fastops import FEW_ROWS, linear

    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(96, 128, generator=gen), torch.randn(96, generator=gen)
    for rows in (1, 2, 7, FEW_ROWS, FEW_ROWS + 1):
        x = torch.randn(1, rows, 128, generator=gen)
        for bias in (None, b):
            got, want = linear(x, w, bias), F.linear(x, w, bias)
            assert got.shape == want.shape == (1, rows, 96) and got.is_contiguous()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
            if rows in (1, FEW_ROWS + 1):
                assert torch.equal(got, want)
    x = torch.randn(3, 128, generator=gen).bfloat16()
    assert torch.equal(linear(x, w.bfloat16()), F.linear(x, w.bfloat16()))


def test_fast_linear_layers_start_on_64_bytes_and_keep_their_values_and_ties():
    """A checkpoint's weights lie at any offset of its file, and ``W @ x^T``'s rounding depends
    on where ``W`` lies: the fast ops move an unaligned float32 weight to aligned memory, so a
    configuration's copy of it (aligned) computes the same bits."""
    from sparkv.runtime.fastops import install_fast_ops, linear

    flat = torch.randn(1 + 96 * 128)
    model = torch.nn.Sequential(torch.nn.Linear(128, 96, bias=False), torch.nn.Linear(128, 96))
    with torch.no_grad():
        model[0].weight.data = flat[1:].view(96, 128)          # 4 bytes past an aligned start
    model[1].weight = model[0].weight                          # tied, as an LM head may be
    assert model[0].weight.data_ptr() % 64
    values = model[0].weight.detach().clone()
    install_fast_ops(model)
    assert model[0].weight.data_ptr() % 64 == 0
    assert torch.equal(model[0].weight, values) and model[1].weight is model[0].weight
    x = torch.randn(1, 5, 128)
    with torch.no_grad():
        assert torch.equal(model[0](x), linear(x, values.clone()))


def test_rope_and_rms_norm_match_the_plain_formulas():
    from torch.nn import functional as F

    from sparkv.runtime.fastops import apply_rope

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 20, 16, generator=gen)
    freqs = torch.arange(20.0)[:, None] * torch.rand(8, generator=gen)[None]
    emb = torch.cat((freqs, freqs), -1)[None]
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = x.chunk(2, -1)
    plain = x * cos[:, None] + torch.cat((-x2, x1), -1) * sin[:, None]
    assert torch.allclose(apply_rope(x, cos, sin), plain, atol=1e-6)
    h = torch.randn(2, 5, 64, generator=gen)
    w = torch.rand(64, generator=gen)
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(F.rms_norm(h, (64,), eps=1e-5) * w, ref)


def _encoded(lm, tmp_path):
    from sparkv.server.encoder import ContextSpec, derive_context_id, encode_context
    from sparkv.server.models import ModelEntry
    from sparkv.server.stores import open_store

    store = open_store(f"file://{tmp_path}/store")
    entry = ModelEntry.from_loaded("tiny", lm, 4096)
    ids = tuple(int(x) for x in torch.randint(1, 128, (80,), generator=torch.Generator()
                                               .manual_seed(3)))
    spec = ContextSpec("t", "tiny", ids, 32, ("raw",), 0, False, None)
    cid = derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)
    data, _ = encode_context(entry, spec, cid, store.chunks)
    return data, store, spec, cid


def test_a_context_made_under_one_configuration_is_read_under_another(tiny_llama, tmp_path):
    """A ``mixed`` server's manifest names its configuration; a float32 edge knows it and
    takes the raw frames as they are, cast once into its memory (bit for bit: both float32);
    a manifest without the field means its dtype's; an unknown one is refused."""
    from sparkv.codec import decode
    from sparkv.protocol.errors import ManifestError
    from sparkv.protocol.manifest import Manifest
    from sparkv.runtime import LayerStepper
    from sparkv.server.stores import ChunkKey

    server = _converted(tiny_llama, "mixed")
    data, store, spec, cid = _encoded(server, tmp_path)
    manifest = Manifest.parse(data)
    assert manifest.model.compute == "mixed" and manifest.model.dtype == "float32"
    assert manifest.check_compute(CONFIGS) == "mixed"
    src = LayerStepper(server, list(spec.token_ids), 32)
    src.complete()
    c = manifest.chunks[0]
    chunk = decode(store.chunks.get(spec.tenant, cid, ChunkKey(c.t, c.l, c.g, "raw")))
    k = src.kv.layer_kv()[c.l][0][0, :, c.token_start:c.token_start + c.num_tokens]
    assert torch.equal(chunk.k.to(tiny_llama.dtype), k)
    doc = json.loads(data)
    del doc["model"]["compute"]                                # an older server's manifest
    assert Manifest.parse(json.dumps(doc).encode()).check_compute(CONFIGS) == "float32"
    doc["model"]["compute"] = "int2-future"
    with pytest.raises(ManifestError, match="int2-future.*does not know"):
        Manifest.parse(json.dumps(doc).encode()).check_compute(CONFIGS)


def test_int4_decode_is_float32_for_a_prefill_and_the_int4_kernel_for_answer_tokens():
    """``int4-decode``: a pass marked as answer tokens is ``int4-kernel``'s, any other pass
    (a prefill of any length, a ragged last chunk of a few tokens) float32's bit for bit."""
    from sparkv.runtime.fastops import install_fast_ops
    from sparkv.runtime.linears import Int4DecodeLinear, Int4KernelLinear, answer_tokens, answering

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    install_fast_ops(linear)                 # a loaded model's float32 linear layers
    dual, kernel = Int4DecodeLinear(linear), Int4KernelLinear(linear)
    with torch.no_grad():
        for rows in (1, 3, 40):
            x = torch.randn(1, rows, 128)
            assert torch.equal(dual(x), linear(x))
            with answer_tokens():
                assert answering()
                assert torch.equal(dual(x), kernel(x))
                assert not torch.equal(dual(x), linear(x))     # the int4 weights differ
            assert not answering()
    assert dual.weight_nbytes() == 96 * 128 * 4 + kernel.weight_nbytes()


def test_int4_decode_judges_its_answers_as_it_makes_them(tiny_llama):
    """Under ``int4-decode`` a context's KV and the first token are float32's; the answer tokens
    after it go through the int4 kernel, and teacher forcing feeds the reference one token a
    pass the same way, so a greedy answer forced back agrees with itself everywhere."""
    from sparkv.runtime import greedy_generate
    from sparkv.runtime.generate import reference_prefill, teacher_forced_agreement

    lm = _converted(tiny_llama, "int4-decode")
    assert get_compute("int4-decode").answers_differ
    ids = [int(x) for x in torch.randint(1, 128, (80,), generator=torch.Generator()
                                         .manual_seed(3))]
    question = ids[-6:]
    kv = reference_prefill(lm, ids[:-6])
    mine = greedy_generate(lm, kv, 74, question, max_new_tokens=12, stop_at_eos=False)
    fp = reference_prefill(tiny_llama, ids[:-6])
    for (k1, v1), (k2, v2) in zip(kv, fp):                      # its prefill is float32's
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    dense = greedy_generate(tiny_llama, fp, 74, question, max_new_tokens=12, stop_at_eos=False)
    assert torch.equal(mine.first_logits, dense.first_logits)
    assert teacher_forced_agreement(lm, kv, 74, question, mine.tokens) == 1.0


def test_mixed_mlp_int4_decode_is_bf16_for_a_prefill_and_the_int4_kernel_for_answer_tokens():
    """``mixed-mlp-int4-decode``'s linear layer: a pass marked as answer tokens is
    ``int4-kernel``'s, any other pass ``mixed``'s bf16 matmul bit for bit; both in bf16."""
    from sparkv.runtime.linears import (Bf16Linear, Int4KernelLinear, MixedInt4DecodeLinear,
                                        answer_tokens)

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    dual, bf16, kernel = (MixedInt4DecodeLinear(linear), Bf16Linear(linear),
                          Int4KernelLinear(linear))
    with torch.no_grad():
        for rows in (1, 3, 40):
            x = torch.randn(1, rows, 128)
            assert torch.equal(dual(x), bf16(x)) and dual.matmul(x).dtype == torch.bfloat16
            with answer_tokens():
                assert torch.equal(dual(x), kernel(x))
                assert dual.matmul(x).dtype == torch.bfloat16
                assert not torch.equal(dual(x), bf16(x))        # the int4 weights differ
    assert dual.weight_nbytes() == 96 * 128 * 2 + kernel.weight_nbytes()


def test_mixed_mlp_int4_decode_prefills_as_mixed_mlp_and_judges_answers_as_it_makes_them(
        tiny_llama):
    """Under ``mixed-mlp-int4-decode`` a context's KV and the first token are ``mixed-mlp``'s
    bit for bit (its MLPs keep bf16 activations); the later answer tokens go through the int4
    kernel, and teacher forcing feeds them one a pass the same way."""
    from sparkv.runtime import greedy_generate
    from sparkv.runtime.generate import reference_prefill, teacher_forced_agreement

    name = "mixed-mlp-int4-decode"
    lm, ref = _converted(tiny_llama, name), _converted(tiny_llama, "mixed-mlp")
    assert get_compute(name).answers_differ and get_compute(name).bf16_matmuls
    info = lm.extra["compute_info"]
    assert info["mlp_layers"] == ref.extra["compute_info"]["mlp_layers"] == info["layers"]
    ids = [int(x) for x in torch.randint(1, 128, (80,), generator=torch.Generator()
                                         .manual_seed(3))]
    question = ids[-6:]
    kv, kv_ref = reference_prefill(lm, ids[:-6]), reference_prefill(ref, ids[:-6])
    for (k1, v1), (k2, v2) in zip(kv, kv_ref):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    mine = greedy_generate(lm, kv, 74, question, max_new_tokens=12, stop_at_eos=False)
    theirs = greedy_generate(ref, kv_ref, 74, question, max_new_tokens=12, stop_at_eos=False)
    assert torch.equal(mine.first_logits, theirs.first_logits)
    assert teacher_forced_agreement(lm, kv, 74, question, mine.tokens) == 1.0


def test_a_manifest_names_the_configuration_that_made_the_kv(tiny_llama, tmp_path):
    """A ``mixed-mlp-int4-decode`` server's KV is ``mixed-mlp``'s bit for bit: its manifest
    says ``mixed-mlp``, which a device without the newer name reads too."""
    from sparkv.protocol.manifest import Manifest

    data, *_ = _encoded(_converted(tiny_llama, "mixed-mlp-int4-decode"), tmp_path)
    assert Manifest.parse(data).model.compute == "mixed-mlp"
    assert get_compute("mixed-mlp-int4-decode").prefill_name == "mixed-mlp"
    assert get_compute("mixed-mlp").prefill_name == "mixed-mlp"


def test_a_configuration_that_differs_only_in_its_answers_keeps_its_prefill_twins_profile(
        tiny_llama):
    """The latency profile of the layer steps is matched by ``compute_name``: the twin whose
    prefill passes a configuration's are (``prefill_as``), which exists and is not itself a
    twin."""
    from sparkv.predictor.device import compute_name

    twins = {n: c.prefill_as for n, c in CONFIGS.items() if c.prefill_as}
    assert twins == {"int4-decode": "float32", "mixed-mlp-int4-decode": "mixed-mlp"}
    assert all(CONFIGS[t].prefill_as is None for t in twins.values())
    assert compute_name(_converted(tiny_llama, "mixed-mlp-int4-decode")) == "mixed-mlp"
    assert compute_name(_converted(tiny_llama, "int4")) == "int4"
    assert compute_name(tiny_llama) == "float32"
