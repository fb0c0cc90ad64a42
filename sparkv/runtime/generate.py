"""Generation over an assembled KV cache, and the reference (plain transformers) prefill.

:func:`greedy_generate` prefills the question (the prompt suffix) over the context's cache at
positions ``N .. N+q-1`` and decodes greedily, or as a :class:`~sparkv.runtime.sampling.Sampling`
says; greedy, it gives the same tokens as ``model.generate`` on the full prompt (tested). It
times the first token, which ends TTFT.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from sparkv.cache import ContextKV, SparkvCache
from sparkv.cache.fork import ForkCache
from sparkv.generation import base_stats
from sparkv.layout import ChunkGeometry
from sparkv.runtime.batchdecode import DecodeItem, decode_step
from sparkv.runtime.compute import compute_of
from sparkv.runtime.hfcache import model_call, output_cache
from sparkv.runtime.kvcache import LayerKV, from_dynamic_cache, memory_from_layers
from sparkv.runtime.model import LoadedModel
from sparkv.runtime.sampling import Sampling, TokenChooser
from sparkv.runtime.stops import StopStrings

SAMPLE_CONTEXT = Path(__file__).resolve().parent.parent / "data" / "sample_context.txt"


@dataclass
class GenerationResult:
    """Tokens generated after the question, with timings; a
    :class:`~sparkv.generation.Generation` (``text``, ``tokens``, ``stats``).

    Attributes:
        tokens: generated token ids (greedy unless sampled), at most ``max_new_tokens``.
        first_logits: ``[vocab]`` float32 logits of the first generated token.
        first_token_s: seconds from the call to the first token (question prefill + sampling).
        total_s: seconds for the whole call.
    """

    tokens: list[int]
    first_logits: torch.Tensor
    first_token_s: float
    total_s: float
    text: str = field(default="")
    prefill_s: float = 0.0  # the question's forward pass (part of first_token_s)
    seed: int | None = None  # the sampling's seed (None: greedy)

    @property
    def stats(self) -> dict[str, Any]:
        """``ttft_s`` (= ``first_token_s``), ``new_tokens``, ``prefill_s``, ``total_s``; a
        sampled answer's ``seed``."""
        out = {**base_stats(self.first_token_s, self.tokens), "prefill_s": self.prefill_s,
               "total_s": self.total_s}
        if self.seed is not None:
            out["seed"] = self.seed
        return out


def context_memory(lm: LoadedModel, kv: LayerKV | ContextKV, n: int) -> ContextKV:
    """``kv`` as a KV memory of ``n`` context tokens (a given memory is checked and kept: every
    layer must have seen ``n`` positions, its tokens and any appended ones)."""
    if isinstance(kv, ContextKV):
        if set(kv.positions) != {n}:
            raise ValueError(f"the memory holds {sorted(set(kv.positions))} tokens, context has "
                             f"{n}")
        return kv
    if kv and kv[0][0].shape[2] != n:
        raise ValueError(f"cache holds {kv[0][0].shape[2]} tokens, context has {n}")
    geometry = ChunkGeometry.from_config(lm.config, n, max(16, min(n, 1 << 16)))
    return memory_from_layers(kv, geometry, spare_tokens=64)


@torch.inference_mode()
def greedy_generate(lm: LoadedModel, kv: LayerKV | ContextKV, context_len: int | Sequence[int],
                    question_ids: Sequence[int], max_new_tokens: int = 32,
                    stop_at_eos: bool = True, keep: bool = False,
                    stop: Sequence[str] = (), truncate: bool = True,
                    sampling: Sampling | None = None,
                    after_first: Callable[[], None] | None = None) -> GenerationResult:
    """Greedy decoding (or sampling) after ``question_ids`` over a context cache of ``context_len`` tokens.

    The cache is a :class:`~sparkv.cache.SparkvCache` over the KV memory: new tokens are appended
    in place (no per-token copy of a layer); pruned and quantized layers are attended with their
    explicit positions.

    Args:
        kv: the context's KV memory, or per-layer ``(K, V)`` ``[1, kv_heads, N, head_dim]``
            (copied once into a memory).
        context_len: N, or the context's token ids (only their count is used).
        question_ids: the prompt suffix (at least one token).
        keep: leave the question and the answer in the memory (the context grows, as a chat
            does); by default the memory is left as it was.
        truncate: without ``keep``, forget what the call appended; ``False`` leaves what a
            finished call appended (uncommitted) for the caller to read
            (:meth:`ContextKV.appended`) and truncate (a call that raises forgets it).
        stop: stop strings: the answer ends at the token that completes one, its text before
            it (:class:`~sparkv.runtime.stops.StopStrings`).
        sampling: how each token is chosen (default: greedy).
        after_first: called once the first answer token is chosen (and reported), before the
            second is computed; the memory then holds the context and the question.
    """
    n = context_len if isinstance(context_len, int) else len(context_len)
    if not question_ids:
        raise ValueError("the question needs at least one token")
    start = time.perf_counter()
    memory = context_memory(lm, kv, n)
    cache = SparkvCache(memory)
    done = False
    try:
        res = _decode(lm, cache, n, question_ids, max_new_tokens, stop_at_eos, start,
                      StopStrings(stop), TokenChooser.of_model(lm, sampling),
                      after_first=after_first)
        done = True
        return res
    finally:
        if keep:
            cache.commit()
        elif truncate or not done:
            memory.truncate()


@torch.inference_mode()
def generate_over(lm: LoadedModel, cache: SparkvCache | ForkCache, n: int,
                  question_ids: Sequence[int], max_new_tokens: int, *, stop_at_eos: bool = True,
                  stop: Sequence[str] = (), sampling: Sampling | None = None,
                  after_question: Callable[[], None] | None = None) -> GenerationResult:
    """:func:`greedy_generate` over a cache the caller made (a fork of a memory,
    :class:`~sparkv.cache.fork.ForkCache`, reads it and keeps the new tokens itself): the
    question at positions ``n ..``, then the answer; ``after_question`` is called once the
    question's forward pass ran (the cache holds its KV)."""
    if not question_ids:
        raise ValueError("the question needs at least one token")
    return _decode(lm, cache, n, question_ids, max_new_tokens, stop_at_eos,
                   time.perf_counter(), StopStrings(stop), TokenChooser.of_model(lm, sampling),
                   after_question)


def _decode(lm: LoadedModel, cache: SparkvCache | ForkCache, n: int,
            question_ids: Sequence[int], max_new_tokens: int, stop_at_eos: bool, start: float,
            stops: StopStrings, choose: TokenChooser,
            after_question: Callable[[], None] | None = None,
            after_first: Callable[[], None] | None = None) -> GenerationResult:
    device = lm.device
    ids = torch.tensor([list(question_ids)], dtype=torch.long, device=device)
    pos = torch.arange(n, n + ids.shape[1], device=device)
    out = model_call(lm.model, input_ids=ids, cache=cache, position_ids=pos.unsqueeze(0),
                     cache_position=pos, use_cache=True, logits_to_keep=1)
    if after_question is not None:
        after_question()
    prefill_s = time.perf_counter() - start
    logits = out.logits[0, -1].float()
    token = choose(logits)
    first_s = time.perf_counter() - start
    if after_first is not None:
        after_first()
    tokens = [token]
    eos = lm.eos_ids
    cur = n + ids.shape[1]
    while (len(tokens) < max_new_tokens and not (stop_at_eos and token in eos)
           and not stops.hit(lm, tokens) and not choose.finished):
        token = choose(decode_step(lm, DecodeItem(cache, token, cur)))
        tokens.append(token)
        cur += 1
    return GenerationResult(tokens, logits, first_s, time.perf_counter() - start,
                            answer_text(lm, tokens, stops), prefill_s, choose.seed)


def answer_text(lm: LoadedModel, tokens: Sequence[int], stops: StopStrings | None = None) -> str:
    """An answer's text: its tokens decoded (end-of-sequence tokens left out; none without a
    tokenizer), cut before its first stop string."""
    if lm.tokenizer is None:
        return ""
    eos = lm.eos_ids
    text = lm.decode_tokens([t for t in tokens if t not in eos])
    return stops.cut(text) if stops else text



@torch.inference_mode()
def teacher_forced_agreement(lm: LoadedModel, kv: LayerKV | ContextKV, context_len: int,
                             question_ids: Sequence[int], ref: Sequence[int]) -> float:
    """Share of the reference continuation ``ref`` whose tokens are the argmax given the
    reference prefix over this cache (no divergence cascade, unlike :func:`greedy_agreement`)."""
    if len(ref) < 2:
        return 1.0
    memory = context_memory(lm, kv, context_len)
    try:
        if compute_of(lm).answers_differ:   # answer tokens compute another way: one a pass
            pred = _forced_token_by_token(lm, SparkvCache(memory), context_len, question_ids,
                                          ref)
        else:
            ids = list(question_ids) + list(ref[:-1])
            pos = torch.arange(context_len, context_len + len(ids), device=lm.device)
            out = model_call(lm.model, input_ids=torch.tensor([ids], device=lm.device),
                             cache=SparkvCache(memory), position_ids=pos[None],
                             cache_position=pos, use_cache=True)
            pred = out.logits[0, len(question_ids) - 1:].argmax(-1).tolist()
    finally:
        memory.truncate()
    return sum(int(a == b) for a, b in zip(pred, ref)) / len(ref)


def _forced_token_by_token(lm: LoadedModel, cache: SparkvCache, n: int,
                           question_ids: Sequence[int], ref: Sequence[int]) -> list[int]:
    """The argmax after the question and after each reference prefix, fed as generation feeds
    it: the question in one pass, then one reference token a pass."""
    ids = torch.tensor([list(question_ids)], dtype=torch.long, device=lm.device)
    pos = torch.arange(n, n + ids.shape[1], device=lm.device)
    out = model_call(lm.model, input_ids=ids, cache=cache, position_ids=pos.unsqueeze(0),
                     cache_position=pos, use_cache=True, logits_to_keep=1)
    pred = [int(torch.argmax(out.logits[0, -1]))]
    cur = n + ids.shape[1]
    for token in ref[:-1]:
        pred.append(int(torch.argmax(decode_step(lm, DecodeItem(cache, int(token), cur)))))
        cur += 1
    return pred


@torch.inference_mode()
def reference_prefill(lm: LoadedModel, token_ids: Sequence[int]) -> LayerKV:
    """The model's own full prefill (transformers forward); per layer ``(K, V)`` after RoPE."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=lm.device)
    # the last position's logits only: all of them are [N, vocab] (3.2 GB in fp32 at 16K tokens)
    out = lm.model(input_ids=ids, use_cache=True, logits_to_keep=1)
    return [(k.contiguous(), v.contiguous()) for k, v in from_dynamic_cache(output_cache(out))]


@torch.inference_mode()
def reference_generate(lm: LoadedModel, prompt_ids: Sequence[int], max_new_tokens: int = 32,
                       ) -> list[int]:
    """Plain ``model.generate`` on the full prompt, greedy: the tokens sparkv must reproduce."""
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=lm.device)
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=max_new_tokens, pad_token_id=_pad_id(lm))
    return out[0, ids.shape[1]:].tolist()


def _pad_id(lm: LoadedModel) -> int:
    pad = getattr(lm.config, "pad_token_id", None)
    if pad is None:
        eos = lm.eos_ids
        pad = min(eos) if eos else 0
    return int(pad)


def sample_text() -> str:
    """The bundled natural-text sample (English prose of three free-software licences)."""
    return SAMPLE_CONTEXT.read_text(encoding="utf-8")


def sample_context_ids(lm: LoadedModel, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids of natural text (the sample, repeated if it is too short); a model
    without a tokenizer (a random-weight shape) gets seeded random ids instead."""
    if lm.tokenizer is None:
        gen = torch.Generator().manual_seed(num_tokens)
        vocab = int(lm.config.vocab_size)
        return torch.randint(0, vocab, (num_tokens,), generator=gen).tolist()
    base = lm.encode_text(sample_text())
    ids: list[int] = []
    while len(ids) < num_tokens:
        ids.extend(base)
    return ids[:num_tokens]


def first_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the first-token distributions, in nats."""
    p = torch.log_softmax(ref_logits.float(), -1)
    q = torch.log_softmax(logits.float(), -1)
    return float(torch.sum(p.exp() * (p - q)))


def greedy_agreement(ref: Sequence[int], other: Sequence[int]) -> float:
    """Share of positions where two greedy sequences agree, up to the first divergence counted as
    the prefix length over ``len(ref)`` (the usual "tokens matched before diverging" measure)."""
    if not ref:
        return 1.0
    n = 0
    for a, b in zip(ref, other):
        if a != b:
            break
        n += 1
    return n / len(ref)


CHAT_SYSTEM = "You are a helpful assistant. Answer questions about the user's document."


def prompt_parts(lm: LoadedModel, document_ids: Sequence[int], question: str
                 ) -> tuple[list[int], list[int]]:
    """Splits a question-about-a-document prompt into the reusable context and the suffix.

    For ChatML models (SmolLM2, Qwen) the context is the system turn plus the start of the user turn
    holding the document, and the suffix closes the user turn with the question and opens the
    assistant's; other models get ``document + "\\n\\nQuestion: ...\\nAnswer:"``. The suffix is
    :func:`sparkv.runtime.turns.suffix_ids` of the lone question (empty for an empty question; a
    conversation of several turns: :class:`~sparkv.runtime.turns.Conversation`).
    """
    from sparkv.runtime.turns import Conversation, suffix_ids

    head = list(document_ids)
    if lm.chatml:
        head = lm.encode_text(f"<|im_start|>system\n{CHAT_SYSTEM}<|im_end|>\n<|im_start|>user\n"
                              ) + head
    return head, (suffix_ids(lm, Conversation.of(question)) if question.strip() else [])
