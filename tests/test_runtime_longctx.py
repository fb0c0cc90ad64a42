"""The long-context timing mode (``rope-extended:POSITIONS[:BASE]``): a tiny random-weight model
whose window is extended accepts the new positions, its layer steps still equal its full prefill
past the native window, and it is named and labelled as what it is."""

from __future__ import annotations

import pytest
import torch

from sparkv.runtime import LayerStepper, ModelNotFoundError, load_model, reference_prefill
from sparkv.runtime.longctx import LongContextSpec, long_context_spec

NATIVE = 8192


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A 2-layer random Llama checkpoint (GQA) with an 8192-position window, as SmolLM2's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=NATIVE, rope_theta=100000.0, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)
    path = tmp_path_factory.mktemp("longctx") / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def long_lm(tiny_ckpt):
    return load_model(long_context_spec(2 * NATIVE, str(tiny_ckpt)))


def test_the_extended_model_accepts_16k_positions(tiny_ckpt, long_lm):
    assert long_lm.max_positions == 16384 and long_lm.native_positions == NATIVE
    rope = long_lm.config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 2.0
    assert rope["original_max_position_embeddings"] == NATIVE
    ids = list(range(1, 16385))
    LayerStepper(long_lm, ids, 1024)           # a 16K context is a valid stepper (no compute)
    with pytest.raises(ValueError, match="exceeds the model's 8192 positions"):
        LayerStepper(load_model(tiny_ckpt), ids, 1024)
    # the last position: one token forward at position 16383 (attention over itself only)
    x = torch.zeros(1, 1, 64)
    cos, sin = long_lm.decoder.rotary_emb(x, torch.tensor([[0, 8191, 16383]]))
    assert torch.isfinite(cos).all() and torch.isfinite(sin).all()
    with torch.inference_mode():
        out = long_lm.model(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[16383]]))
    assert torch.isfinite(out.logits).all()


def test_layer_steps_equal_the_full_prefill_past_the_native_window(tmp_path):
    """YaRN is static: layer steps of any span reproduce the extended model's own prefill."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=64, rope_theta=10000.0, eos_token_id=None,
                      bos_token_id=None, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "short")
    lm = load_model(long_context_spec(256, str(tmp_path / "short")))
    ids = torch.randint(1, 128, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = reference_prefill(lm, ids)
    stepper = LayerStepper(lm, ids, 48)
    stepper.complete()
    for (k, v), (rk, rv) in zip(stepper.kv.layer_kv(), ref):
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)


def test_named_labelled_and_fingerprinted_as_extended(tiny_ckpt, long_lm):
    base = load_model(tiny_ckpt)
    assert long_lm.name == f"rope-extended:16384:{tiny_ckpt}"
    assert "RoPE extended 8192 -> 16384" in long_lm.label and "quality only within 8192" \
        in long_lm.label
    assert long_lm.fingerprint != base.fingerprint       # its chunks are not the base's
    assert long_lm.base_fingerprint == base.fingerprint  # its measured tables are
    assert long_lm.extra["long_context"]["native_positions"] == NATIVE
    assert base.label == base.name and base.native_positions == NATIVE


@pytest.mark.parametrize("spec, match", [
    ("rope-extended:abc", "must be an integer"),
    ("rope-extended:0", "must be positive"),
    ("rope-extended:4096:random:nope", "unknown random model shape"),
    ("rope-extended:20000:rope-extended:30000", "cannot be one itself"),
])
def test_bad_specs_are_clear_errors(spec, match):
    with pytest.raises(ModelNotFoundError, match=match):
        load_model(spec)


def test_not_past_the_window_is_a_clear_error(tiny_ckpt):
    with pytest.raises(ModelNotFoundError, match="already accepts 8192 positions"):
        load_model(long_context_spec(4096, str(tiny_ckpt)))


def test_spec_round_trip():
    spec = LongContextSpec.parse("rope-extended:16384:random:smollm2-135m:3")
    assert spec == LongContextSpec(16384, "random:smollm2-135m:3")
    assert LongContextSpec.parse("rope-extended:16384").base is None
    assert spec.name("x") == "rope-extended:16384:x"
