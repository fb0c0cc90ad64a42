"""Profiler on a tiny random Llama: real steps, sane samples; load generator; utilisation."""

from __future__ import annotations

import time

import pytest
import torch

from sparkv.predictor import (CpuUtilisation, LoadGenerator, ProfileConfig, Profiler,
                              device_fingerprint, load_samples, save_samples)
from sparkv.predictor.device import fingerprint_differences
from sparkv.runtime.attention import causal_block_count


@pytest.fixture(scope="module")
def tiny2():
    """The brief's 2-layer random Llama (GQA 4/2 heads)."""
    from helpers import tiny_llama_model

    return tiny_llama_model(2, "tiny2")


CONFIG = ProfileConfig(context_tokens=640, chunk_sizes=(128, 256), cdf_thresholds=(0.5, 0.9),
                       loads=(0.0, 0.5), layers=2, projection_repeats=2, threads=1,
                       ramp_seconds=0.05, max_load_seconds=60)


@pytest.fixture(scope="module")
def profiled(tiny2):
    profiler = Profiler(tiny2, CONFIG, progress=False)
    samples = profiler.run()
    return profiler, samples


def test_profiler_runs_every_planned_step(tiny2, profiled):
    profiler, samples = profiled
    assert len(samples) == CONFIG.planned_steps(num_layers=2)
    # 640 tokens: T=128 -> 5 chunks, T=256 -> 3 chunks (ragged last of 128); 2 layers each;
    # 3 backends (dense + 2 cdf thresholds); 2 loads
    assert len(samples) == 2 * 3 * (5 + 3) * 2
    assert {s.backend for s in samples} == {"dense", "block_sparse"}
    assert {s.cdf_threshold for s in samples} == {None, 0.5, 0.9}
    assert {s.load for s in samples} == {0.0, 0.5}
    assert {s.chunk_tokens for s in samples} == {128, 256}
    meta = profiler.metadata()
    assert meta["num_layers"] == 2 and meta["arch"]["kv_heads"] == 2
    assert meta["fingerprint"]["threads"] == 1
    assert meta["model_fingerprint"] == tiny2.fingerprint


def test_samples_are_sane(profiled):
    _, samples = profiled
    for s in samples:
        assert s.ms > 0 and 0.0 <= s.utilisation <= 1.0
        assert s.threads == 1 and s.utilisation_source == "cpu-psutil"
        assert s.key_tokens == s.prefix_tokens + s.query_tokens
        assert s.prefix_tokens == s.t * s.chunk_tokens
        assert s.query_tokens == min(s.chunk_tokens, 640 - s.prefix_tokens)
        if s.layer == 1:  # the last layer of a 2-layer model: projection-only, no attention
            assert s.kind == "projection" and s.active_blocks == 0
            continue
        assert s.kind == "attention"
        assert s.causal_blocks == causal_block_count(s.query_tokens, s.key_tokens,
                                                     s.prefix_tokens)
        if s.backend == "dense":
            assert s.active_blocks == s.causal_blocks and s.density == 1.0
        else:
            assert 0 < s.active_blocks <= s.causal_blocks
            assert s.density == pytest.approx(s.active_blocks / s.causal_blocks)
    # later chunks attend over more keys
    dense = [s for s in samples if s.backend == "dense" and s.chunk_tokens == 128 and s.layer == 0]
    assert max(s.causal_blocks for s in dense) > min(s.causal_blocks for s in dense)


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_samples_roundtrip(profiled, tmp_path, suffix):
    profiler, samples = profiled
    path = save_samples(tmp_path / f"s{suffix}", samples, profiler.metadata())
    back, meta = load_samples(path)
    assert back == samples
    assert meta["model_fingerprint"] == profiler.metadata()["model_fingerprint"]


def test_load_generator_is_bounded_and_stopped():
    gen = LoadGenerator(1.5, max_seconds=30)
    assert gen.processes == 2
    with gen:
        assert gen.running
    assert not gen.running
    # the children stop on their own at max_seconds even if nobody stops them
    gen = LoadGenerator(0.5, max_seconds=0.5).start()
    deadline = time.time() + 10
    while gen.running and time.time() < deadline:
        time.sleep(0.1)
    assert not gen.running
    gen.stop()
    assert LoadGenerator(0).start().processes == 0
    with pytest.raises(ValueError):
        LoadGenerator(-1)


def test_cpu_utilisation_in_range():
    mon = CpuUtilisation()
    assert 0.0 <= mon.probe(0.05) <= 1.0
    assert 0.0 <= mon.sample() <= 1.0


def test_utilisation_window_keeps_one_mark_before_the_window():
    from sparkv.predictor.device import UtilisationWindow

    now = [0.0]
    window = UtilisationWindow(CpuUtilisation(), window_s=0.05, clock=lambda: now[0])
    assert 0.0 <= window.read() <= 1.0  # nothing ticked yet: a probe
    for _ in range(5):
        window.tick()
        now[0] += 0.03
    # ticks at 0.00 .. 0.12; at 0.12 the window (0.07, 0.12] holds 0.09 and 0.12, plus the one
    # mark at or before its start (0.06)
    assert [round(t, 2) for t, _ in window._marks] == [0.06, 0.09, 0.12]
    assert 0.0 <= window.read() <= 1.0
    window.reset()
    assert not window._marks


def test_fingerprint():
    fp = device_fingerprint("cpu", threads=1)
    assert set(fp) == {"cpu", "cores", "torch", "threads", "cuda", "dtype"}
    assert fp["threads"] == 1 and fp["cuda"] is None and fp["torch"] == torch.__version__
    other = dict(fp, threads=2)
    assert fingerprint_differences(fp, fp) == []
    assert fingerprint_differences(fp, other) == ["threads: 1 != 2"]
    # a profile is kept per compute dtype (docs/dtypes.md)
    assert fp["dtype"] == "float32"
    assert fingerprint_differences(fp, dict(fp, dtype="bfloat16")) == [
        "dtype: 'float32' != 'bfloat16'"]


def test_profile_cli_and_bench_on_a_saved_tiny_model(tiny2, tmp_path, capsys):
    """`sparkv profile --train` on a checkpoint directory, then `sparkv bench predictor
    --samples` on its samples: files written, the model loads back on this device."""
    import json
    import warnings

    from sparkv.cli import main
    from sparkv.predictor import DeviceMismatchWarning, LatencyModel, load_predictor

    ckpt = tmp_path / "tiny"
    tiny2.model.save_pretrained(ckpt)
    samples_path, model_path = tmp_path / "s.csv", tmp_path / "m.json"
    rc = main(["profile", "--model", str(ckpt), "--out", str(samples_path), "--tokens", "512",
               "--chunk-sizes", "128,256", "--cdf", "0.9", "--loads", "0", "--layers", "2",
               "--train", str(model_path), "--no-progress"])
    assert rc == 0
    samples, meta = load_samples(samples_path)
    assert len(samples) == 2 * (4 + 2) * 2 and meta["config"]["threads"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeviceMismatchWarning)
        assert isinstance(load_predictor(model_path, threads=1), LatencyModel)
    out = tmp_path / "bench" / "predictor.json"
    assert main(["bench", "predictor", "--samples", str(samples_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    res = doc["results"][0]
    assert doc["benchmark"] == "predictor" and res["samples"] == len(samples)
    assert res["mlp_mape"] > 0 and res["roofline_mape"] > 0 and res["mlp_one_chunk_ms"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert "targets:" in capsys.readouterr().out
