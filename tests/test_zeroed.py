"""sparkv.cache.zeroed: zero-filled tensors that take memory only where written (the KV arena of
an ask holds the chunks it has, not its whole context)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from sparkv.cache import zeroed
from sparkv.cache.layer import LayerStore

STATUS = Path("/proc/self/status")
needs_proc = pytest.mark.skipif(not STATUS.exists(), reason="reads VmRSS from /proc")

MB = 2**20


def _rss() -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_zeros_reads_as_zeros_and_takes_writes():
    t = zeroed.zeros((1, 3, 4096, 64), torch.float32)
    assert t.shape == (1, 3, 4096, 64) and t.dtype == torch.float32
    assert not t.any()
    t[0, 1, 100:200] = 2.5
    assert float(t.sum()) == pytest.approx(2.5 * 100 * 64)
    assert not t[0, 0].any() and not t[0, 2].any()
    u = t.clone()
    t.zero_()
    assert float(u.sum()) == pytest.approx(2.5 * 100 * 64) and not t.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.float32])
def test_zeros_keeps_the_dtype(dtype):
    t = zeroed.zeros((2, 1024, 128), dtype)
    assert t.dtype == dtype and t.shape == (2, 1024, 128) and not t.any()


def test_small_tensors_are_plain_zeros():
    t = zeroed.zeros((4, 8), torch.float32)
    assert t.shape == (4, 8) and not t.any()
    assert t.untyped_storage().nbytes() == 4 * 8 * 4


@needs_proc
def test_memory_comes_on_write_and_goes_on_free():
    gc.collect()
    before = _rss()
    t = zeroed.zeros((64 * MB // 4,), torch.float32)
    assert _rss() - before < 16 * MB                      # made: not yet the process's memory
    assert not t[:: 1024].any()                           # reading maps the zero page only
    assert _rss() - before < 16 * MB
    t[: 32 * MB // 4] = 1.0                               # half written: about half taken
    grown = _rss() - before
    assert 28 * MB <= grown < 48 * MB
    del t
    gc.collect()
    assert _rss() - before < 16 * MB                      # freed at once (unmapped)


@needs_proc
def test_a_dense_layer_takes_memory_as_its_chunks_arrive():
    gc.collect()
    before = _rss()
    store = LayerStore(num_heads=4, head_dim=64, capacity=32768, dtype=torch.float32,
                       device="cpu", lazy=True)           # K and V: 64 MB together
    assert store.nbytes == 2 * 4 * 32768 * 64 * 4         # the account counts the capacity
    assert _rss() - before < 16 * MB
    k = torch.ones(4, 4096, 64)
    store.write_dense(0, 4, 0, k, -k)                     # one eighth of the slots
    grown = _rss() - before
    assert 6 * MB <= grown < 24 * MB
    assert float(store.k[0, :, :4096].sum()) == 4 * 4096 * 64
    assert not store.k[0, :, 4096:].any() and not store.v[0, :, 4096:].any()


def test_only_an_edge_ask_s_memory_is_lazy(tiny_llama):
    """Without ``lazy`` (a switch's working memory, filled at once by several threads) a layer
    is made by ``torch.zeros``; the edge's load memory (``LayerStepper(..., lazy=True)``) is
    lazy. (How much memory an eager layer adds is not asserted: a worker's heap may already
    hold freed pages that ``torch.zeros`` reuses.)"""
    from sparkv.runtime.stepper import LayerStepper

    store = LayerStore(num_heads=4, head_dim=64, capacity=32768, dtype=torch.float32,
                       device="cpu")
    assert not store.lazy and store.k is not None and not store.k.any()
    stepper = LayerStepper(tiny_llama, list(range(1, 200)), 64, lazy=True)
    assert all(layer.lazy for layer in stepper.kv.layers if layer is not None)
    assert not any(layer.lazy for layer in LayerStepper(tiny_llama, list(range(1, 200)), 64)
                   .kv.layers if layer is not None)
