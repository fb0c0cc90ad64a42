"""One call under the profiler (:mod:`sparkv.bench.profiling`), and ``bench prefill --profile``
through it, on the CPU (the operators by self CPU time)."""

from __future__ import annotations

import json

import torch

from helpers import shared_tiny_checkpoint
from sparkv.bench.profiling import kernel_table, profile_kernels


def test_the_heaviest_operators_come_first_with_their_calls():
    a = torch.randn(256, 256)

    def work() -> None:
        for _ in range(3):
            a @ a
        a.add(1.0)

    prof = profile_kernels(work, torch.device("cpu"), top=5)
    names = [t["kernel"] for t in prof["top_kernels"]]
    assert prof["wall_s"] > 0 and prof["kernel_busy_s"] > 0 and prof["kernel_launches"] >= 4
    assert any("mm" in n for n in names)
    ms = [t["ms"] for t in prof["top_kernels"]]
    assert ms == sorted(ms, reverse=True) and len(ms) <= 5
    mm = next(t for t in prof["top_kernels"] if "mm" in t["kernel"])
    assert mm["calls"] >= 3
    assert kernel_table(prof, width=8)[0][0] == names[0][:8]


def test_bench_prefill_profiles_a_variant(tmp_path, capsys):
    from sparkv.cli import main

    out = tmp_path / "p.json"
    rc = main(["bench", "prefill", "--model", str(shared_tiny_checkpoint()), "--sizes", "96",
               "--chunk-tokens", "32", "--repeats", "1", "--max-new-tokens", "1",
               "--variants", "full,dense", "--profile", "dense", "--out", str(out)])
    assert rc == 0
    assert "profile of dense at 96 tokens" in capsys.readouterr().out
    prof = json.loads(out.read_text())["profile"]
    assert prof["variant"] == "dense" and prof["tokens"] == 96 and prof["top_kernels"]


def test_the_mask_prediction_profiles_eager_and_as_the_pipeline(capsys):
    """``bench attention --profile-predict``'s profiles (the bench itself needs CUDA; the
    profiles run wherever the prediction does)."""
    from sparkv.bench.attention import predict_profiles

    out = predict_profiles(torch.device("cpu"), (4, 2, 16), 512)
    assert out["heads"] == "4/2/16" and out["keys"] == 512
    for name in ("eager", "pipeline"):
        assert out[name]["kernel_launches"] > 0 and out[name]["top_kernels"]
    printed = capsys.readouterr().out
    assert "mask prediction (eager) at 512 keys" in printed and "(pipeline)" in printed
