"""Model loading: the bundled default, local checkpoints, clear errors, the chunk geometry."""

from __future__ import annotations

import json

import pytest

from sparkv.cli import main
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.runtime import ModelNotFoundError, UnsupportedModelError, load_model


def test_default_model_is_smollm2(smollm2):
    cfg = smollm2.config
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 30
    assert cfg.num_key_value_heads == 3 and cfg.num_attention_heads == 9
    assert smollm2.tokenizer is not None
    ids = smollm2.encode_text("The capital of France is")
    from sparkv.runtime import reference_generate
    assert "Paris" in smollm2.decode_tokens(reference_generate(smollm2, ids, 4))


def test_local_checkpoint_roundtrip(tmp_path, tiny_llama):
    tiny_llama.model.save_pretrained(tmp_path / "ckpt")
    lm = load_model(tmp_path / "ckpt")
    assert lm.config.num_hidden_layers == 3 and lm.tokenizer is None


def test_missing_path_gives_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="--model PATH"):
        load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path / "empty")


def test_unsupported_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="not supported"):
        load_model(d)


def test_cli_reports_bad_model_without_traceback(tmp_path, capsys):
    rc = main(["bench", "prefill", "--model", str(tmp_path / "nope"), "--sizes", "64"])
    assert rc == 2
    assert "sparkv: error: no model at" in capsys.readouterr().err


def test_geometry():
    g = ChunkGeometry(num_tokens=530, chunk_tokens=200, num_layers=30, num_kv_heads=3,
                      head_dim=64, heads_per_group=1)
    assert g.num_token_chunks == 3 and g.num_groups == 3 and g.num_chunks == 270
    assert g.token_range(2) == (400, 530) and g.chunk_len(2) == 130
    assert g.chunk_shape(KVChunkId(2, 0, 1)) == (1, 130, 64)
    assert len(list(g.chunk_ids())) == 270
    assert ChunkGeometry.from_dict(g.to_dict()) == g
    with pytest.raises(ValueError):
        ChunkGeometry(10, 8, 1, 1, 1)
    with pytest.raises(ValueError):
        ChunkGeometry(10, 16, 1, 3, 1, heads_per_group=2)
    with pytest.raises(IndexError, match="token chunk 3"):
        g.check(KVChunkId(3, 0, 0))


def test_prompt_parts_chatml(smollm2):
    from sparkv.runtime.generate import prompt_parts

    ctx, q = prompt_parts(smollm2, [42, 43], "Why?")
    assert smollm2.decode_tokens(ctx[-2:]) == smollm2.decode_tokens([42, 43])
    text = smollm2.tokenizer.decode(q)
    assert text.endswith("<|im_start|>assistant\n") and "Why?" in text
