"""The device service's density hook (sparkv/device/density.py) records the same column sums
whichever way it computes them: a fork's passes adding the column sums of the weights its
attention made (``TAKE_WEIGHTS``), a decoded token's rows kept for one product per layer at the
end of the pass (or when a layer's rows fill up), the queries the fast attention forward offers
or projected again, over a fork's prefix and tail as two views or over one cache's keys. The
reference is the hook computing every pass at once (``DEFER_ROWS = 0``, no weights taken),
itself checked against
``output_attentions`` in tests/test_bench_quality_variants.py. A tiny random Llama with GQA,
fp32; no timing."""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import SparkvCache
from sparkv.cache.fork import ForkCache
from sparkv.device import density
from sparkv.device.density import DensityRecorder, install_hooks, recording
from sparkv.runtime.generate import context_memory, generate_over, reference_prefill
from sparkv.runtime.hooks import QUERY_SINK

N = 40


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _record(lm, *, fork: bool, defer: int = DensityRecorder.DEFER_ROWS,
            flush: int = DensityRecorder.FLUSH_BYTES, question: int = 5,
            tokens: int = 9, take: bool = False) -> DensityRecorder:
    """A question and its answer over a fresh memory of ``N`` tokens, recorded."""
    install_hooks(lm.model)
    mem = context_memory(lm, reference_prefill(lm, _ids(N, 1)), N)
    rec = DensityRecorder(N + question + tokens + 1)
    cache = ForkCache(mem) if fork else SparkvCache(mem)
    old = DensityRecorder.DEFER_ROWS, DensityRecorder.FLUSH_BYTES, DensityRecorder.TAKE_WEIGHTS
    DensityRecorder.DEFER_ROWS, DensityRecorder.FLUSH_BYTES = defer, flush
    DensityRecorder.TAKE_WEIGHTS = take
    try:
        with recording(rec):
            generate_over(lm, cache, N, _ids(question, 2), tokens, stop_at_eos=False)
    finally:
        (DensityRecorder.DEFER_ROWS, DensityRecorder.FLUSH_BYTES,
         DensityRecorder.TAKE_WEIGHTS) = old
    return rec


@pytest.mark.parametrize("fork", [True, False])
def test_kept_rows_sum_to_what_each_pass_adds_at_once(tiny_llama, fork):
    want = _record(tiny_llama, fork=fork, defer=0)
    row = 4 * 16 * 4                                     # a row's queries: 4 heads of 16, fp32
    for flush in (DensityRecorder.FLUSH_BYTES, 3 * row):  # a layer's rows summed mid-answer
        got = _record(tiny_llama, fork=fork, flush=flush)
        assert got.calls < want.calls                    # fewer products: it did wait
        torch.testing.assert_close(got.mass, want.mass, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.rows, want.rows)
    # every row seen: the question's 5 and 8 decoded tokens' (the last one never runs), per layer
    layers = tiny_llama.config.num_hidden_layers
    assert float(want.rows[0]) == (5 + 8) * layers
    assert float(want.rows[N + 5 + 7]) == 1 * layers    # the last token run sees itself only


@pytest.mark.parametrize("defer", [0, DensityRecorder.DEFER_ROWS])
def test_a_forks_taken_weights_sum_to_what_the_hook_computes(tiny_llama, defer, monkeypatch):
    """A fork's attention hands its weights over: every pass's column sums are taken from
    them (no product of the hook's own), the same sums and the same row counts."""
    want = _record(tiny_llama, fork=True, defer=0)
    taken, plain = [], DensityRecorder.take
    monkeypatch.setattr(DensityRecorder, "take", lambda self, *a: taken.append(a)
                        or plain(self, *a))
    folds, fold = [], density._Columns._fold
    monkeypatch.setattr(density._Columns, "_fold", lambda self: folds.append(len(self.kept))
                        or fold(self))
    layers = tiny_llama.config.num_hidden_layers
    for flush in (DensityRecorder.FLUSH_BYTES, 200):    # kept to the end, or summed mid-answer
        taken.clear(), folds.clear()
        got = _record(tiny_llama, fork=True, defer=defer, take=True, flush=flush)
        assert [(t[1], t[3]) for t in taken] == [(4, 5)] * layers + [(4, 1)] * 8 * layers
        assert (folds == [len(taken)]) == (flush > 200)  # one sum, or several on the way
        assert not got._waiting and got.calls == 1      # one sum at the end, no product
        torch.testing.assert_close(got.mass, want.mass, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.rows, want.rows)
    assert torch.equal(_record(tiny_llama, fork=False, take=True).rows,   # no weights offered:
                       _record(tiny_llama, fork=False, defer=0).rows)     # it sums them itself


def test_offered_queries_are_the_ones_projected_again(tiny_llama, monkeypatch):
    install_hooks(tiny_llama.model)
    attention = [m for n, m in tiny_llama.model.named_modules() if n.endswith("self_attn")]
    assert all(getattr(m, QUERY_SINK) is density._offered for m in attention)
    seen = []

    def counted(module, q):
        seen.append(q.shape)
        density._offered(module, q)

    for m in attention:
        monkeypatch.setattr(m, QUERY_SINK, counted)
    offered = _record(tiny_llama, fork=True, defer=0)
    # the context's prefill (not recorded), then the question's pass and 8 tokens' per layer
    assert [q[2] for q in seen] == [N] * 3 + [5] * 3 + [1] * 24
    for m in attention:
        monkeypatch.setattr(m, QUERY_SINK, None)
    projected = _record(tiny_llama, fork=True, defer=0)
    torch.testing.assert_close(offered.mass, projected.mass, atol=1e-5, rtol=1e-5)
    assert torch.equal(offered.rows, projected.rows)


@pytest.mark.parametrize("take", [False, True])
def test_a_failed_pass_adds_none_of_its_waiting_rows(tiny_llama, take, monkeypatch):
    install_hooks(tiny_llama.model)
    monkeypatch.setattr(DensityRecorder, "TAKE_WEIGHTS", take)
    mem = context_memory(tiny_llama, reference_prefill(tiny_llama, _ids(N, 1)), N)
    rec = DensityRecorder(N + 8)
    with pytest.raises(RuntimeError, match="stop"):
        with recording(rec):
            generate_over(tiny_llama, ForkCache(mem), N, _ids(1, 3), 1, stop_at_eos=False)
            assert rec._columns.spans if take else rec._waiting   # the 1-row pass waits
            raise RuntimeError("stop")
    assert not rec._waiting and not rec._columns.spans and float(rec.mass.sum()) == 0.0


def test_a_forks_key_count_is_what_its_key_parts_make(tiny_llama):
    """The hook counts a fork's keys for a decoded token without making their views."""
    mem = context_memory(tiny_llama, reference_prefill(tiny_llama, _ids(N, 1)), N)
    fork = ForkCache(mem)
    assert all(layer.key_count() is None and layer.key_parts() is None
               for layer in fork.layers)                 # nothing of its own yet
    generate_over(tiny_llama, fork, N, _ids(3, 2), 4, stop_at_eos=False)
    for layer in fork.layers:
        parts = layer.key_parts()
        assert parts is not None
        assert layer.key_count() == sum(int(p.shape[1]) for p in parts) == N + 3 + 3
    grown = SparkvCache(context_memory(tiny_llama, reference_prefill(tiny_llama, _ids(N, 1)), N))
    generate_over(tiny_llama, grown, N, _ids(3, 2), 4, stop_at_eos=False)
    for cache in (fork, grown):                          # what the hook counts: the same
        for i in range(len(cache.layers)):
            parts = density._key_parts(cache, i)
            assert parts and density._key_count(cache, i) == sum(int(p.shape[1]) for p in parts)


def test_kept_rows_join_their_positions_into_spans_and_are_scaled_once():
    rows = density._Rows(cache=None, scale=0.25)
    qs = [torch.randn(1, 4, n, 8, generator=torch.Generator().manual_seed(n))
          for n in (5, 1, 1, 2)]
    for q, first in zip(qs, (10, 15, 16, 30)):          # a question, two tokens, then a gap
        rows.keep(q, first)
    assert rows.spans == [(10, 7), (30, 2)]
    assert rows.nbytes == 9 * 4 * 8 * 4
    assert torch.equal(rows.queries(), torch.cat(qs, dim=2)[0] * 0.25)
    assert all(a is b for a, b in zip(rows.q, qs))       # kept as offered: no copy per token
