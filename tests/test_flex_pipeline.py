"""The block-sparse mask pipeline a GPU compiles (sparkv/runtime/flex.py, issue 46): the
prediction and the BlockMask's indices as one function whose every layer's thresholds are data,
so one graph serves every layer, length and offset; and the eager fallback when compiling
fails. Traced here with a counting backend (no kernels are generated on the CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparkv.runtime.attention import BlockSparseAttention, SparsityConfig
from sparkv.runtime.flex import flex_available, mask_indices, predicted_mask

pytestmark = pytest.mark.skipif(not flex_available(), reason="no flex_attention here")


def _preds() -> list[BlockSparseAttention]:
    """The base predictor and two layers' calibrated ones (per-head cdf, their own sim)."""
    base = SparsityConfig()
    return [BlockSparseAttention(base),
            BlockSparseAttention(replace(base, cdf_threshold=0.5, sim_threshold=0.3, topk=None)),
            BlockSparseAttention(replace(base, cdf_threshold=(0.9, 0.8, 0.7, 0.95),
                                         sim_threshold=0.1, topk=None))]


def _inputs(pred, nq, nk, gen):
    q = torch.randn(1, 4, nq, 64, generator=gen)
    k = torch.randn(1, 2, nk, 64, generator=gen)
    off = nk - nq
    _, _, _, visible, diagonal = pred._geometry(nq, nk, off, q.device)
    return (pred, q, k, off, None, visible, diagonal, pred.threshold_tensors(4, q.device))


def test_the_mask_pipeline_is_one_graph_for_every_layer_and_length():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(predicted_mask, backend=counter, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for pred in _preds():
        for nq, nk in ((384, 1024), (384, 1280), (640, 2048)):
            args = _inputs(pred, nq, nk, gen)
            got, want = compiled(*args), predicted_mask(*args)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
            keep = pred.predict_mask(*args[1:5]) & args[5]
            assert torch.equal(got[0], keep)          # the layer's own thresholds applied
    assert counter.frame_count == 1


def test_the_indices_split_kept_blocks_into_partial_and_full():
    pred = _preds()[0]
    _, _, _, visible, diagonal = pred._geometry(256, 1000, 744, torch.device("cpu"))
    keep = visible.expand(1, 4, *visible.shape).clone()
    num, idx, fnum, fidx = mask_indices(keep, diagonal, 1000)
    last = diagonal.clone()
    last[:, -1] = True                                 # 1000 keys: the last block is partial
    assert torch.equal(num, (keep & last).sum(-1).int())
    assert torch.equal(fnum, (keep & ~last).sum(-1).int())
    for h in range(4):
        for i in range(keep.shape[2]):
            assert idx[0, h, i, :num[0, h, i]].tolist() == \
                torch.nonzero(keep[0, h, i] & last[i]).view(-1).tolist()
            assert fidx[0, h, i, :fnum[0, h, i]].tolist() == \
                torch.nonzero(keep[0, h, i] & ~last[i]).view(-1).tolist()


def test_a_compiled_pipeline_that_fails_is_dropped_for_the_eager_one(monkeypatch):
    from sparkv.runtime import flex

    calls = []

    def broken(*args):
        calls.append(1)
        raise RuntimeError("inductor: cannot lower")

    monkeypatch.setattr(flex, "_pipeline", lambda device: broken)
    backend = flex.FlexAttention(sparse=True)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 256, 64, generator=gen)
    k = torch.randn(1, 2, 1024, 64, generator=gen)
    for _ in range(2):
        keep, indices = backend.predict(q, k, 768)
        assert torch.equal(keep, backend._predictor.predict_mask(q, k, 768) &
                           backend._predictor._geometry(256, 1024, 768, q.device)[3])
        assert len(indices) == 4
    assert len(calls) == 1 and "cannot lower" in backend.failure


def test_the_attention_bench_times_the_pipeline_flex_sparse_runs():
    from sparkv.runtime.autoattn import measure_point

    row = measure_point(torch.device("cpu"), (4, 2), 64, 1024, 256, (0.25,), repeats=1)
    assert row["pipeline_ms"] > 0 and row["pipeline_failure"] is None
    assert 0 < row["sparse"][0]["density"] < 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_the_compiled_pipeline_on_the_gpu_builds_the_cpus_mask():
    """The mask and its indices built on the GPU by the compiled pipeline equal the CPU's eager
    ones (fp32 inputs: the prediction's sums in one order on both)."""
    from sparkv.runtime.flex import FlexAttention

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(2)
    for pred in _preds():
        for nq, nk in ((384, 1024), (640, 4096)):
            args = _inputs(pred, nq, nk, gen)
            cpu = predicted_mask(*args)
            gpu_backend = FlexAttention(sparse=True, config=pred.config)
            keep, indices = gpu_backend.predict(args[1].to(dev), args[2].to(dev), args[3],
                                                predictor=pred)
            assert gpu_backend.failure is None, gpu_backend.failure
            mismatch = (keep.cpu() != cpu[0]).float().mean().item()
            assert mismatch <= 0.002, mismatch          # a near-tie may rank differently
            if mismatch == 0:
                assert all(torch.equal(a.cpu(), b) for a, b in zip(indices, cpu[1:]))
