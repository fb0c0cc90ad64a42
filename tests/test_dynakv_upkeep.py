"""The clusters' upkeep off the token's path (sparkv.decode.upkeep): no entry is ever left out of
both the clusters and the window, the lag is at most one step per layer, the worker's errors
surface in the decoding thread, and closing mid-upkeep leaves no thread and no file behind.

Synthetic layers (tests/test_dynakv.py's drifting keys) drive :class:`ClusteredKV` directly; the
upkeep is slowed down (a sleep in each job) so the decoding thread runs ahead of it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_dynakv import G, H, Synthetic

from sparkv.decode import ClusteredKV, UpkeepError, policy_config
from sparkv.decode.index import ClusterIndex
from sparkv.decode.policy import LayerState

BASE = {"budget": 24, "ram_budget": 60_000, "sinks": 2, "recent": 8, "avg_cluster": 8,
        "max_cluster": 24, "buffer_max": 6, "write_buffer": 8, "local_every": 8,
        "local_cluster": 4}


def _make(tmp_path, policy: str = "dynakv", steps: int = 40, **kw):
    syn = Synthetic()
    cfg = policy_config(policy, **{**BASE, **kw})
    kv = ClusteredKV(syn.entries, None, H * G, cfg, final_tokens=syn.n + 4 * steps,
                     max_positions=syn.n + 4 * steps + 16, flash_dir=tmp_path)
    return kv, syn


def _step(kv: ClusteredKV, syn: Synthetic, t: int, tokens: int = 1) -> list[torch.Tensor]:
    """One decoding step of ``tokens`` new entries per layer; the layers' outputs."""
    outs = []
    for l, layer in enumerate(kv.layers):  # noqa: E741
        ks, vs = zip(*(syn.new(l, t * 7 + i) for i in range(tokens)))
        pos = layer.update(torch.cat(ks, 1), torch.cat(vs, 1))
        q = torch.randn(1, H * G, tokens, syn.d, generator=syn.rng)
        outs.append(layer.attend(q, None, pos))
    kv.end_step(tokens)
    return outs


def _upkeep_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dynakv-upkeep")]


@pytest.fixture
def slow_upkeep(monkeypatch):
    """Each upkeep job sleeps first, so the decoding thread runs ahead of it."""
    end_step = LayerState._end_step

    def slow(self, *args):
        time.sleep(0.01)
        return end_step(self, *args)

    monkeypatch.setattr(LayerState, "_end_step", slow)


@pytest.mark.parametrize("policy", ["dynakv", "local"])
def test_every_entry_is_clustered_or_in_the_window_when_a_layer_selects(tmp_path, slow_upkeep,
                                                                        policy):
    """At every selection, each head's clusters, buffers and waiting entries hold every position
    outside the window, and the layer has no upkeep pending (the lag bound), including after a
    step of more new entries than the window holds."""
    kv, syn = _make(tmp_path, policy)
    seen = []
    select = LayerState._select

    def checked(self, q):
        assert not self.eng.upkeep.pending(self.l), "a layer selected with its upkeep pending"
        for idx in self.indexes:
            held = np.concatenate(list(idx.members().values()) + [idx.buffered_positions()])
            s_end, w0 = self.window.bounds()
            window = np.r_[0:s_end, w0:self.end]
            missing = np.setdiff1d(np.arange(self.end), np.union1d(held, window))
            assert not len(missing), f"layer {self.l} head {idx.head} misses {missing.tolist()}"
        seen.append(self.l)
        return select(self, q)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(LayerState, "_select", checked)
            for t in range(12):
                _step(kv, syn, t, tokens=12 if t in (3, 8) else 1)   # 12 > recent (8)
        assert len(seen) == 12 * len(kv.layers)
        assert kv.upkeep.jobs == 12 * len(kv.layers) and kv.upkeep.pending_peak >= 1
        kv.check()
    finally:
        kv.close()


def test_background_upkeep_equals_inline_when_the_cache_holds_everything(tmp_path, slow_upkeep):
    """With an unbounded cache, the clusters and every layer's output are the same whether the
    upkeep runs on its thread or inline."""
    results = []
    for background in (True, False):
        kv, syn = _make(tmp_path / str(background), ram_budget=None,
                        background_upkeep=background)
        try:
            outs = [o for t in range(20) for o in _step(kv, syn, t)]
            kv.check()
            members = [sorted(tuple(sorted(p.tolist())) for p in idx.members().values())
                       for layer in kv.layers for idx in layer.indexes]
            results.append((outs, members))
        finally:
            kv.close()
    (o1, m1), (o2, m2) = results
    assert m1 == m2
    assert all(torch.equal(a, b) for a, b in zip(o1, o2))


def test_an_upkeep_error_is_raised_by_the_next_step_and_every_later_one(tmp_path, monkeypatch):
    kv, syn = _make(tmp_path)
    observe, calls = ClusterIndex.observe, [0]

    def failing(self, *args):
        calls[0] += 1
        if calls[0] == 9:
            raise OSError("disk gone")
        return observe(self, *args)

    monkeypatch.setattr(ClusterIndex, "observe", failing)
    try:
        with pytest.raises(UpkeepError, match="disk gone") as err:
            for t in range(6):
                _step(kv, syn, t)
        assert isinstance(err.value.__cause__, OSError)
        assert calls[0] == 9                           # nothing ran past the failed job's step
        with pytest.raises(UpkeepError):
            _step(kv, syn, 7)
        with pytest.raises(UpkeepError):
            kv.check()
    finally:
        kv.close()
    assert not _upkeep_threads()
    assert not kv.dir.exists()


def test_closing_mid_upkeep_leaves_no_thread_and_no_file(tmp_path, monkeypatch):
    kv, syn = _make(tmp_path)
    gate, entered = threading.Event(), threading.Event()
    end_step = LayerState._end_step

    def held(self, *args):
        if self.l == len(kv.layers) - 1:
            entered.set()
            assert gate.wait(60), "never opened"
        return end_step(self, *args)

    monkeypatch.setattr(LayerState, "_end_step", held)
    _step(kv, syn, 0)                    # the last layer's job is running, held
    assert entered.wait(60)
    assert kv.upkeep.pending(len(kv.layers) - 1)
    assert _upkeep_threads()
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    kv.close()
    opener.join()
    assert not _upkeep_threads()
    assert not kv.dir.exists()

