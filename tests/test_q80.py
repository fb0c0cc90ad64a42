"""Q8_0 blocks and their few-rows product (sparkv/runtime/q80.py, ``int4``'s LM head):
quantizing Q8_0 values finds their blocks again (SmolLM2's head: the GGUF's own token_embd
blocks); the kernel gives the blocks' weights bit for bit (one-hot rows, every row count's
kernel) and float32's product up to the order of its sums for any number of rows;
``Q80Linear`` takes it for few rows and float32's own product otherwise; ``int4`` puts it in
SmolLM2's LM head, still tied to the embedding, and keeps a head that is not Q8_0 values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sparkv.runtime.fastops import linear as fast_linear
from sparkv.runtime.linears import Q80Linear
from sparkv.runtime.q80 import kernel_arrays, q80_matmul, quantize_q80
from sparkv.runtime.rowkernels import MAX_ROWS


def _q80_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights that are Q8_0 values (one rounding of random ones), with a zero block, a
    subnormal float16 scale and a block of negatives."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[0, :32] = 0
    w[1, :32] = torch.linspace(-3e-6, 3e-6, 32)
    w[2, 32:64] = -7.0 + torch.rand(32, generator=g)
    return quantize_q80(w).dequantize()


def test_q80_values_come_back_as_their_blocks():
    w = _q80_values(40, 128, 0)
    q = quantize_q80(w)
    assert q.exact(w)
    assert torch.equal(quantize_q80(q.dequantize()).codes, q.codes)
    assert int(q.codes.abs().max()) == 127
    assert not quantize_q80(torch.randn(8, 64)).exact(torch.randn(8, 64))


def test_smollm2_head_is_the_ggufs_q80_blocks(smollm2):
    from gguf import GGUFReader

    from sparkv.runtime.model import SMOLLM2_GGUF, _smollm2_gguf_dir

    head = smollm2.model.get_output_embeddings().weight
    q = quantize_q80(head)
    assert q.exact(head)
    tensors = {t.name: t for t in GGUFReader(str(_smollm2_gguf_dir() / SMOLLM2_GGUF)).tensors}
    raw = np.asarray(tensors["token_embd.weight"].data).reshape(head.shape[0], -1, 34)
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    codes = raw[..., 2:].copy().view(np.int8).reshape(head.shape)
    assert torch.equal(q.codes, torch.from_numpy(codes))
    assert torch.equal(q.d, torch.from_numpy(d))


def test_one_hot_rows_give_the_weights_bit_for_bit_through_every_kernel():
    w = _q80_values(48, 96, 1)
    arrays = kernel_arrays(quantize_q80(w))
    eye = torch.eye(96)
    a, k = 0, 1
    while a < 96:
        assert torch.equal(q80_matmul(eye[a:a + k], arrays), w[:, a:a + k].T)
        a, k = a + k, k % MAX_ROWS + 1


@pytest.mark.parametrize("n", [1, 2, 3, 8, 11])
def test_rows_equal_float32s_product_up_to_its_sums(n):
    w = _q80_values(200, 576, n)
    x = torch.randn(1, n, 576, generator=torch.Generator().manual_seed(n))
    got = q80_matmul(x, kernel_arrays(quantize_q80(w)))
    assert got.shape == (1, n, 200)
    torch.testing.assert_close(got, x @ w.T, atol=1e-4, rtol=1e-4)


def test_q80_linear_takes_the_kernel_for_few_rows_and_float32_otherwise(monkeypatch):
    from sparkv.runtime import linears

    lin = nn.Linear(576, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_q80_values(96, 576, 3))
    layer = Q80Linear(lin)
    assert layer.exact and layer.weight is lin.weight               # kept, not copied
    calls = []
    monkeypatch.setattr(linears, "q80_matmul",
                        lambda x, a: calls.append(x.shape) or q80_matmul(x, a))
    g = torch.Generator().manual_seed(4)
    few = torch.randn(1, Q80Linear.KERNEL_ROWS, 576, generator=g)
    torch.testing.assert_close(layer(few), lin(few), atol=1e-4, rtol=1e-4)
    assert calls == [few.shape]
    many = torch.randn(1, Q80Linear.KERNEL_ROWS + 1, 576, generator=g)
    assert torch.equal(layer(many), fast_linear(many, lin.weight))
    assert calls == [few.shape]
    assert layer.weight_nbytes() == 96 * 576 + 96 * 18 * 2           # codes + fp16 scales


def test_q80_answer_linear_takes_the_kernel_for_answer_tokens_only(monkeypatch):
    """``mixed-mlp-int4-decode``'s head: a pass marked as answer tokens is ``Q80Linear``'s,
    any other (the first token's logits: one row) float32's product bit for bit."""
    from sparkv.runtime import linears
    from sparkv.runtime.linears import Q80AnswerLinear, answer_tokens

    lin = nn.Linear(576, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(_q80_values(96, 576, 5))
    layer, plain = Q80AnswerLinear(lin), Q80Linear(lin)
    calls = []
    monkeypatch.setattr(linears, "q80_matmul",
                        lambda x, a: calls.append(x.shape) or q80_matmul(x, a))
    one = torch.randn(1, 1, 576, generator=torch.Generator().manual_seed(5))
    assert torch.equal(layer(one), fast_linear(one, lin.weight)) and not calls
    with answer_tokens():
        assert torch.equal(layer(one), plain(one))
    assert len(calls) == 2                             # the answer token's and plain's own


def test_int4_keeps_a_head_that_is_not_q80_values(tiny_llama):
    import copy

    from sparkv.runtime import LoadedModel
    from sparkv.runtime.compute import apply_compute

    lm = LoadedModel.from_model(copy.deepcopy(tiny_llama.model), None, "tiny")
    info = apply_compute(lm, "int4")
    assert info["head"].startswith("kept")
    assert isinstance(lm.model.lm_head, nn.Linear)
