"""Devices and the GPU paths: --device/--dtype resolution and its errors, flex_attention as a
real block-sparse kernel (checked here in its eager form on the CPU), the auto backend, and the
CUDA tests that run only where a GPU is (CI has none: they skip)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparkv.runtime import (AutoAttention, BlockSparseAttention, DenseAttention, DeviceUnavailable,
                            FlexAttention, SparsityConfig, flex_available, get_backend,
                            resolve_device, resolve_dtype)
from sparkv.runtime.autoattn import AttentionProfile
from sparkv.runtime.flex import block_mask

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device on this machine")
needs_flex = pytest.mark.skipif(not flex_available(), reason="no flex_attention in this PyTorch")


# ---- devices -----------------------------------------------------------------------------------
def test_devices_resolve_and_fail_clearly():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if CUDA else "cpu")
    with pytest.raises(DeviceUnavailable, match="unknown device"):
        resolve_device("tpu")
    if not CUDA:
        with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
            resolve_device("cuda")
        with pytest.raises(DeviceUnavailable, match="CUDA is not available"):
            resolve_device("cuda:1")


def test_dtypes_resolve():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(DeviceUnavailable, match="float16 on the CPU"):
        resolve_dtype("float16", cpu)
    with pytest.raises(DeviceUnavailable, match="unknown compute configuration"):
        resolve_dtype("int3", cpu)


@pytest.mark.skipif(CUDA, reason="checks the error on a machine without CUDA")
@pytest.mark.parametrize("argv", [["model", "--device", "cuda"],
                                  ["ask", "--server", "http://127.0.0.1:9", "--context", "0" * 32,
                                   "hi", "--device", "cuda"],
                                  ["serve", "--device", "cuda", "--port", "0"]])
def test_cli_device_cuda_without_cuda_is_a_clear_error(argv, capsys):
    from sparkv.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:            # argparse: the option does not exist on this command
        pytest.fail(f"{argv[0]} has no --device option ({e})")
    err = capsys.readouterr().err
    assert rc == 2 and "CUDA is not available" in err and "Traceback" not in err


# ---- flex_attention ----------------------------------------------------------------------------
def _token_mask(keep: torch.Tensor, nq: int, nk: int, q_offset: int) -> torch.Tensor:
    tok = keep.repeat_interleave(128, 2)[:, :, :nq].repeat_interleave(64, 3)[..., :nk]
    causal = torch.arange(nk)[None, :] <= (torch.arange(nq)[:, None] + q_offset)
    return tok & causal


@needs_flex
@pytest.mark.parametrize("nq,off,hq,hkv", [(128, 0, 4, 2), (200, 300, 4, 2), (77, 500, 6, 3)])
def test_flex_dense_equals_dense_attention(nq, off, hq, hkv):
    torch.manual_seed(nq)
    q = torch.randn(1, hq, nq, 32)
    k = torch.randn(1, hkv, off + nq, 32)
    v = torch.randn(1, hkv, off + nq, 32)
    got, stats = FlexAttention(sparse=False).attend(q, k, v, off)
    want, _ = DenseAttention().attend(q, k, v, off)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert stats.density == 1.0


@needs_flex
@pytest.mark.parametrize("nq,off,hq,hkv", [(200, 300, 4, 2), (77, 500, 6, 3)])
def test_flex_sparse_equals_masked_dense_attention(nq, off, hq, hkv):
    torch.manual_seed(off)
    q = torch.randn(1, hq, nq, 32)
    k = torch.randn(1, hkv, off + nq, 32)
    v = torch.randn(1, hkv, off + nq, 32)
    cfg = SparsityConfig(dense_below=0, min_keys=0, cdf_threshold=0.5, sim_threshold=-1.0)
    keep = BlockSparseAttention(cfg).predict_mask(q, k, off)
    got, stats = FlexAttention(sparse=True, config=cfg).attend(q, k, v, off, mask=keep)
    assert stats.density < 1.0                           # some blocks really were skipped
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_token_mask(keep, nq, off + nq, off),
                                          enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_flex
def test_block_mask_splits_full_and_causal_blocks():
    keep = torch.zeros(1, 1, 2, 6, dtype=torch.bool)
    keep[..., 0, :3] = True
    keep[..., 1, :] = True
    diagonal = torch.zeros(2, 6, dtype=torch.bool)
    diagonal[0, 2] = diagonal[1, 4] = diagonal[1, 5] = True
    bm = block_mask(keep, diagonal, 256, 384, 128)
    assert bm.full_kv_num_blocks.tolist() == [[[2, 4]]]     # fully visible, no mask_mod
    assert bm.kv_num_blocks.tolist() == [[[1, 2]]]          # cut by the causal boundary


def test_auto_on_cpu_tensors_is_block_sparse():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 256, 32)
    k = torch.randn(1, 2, 1536, 32)
    v = torch.randn(1, 2, 1536, 32)
    a, _ = AutoAttention().attend(q, k, v, 1280)
    b, _ = BlockSparseAttention().attend(q, k, v, 1280)
    assert torch.equal(a, b)
    assert get_backend("auto").name == ("auto" if CUDA else "block_sparse")


def test_profile_never_sparse_below_its_threshold():
    p = AttentionProfile(min_sparse_keys=8192, breakeven={8192: 0.3, 32768: 0.6})
    assert p.density_limit(4096) == 0.0
    assert p.density_limit(8192) == pytest.approx(0.3)
    assert p.density_limit(20480) == pytest.approx(0.45)
    assert p.density_limit(65536) == pytest.approx(0.6)


# ---- CUDA --------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_stepper_equals_the_full_forward(tiny_llama):
    from sparkv.runtime import LayerStepper, LoadedModel, reference_prefill

    lm = LoadedModel.from_model(tiny_llama.model.to("cuda"), None, "tiny-cuda")
    ids = torch.randint(0, 128, (300,)).tolist()
    with torch.inference_mode():
        ref = reference_prefill(lm, ids)
    for backend, fused in (("dense", False), ("auto", False), ("dense", True), ("auto", True)):
        st = LayerStepper(lm, ids, 64, backend=get_backend(backend))
        st.complete(fused=fused)
        for (k, v), (rk, rv) in zip(st.kv.layer_kv(), ref):
            torch.testing.assert_close(k, rk, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(v, rv, atol=2e-4, rtol=2e-4)
    tiny_llama.model.to("cpu")


@needs_cuda
@needs_flex
def test_cuda_flex_equals_dense():
    torch.manual_seed(0)
    q = torch.randn(1, 9, 512, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 3, 2048, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    got, _ = FlexAttention(sparse=False).attend(q, k, v, 1536)
    want, _ = DenseAttention().attend(q, k, v, 1536)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
def test_cuda_split_equals_masked_dense():
    from sparkv.runtime.split import lse_kernel, split_attention

    chosen = lse_kernel(torch.device("cuda"), torch.bfloat16)
    assert chosen is not None, "no LSE kernel passed its self-check on this GPU"
    torch.manual_seed(0)
    for hq, hkv, d, off, n in [(9, 3, 64, 1536, 512), (24, 8, 128, 4096, 1024)]:
        q = torch.randn(1, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(1, hkv, off + n + 128, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        got = split_attention(q, k, v, off)
        want, _ = DenseAttention(split=False).attend(q, k, v, off)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_cuda
@needs_flex
def test_cuda_flex_compiles_once_across_steps():
    from torch._dynamo.utils import counters

    flex = FlexAttention(sparse=False)
    torch.manual_seed(0)
    before = None
    for t in range(1, 7):                       # six steps, six key lengths and offsets
        q = torch.randn(1, 9, 512, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 3, 512 * (t + 1), 64, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        got, _ = flex.attend(q, k, v, 512 * t)
        want, _ = DenseAttention(split=False).attend(q, k, v, 512 * t)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        if t == 2:
            before = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == before     # no recompilation per step


@needs_cuda
@needs_flex
def test_cuda_auto_sparse_path_equals_masked_attention():
    cfg = SparsityConfig(dense_below=0, min_keys=0, cdf_threshold=0.5, sim_threshold=-1.0)
    auto = AutoAttention(cfg, AttentionProfile(min_sparse_keys=0, breakeven={1: 1.01}))
    torch.manual_seed(1)
    q = torch.randn(1, 6, 256, 32, device="cuda")
    k = torch.randn(1, 3, 1280, 32, device="cuda")
    v = torch.randn_like(k)
    got, stats = auto.attend(q, k, v, 1024)
    assert auto.failure is None and stats.density < 1.0
    keep = BlockSparseAttention(cfg).predict_mask(q, k, 1024).cpu()
    tok = _token_mask(keep, 256, 1280, 1024).cuda()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=tok, enable_gqa=True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_cuda
def test_cuda_random_shape_is_seeded_bf16():
    from sparkv.runtime import load_model

    a = load_model("random:smollm2-135m", device="cuda", dtype="auto", progress=False)
    b = load_model("random:smollm2-135m", device="cuda", dtype="auto", progress=False)
    assert a.dtype == torch.bfloat16
    assert torch.equal(next(a.model.parameters()), next(b.model.parameters()))


@needs_cuda
def test_cuda_logits_are_chosen_as_on_the_cpu_json_form_and_seeded_draws_included():
    """The chooser over CUDA logits: greedy with a JSON form, the CPU's tokens; a seeded draw
    (its generator on the GPU) repeats with its seed and keeps to the form."""
    from sparkv.runtime.guided import TokenBytes
    from sparkv.runtime.jsonform import JsonForm
    from sparkv.runtime.sampling import Sampling, TokenChooser

    texts: list[bytes | None] = [None] + [bytes([b]) for b in range(32, 127)] + [
        b'{"', b'":', b'",', b"true", b"false", b"null", b"]}", b"\n  "]
    vocab = TokenBytes(texts, (0,))
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(len(texts), generator=gen) * 4 for _ in range(120)]

    def answer(device: str, **rule) -> list[int]:
        choose = TokenChooser(Sampling(form=JsonForm.any_object(), **rule), vocab)
        out = []
        for x in steps:
            out.append(choose(x.to(device)))
            if choose.finished:
                break
        return out

    assert answer("cuda") == answer("cpu")
    drawn = answer("cuda", temperature=1.0, top_p=0.9, seed=3)
    assert drawn == answer("cuda", temperature=1.0, top_p=0.9, seed=3)
    text = b"".join(texts[t] or b"" for t in drawn)
    assert text.lstrip().startswith(b"{")

