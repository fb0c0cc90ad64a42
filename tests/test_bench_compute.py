"""``sparkv bench compute`` and ``sparkv bench layer-precision`` (docs/benchmarks.md) on the tiny
model: every configuration is timed in every round, float32 is the paired baseline, the
transformers-ops row and the profile are there when asked, and the layer selection is stored
where ``mixed-layers`` reads it. No timing is asserted."""

from __future__ import annotations

import json

from helpers import shared_tiny_checkpoint
from sparkv.cli import main


def test_configurations_are_timed_side_by_side(tmp_path, capsys):
    out = tmp_path / "compute.json"
    assert main(["bench", "compute", "--model", str(shared_tiny_checkpoint()), "--sizes", "96",
                 "--chunk-tokens", "32", "--repeats", "2", "--configs", "int4,bf16-weights",
                 "--compare-ops", "--profile", "--predict", "--threads", "1",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = {r["config"]: r for r in doc["results"]}
    assert list(rows) == ["float32", "int4", "bf16-weights", "float32/transformers-ops"]
    for r in rows.values():
        assert r["tokens"] == 96 and len(r["walls_s"]) == 2 == len(r["speedups_vs_float32"])
        assert len(r["load_avg"]) == 2 and r["wall_s"] > 0
        assert len(r["cpus_s"]) == 2 and r["cpu_s"] > 0          # the CPU time beside the wall
        assert r["cpu_speedups_vs_float32"] == [f / c for f, c in
                                                zip(rows["float32"]["cpus_s"], r["cpus_s"])]
        assert r["predicted_s"] > 0 and r["roofline_s"] > 0       # predicted beside measured
        assert r["predicted_error"] == r["predicted_s"] / r["wall_s"] - 1
    assert rows["float32"]["speedups_vs_float32"] == [1.0, 1.0]
    assert rows["float32"]["first_token_kl_vs_float32"] == 0.0
    assert set(doc["profile"]) == {"float32", "float32/transformers-ops"}
    assert doc["profile"]["float32"]["top"] and doc["config"]["repeats"] == 2
    printed = capsys.readouterr().out
    assert "x float32 (paired)" in printed and "x float32 CPU" in printed


def test_layer_precision_is_measured_and_saved(tmp_path, monkeypatch):
    from sparkv.runtime import load_model
    from sparkv.runtime.layerprec import load_precision

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "lp.json"
    assert main(["bench", "layer-precision", "--model", str(shared_tiny_checkpoint()),
                 "--tokens", "64", "--budget-kl", "1", "--save", "--threads", "1",
                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())["results"][0]
    lm = load_model(shared_tiny_checkpoint())
    stored = load_precision(lm.fingerprint)
    assert stored is not None and stored.bf16 == rec["bf16"]
    assert len(rec["layer_kl"]) == lm.config.num_hidden_layers
    assert rec["meta"]["text"] == "pydoc_data.topics"
