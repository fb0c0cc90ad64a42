"""The compute dtype per device (docs/dtypes.md): ``--dtype auto``'s choice (CPU flags, the
model's quality-table verdict), the loader that applies it, bf16 layer steps against bf16 full
prefill, the CPU's split attention, and a stream whose server and edge differ in dtype."""

from __future__ import annotations

import copy

import pytest
import torch

from sparkv.predictor.quality import QualityEntry, QualityTable, RetrievalScore
from sparkv.runtime.compute import auto_compute, resolve_dtype
from sparkv.runtime.device import DeviceUnavailable, cpu_bf16_flags

CPU = torch.device("cpu")


@pytest.fixture
def cpuinfo(tmp_path):
    """Fake /proc/cpuinfo files: ``{"avx512": ..., "amx": ..., "none": ..., "missing": ...}``."""
    files = {"avx512": "flags\t\t: fpu sse2 avx512f avx512_bf16\n",
             "amx": "flags\t\t: fpu amx_tile amx_bf16\nflags\t\t: fpu amx_tile amx_bf16\n",
             "arm": "Features\t: fp asimd bf16\n", "none": "flags\t\t: fpu sse2 avx2\n"}
    out = {}
    for name, text in files.items():
        out[name] = tmp_path / f"cpuinfo-{name}"
        out[name].write_text("processor\t: 0\n" + text)
    out["missing"] = tmp_path / "no-such-cpuinfo"
    return out


def _table(fingerprint: str, verdict: str, name: str = "bfloat16",
           **others: str) -> QualityTable:
    entries = [QualityEntry(n, {"passkey": RetrievalScore(8, 8, 8, 8)}, 20, 0.95, 0.995, 1e-4,
                            0.0, {"verdict": v, "summary": v, "metrics": {}}, {"dtype": n})
               for n, v in {name: verdict, **others}.items()]
    return QualityTable(fingerprint, "tiny", 1.0, [], [], {}, sections={"dtypes": entries})


def test_auto_needs_bf16_hardware_and_a_passing_table(cpuinfo):
    assert cpu_bf16_flags(cpuinfo["avx512"]) == ["avx512_bf16"]
    assert cpu_bf16_flags(cpuinfo["amx"]) == ["amx_bf16"]
    assert cpu_bf16_flags(cpuinfo["arm"]) == [] == cpu_bf16_flags(cpuinfo["none"])
    assert cpu_bf16_flags(cpuinfo["missing"]) == []
    for hw in ("avx512", "amx"):
        assert auto_compute(CPU, {"bfloat16": True}, cpuinfo[hw])[0].dtype == torch.bfloat16
        config, why = auto_compute(CPU, {"bfloat16": False}, cpuinfo[hw])  # the table fails it
        assert config.name == "float32" and "bfloat16 does not pass" in why
        config, why = auto_compute(CPU, {}, cpuinfo[hw])                    # no verdict
        assert config.name == "float32" and "bfloat16 has no verdict" in why
    config, why = auto_compute(CPU, {"bfloat16": True}, cpuinfo["none"])  # no hardware
    assert config.name == "float32" and "without bfloat16 hardware" in why
    # forcing: an explicit dtype is taken as given, whatever the table says
    assert resolve_dtype("float32", CPU) == torch.float32
    assert resolve_dtype("auto", CPU) == torch.float32                      # no verdict: fp32
    assert resolve_dtype("mixed", CPU) == torch.float32      # a configuration's activations
    with pytest.raises(DeviceUnavailable):
        resolve_dtype("float16", CPU)
    with pytest.raises(DeviceUnavailable, match="unknown compute configuration"):
        resolve_dtype("int3", CPU)


VERDICTS = (True, False, None)


def test_auto_never_picks_a_configuration_that_does_not_pass(cpuinfo):
    """Every combination of pass / fail-or-undecided / no verdict over the candidates, on every
    kind of CPU: auto takes float32 or a configuration whose verdict passes, and on a CPU with
    bf16 hardware the first passing one of its order."""
    import itertools

    from sparkv.runtime.compute import CPU_BF16_ORDER

    for combo in itertools.product(VERDICTS, repeat=len(CPU_BF16_ORDER)):
        verdicts = dict(zip(CPU_BF16_ORDER, combo))
        for hw in ("amx", "avx512", "none"):
            config, _ = auto_compute(CPU, verdicts, cpuinfo[hw])
            assert config.name == "float32" or verdicts[config.name] is True
            passing = [n for n in CPU_BF16_ORDER if verdicts[n]]
            want = passing[0] if passing and hw != "none" else "float32"
            assert config.name == want


def test_auto_with_a_table_that_fails_it_stays_float32(tmp_path, cpuinfo):
    from sparkv.predictor.dtypes import choose_dtype
    from sparkv.predictor.quality import table_cpu_dtype

    path = tmp_path / "table.json"
    _table("fp-tiny", "fail", "bfloat16", mixed="fail", **{"int4-kernel": "undecided"}).save(path)
    for hw in ("amx", "none"):
        choice = choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo[hw])
        assert choice.compute == "float32" and choice.dtype == torch.float32
        assert table_cpu_dtype("fp-tiny", path, cpuinfo[hw]) == "float32"
    _table("fp-tiny", "fail", "bfloat16", mixed="pass").save(path)
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["amx"]).compute == "mixed"
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["none"]).compute == "float32"
    # mixed-layers passes, but without the model's per-layer selection it cannot be built
    _table("fp-tiny", "fail", "bfloat16", **{"mixed-layers": "pass"}).save(path)
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["amx"]).compute == "float32"


def test_choose_dtype_reads_the_models_table(tmp_path, cpuinfo):
    from sparkv.predictor.dtypes import choose_dtype

    path = tmp_path / "table.json"
    _table("fp-tiny", "pass").save(path)
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["amx"]).dtype == torch.bfloat16
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["none"]).dtype == torch.float32
    assert choose_dtype("float32", CPU, "fp-tiny", path, cpuinfo["amx"]).dtype == torch.float32
    with pytest.warns(UserWarning, match="not other-model"):           # another model's table
        assert choose_dtype("auto", CPU, "other-model", path, cpuinfo["amx"]).dtype == \
            torch.float32
    _table("fp-tiny", "fail").save(path)
    choice = choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["amx"])
    assert choice.dtype == torch.float32 and "bfloat16 does not pass" in choice.reason
    # a GPU follows the same measured loss: a failed bf16 verdict means float32 there too
    choice = choose_dtype("auto", torch.device("cuda"), "fp-tiny", path, cpuinfo["amx"])
    assert choice.dtype == torch.float32 and "CUDA" in choice.reason


def test_load_model_in_dtype_casts_where_auto_says(tmp_path, tiny_llama, cpuinfo):
    from sparkv.predictor.dtypes import load_model_in_dtype

    ckpt = tmp_path / "ckpt"
    tiny_llama.model.save_pretrained(ckpt)
    lm = load_model_in_dtype(ckpt, "auto", "cpu", table_path=tmp_path / "none.json",
                             cpuinfo=cpuinfo["amx"])
    assert lm.dtype == torch.float32 and lm.extra["dtype_choice"].requested == "auto"
    table = _table(lm.fingerprint, "pass").save(tmp_path / "table.json")
    lm = load_model_in_dtype(ckpt, "auto", "cpu", table_path=table, cpuinfo=cpuinfo["amx"])
    assert lm.dtype == torch.bfloat16 and lm.extra["dtype_choice"].name == "bfloat16"
    assert load_model_in_dtype(ckpt, "auto", "cpu", table_path=table,
                               cpuinfo=cpuinfo["none"]).dtype == torch.float32
    assert load_model_in_dtype(ckpt, "float32", "cpu", table_path=table,
                               cpuinfo=cpuinfo["amx"]).dtype == torch.float32


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_split_attention_on_the_cpu_equals_the_masked_path(dtype, atol):
    from sparkv.runtime.attention import _sdpa_causal
    from sparkv.runtime.split import lse_kernel

    assert lse_kernel(CPU, dtype) is not None                # the CPU's flash kernel passes
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 40, 16, generator=gen)
    k, v = (torch.randn(1, 2, 130, 16, generator=gen) for _ in range(2))   # arena > o + n
    ref = _sdpa_causal(q, k, v, 70, 0.25, split=False)                      # fp32, masked
    got = _sdpa_causal(q.to(dtype), k.to(dtype), v.to(dtype), 70, 0.25, split=True)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), ref, atol=atol, rtol=atol)


def _bf16(lm):
    from sparkv.runtime import LoadedModel

    return LoadedModel.from_model(copy.deepcopy(lm.model).to(torch.bfloat16), lm.tokenizer,
                                  lm.name)


def test_bf16_steps_equal_bf16_full_prefill_and_greedy_tokens_match(smollm2):
    from sparkv.runtime import LayerStepper, greedy_generate, sample_context_ids
    from sparkv.runtime.hfcache import output_cache
    from sparkv.runtime.kvcache import from_dynamic_cache

    lm = _bf16(smollm2)
    ids = sample_context_ids(lm, 320)
    stepper = LayerStepper(lm, ids, chunk_tokens=128)        # 3 chunks: the split path runs
    stepper.complete()
    steps = stepper.kv.layer_kv()
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    full = from_dynamic_cache(output_cache(out))
    for (ks, vs), (kf, vf) in zip(steps, full):
        assert ks.dtype == torch.bfloat16
        for a, b in ((ks, kf), (vs, vf)):    # bf16: a few units in the last place of |x|
            tol = 0.05 * float(b.float().abs().max()) + 0.05
            assert float((a.float() - b.float()).abs().max()) <= tol
    question = lm.encode_text("\n\nQuestion: what is this text about?\nAnswer:")
    a = greedy_generate(lm, steps, len(ids), question, 8, stop_at_eos=False)
    b = greedy_generate(lm, full, len(ids), question, 8, stop_at_eos=False)
    assert a.tokens == b.tokens


def _stream_chunk(k, v, t, l, start, num_layers, level, into):  # noqa: E741
    """One chunk through the codec (the server's dtype) into the edge's memory ``into``."""
    from sparkv.codec import decode, encode
    from sparkv.codec.chunk import KVChunk
    from sparkv.layout import KVChunkId

    frame = encode(KVChunk(KVChunkId(t, l, 0), start, k, v, num_layers), level)
    chunk = decode(frame)
    assert chunk.k.dtype == k.dtype                          # the frame carries the server's
    into.put(chunk.id, chunk.k, chunk.v, source="streamed")
    return chunk


@pytest.mark.parametrize("server,edge", [(torch.bfloat16, torch.float32),
                                         (torch.float32, torch.bfloat16)])
def test_a_dtype_mismatch_stream_decodes_right(tiny_llama, server, edge):
    """Server prefill in one dtype, edge steps in the other: the raw level arrives exact in the
    server's dtype and is cast once, at the edge's KV memory; the edge's steps after it give
    its own full prefill's answer within bf16 tolerance."""
    from sparkv.cache import ContextKV
    from sparkv.layout import StepId
    from sparkv.runtime import LayerStepper, LoadedModel

    def as_dtype(dtype):
        return LoadedModel.from_model(copy.deepcopy(tiny_llama.model).to(dtype), None, "tiny")

    srv, edg = as_dtype(server), as_dtype(edge)
    ids = [int(x) for x in torch.randint(1, 128, (96,), generator=torch.Generator().manual_seed(5))]
    src = LayerStepper(srv, ids, chunk_tokens=32)
    src.complete()
    g = src.geometry
    kv = ContextKV(g, edge, CPU)
    for l in range(g.num_layers):                            # token chunk 0 of every layer
        k, v = src.kv.layer_kv()[l]
        a, b = g.token_range(0)
        level = "raw" if l % 2 == 0 else "q8"
        chunk = _stream_chunk(k[0, :, a:b].contiguous(), v[0, :, a:b].contiguous(), 0, l, a,
                              g.num_layers, level, kv)
        if level == "raw":                                   # exact, then one cast
            assert torch.equal(kv.layers[l].k[0, :, a:b], chunk.k.to(edge))
    stepper = LayerStepper(edg, ids, chunk_tokens=32, kv=kv)
    assert StepId(0, 0) not in stepper.steps_needed()        # the streamed chunk is used
    stepper.complete()
    ref = LayerStepper(edg, ids, chunk_tokens=32)
    ref.complete()
    for (k1, v1), (k2, v2) in zip(stepper.kv.layer_kv(), ref.kv.layer_kv()):
        assert k1.dtype == edge
        for x, y in ((k1, k2), (v1, v2)):
            assert float((x.float() - y.float()).abs().max()) <= 0.05 * float(
                y.float().abs().max()) + 0.05


def _dtype_rows(config: str, teacher_forced: float, n: int = 25) -> list[dict]:
    """``n`` QA answers of ``local/dense@config`` (the dtype group) paired with dense's, in the
    bench's row format (what ``sparkv bench quality --rows`` writes)."""
    rows = []
    for i in range(n):
        for name, group, tf, dtype in (("dense", "dense", 1.0, None),
                                       (f"local/dense@{config}", "dtype", teacher_forced, config)):
            rows.append({"family": "qa", "size": None, "tokens": 2000, "probe": f"qa/{i}",
                         "config": name, "group": group, "strategy": None, "level": None,
                         "backend": None, "link": None, "dtype": dtype, "error": None,
                         "correct": False, "score": 0.0, "greedy_agreement": tf,
                         "teacher_forced": tf, "first_token_kl": (1.0 - tf) / 4, "mb": 0.0,
                         "ttft_s": None, "fallback": {}})
    return rows


@pytest.mark.parametrize("mixed_tf, want_bf16_cpu", [(1.0, "mixed"), (0.95, "float32")])
def test_configuration_rows_decide_auto_through_the_tables_rule(tmp_path, cpuinfo, mixed_tf,
                                                                 want_bf16_cpu):
    """A configuration's answers become a ``dtypes`` entry by the rule and the table code every
    group uses (``quality_table``, what ``--save-table`` writes); ``auto`` reads that entry.
    bfloat16 and int4-kernel fail (a teacher-forced drop of 0.05), so ``auto`` takes ``mixed``
    on a bf16 CPU only when its own rows pass, float32 when they fail, and float32 on a CPU
    without bf16 hardware either way."""
    from types import SimpleNamespace

    from sparkv.bench.quality import Config, quality_table
    from sparkv.predictor.dtypes import choose_dtype

    answers = (_dtype_rows("bfloat16", 0.95) + _dtype_rows("int4-kernel", 0.95)
               + _dtype_rows("mixed", mixed_tf))
    rows = list({(r["probe"], r["config"]): r for r in answers}.values())   # dense's once
    configs = [Config("dense", "dense")] + [Config(f"local/dense@{n}", "dtype")
                                            for n in ("bfloat16", "int4-kernel", "mixed")]
    lm = SimpleNamespace(fingerprint="fp-tiny", name="tiny",
                         config=SimpleNamespace(num_hidden_layers=2))
    path = tmp_path / "table.json"
    table = quality_table(rows, configs, lm, {"benchmark": "test"})
    table.save(path)
    verdicts = {e.name: e.verdict_name for e in table.section("dtypes")}
    assert verdicts == {"bfloat16": "fail", "int4-kernel": "fail",
                        "mixed": "pass" if mixed_tf == 1.0 else "fail"}
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["amx"]).compute == want_bf16_cpu
    assert choose_dtype("auto", CPU, "fp-tiny", path, cpuinfo["none"]).compute == "float32"
