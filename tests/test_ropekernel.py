"""RoPE of an answer token's q and k in one numba call (sparkv/runtime/ropekernel.py): it rounds
as it says (one product rounded, the other fused), for every row count it takes, strided (a
projection's views) or not, at any scale and position; where this machine's torch rounds so
(checked once), bit for bit torch's operations, passes it does not take keep torch's, and
SmolLM2's answer tokens run it with the logits of torch's RoPE bit for bit; where not, it is not
used."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from sparkv.runtime import ropekernel
from sparkv.runtime.fastops import apply_rope, rope_pair
from sparkv.runtime.ropekernel import MAX_ROWS, matches_torch, rope_qk, takes, torch_rope


def _emb(rows: int, dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[1, rows, dim]`` of RoPE's angles at random positions up to 32K."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    pos = torch.randint(0, 32768, (rows,), generator=gen).float()
    ang = pos[:, None] * inv[None]
    emb = torch.cat((ang, ang), dim=-1)[None]
    return emb.cos(), emb.sin()


def _projected(rows: int, gen: torch.Generator, scale: float) -> tuple[torch.Tensor, ...]:
    """q ``[1, 9, rows, 64]`` and k ``[1, 3, rows, 64]`` as views of one projection's output
    (strided, as the attention forward has them)."""
    qkv = torch.randn(1, rows, 960, generator=gen) * scale
    q, k = qkv[..., :576], qkv[..., 576:768]
    return (q.view(1, rows, 9, 64).transpose(1, 2), k.view(1, rows, 3, 64).transpose(1, 2))


#: where this machine's torch does not round RoPE as the kernel does, the kernel is not used
_TORCH_AS_KERNEL = pytest.mark.skipif(not matches_torch(), reason="this machine's torch rounds "
                                      "RoPE otherwise: the kernel is not used here")


def _fma_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the kernel defines it, from float64: ``x1 * c`` rounded to float32, then the
    other product added with one rounding (a float32 product is exact in float64)."""
    c, s = cos.unsqueeze(1).double(), sin.unsqueeze(1).double()
    x64 = x.double()
    h = x.shape[-1] // 2
    x1, x2 = x64[..., :h], x64[..., h:]
    first = (x1 * c[..., :h]).float().double() - x2 * s[..., :h]
    second = (x2 * c[..., h:]).float().double() + x1 * s[..., h:]
    return torch.cat((first, second), dim=-1).float()


def _cases() -> Iterator[tuple[torch.Tensor, ...]]:
    """64 cases ``(q, k, cos, sin)``: every row count the kernel takes, scales 1e-3 to 1e3."""
    gen = torch.Generator().manual_seed(0)
    for case in range(64):
        rows = 1 + case % MAX_ROWS
        yield (*_projected(rows, gen, 10.0 ** (case % 7 - 3)), *_emb(rows, 64, gen))


def test_the_kernel_rounds_as_it_says():
    for q, k, cos, sin in _cases():
        got_q, got_k = rope_qk(q, k, cos, sin)
        assert torch.equal(got_q, _fma_rope(q, cos, sin))
        assert torch.equal(got_k, _fma_rope(k, cos, sin))
        assert got_q.is_contiguous() and not got_q.isnan().any()


@_TORCH_AS_KERNEL
def test_the_kernel_is_torchs_rope_bit_for_bit():
    for q, k, cos, sin in _cases():
        assert takes(q, cos, sin) and takes(k, cos, sin)
        got_q, got_k = rope_qk(q, k, cos, sin)
        assert torch.equal(got_q, torch_rope(q, cos, sin))
        assert torch.equal(got_k, torch_rope(k, cos, sin))


@_TORCH_AS_KERNEL
def test_passes_it_does_not_take_keep_torchs_rope():
    gen = torch.Generator().manual_seed(1)
    q, k = _projected(MAX_ROWS + 1, gen, 1.0)
    cos, sin = _emb(MAX_ROWS + 1, 64, gen)
    assert not takes(q, cos, sin)                                # too many rows
    one, cos1, sin1 = q[:, :, :1], cos[:, :1], sin[:, :1]
    assert takes(one, cos1, sin1)
    assert not takes(one.double(), cos1.double(), sin1.double())  # not float32
    half_cos, half_sin = _emb(1, 32, gen)
    assert not takes(one, half_cos, half_sin)                   # a partial rotary dimension
    assert not takes(one.expand(2, -1, -1, -1), cos1, sin1)     # cos/sin broadcast over a batch
    assert not takes(one, cos1, sin[:, :2])                     # sin of another shape
    assert not takes(one[0], cos1[0], sin1[0])                  # not [B, H, n, D]
    assert not takes(one.clone().requires_grad_(), cos1, sin1)  # autograd follows it
    got_q, got_k = rope_pair(q, k, cos, sin)
    assert torch.equal(got_q, apply_rope(q, cos, sin))
    assert torch.equal(got_k, apply_rope(k, cos, sin))


def test_a_pass_autograd_follows_keeps_torchs_rope_and_its_gradient(tiny_llama):
    """A forward with gradients (the model's parameters require them): torch's RoPE, and the
    gradient reaches the query projection."""
    model = tiny_llama.model
    with torch.enable_grad():
        out = model(input_ids=torch.tensor([[1, 2, 3]])).logits
        out.sum().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_a_machine_whose_torch_rounds_otherwise_keeps_torchs_rope(monkeypatch):
    """Where the check fails (another torch build, another CPU), the kernel is not used."""
    gen = torch.Generator().manual_seed(2)
    q, k = _projected(1, gen, 1.0)
    cos, sin = _emb(1, 64, gen)
    monkeypatch.setattr(ropekernel, "matches_torch", lambda: False)
    assert not takes(q, cos, sin)
    calls = []
    monkeypatch.setattr(ropekernel, "rope_qk", lambda *a: calls.append(a))
    got_q, _ = rope_pair(q, k, cos, sin)
    assert not calls and torch.equal(got_q, torch_rope(q, cos, sin))


def _answer_logits(lm, ids: list[int]) -> list[torch.Tensor]:
    """The logits of three answer tokens (fixed ones) after a context of ``ids``."""
    from sparkv.cache import SparkvCache
    from sparkv.runtime.batchdecode import DecodeItem, decode_together
    from sparkv.runtime.generate import context_memory, reference_prefill

    cache = SparkvCache(context_memory(lm, reference_prefill(lm, ids), len(ids)))
    return [decode_together(lm, [DecodeItem(cache, tok, len(ids) + i)])
            for i, tok in enumerate((5, 17, 42))]


@_TORCH_AS_KERNEL
@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_smollm2_answer_tokens_are_those_of_torchs_rope(smollm2, dtype, monkeypatch):
    """Answer tokens over a context with the kernel and with torch's RoPE: equal logits."""
    from sparkv.runtime import load_model

    lm = smollm2 if dtype == "float32" else load_model(dtype=dtype)
    ids = lm.tokenizer("The kernel rotates queries and keys; the answer stays.")["input_ids"]
    used = []
    real = ropekernel.rope_qk

    def counted(*args):
        used.append(1)
        return real(*args)

    monkeypatch.setattr(ropekernel, "rope_qk", counted)
    fast = _answer_logits(lm, ids)
    assert len(used) == 3 * lm.model.config.num_hidden_layers
    monkeypatch.setattr(ropekernel, "matches_torch", lambda: False)
    plain = _answer_logits(lm, ids)
    assert all(torch.equal(a, b) for a, b in zip(fast, plain))
