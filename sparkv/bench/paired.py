"""The paired in-process evaluator of ``sparkv bench quality`` (docs/quality.md, "The matrix").

Per context: one dense fp32 prefill (:func:`~sparkv.bench.variants.prefill_reference`), the
dense reference's answers over it (the ``dense`` rows), then every variant's cache
(:mod:`sparkv.bench.variants`) and every probe answered over it and judged against the
reference on the same task (:func:`~sparkv.bench.quality.score_answer`: greedy agreement,
teacher-forced agreement, first-token KL, the answer's score). No server, no link: the groups
it measures do not depend on timing.

Rows carry ``load_s`` (seconds to make the variant's cache of the context, the dense prefill for
``dense``) and ``answer_s`` (seconds to answer and judge the probe), and the same spans in CPU
seconds of this process (``load_cpu_s``, ``answer_cpu_s``: on a shared machine wall time
measures the other jobs too): the cost per task and variant. A run resumes: (probe, configuration) pairs already in ``done`` are skipped, and a
context whose every pair is done is not even prefilled.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from sparkv.bench.answers import (Config, QualityContext, base_row, context_line,
                                  reference_answers, score_answer, use_codec)
from sparkv.bench.variants import SPARE_TOKENS, Reference, Variant, prefill_reference

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

DENSE = Config("dense", "dense")

Emit = Callable[[dict[str, Any]], None]


def applies(variant: Variant, ctx: QualityContext, max_trials: dict[Any, int]) -> bool:
    """Whether ``variant`` is asked about ``ctx``: a retrieval task whose trial index reaches
    ``max_trials[(group, size)]``, else ``max_trials[group]``, is skipped (QA always applies)."""
    limit = max_trials.get((variant.group, ctx.size), max_trials.get(variant.group))
    return limit is None or ctx.trial is None or ctx.trial < limit


def pending(ctx: QualityContext, names: Iterable[str], done: set[tuple[str, str]]
            ) -> list[str]:
    """The configurations of ``names`` with a probe of ``ctx`` not yet in ``done``."""
    return [n for n in names if any((p.id, n) not in done for p in ctx.probes)]


def evaluate(lm: LoadedModel, contexts: Sequence[QualityContext], variants: Sequence[Variant], *,
             emit: Emit, done: set[tuple[str, str]] | None = None,
             max_trials: dict[Any, int] | None = None, chunk_tokens: int = 512,
             progress: bool = True) -> None:
    """Every probe of ``contexts`` under the dense reference and every variant (module
    docstring); each row goes to ``emit`` as soon as it is judged."""
    from sparkv.logs import progress_bar

    from sparkv.predictor.quality import codec_signature

    use_codec(codec_signature(lm.config.num_hidden_layers))
    done = done or set()
    limits = max_trials or {}
    by_name = {v.name: v for v in variants}
    total = sum(len(c.probes) * (1 + sum(applies(v, c, limits) for v in variants))
                for c in contexts)
    bar = progress_bar(total=total, desc="quality", unit="answer", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, mininterval=2.0)
    try:
        for ctx in contexts:
            todo = [by_name[n] for n in pending(ctx, [v.name for v in variants
                                                      if applies(v, ctx, limits)], done)]
            dense_todo = bool(pending(ctx, ["dense"], done))
            if not todo and not dense_todo:
                bar.update(len(ctx.probes) * (1 + len([v for v in variants
                                                       if applies(v, ctx, limits)])))
                continue
            rows: list[dict[str, Any]] = []

            def out(row: dict[str, Any]) -> None:
                rows.append(row)
                if (row["probe"], row["config"]) not in done:
                    emit(row)
                bar.update(1)

            bar.set_postfix_str(f"{ctx.id}: dense reference")
            context_rows(lm, ctx, todo, out, chunk_tokens, bar.set_postfix_str)
            bar.write(context_line(ctx, rows))
    finally:
        bar.close()


def context_rows(lm: LoadedModel, ctx: QualityContext, variants: Sequence[Variant], emit: Emit,
                 chunk_tokens: int = 512, status: Callable[[str], Any] | None = None) -> None:
    """The dense rows and every variant's rows of one context (one prefill)."""
    ref = prefill_reference(lm, ctx.token_ids, density=any(v.needs_density() for v in variants),
                            chunk_tokens=chunk_tokens)
    refs, suffixes, margins = _reference(lm, ctx, ref, emit)
    for variant in variants:
        if status is not None:
            status(f"{ctx.id}: {variant.name}")
        variant_rows(ctx, variant, ref, refs, suffixes, margins, emit)


def _reference(lm: LoadedModel, ctx: QualityContext, ref: Reference, emit: Emit
               ) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, list[float]]]:
    """The dense reference's answers over the reference prefill (the ``dense`` rows, with the
    prefill's seconds as their ``load_s``)."""
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.kvcache import memory_from_layers

    n = ref.num_tokens
    mem = memory_from_layers(ref.layers, ChunkGeometry.from_config(lm.config, n, n),
                             spare_tokens=SPARE_TOKENS)

    def timed(row: dict[str, Any]) -> None:
        row["load_s"], row["load_cpu_s"] = ref.prefill_s, ref.prefill_cpu_s
        emit(row)

    out = reference_answers(lm, ctx, mem, DENSE, timed)
    del mem
    return out


def variant_rows(ctx: QualityContext, variant: Variant, ref: Reference, refs: dict[str, Any],
                 suffixes: dict[str, list[int]], margins: dict[str, list[float]],
                 emit: Emit) -> None:
    """Every probe of ``ctx`` over ``variant``'s cache, judged against the reference; a variant
    that fails is recorded as an error row per probe, never dropped."""
    config = variant.config()
    try:
        load = variant.load(ref)
    except Exception as exc:  # noqa: BLE001 - one failed configuration is a result
        for probe in ctx.probes:
            emit(_error_row(ctx, probe, config, exc))
        return
    for probe in ctx.probes:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            row = answer(ctx, probe, config, load, refs[probe.id], suffixes[probe.id],
                         margins.get(probe.id))
        except Exception as exc:  # noqa: BLE001
            row = _error_row(ctx, probe, config, exc)
        row["load_s"], row["load_cpu_s"] = load.load_s, load.load_cpu_s
        row["answer_s"] = time.perf_counter() - t0
        row["answer_cpu_s"] = time.process_time() - c0
        emit(row)


def answer(ctx: QualityContext, probe: Any, config: Config, load: Any, ref: Any,
           suffix: Sequence[int], margins: Sequence[float] | None) -> dict[str, Any]:
    """One probe answered over a variant's cache (greedy, as ``ask`` ends) and scored."""
    from sparkv.runtime.generate import greedy_generate

    gen = greedy_generate(load.lm, load.kv, len(ctx.token_ids), suffix, probe.new_tokens,
                          stop_at_eos=probe.stop_at_eos)
    row = score_answer(load.lm, ctx, probe, config, ref, suffix, gen.text, gen.tokens,
                       gen.first_logits, load.kv, load, None, margins)
    row.update(load.info)
    return row


def _error_row(ctx: QualityContext, probe: Any, config: Config, exc: BaseException
               ) -> dict[str, Any]:
    row = base_row(ctx, probe, config)
    row.update({"answer": "", "score": 0.0, "correct": False,
                "error": f"{type(exc).__name__}: {exc}"})
    return row
