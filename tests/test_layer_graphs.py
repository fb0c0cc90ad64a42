"""Piecewise CUDA graphs of layer steps (sparkv/runtime/graphs.py, issue 46).

On the CPU the graphs are emulated (a replay re-runs the captured function over the same static
buffers): every buffer, copy, capture rule and fallback of the path runs, and its outputs must be
the eager stepper's bit for bit. On CUDA the real graphs must give the eager stepper's K/V and
outputs within float32 tolerance; without CUDA those tests skip.
"""

from __future__ import annotations

import pytest
import torch

from sparkv.layout import StepId
from sparkv.runtime import LayerStepper
from sparkv.runtime.device import cuda_graphs
from sparkv.runtime.graphs import CAPTURE_AFTER, LayerGraphs

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def _run(lm, ids, chunk, graphs, order=None):
    stepper = LayerStepper(lm, ids, chunk, graphs=graphs)
    if order is None:
        stepper.complete()
    else:
        stepper.run(order)
    return stepper


def _assert_same_kv(a: LayerStepper, b: LayerStepper, atol: float = 0.0) -> None:
    for (ka, va), (kb, vb) in zip(a.kv.layer_kv(), b.kv.layer_kv()):
        if atol:
            torch.testing.assert_close(ka, kb, atol=atol, rtol=atol)
            torch.testing.assert_close(va, vb, atol=atol, rtol=atol)
        else:
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_emulated_graphs_give_the_eager_steps_kv_bit_for_bit(tiny_llama):
    ids = _ids(160, 128)
    eager = _run(tiny_llama, ids, 32, graphs=False)
    graphs = LayerGraphs(tiny_llama, emulate=True)
    graphed = _run(tiny_llama, ids, 32, graphs=graphs)
    _assert_same_kv(eager, graphed)
    # 5 token chunks x 2 layers below the last: the first sighting of each layer's shape runs
    # eagerly, the rest replay; the last layer (projection only) never does
    assert graphs.captures == 2 * 2 and graphs.failure is None
    assert graphs.replays == 2 * (5 - (CAPTURE_AFTER - 1))


def test_graphs_are_shared_by_a_models_steppers_and_serve_any_step_order(tiny_llama):
    """One set of graphs and buffers serves every stepper of the model; a layer-major order
    (steps of other layers in between) and a second context give the eager K/V."""
    graphs = LayerGraphs(tiny_llama, emulate=True)
    layer_major = [StepId(t, l) for l in range(3) for t in range(4)]
    for seed in (1, 2):
        ids = _ids(128, 128, seed)
        _assert_same_kv(_run(tiny_llama, ids, 32, False, layer_major),
                        _run(tiny_llama, ids, 32, graphs, layer_major))
    assert graphs.captures == 4 and len(graphs._buffers) == 1
    assert graphs.replays == 2 * 4 + 2 * 4 - 2


def test_a_one_off_shape_and_a_hooked_layer_run_eagerly(tiny_llama):
    """The last, shorter chunk's shape is seen once (eager); a layer with a forward hook (a
    press, LLMS's statistics) must run its modules, so it is never graphed."""
    graphs = LayerGraphs(tiny_llama, emulate=True)
    calls = []
    handle = tiny_llama.decoder.layers[1].mlp.register_forward_hook(
        lambda m, i, o: calls.append(o.shape[1]))
    try:
        ids = _ids(100, 128, 3)     # chunks of 32, 32, 32, 4
        graphed = _run(tiny_llama, ids, 32, graphs)
        _assert_same_kv(_run(tiny_llama, ids, 32, False), graphed)
    finally:
        handle.remove()
    assert calls and len(calls) >= 4 * 2      # both runs' layer-1 steps ran the MLP module
    assert set(k[0] for k in graphs._graphs) == {0}
    assert set(k[1] for k in graphs._graphs) == {32}


def test_a_failed_capture_turns_the_graphs_off_and_the_steps_run_eagerly(tiny_llama,
                                                                         monkeypatch):
    graphs = LayerGraphs(tiny_llama, emulate=True)

    def broken(self, layer, b):
        raise RuntimeError("operation not permitted when stream is capturing")

    import sparkv.runtime.graphs as mod

    class Capturing(mod._Emulated):
        def __init__(self, fn, device, pool):
            fn()

    monkeypatch.setattr(mod, "_Emulated", Capturing)
    monkeypatch.setattr(LayerGraphs, "_pre", broken)
    ids = _ids(128, 128, 4)
    graphed = _run(tiny_llama, ids, 32, graphs)
    _assert_same_kv(_run(tiny_llama, ids, 32, False), graphed)
    assert graphs.failure and "capturing" in graphs.failure
    assert graphs.replays == 0 and not graphs._graphs


def test_cpu_steppers_have_no_graphs_by_default(tiny_llama, monkeypatch):
    monkeypatch.setenv("SPARKV_CUDA_GRAPHS", "1")
    assert not cuda_graphs(torch.device("cpu"))
    assert LayerStepper(tiny_llama, [1, 2, 3], 16).graphs is None


def test_emulated_graphs_on_smollm2_at_fp32(smollm2):
    """The real model's shape (GQA 9/3 heads, 30 layers): the same K/V bit for bit."""
    ids = _ids(96, 1000, 5)
    graphs = LayerGraphs(smollm2, emulate=True)
    _assert_same_kv(_run(smollm2, ids, 32, False), _run(smollm2, ids, 32, graphs))
    assert graphs.replays == 29 * 2


@needs_cuda
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_graphs_give_the_eager_steps_kv(dtype, atol):
    from sparkv.runtime import load_model

    lm = load_model("random:smollm2-135m", device="cuda", dtype=dtype, progress=False)
    ids = _ids(1024 * 4 + 100, 1000, 6)
    graphs = LayerGraphs(lm)
    graphed = _run(lm, ids, 1024, graphs)
    assert graphs.failure is None, graphs.failure
    assert graphs.replays == 29 * (4 - (CAPTURE_AFTER - 1))
    _assert_same_kv(_run(lm, ids, 1024, False), graphed, atol=atol)
    assert cuda_graphs(lm.device)
    assert LayerStepper(lm, ids[:10], 16).graphs is not None


def test_real_capture_without_cuda_fails_cleanly_and_the_steps_run_eagerly(tiny_llama):
    """``graphs=True`` forces the model's own graphs; on a CPU their capture cannot work: it is
    recorded once, and the steps give the eager K/V."""
    from sparkv.runtime.graphs import graphs_of

    if CUDA:
        pytest.skip("a CUDA machine captures for real")
    ids = _ids(128, 128, 7)
    stepper = _run(tiny_llama, ids, 32, graphs=True)
    assert stepper.graphs is graphs_of(tiny_llama)
    assert stepper.graphs.failure and stepper.graphs.replays == 0
    _assert_same_kv(_run(tiny_llama, ids, 32, False), stepper)
    tiny_llama.extra.pop("graphs")
