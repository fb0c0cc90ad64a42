"""The device's KV memory off the CPU's host shortcuts (issue 46, Deliver 4): what a GPU runs.

On the CPU the memory's bulk operations take host shortcuts (flash records copied into the pages'
rows through numpy views, the numba dequantization into the working memory, the fused numba
resident attention, DynaKV's row arena). On a GPU none of them can run: the same operations go
through torch on the device. ``SPARKV_GENERIC_KV=1`` (:mod:`sparkv.cache.hostmem`) takes those
device-generic paths on the CPU, so that they are tested here on every run; the CUDA cases run
the LLMS service and DynaKV with the model on a GPU (``bench/gpu_check.sh``'s ``tests`` phase)
and skip without one.
"""

from __future__ import annotations

import pytest
import torch

from sparkv.cache import LEVELS
from sparkv.cache.hostmem import GENERIC_ENV, host_addressable
from sparkv.device import ContextService
from sparkv.runtime.generate import sample_context_ids
from helpers import flash_profile, same_payloads

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
FAST_FLASH = flash_profile(fast=True)


@pytest.fixture(scope="module")
def doc(smollm2):
    return sample_context_ids(smollm2, 300)


def _no_host_kernels(monkeypatch) -> None:
    """Forces the generic paths and makes every host shortcut fail if it is still taken."""
    from sparkv.device import dequant

    monkeypatch.setenv(GENERIC_ENV, "1")

    def refuse(*args, **kwargs):
        raise AssertionError("a host shortcut ran on the device-generic path")

    monkeypatch.setattr(dequant, "_rows_into", refuse)
    monkeypatch.setattr(dequant, "_records_into", refuse)


def _trace(lm, doc, tmp_path, name, swap=True):
    """A context at int2 to int8 (and its fp sink), swapped out and read back from flash before
    each of two turns (``swap``; else kept resident), each call filling its working memory from
    the pages (no working memory kept between calls): the answers, the chunks read back per
    call, the levels and the memory's device."""
    svc = ContextService(lm, 256 << 20, tmp_path / name, io_profile=FAST_FLASH, journal=False,
                         ratio=0.4, keep_working=False)
    svc.recompute.scale = 1e6        # read the chunks back from flash rather than recompute
    cid = svc.new_context(system_ids=doc)
    levels = set(svc.contexts[cid].levels)
    answers, loads = [], []
    for turn in (doc[-12:], doc[-30:-20]):        # token ids: a random model has no tokenizer
        before = _payloads(svc, cid)
        if swap:
            svc.swap_out(cid)
        r = svc.call(cid, prompt_ids=list(turn), max_new_tokens=8)
        after = _payloads(svc, cid)
        same_payloads(before, {c: after[c] for c in before})   # read back bit for bit
        answers.append(r.tokens)
        loads.append(r.load.read_chunks)
    C = svc.contexts[cid].memory
    device = C.device
    svc.close()
    return answers, loads, levels, device


def _payloads(svc, cid) -> dict:
    """The full token chunks' payloads (level; codes, scales and zeros, or values) on the host."""
    from sparkv.device.loader import token_chunk_ids

    C = svc.contexts[cid].memory
    g = C.geometry
    out = {}
    for t in range(g.num_tokens // g.chunk_tokens):
        for c in token_chunk_ids(g, t):
            p = C.state(c).payload
            if p is not None:
                sides = [x for y in (p.k, p.v) for x in ([y] if p.level == "fp" else
                                                         [y.codes, y.scale, y.zero])]
                out[c] = (p.level, [x.cpu() for x in sides])
    return out


def test_host_addressable_is_the_cpu_unless_forced(monkeypatch):
    assert host_addressable(torch.zeros(1)) and host_addressable("cpu")
    assert not host_addressable(torch.device("meta"))
    monkeypatch.setenv(GENERIC_ENV, "1")
    assert not host_addressable(torch.zeros(1))


def test_the_llms_service_answers_the_same_on_the_device_generic_paths(smollm2, doc, tmp_path,
                                                                       monkeypatch):
    """Compression to int8/int4/int2, swap-out, read-back from flash into the pages and the
    fill of the working memory, through torch only: the same answers as the host kernels'."""
    want, want_loads, levels, _ = _trace(smollm2, doc, tmp_path, "host")
    assert {"int4", "int2"} <= levels <= set(LEVELS)
    assert all(n > 0 for n in want_loads)
    _no_host_kernels(monkeypatch)
    got, loads, _, _ = _trace(smollm2, doc, tmp_path, "generic")
    assert got == want
    assert loads == want_loads


def test_the_resident_attention_of_a_quantized_memory_is_torchs_on_the_generic_path(monkeypatch):
    from sparkv.cache.qattend import TorchPagedAttention
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.kvcache import memory_from_layers

    geo = ChunkGeometry(64, 16, 1, 2, 32, 1)
    g = torch.Generator().manual_seed(0)
    mem = memory_from_layers([tuple(torch.randn(1, 2, 64, 32, generator=g) for _ in range(2))],
                             geo)
    for cid in geo.chunk_ids():
        mem.set_level(cid, "int8")
    assert not isinstance(mem.resident_attention(0), TorchPagedAttention)
    monkeypatch.setenv(GENERIC_ENV, "1")
    assert isinstance(mem.resident_attention(0), TorchPagedAttention)


@pytest.mark.parametrize("policy", ["dynakv", "dynakv-packed"])
def test_dynakv_decodes_exactly_on_the_generic_path(tiny_llama, tmp_path, monkeypatch, policy):
    """DynaKV without the row arena and its fused numba attention (the path of a memory that is
    not float32 host memory): a budget holding everything decodes like full KV."""
    from sparkv.decode import generate
    from sparkv.runtime import greedy_generate, reference_prefill

    monkeypatch.setenv(GENERIC_ENV, "1")
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (80,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(tiny_llama, ids)
    want = greedy_generate(tiny_llama, layers, 80, [3, 9, 27], max_new_tokens=20,
                           stop_at_eos=False)
    got, st = generate(tiny_llama, layers, 80, [3, 9, 27], 20, kv_policy=policy, budget=1.0,
                       ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, probe=True,
                       avg_cluster=8, max_cluster=16, recent=8)
    assert got.tokens == want.tokens
    assert st.recall == pytest.approx(1.0, abs=1e-6)


# ---- on a GPU ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_cuda():
    """The SmolLM2 shape on the GPU, random weights (the bundled weights do not travel to the
    GPU machine; the service's exactness does not need real ones), float32."""
    from sparkv.runtime import load_model

    return load_model("random:smollm2-135m", device="cuda", dtype=torch.float32, progress=False)


def test_swapped_out_and_read_back_answers_as_never_swapped(smollm2, doc, tmp_path):
    """What the CUDA case checks on the GPU, here on the CPU: a context read back from flash
    answers exactly as the same context kept resident."""
    want, loads, _, _ = _trace(smollm2, doc, tmp_path, "kept", swap=False)
    assert loads == [0, 0]
    assert _trace(smollm2, doc, tmp_path, "swapped")[0] == want


@needs_cuda
def test_cuda_llms_service_keeps_its_memory_on_the_gpu_and_reads_it_back_exactly(
        smollm2_cuda, tmp_path):
    """The LLMS service with the model on a GPU: the contexts' pages live there at every level,
    and a context swapped out to flash and read back answers exactly as one kept resident."""
    doc = sample_context_ids(smollm2_cuda, 300)
    want, _, _, _ = _trace(smollm2_cuda, doc, tmp_path, "kept", swap=False)
    got, loads, levels, device = _trace(smollm2_cuda, doc, tmp_path, "swapped")
    assert device.type == "cuda"
    assert {"int4", "int2"} <= levels and all(n > 0 for n in loads)
    assert got == want


@needs_cuda
def test_cuda_dynakv_decodes_exactly_like_full_kv(tiny_llama, tmp_path):
    import copy

    from sparkv.decode import generate
    from sparkv.runtime import LoadedModel, greedy_generate, reference_prefill

    lm = LoadedModel.from_model(copy.deepcopy(tiny_llama.model).to("cuda"), None, "tiny-cuda")
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (80,)).tolist()
    with torch.inference_mode():
        layers = reference_prefill(lm, ids)
    assert layers[0][0].is_cuda
    want = greedy_generate(lm, layers, 80, [3, 9, 27], max_new_tokens=20, stop_at_eos=False)
    got, st = generate(lm, layers, 80, [3, 9, 27], 20, kv_policy="dynakv", budget=1.0,
                       ram_budget=None, stop_at_eos=False, flash_dir=tmp_path, probe=True,
                       avg_cluster=8, max_cluster=16, recent=8)
    # the clustered memory attends in host RAM (sparkv/decode/hf.py), the full reference on
    # the GPU: the probe's recall and output error are exact checks; the tokens agree unless
    # two logits tie within the devices' rounding
    assert st.recall == pytest.approx(1.0, abs=1e-6) and st.output_error < 1e-4
    assert len(got.tokens) == len(want.tokens) == 20
