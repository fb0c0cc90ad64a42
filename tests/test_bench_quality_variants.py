"""The paired in-process evaluator of ``sparkv bench quality`` (sparkv/bench/variants.py,
sparkv/bench/paired.py): a level variant is bit for bit what streaming that level delivers
through a real server and the edge; every variant group yields rows of the right shape on a tiny
random model; a press keeps its ratio; the device variant takes its levels from the device
service's own policy; a run resumes and shards."""

from __future__ import annotations

import argparse

import pytest
import torch

from helpers import FLOAT32_SERVER
from sparkv.bench.answers import Config, Probe, QualityContext
from sparkv.bench.paired import evaluate
from sparkv.bench.quality import (NEW_TOKENS, build_matrix, done_answers, parse_group_trials,
                                  parse_new_tokens, parse_shard, resolve_args)
from sparkv.bench.variants import (VARIANTS, DeviceVariant, PressVariant, make_variant,
                                   make_variants, prefill_reference)

#: the keys every in-process row has (today's rows plus the new groups' fields and costs)
ROW_KEYS = {"family", "size", "tokens", "context", "probe", "kind", "config", "group",
            "strategy", "level", "backend", "link", "dtype", "press", "ratio", "codec", "error",
            "answer", "score", "correct", "greedy_agreement", "divergence_pos",
            "ref_margin_at_divergence", "near_tie", "teacher_forced", "first_token_kl", "mb",
            "ttft_s", "streamed", "computed", "levels", "fallback", "reused_load", "load_s",
            "answer_s"}


def _dense(kv, l: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: E741
    """Layer ``l``'s first ``n`` tokens of a variant's cache as ``[1, H, n, D]`` K and V (the
    device variant's is a switch's working memory: dense arenas, no chunk table)."""
    heads = kv.layer_entries(l, stop=n)
    return (torch.stack([h.k for h in heads])[None], torch.stack([h.v for h in heads])[None])


def _tiny_context(n: int = 70, seed: int = 0, probes: int = 2) -> QualityContext:
    """A context of random tokens for the tokenizer-less tiny Llama, with ``probes`` questions
    given as token ids (retrieval-shaped: a 4-token answer, stop at EOS)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (n,), generator=g).tolist()
    ctx = QualityContext(f"tiny-{seed}", "passkey", n, ids, trial=seed)
    for i in range(probes):
        q = torch.randint(1, 128, (5,), generator=g).tolist()
        task = argparse.Namespace(score=lambda a: 0.0, answers=["x"], depth=0.5, seed=seed)
        ctx.probes.append(Probe(f"tiny-{seed}/{i}", "passkey", "", 4, True, task=task,
                                question_ids=q))
    return ctx


def test_the_reference_prefill_is_todays_dense_reference(tiny_llama):
    """The evaluator's one prefill (logits of the last position, the press window and the
    densities recorded on it) gives bit for bit the K/V of ``reference_prefill``."""
    from sparkv.runtime.generate import reference_prefill

    ids = _tiny_context().token_ids
    ref = prefill_reference(tiny_llama, ids, density=True)
    for (k, v), (k2, v2) in zip(ref.layers, reference_prefill(tiny_llama, ids)):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert ref.mass is not None and ref.mass.numel() >= len(ids) and float(ref.mass.sum()) > 0
    assert len(ref.window.q) == tiny_llama.config.num_hidden_layers


@pytest.mark.parametrize("group,value", [("level", "q4"), ("level", "raw"),
                                         ("backend", "dense"), ("backend", "block_sparse"),
                                         ("dtype", "bfloat16"), ("press", "adakv:0.5"),
                                         ("device", "0.5")])
def test_every_group_yields_rows_of_the_right_shape(tiny_llama, group, value):
    variant = make_variant(group, value)
    rows: list[dict] = []
    evaluate(tiny_llama, [_tiny_context()], [variant], emit=rows.append, chunk_tokens=32,
             progress=False)
    assert [r["config"] for r in rows] == ["dense", "dense", variant.name, variant.name]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert r["error"] is None, r["error"]
    mine = [r for r in rows if r["config"] == variant.name]
    assert {r["group"] for r in mine} == {group}
    for r in mine:
        assert 0.0 <= r["teacher_forced"] <= 1.0 and r["first_token_kl"] >= 0.0
        assert r["load_s"] > 0 and r["answer_s"] > 0
    if (group, value) in (("level", "raw"), ("backend", "dense")):   # lossless, or the same
        for r in mine:                                                # math in another order
            assert r["teacher_forced"] == 1.0
    if group == "dtype":
        assert mine[0]["dtype"] == "bfloat16"
    if group in ("level", "press", "device"):
        assert mine[0]["mb"] > 0


def test_bfloat16_computes_and_answers_in_bfloat16(tiny_llama):
    ref = prefill_reference(tiny_llama, _tiny_context().token_ids, chunk_tokens=32)
    load = make_variant("dtype", "bfloat16").load(ref)
    assert load.lm.dtype == torch.bfloat16 and load.kv.dtype == torch.bfloat16
    assert tiny_llama.dtype == torch.float32              # the reference model is untouched
    assert make_variant("dtype", "bfloat16").load(ref).lm is load.lm   # one copy per process
    with pytest.raises(ValueError, match="unknown compute configuration"):
        make_variant("dtype", "float8")


@pytest.mark.parametrize("name", ["mixed", "int4", "mixed-layers"])
def test_a_compute_configuration_is_a_dtype_row(tiny_llama, name, tmp_path, monkeypatch):
    """Every compute configuration is a value of the dtype group (docs/dtypes.md): a copy of the
    model in it computes the cache and answers (mixed-layers with the model's stored
    selection)."""
    from sparkv.runtime.layerprec import LayerPrecision, save_precision

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    save_precision(LayerPrecision(tiny_llama.base_fingerprint, [1], [0.1, 0.0, 0.2],
                                  [1.0, 1.0, 1.0], 0.05))
    ref = prefill_reference(tiny_llama, _tiny_context().token_ids, chunk_tokens=32)
    variant = make_variant("dtype", name)
    load = variant.load(ref)
    assert load.lm.compute.name == name and load.kv.dtype == torch.float32
    assert tiny_llama.compute.name == "float32"            # the reference model is untouched
    assert variant.config().dtype == name and variant.name == f"local/dense@{name}"
    if name == "mixed-layers":
        assert load.lm.extra["compute_info"]["layers"] == [1]


@pytest.mark.parametrize("ratio", [0.75, 0.5, 0.25])
def test_a_press_keeps_its_ratio(tiny_llama, ratio):
    """The server's press on the dense reference keeps ``ratio`` of the entries (the window
    included), and the cache holds exactly those entries."""
    ids = _tiny_context(n=200).token_ids
    ref = prefill_reference(tiny_llama, ids, chunk_tokens=64)
    variant = PressVariant(f"adakv:{ratio}")
    load = variant.load(ref)
    assert load.info["kept_fraction"] == pytest.approx(ratio, abs=0.02)
    g = load.kv.geometry
    held = sum(sum(load.kv.kept(cid)) for cid in g.chunk_ids())
    assert held == pytest.approx(ratio * g.num_layers * g.num_kv_heads * len(ids), rel=0.03)
    assert variant.config().ratio == ratio and variant.config().press == f"adakv:{ratio}"


def test_the_device_variant_uses_the_services_levels(tiny_llama, monkeypatch):
    """Its levels are what the service's LevelPolicy.assign returns for the densities of the
    reference prefill; ratio 1.0 keeps the sinks' chunk at fp and the rest int8, 0.5 mixes
    lower levels in; every chunk's values are the service payload's at that level."""
    from sparkv.device.levels import LevelPolicy

    calls = []
    real = LevelPolicy.assign

    def spy(self, ctx, g):
        out = real(self, ctx, g)
        calls.append((self.ratio, list(out)))
        return out

    monkeypatch.setattr(LevelPolicy, "assign", spy)
    ids = _tiny_context(n=160).token_ids
    ref = prefill_reference(tiny_llama, ids, density=True, chunk_tokens=64)
    full = DeviceVariant("1.0").load(ref)
    half = DeviceVariant("0.5").load(ref)
    assert [r for r, _ in calls] == [1.0, 0.5]
    lv1, lv5 = calls[0][1], calls[1][1]
    assert lv1[0] == "fp" and set(lv1[1:]) == {"int8"}
    assert set(lv5[1:]) - {"int8"} and full.levels == {"fp": 1, "int8": len(lv1) - 1}
    assert half.bytes_streamed < full.bytes_streamed
    k_ref = ref.layers[0][0][0, :, :16]
    k_fp = _dense(full.kv, 0, len(ids))[0][0, :, :16]
    assert torch.equal(k_ref, k_fp)                        # the fp chunk is exact
    k8 = _dense(full.kv, 0, len(ids))[0][0, :, 16:32]
    assert not torch.equal(k8, ref.layers[0][0][0, :, 16:32])
    assert (k8 - ref.layers[0][0][0, :, 16:32]).abs().max() < 0.05 * k_ref.abs().max() + 1e-3


def test_the_device_variant_answers_from_the_services_pages(tiny_llama):
    """The device variant's cache is a working memory filled from a paged memory holding each
    token chunk at its level, as a switch fills one: bit for bit each chunk's payload quantized
    to its level and dequantized (int8, and int4 / int2 at 0.5), the fp chunk exact."""
    from sparkv.cache.payload import ChunkPayload, contiguous_positions
    from sparkv.layout import KVChunkId

    ids = _tiny_context(n=160).token_ids
    ref = prefill_reference(tiny_llama, ids, density=True, chunk_tokens=64)
    for ratio in ("1.0", "0.5"):
        variant = DeviceVariant(ratio)
        _, g, levels = variant.levels(ref)
        got = variant.load(ref)
        assert got.kv.geometry.num_tokens == len(ids) and got.kv.layers[0] is not None
        for l, (k, v) in enumerate(ref.layers):  # noqa: E741
            gk, gv = _dense(got.kv, l, len(ids))
            for t, lv in enumerate(levels):
                t0, t1 = g.token_range(t)
                hh, d = g.num_kv_heads, g.head_dim
                p = ChunkPayload(KVChunkId(t, l, 0), "fp", [t1 - t0] * hh,
                                 contiguous_positions([t1 - t0] * hh, t0),
                                 k[0, :, t0:t1].reshape(-1, d).clone(),
                                 v[0, :, t0:t1].reshape(-1, d).clone(), k.dtype)
                ek, ev = (p if lv == "fp" else p.at_level(lv)).fp()
                assert torch.equal(gk[0, :, t0:t1], ek.view(hh, t1 - t0, d)), (ratio, l, t, lv)
                assert torch.equal(gv[0, :, t0:t1], ev.view(hh, t1 - t0, d)), (ratio, l, t, lv)


def test_a_run_resumes_and_skips_what_is_done(tiny_llama):
    ctxs = [_tiny_context(seed=s, probes=1) for s in range(2)]
    variants = make_variants({"level": ["q8"], "press": ["adakv:0.5"]})
    first: list[dict] = []
    evaluate(tiny_llama, ctxs[:1], variants, emit=first.append, chunk_tokens=32, progress=False)
    done = {(r["probe"], r["config"]) for r in first}
    second: list[dict] = []
    evaluate(tiny_llama, ctxs, variants, emit=second.append, done=done, chunk_tokens=32,
             progress=False)
    assert {r["context"] for r in second} == {"tiny-1"} and len(second) == 3
    # the press group asked only the first trial
    third: list[dict] = []
    evaluate(tiny_llama, ctxs, variants, emit=third.append, max_trials={"press": 1},
             chunk_tokens=32, progress=False)
    assert [r["config"] for r in third if r["context"] == "tiny-1"] == ["dense", "stream@q8"]
    fourth: list[dict] = []                       # a limit at one size only
    evaluate(tiny_llama, ctxs, variants, emit=fourth.append, max_trials={("press", 70): 1,
                                                                         ("press", 9): 0},
             chunk_tokens=32, progress=False)
    assert [r["config"] for r in fourth if r["context"] == "tiny-1"] == ["dense", "stream@q8"]


def test_a_resumed_run_measures_again_what_had_another_answer_length():
    rows = [{"probe": "qa/a", "config": "dense", "family": "qa", "new_tokens": 8},
            {"probe": "qa/b", "config": "dense", "family": "qa"},          # an older row
            {"probe": "p-1", "config": "dense", "family": "passkey", "new_tokens": 16},
            {"probe": "p-2", "config": "dense", "family": "passkey", "error": "boom"}]
    assert done_answers(rows, NEW_TOKENS) == {("qa/b", "dense"), ("p-1", "dense")}
    assert done_answers(rows, {**NEW_TOKENS, "qa": 8}) == {("qa/a", "dense"), ("p-1", "dense")}


def test_matrix_presets_and_shards():
    names = [c.name for c in build_matrix(["q5"], ["block_sparse"], ["default"], ["20"],
                                          ["bfloat16"], ["adakv:0.5@repeat"], ["0.75"])]
    assert names == ["dense", "stream@q5", "local/block_sparse", "local/dense@bfloat16",
                     "press/adakv:0.5@repeat", "device@0.75", "default@20mbps"]
    assert set(VARIANTS) == {"level", "backend", "dtype", "press", "device"}
    with pytest.raises(Exception):
        make_variant("level", "q9")
    with pytest.raises(ValueError):
        make_variant("device", "9")
    with pytest.raises(ValueError):
        make_variant("nope", "1")

    def args(**kw):
        base = dict(quick=False, table=False, encode_levels="raw,q8", chunk_tokens=512,
                    rtt_ms=20.0, seed=0, qa_file=None, shard=None)
        return argparse.Namespace(**{**base, **kw})

    t = resolve_args(args(table=True))
    assert t["sizes"] == [2048, 4096, 8192] and t["trials"] == "30" and t["strategies"] == []
    assert t["group_trials"]["press"] == 10 and t["qa_questions"] is None
    assert set(t["levels"]) >= {"q8", "q6", "q5", "q4"} and len(t["presses"]) >= 4
    assert "adakv:0.5@repeat" in t["presses"] and t["device_ratios"] == ["1.0", "0.75", "0.5"]
    q = resolve_args(args(quick=True, levels="q8"))
    assert q["levels"] == ["q8"] and q["strategies"] == [] and q["qa_questions"] == 3
    with pytest.raises(ValueError):
        resolve_args(args(quick=True, table=True))
    assert q["new_tokens"] == NEW_TOKENS
    assert resolve_args(args(new_tokens="qa=8"))["new_tokens"] == {**NEW_TOKENS, "qa": 8}
    assert parse_new_tokens("qa=8, passkey=4") == {**NEW_TOKENS, "qa": 8, "passkey": 4}
    for bad in ("nope=3", "qa", "qa=0", "qa=x", "qa=-1"):
        with pytest.raises(ValueError):
            parse_new_tokens(bad)
    assert parse_group_trials("press=10,device@8192=5") == {"press": 10, ("device", 8192): 5}
    for bad in ("nope=3", "press", "press=x"):
        with pytest.raises(ValueError):
            parse_group_trials(bad)
    assert parse_shard("1/3") == (1, 3) and parse_shard(None) == (0, 1)
    for bad in ("3/3", "x", "1/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)
    assert Config("x", "press", press="adakv:0.5", ratio=0.5).to_dict()["ratio"] == 0.5


def test_a_level_variant_is_what_streaming_that_level_delivers(smollm2, tmp_path):
    """Bit identity with the real path: a context encoded by a real server at q5 (T=128) and
    streamed by the edge (stream-only, q5) assembles exactly the cache the level variant derives
    from the dense reference with the codec's encode + decode."""
    from sparkv.edge import EdgeSession, chat_context
    from sparkv.runtime.generate import sample_context_ids
    from sparkv.server.process import ServerProcess

    lm = smollm2
    context = chat_context(lm, sample_context_ids(lm, 300))
    srv = ServerProcess(None, f"file://{tmp_path}/store", log_path=tmp_path / "server.log",
                        env=FLOAT32_SERVER).start()
    try:
        session = EdgeSession.connect(srv.url, model=lm, timeout_s=120.0)   # a loaded machine
        cid = session.client.create_context(token_ids=context, levels=["q5"], chunk_tokens=128)
        res = session.ask(cid, "Who may copy the program?", max_new_tokens=2, use_cache=False,
                          strategy="stream", level="q5", backend="dense")
        assert not res.breakdown.fallback and res.breakdown.chunks_computed == 0
        streamed = [(k.clone(), v.clone()) for k, v in res.load.kv.layer_kv()]
        session.close()
    finally:
        srv.stop()
    ref = prefill_reference(lm, context, chunk_tokens=128)
    mine = make_variant("level", "q5").load(ref)
    n = len(context)
    assert mine.chunks_streamed == res.breakdown.chunks_streamed
    assert mine.bytes_streamed == res.breakdown.bytes_streamed
    for (k, v), (k2, v2) in zip(mine.kv.layer_kv(), streamed):
        assert torch.equal(k[:, :, :n], k2[:, :, :n]) and torch.equal(v[:, :, :n], v2[:, :, :n])


def test_the_density_hook_is_the_attention_column_mass():
    """The device service's attention hook (which now leaves out the keys a block of rows cannot
    see) records the column sums of the model's own attention matrices, head-averaged, summed
    over layers: checked against an eager model's ``output_attentions`` (600 tokens: several
    256-row blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparkv.device.density import DensityRecorder, install_hooks, recording

    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=3, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 600))
    rec = DensityRecorder(600)
    install_hooks(model)
    with torch.inference_mode(), recording(rec):
        out = model(input_ids=ids, use_cache=True, output_attentions=True)
    mass = sum(a[0].sum(dim=(0, 1)).double() / a.shape[1] for a in out.attentions)
    assert torch.allclose(rec.mass, mass, atol=1e-5)
    assert torch.equal(rec.rows, torch.arange(600, 0, -1, dtype=torch.float64) * 3)
