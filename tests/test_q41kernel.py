"""The Q4_1 product for a few rows (sparkv/runtime/q41kernel.py, the ``int4`` configuration's
answer tokens): the blocks' own weights bit for bit (one-hot rows give the dequantized weight's
columns exactly, through each row count's kernel), float32's product up to the order of its
sums (1e-4) for any row and any number of rows (more than ``MAX_ROWS`` take several calls),
float16 scales and minima widened exactly (subnormals, zeros and negatives included);
``Q41Linear`` takes it for passes of at most ``KERNEL_ROWS`` rows and dequantizes for longer
ones (the kernel's dequantization: the blocks' weight bit for bit, so float32's product)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparkv.runtime.linears import Q41Linear
from sparkv.runtime.q41 import Q41Weight, quantize_q41
from sparkv.runtime.q41kernel import (MAX_ROWS, KernelBlocks, blocks_dequantize, blocks_matmul,
                                       pack_blocks, q41_matmul, unpack_blocks)


def _blocks(rows: int, cols: int, seed: int) -> Q41Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0                                        # a zero block: d = 0
    w[1, :32] = torch.linspace(-3e-6, 3e-6, 32)          # subnormal float16 scale and minimum
    w[2, 32:64] = -7.0 + torch.rand(32, generator=g)     # negative minimum
    return quantize_q41(w)


@pytest.mark.parametrize("rows,cols", [(48, 64), (96, 576), (40, 1536)])
def test_one_hot_rows_give_the_blocks_weights_bit_for_bit(rows, cols):
    q = _blocks(rows, cols, rows)
    packed = pack_blocks(q)
    back = unpack_blocks(*packed)
    assert torch.equal(back.codes, q.codes) and torch.equal(back.d, q.d)
    assert torch.equal(back.m, q.m)
    w = q.dequantize()
    eye = torch.eye(cols)
    a, k = 0, 1
    while a < cols:                               # every kernel (1 to MAX_ROWS rows a call)
        assert torch.equal(q41_matmul(eye[a:a + k], *packed), w[:, a:a + k].T)
        a, k = a + k, k % MAX_ROWS + 1


@pytest.mark.parametrize("rows,cols", [(48, 64), (96, 576), (40, 1536)])
def test_the_kernels_dequantize_is_the_blocks_weight_bit_for_bit(rows, cols):
    q = _blocks(rows, cols, rows + 1)
    got = blocks_dequantize(KernelBlocks.of(*pack_blocks(q)))
    assert got.dtype == torch.float32 and torch.equal(got, q.dequantize())


@pytest.mark.parametrize("n", [1, 3, 4, 5, 8])
def test_rows_equal_float32s_product_up_to_its_sums(n):
    q = _blocks(200, 576, n)
    x = torch.randn(2, n, 576, generator=torch.Generator().manual_seed(n))  # 2 to 16 rows
    got = q41_matmul(x, *pack_blocks(q))
    assert got.shape == (2, n, 200)
    torch.testing.assert_close(got, x @ q.dequantize().T, atol=1e-4, rtol=1e-4)


def test_q41_linear_takes_the_kernel_for_few_rows_only(monkeypatch):
    from sparkv.runtime import linears

    lin = nn.Linear(576, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(quantize_q41(lin.weight).dequantize())
    layer = Q41Linear(lin)
    assert layer.exact
    calls = []
    monkeypatch.setattr(linears, "blocks_matmul",
                        lambda x, b: calls.append(x.shape) or blocks_matmul(x, b))
    few = torch.randn(1, Q41Linear.KERNEL_ROWS, 576, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(few), lin(few), atol=1e-4, rtol=1e-4)
    assert calls == [few.shape]
    many = torch.randn(1, Q41Linear.KERNEL_ROWS + 1, 576)
    assert torch.equal(layer(many), linears.fast_linear(many, lin.weight))
    assert calls == [few.shape]                                   # dequantized, not the kernel


def test_q41_linear_reads_the_buffers_it_holds_now():
    """The kernel's views follow the buffers: weights loaded in place and buffers replaced."""
    g = torch.Generator().manual_seed(5)
    a, b = nn.Linear(64, 40, bias=False), nn.Linear(64, 40, bias=False)
    layer = Q41Linear(a)
    x = torch.randn(1, 2, 64, generator=g)
    want_a = x @ quantize_q41(a.weight).dequantize().T
    want_b = x @ quantize_q41(b.weight).dequantize().T
    torch.testing.assert_close(layer(x), want_a, atol=1e-4, rtol=1e-4)
    layer.load_state_dict(Q41Linear(b).state_dict())              # copied into the buffers
    torch.testing.assert_close(layer(x), want_b, atol=1e-4, rtol=1e-4)
    other = Q41Linear(a)
    layer.codes, layer.d, layer.m = other.codes, other.d, other.m  # buffers replaced
    torch.testing.assert_close(layer(x), want_a, atol=1e-4, rtol=1e-4)


def test_int4_answers_are_judged_a_token_a_pass():
    from sparkv.runtime.compute import get_compute

    assert get_compute("int4").answers_differ


def _int4(tiny_llama):
    import copy

    from sparkv.runtime import LoadedModel
    from sparkv.runtime.compute import apply_compute

    lm = LoadedModel.from_model(copy.deepcopy(tiny_llama.model), None, "tiny")
    info = apply_compute(lm, "int4")
    assert info["shared_products"] == 2 * 3                   # attention and MLP, 3 layers
    return lm


def test_shared_input_layers_make_their_outputs_in_one_call_bit_for_bit(tiny_llama):
    from sparkv.runtime.fastops import SHARED_PRODUCT

    lm = _int4(tiny_llama)
    attn, mlp = lm.decoder.layers[1].self_attn, lm.decoder.layers[1].mlp
    g = torch.Generator().manual_seed(6)
    for parent, layers in ((attn, (attn.q_proj, attn.k_proj, attn.v_proj)),
                           (mlp, (mlp.gate_proj, mlp.up_proj))):
        shared = getattr(parent, SHARED_PRODUCT)
        whole = shared._whole[0].untyped_storage().data_ptr()
        assert all(m.codes.untyped_storage().data_ptr() == whole for m in layers)   # views
        for n in (1, 3, MAX_ROWS):
            x = torch.randn(1, n, layers[0].in_features, generator=g)
            got = shared(x)
            assert got is not None and len(got) == len(layers)
            for y, m in zip(got, layers):
                assert torch.equal(y, m(x))
        assert shared(torch.randn(1, MAX_ROWS + 1, layers[0].in_features)) is None


def test_shared_product_follows_loaded_weights_and_steps_aside_for_replaced_ones(tiny_llama):
    import copy

    from sparkv.runtime.fastops import SHARED_PRODUCT

    lm = _int4(tiny_llama)
    attn = lm.decoder.layers[0].self_attn
    shared = getattr(attn, SHARED_PRODUCT)
    x = torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(7))
    before = shared(x)
    other = Q41Linear(nn.Linear(64, attn.q_proj.out_features, bias=False))
    attn.q_proj.load_state_dict(other.state_dict())          # copied into the shared blocks
    after = shared(x)
    assert torch.equal(after[0], other(x)) and not torch.equal(after[0], before[0])
    assert torch.equal(after[1], before[1])
    attn.k_proj.codes = attn.k_proj.codes.clone()            # replaced: layer by layer
    assert shared(x) is None
    copied = copy.deepcopy(lm.decoder.layers[1].self_attn)  # a deep copy reads its own blocks
    got = getattr(copied, SHARED_PRODUCT)(x)
    assert got is not None and torch.equal(got[2], copied.v_proj(x))


@pytest.mark.parametrize("shape", [(576,), (0, 576), (1, 576), (1, 1, 576), (2, 9, 576),
                                   (576, 3)])
def test_every_input_shape_comes_back_with_its_leading_dims(shape):
    """One row, none, a few, more than a call takes (18: three calls) and a transposed,
    non-contiguous input: ``[..., out]``, float32's product up to its sums."""
    q = _blocks(40, 576, 7)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    if shape == (576, 3):
        x = x.T
    got = q41_matmul(x, *pack_blocks(q))
    assert got.shape == (*x.shape[:-1], 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, x @ q.dequantize().T, atol=1e-4, rtol=1e-4)


def test_the_kernels_follow_torchs_thread_count_as_it_changes():
    """numba's thread count is remembered per thread but follows a new torch count."""
    import numba as nb

    from sparkv.kernels import use_torch_threads

    before = torch.get_num_threads()
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            use_torch_threads()
            assert nb.get_num_threads() == min(n, nb.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(before)
        use_torch_threads()
