"""What ``sparkv bench quality`` asks and how one answer is judged: the configurations
(:class:`Config`), the probes and their contexts, the dense reference's answers and the row of
one answer (:func:`score_answer`). Shared by the server path (:mod:`sparkv.bench.quality`) and
the paired in-process evaluator (:mod:`sparkv.bench.paired`); docs/quality.md.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

#: the floor the ``sparkv``/``stream``/``hybrid`` strategy rows pin (the fixed floor the measured
#: table replaces); ``default`` rows pass nothing and follow whatever ``ask()`` does
PINNED_FLOOR = "q5"

#: a QA answer whose first divergence from dense falls where dense's own top-1 and top-2 logits are
#: closer than this (a near-tie) is counted in ``near_tie_divergences``: greedy agreement there is
#: decided by noise far below what the codec or the local path can promise (docs/quality.md)
NEAR_TIE_LOGITS = 0.05

@dataclass(frozen=True)
class Config:
    """One way of answering.

    Attributes:
        name: ``dense``, ``stream@q5``, ``local/dense``, ``sparkv@20mbps``, ``default@lte``, ...
        group: ``dense``, ``level``, ``backend``, ``dtype``, ``press``, ``device`` (made in
            process, :mod:`sparkv.bench.variants`) or ``strategy`` (through a server).
        strategy: the edge strategy (``None``: the dense reference; ``default``: no arguments).
        level: the forced level (``level`` group), ``auto`` or ``None``.
        backend: the attention backend name, or ``None``.
        link: ``None`` (unshaped loopback), a constant rate ``"20mbps"`` or a trace name.
        dtype: the compute dtype of the ``dtype`` group (``None``: the model's, fp32).
        press: the press spec of the ``press`` group (``adakv:0.5@repeat``), or ``None``.
        ratio: a press's kept ratio, or the device service's global ratio, or ``None``.
        ladder: the device service's quantized levels (``int8,k8v4,int4,int2``), or ``None``.
    """

    name: str
    group: str
    strategy: str | None = None
    level: str | None = None
    backend: str | None = None
    link: str | None = None
    dtype: str | None = None
    press: str | None = None
    ratio: float | None = None
    ladder: str | None = None

    def ask_kwargs(self) -> dict[str, Any]:
        """The policy fields of this configuration's :class:`~sparkv.edge.options.AskOptions`
        (none for ``default``)."""
        if self.strategy == "default":
            return {}
        kw: dict[str, Any] = {"strategy": self.strategy}
        if self.level is not None:
            kw["level"] = self.level
        if self.backend is not None:
            kw["backend"] = self.backend
        if self.group == "strategy" and self.strategy != "local":
            kw["quality_floor"] = PINNED_FLOOR
        return kw

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

# ---- what is asked ------------------------------------------------------------------------------
@dataclass
class Probe:
    """One question about one context.

    Attributes:
        id: unique (``passkey-2048-3``, ``qa/gpl-a-1``).
        family: ``passkey``, ``multikey``, ``multivalue`` or ``qa``.
        question: asked after the context.
        new_tokens: greedy tokens generated.
        stop_at_eos: retrieval answers stop at EOS (scored on the text); QA always generates
            ``new_tokens`` (compared token by token).
        task: the retrieval task (``None`` for QA).
        qa: the QA item (``None`` for retrieval).
        question_ids: the question's tokens after the context (``None``: the chat suffix of
            ``question``; a model without a tokenizer needs them given).
    """

    id: str
    family: str
    question: str
    new_tokens: int
    stop_at_eos: bool
    task: Any = None
    qa: Any = None
    question_ids: Sequence[int] | None = None

    def score(self, answer: str) -> float:
        """Retrieval: the task's score (1.0 correct); QA: 1.0 when a keyword is in the answer."""
        if self.task is not None:
            return float(self.task.score(answer))
        return 1.0 if self.qa is not None and self.qa.keyword_hit(answer) else 0.0

    def info(self) -> dict[str, Any]:
        if self.task is not None:
            return {"answers": self.task.answers, "depth": self.task.depth,
                    "seed": self.task.seed}
        return {"qa_id": self.qa.id, "slice": self.qa.slice, "keywords": list(self.qa.keywords)}


@dataclass
class QualityContext:
    """A context (chat turn + document) and the probes asked about it.

    Attributes:
        id: ``passkey-2048-3`` or ``qa-gpl-a``.
        family: as its probes.
        size: nominal size (retrieval) or ``None`` (QA: the slice decides).
        token_ids: the context's tokens (:func:`sparkv.edge.prompts.chat_context`).
        probes: asked in order.
        trial: the retrieval task's index in its family and size (0, 1, ...); ``None`` for QA.
    """

    id: str
    family: str
    size: int | None
    token_ids: list[int]
    probes: list[Probe] = field(default_factory=list)
    trial: int | None = None

def score_answer(lm: LoadedModel, ctx: QualityContext, probe: Probe, config: Config, ref: Any,
                 suffix: Sequence[int], answer: str, tokens: Sequence[int], first_logits: Any,
                 kv: Any, breakdown: Any, ttft_s: float | None,
                 ref_margins: Sequence[float] | None = None) -> dict[str, Any]:
    """One answer judged against the dense reference ``ref`` (a ``GenerationResult``): answer
    score, greedy agreement, teacher-forced agreement over the cache ``kv`` the engine assembled,
    first-token KL (nats), and what the load did (``breakdown``: bytes streamed, chunks,
    levels, fallbacks)."""
    from sparkv.runtime.generate import (first_token_kl, greedy_agreement,
                                         teacher_forced_agreement)

    row = base_row(ctx, probe, config)
    row["answer"] = answer
    row["score"] = probe.score(answer)
    row["correct"] = row["score"] >= 1.0
    row["greedy_agreement"] = greedy_agreement(ref.tokens, tokens)
    row.update(divergence(ref.tokens, tokens, ref_margins))
    row["teacher_forced"] = teacher_forced_agreement(lm, kv, len(ctx.token_ids), suffix,
                                                     ref.tokens)
    row["first_token_kl"] = max(0.0, first_token_kl(ref.first_logits, first_logits))
    row.update({"mb": breakdown.bytes_streamed / 1e6, "ttft_s": ttft_s,
                "streamed": breakdown.chunks_streamed, "computed": breakdown.chunks_computed,
                "levels": dict(breakdown.levels), "fallback": dict(breakdown.fallback),
                "reused_load": False})
    return row


def divergence(ref_tokens: Sequence[int], tokens: Sequence[int],
               ref_margins: Sequence[float] | None) -> dict[str, Any]:
    """Where an answer first leaves the dense reference's tokens (``divergence_pos``, ``None``
    when it never does) and the dense reference's own top-1 minus top-2 logit margin there
    (``ref_margin_at_divergence``; ``None`` without margins); ``near_tie`` when that margin is
    below :data:`NEAR_TIE_LOGITS`."""
    pos = next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None)
    if pos is None and len(tokens) < len(ref_tokens):
        pos = len(tokens)
    margin = (float(ref_margins[pos]) if pos is not None and ref_margins is not None
              and pos < len(ref_margins) else None)
    return {"divergence_pos": pos, "ref_margin_at_divergence": margin,
            "near_tie": bool(margin is not None and margin < NEAR_TIE_LOGITS)}


def reference_margins(lm: LoadedModel, kv: Any, context_len: int, question_ids: Sequence[int],
                      ref_tokens: Sequence[int]) -> list[float]:
    """The dense reference's top-1 minus top-2 logit at each of its own answer positions (one
    teacher-forced forward over the reference cache ``kv``; the cache is left as it was)."""
    import torch

    from sparkv.cache import SparkvCache
    from sparkv.runtime.generate import context_memory
    from sparkv.runtime.hfcache import model_call

    if not ref_tokens:
        return []
    ids = list(question_ids) + list(ref_tokens[:-1])
    pos = torch.arange(context_len, context_len + len(ids), device=lm.device)
    memory = context_memory(lm, kv, context_len)
    try:
        with torch.inference_mode():
            out = model_call(lm.model, input_ids=torch.tensor([ids], device=lm.device),
                             cache=SparkvCache(memory), position_ids=pos[None],
                             cache_position=pos, use_cache=True)
    finally:
        memory.truncate()
    top = out.logits[0, len(question_ids) - 1:].float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()

def base_row(ctx: QualityContext, probe: Probe, config: Config) -> dict[str, Any]:
    """The keys every answer row starts with: the task, the configuration, the codec, the bf16
    instructions of the CPU that computed it (``cpu_bf16``: a bf16 configuration's answers
    depend on them, docs/quality.md); ``kind`` is the QA question's kind of text (``license``
    for a QA set without kinds; ``None`` for retrieval)."""
    kind = getattr(probe.qa, "kind", "license") if probe.qa is not None else None
    return {"family": ctx.family, "size": ctx.size, "tokens": len(ctx.token_ids),
            "context": ctx.id, "probe": probe.id, **probe.info(), "kind": kind,
            "config": config.name, "group": config.group, "strategy": config.strategy,
            "level": config.level, "backend": config.backend, "link": config.link,
            "dtype": config.dtype, "press": config.press, "ratio": config.ratio,
            "ladder": config.ladder, "codec": _CODEC.get("signature"),
            "cpu_bf16": list(_cpu_bf16()), "new_tokens": probe.new_tokens, "error": None}


@functools.lru_cache(maxsize=1)
def _cpu_bf16() -> tuple[str, ...]:
    from sparkv.runtime.device import cpu_bf16_flags

    return tuple(cpu_bf16_flags())


#: the codec signature of this process (set by :func:`measure`; recorded in every answer)
_CODEC: dict[str, str] = {}


def use_codec(signature: str) -> None:
    """Records ``signature`` (:func:`~sparkv.predictor.quality.codec_signature`) in every row
    :func:`base_row` makes from now on."""
    _CODEC["signature"] = signature

def reference_answers(lm: LoadedModel, ctx: QualityContext, ref_mem: Any, dense: Config,
                      emit: Callable[[dict[str, Any]], None] | None
                      ) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, list[float]]]:
    """Every probe answered over the dense reference's KV memory ``ref_mem`` (rows of the
    ``dense`` configuration emitted unless ``emit`` is ``None``): ``(reference generations,
    question suffixes, the reference's margins of the QA probes)``, each by probe id."""
    from sparkv.edge.prompts import question_suffix
    from sparkv.runtime.generate import greedy_generate

    n = len(ctx.token_ids)
    refs, suffixes, margins = {}, {}, {}
    for probe in ctx.probes:
        suffixes[probe.id] = (list(probe.question_ids) if probe.question_ids is not None
                              else question_suffix(lm, probe.question))
        t0, c0 = time.perf_counter(), time.process_time()
        ref = greedy_generate(lm, ref_mem, n, suffixes[probe.id], probe.new_tokens,
                              stop_at_eos=probe.stop_at_eos)
        if probe.family == "qa":  # where dense itself is a near-tie
            margins[probe.id] = reference_margins(lm, ref_mem, n, suffixes[probe.id],
                                                  ref.tokens)
        refs[probe.id] = ref
        if emit is None:
            continue
        row = base_row(ctx, probe, dense)
        row["answer_s"] = time.perf_counter() - t0
        row["answer_cpu_s"] = time.process_time() - c0
        row.update({"answer": ref.text, "score": probe.score(ref.text),
                    "greedy_agreement": 1.0, "teacher_forced": 1.0,
                    "first_token_kl": 0.0, "mb": 0.0, "ttft_s": None, "streamed": 0,
                    "computed": 0, "levels": {}, "fallback": {}, "reused_load": False,
                    "divergence_pos": None, "ref_margin_at_divergence": None,
                    "near_tie": False})
        if margins.get(probe.id):
            row["ref_min_margin"] = min(margins[probe.id])
        row["correct"] = row["score"] >= 1.0
        emit(row)
    return refs, suffixes, margins

def context_line(ctx: QualityContext, rows: list[dict[str, Any]]) -> str:
    """One line per context: dense's answer, and the configurations that differ from it."""
    dense = [r for r in rows if r["config"] == "dense"]
    if ctx.family == "qa":
        by: dict[str, list[float]] = {}
        for r in rows:
            if r["config"] != "dense" and r.get("teacher_forced") is not None:
                by.setdefault(r["config"], []).append(r["teacher_forced"])
        worst = sorted((statistics.mean(v), k) for k, v in by.items())[:3]
        return (f"[{ctx.id} {len(ctx.token_ids)} tok, {len(ctx.probes)} questions] lowest "
                "teacher-forced: " + ", ".join(f"{k} {v:.2f}" for v, k in worst))
    d = dense[0] if dense else {}
    wrong = [r["config"] for r in rows if r["config"] != "dense" and not r["correct"]]
    return (f"[{ctx.id} {len(ctx.token_ids)} tok, depth {d.get('depth')}] dense "
            f"{'OK ' if d.get('correct') else 'MISS'} {d.get('answer', '').strip()[:48]!r}; "
            f"wrong: {', '.join(wrong) if wrong else 'none'}")
