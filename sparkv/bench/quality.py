"""``sparkv bench quality``: a quality suite that can fail. Retrieval tasks (RULER-style pass key,
multi-key, multi-value) and natural questions about the bundled license texts, answered through
the real pipeline (a ``sparkv serve`` process on loopback, real frames, the edge's engine) under
each configuration, and judged against the dense full-precision reference on the same inputs.

The matrix (docs/quality.md): running every strategy x level x backend x link through the server is
far too slow on a 2-core CPU, and most of that cross product measures the same thing twice. Each
group varies one factor and holds the others at a value that isolates it:

=========  ===============================================  =====================================
group      configurations                                   what it isolates
=========  ===============================================  =====================================
dense      ``dense``: transformers' own full prefill (fp32)  the reference every row is judged by
level      ``stream@L``: stream-only, every chunk at level  the codec (nothing computed; no link:
           L, unshaped loopback                             the plan does not depend on timing)
backend    ``local/B``: every chunk computed with           local attention (nothing streamed)
           attention backend B
strategy   ``S@link``: strategy S with the default level    the planner's mix of both paths under
           policy (``level=auto``, floor ``q5`` pinned),    a realistic link (timing decides the
           ``backend=auto``, through a link; ``default@``   split, so several links are run)
           ``link``: ``ask()`` with no policy arguments,
           what ``sparkv ask`` does with no flags
=========  ===============================================  =====================================

``local`` in the strategy group does not touch the link: it runs once (``local/auto``), and not at
all when the backend group already has the backend ``auto`` resolves to.

Per retrieval task the judgement is the answer's correctness (:mod:`sparkv.bench.tasks`), reported
next to the dense reference's: a task dense fails says nothing, so ``relative = kept /
dense_correct`` counts only the tasks dense answers. Per QA question it is agreement with the
dense reference's 32 greedy tokens (:func:`~sparkv.runtime.generate.greedy_agreement`),
teacher-forced top-1 agreement (:func:`~sparkv.runtime.generate.teacher_forced_agreement`, over
the cache the engine assembled) and first-token KL (:func:`~sparkv.runtime.generate.first_token_kl`).

``--save-table`` turns the level (and backend) group into the planner's
:class:`~sparkv.predictor.quality.QualityTable`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from sparkv.bench.common import (MODEL_HELP, add_output_args, format_table, result_path,
                                 write_result)

#: retrieval families (sparkv.bench.tasks) and the QA set
RETRIEVAL = ("passkey", "multikey", "multivalue")
FAMILIES = (*RETRIEVAL, "qa")
#: greedy tokens generated per answer (multivalue lists three 7-digit numbers)
NEW_TOKENS = {"passkey": 16, "multikey": 24, "multivalue": 64, "qa": 32}
#: a task of nominal size N has a context of N - CONTEXT_MARGIN tokens, so that the context, the
#: question and the longest answer fit in N (SmolLM2's window is 8192)
CONTEXT_MARGIN = 128
#: the floor the ``sparkv``/``stream``/``hybrid`` strategy rows pin (the fixed floor the measured
#: table replaces); ``default`` rows pass nothing and follow whatever ``ask()`` does
PINNED_FLOOR = "q5"
#: targets: QA agreement with dense, and pass-key parity (one miss per 30 dense-correct tasks)
QA_MIN_TEACHER_FORCED = 0.9
QA_MIN_GREEDY = 0.9
PARITY_MISSES_PER = 30
#: a QA answer whose first divergence from dense falls where dense's own top-1 and top-2 logits are
#: closer than this (a near-tie) is counted in ``near_tie_divergences``: greedy agreement there is
#: decided by noise far below what the codec or the local path can promise (docs/quality.md)
NEAR_TIE_LOGITS = 0.05

FULL = {"tasks": "passkey,multikey,multivalue,qa", "sizes": "2048,4096", "trials": "10",
        "levels": "raw,q8,q6,q5,q4,q3", "backends": "dense,block_sparse",
        "strategies": "local,stream,hybrid,sparkv,default", "links": "20,lte",
        "qa_questions": None}
QUICK = {"tasks": "passkey,qa", "sizes": "1024", "trials": "3", "levels": "raw,q8,q5,q4",
         "backends": "dense,block_sparse", "strategies": "default", "links": "20",
         "qa_questions": 3}


def register(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("quality", help="retrieval + QA quality of every level, backend and "
                                       "strategy against the dense reference (docs/quality.md)")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--tasks", default=None,
                   help=f"families: {', '.join(FAMILIES)} (default: all; --quick: passkey,qa)")
    p.add_argument("--sizes", default=None,
                   help="retrieval context sizes in tokens (default 2048,4096; --quick 1024)")
    p.add_argument("--trials", default=None,
                   help="retrieval tasks per family and size: N, plus overrides "
                        "FAMILY=N or FAMILY@SIZE=N, e.g. 10,passkey@2048=30,multikey@8192=0 "
                        "(default 10; --quick 3)")
    p.add_argument("--qa-questions", type=int, default=None,
                   help="ask only the first N QA questions (default: all; --quick 3)")
    p.add_argument("--qa-file", default=None,
                   help="QA set files, comma-separated, in the format of "
                        "sparkv/data/qa_licenses.json (default: every bundled set; "
                        "docs/quality.md)")
    p.add_argument("--levels", default=None,
                   help="level group: stream-only at each level (default raw,q8,q6,q5,q4,q3; "
                        "'' for none)")
    p.add_argument("--backends", default=None,
                   help="backend group: local with each backend (default dense,block_sparse)")
    p.add_argument("--strategies", default=None,
                   help="strategy group at the default level policy: local, stream, hybrid, "
                        "sparkv, default (default: all; --quick default)")
    p.add_argument("--links", default=None,
                   help="links of the strategy group: Mbit/s numbers and trace names or CSVs "
                        "(default 20,lte; --quick 20)")
    p.add_argument("--rtt-ms", type=float, default=20.0,
                   help="emulated round trip of the strategy group's links (ms)")
    p.add_argument("--encode-levels", default="raw,q8,q6,q5,q4,q3",
                   help="levels the server encodes (the swept levels are added)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="T the server encodes with (the TTFT benchmarks' T)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the retrieval tasks and of the verdicts' bootstrap")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--quick", action="store_true",
                   help="a small configuration (a few minutes): pass key at 1K, 3 QA questions")
    add_output_args(p, "quality", quick=True,
                     json_help="write bench/results/quality.json and quality.png "
                               "(quality_quick.* with --quick)")
    p.add_argument("--rows", default=None,
                   help="also append every answer as a JSON line here while running")
    p.add_argument("--save-table", nargs="?", const="", default=None, metavar="PATH",
                   help="write the planner's quality table from the level and backend groups "
                        "(default path: <sparkv cache>/predictor/<fingerprint>.quality.json)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a default-policy configuration's verdict is fail "
                        "(inferior to dense with 95%% confidence; docs/quality.md)")
    p.add_argument("--rescore", default=None, metavar="FILES",
                   help="measure nothing: re-aggregate the answers of earlier runs (quality.json "
                        "files or --rows JSON-lines files, comma-separated; later rows of the "
                        "same question and configuration win)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


# ---- the matrix -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One way of answering.

    Attributes:
        name: ``dense``, ``stream@q5``, ``local/dense``, ``sparkv@20mbps``, ``default@lte``, ...
        group: ``dense``, ``level``, ``backend`` or ``strategy``.
        strategy: the edge strategy (``None``: the dense reference; ``default``: no arguments).
        level: the forced level (``level`` group), ``auto`` or ``None``.
        backend: the attention backend name, or ``None``.
        link: ``None`` (unshaped loopback), a constant rate ``"20mbps"`` or a trace name.
    """

    name: str
    group: str
    strategy: str | None = None
    level: str | None = None
    backend: str | None = None
    link: str | None = None

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


def link_label(link: str) -> str:
    """``"20"`` -> ``"20mbps"``; trace names and CSV stems as they are."""
    try:
        return f"{float(link):g}mbps"
    except ValueError:
        return Path(link).stem if link.endswith(".csv") else link


def auto_backend_name() -> str:
    """What ``backend="auto"`` resolves to on this machine."""
    from sparkv.runtime.attention import get_backend

    return get_backend("auto").name


def build_matrix(levels: Sequence[str], backends: Sequence[str], strategies: Sequence[str],
                 links: Sequence[str]) -> list[Config]:
    """The configurations, dense first (module docstring). Raises ``ValueError`` for unknown
    strategies."""
    from sparkv.edge.planning import STRATEGIES

    bad = [s for s in strategies if s not in STRATEGIES and s != "default"]
    if bad:
        raise ValueError(f"unknown strategies {bad}; choose from "
                         f"{sorted(STRATEGIES) + ['default']}")
    out = [Config("dense", "dense")]
    out += [Config(f"stream@{lv}", "level", "stream", lv, "dense") for lv in levels]
    out += [Config(f"local/{b}", "backend", "local", None, b) for b in backends]
    if "local" in strategies and auto_backend_name() not in backends:
        out.append(Config("local/auto", "strategy", "local", None, "auto"))
    for link in links:
        for s in strategies:
            if s == "local":
                continue
            if s == "default":
                out.append(Config(f"default@{link_label(link)}", "strategy", "default",
                                  link=link))
            else:
                out.append(Config(f"{s}@{link_label(link)}", "strategy", s, "auto", "auto",
                                  link))
    return out


def parse_trials(text: str) -> Callable[[str, int], int]:
    """``"10,passkey=20,passkey@2048=30"`` -> ``trials(family, size)``: the most specific
    override wins (``family@size``, then ``family``, then the plain number; default 10)."""
    base = 10
    by_family: dict[str, int] = {}
    by_size: dict[tuple[str, int], int] = {}
    for part in (x.strip() for x in text.split(",")):
        if not part:
            continue
        if "=" not in part:
            base = int(part)
            continue
        key, n = part.split("=", 1)
        if "@" in key:
            fam, size = key.split("@", 1)
            by_size[(fam.strip(), int(size))] = int(n)
        else:
            by_family[key.strip()] = int(n)
    for fam, _ in [*by_size, *((f, 0) for f in by_family)]:
        if fam not in RETRIEVAL:
            raise ValueError(f"--trials names unknown family {fam!r}; known: {RETRIEVAL}")

    def trials(family: str, size: int) -> int:
        return by_size.get((family, size), by_family.get(family, base))

    return trials


# ---- what is asked --------------------------------------------------------------------------------
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
    """

    id: str
    family: str
    question: str
    new_tokens: int
    stop_at_eos: bool
    task: Any = None
    qa: Any = None

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
    """

    id: str
    family: str
    size: int | None
    token_ids: list[int]
    probes: list[Probe] = field(default_factory=list)


def build_contexts(lm: Any, tasks: Sequence[str], sizes: Sequence[int],
                   trials: Callable[[str, int], int], qa_questions: int | None = None,
                   seed: int = 0, qa_path: str | Path | None = None) -> list[QualityContext]:
    """Retrieval contexts (``trials(family, size)`` per family and size, depths spread over
    10-90%, seeded) and one context per QA slice with its questions, in the order of
    ``tasks`` (then sizes)."""
    from sparkv.bench.qa import load_qa_sets
    from sparkv.bench.tasks import make_task, spread_depths
    from sparkv.edge.prompts import chat_context

    def count(text: str) -> int:
        return len(lm.encode_text(text))

    out: list[QualityContext] = []
    for fam in tasks:
        if fam not in FAMILIES:
            raise ValueError(f"unknown task family {fam!r}; known: {', '.join(FAMILIES)}")
        if fam == "qa":
            qa = load_qa_sets(qa_path).limit(qa_questions)  # None: every bundled set
            for slice_id, items in qa.by_slice().items():
                ctx = QualityContext(f"qa-{slice_id}", "qa", None,
                              chat_context(lm, lm.encode_text(qa.text(slice_id))))
                ctx.probes = [Probe(f"qa/{it.id}", "qa", it.question, NEW_TOKENS["qa"], False,
                                    qa=it) for it in items]
                out.append(ctx)
            continue
        for size in sizes:
            doc_tokens = max(64, size - CONTEXT_MARGIN)
            for i, depth in enumerate(spread_depths(trials(fam, size))):
                task = make_task(fam, doc_tokens, depth, seed + i, count)
                # named by the task's seed: runs with --seed N continue a seed-0 run's series
                # without reusing its names (``--rescore`` merges their rows)
                ctx = QualityContext(f"{fam}-{size}-{seed + i}", fam, size,
                              chat_context(lm, lm.encode_text(task.document)))
                ctx.probes.append(Probe(ctx.id, fam, task.question, NEW_TOKENS[fam], True,
                                        task=task))
                out.append(ctx)
    return out


# ---- measuring ------------------------------------------------------------------------------------
def _shaper(link: str | None, rtt_ms: float) -> Any:
    from sparkv.edge.shaper import LinkShaper
    from sparkv.scheduler.trace import Trace

    if link is None:
        return LinkShaper.unlimited()
    try:
        trace = Trace.constant(float(link))
    except ValueError:
        trace = Trace.sample(link) if link in ("wifi", "lte", "deep-fade") else \
            Trace.from_csv(link)
    return LinkShaper(trace, rtt_s=rtt_ms / 1e3)


#: groups whose load depends neither on the question nor on timing: a QA context is loaded once
#: per configuration and each of its questions answered over that cache
REUSED_GROUPS = ("level", "backend")
#: asks of those groups that fell back to local compute (a starved machine) are asked again
FALLBACK_RETRIES = 2


def score_answer(lm: Any, ctx: QualityContext, probe: Probe, config: Config, ref: Any,
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


def reference_margins(lm: Any, kv: Any, context_len: int, question_ids: Sequence[int],
                      ref_tokens: Sequence[int]) -> list[float]:
    """The dense reference's top-1 minus top-2 logit at each of its own answer positions (one
    teacher-forced forward over the reference cache ``kv``; the cache is left as it was)."""
    import torch

    from sparkv.cache import SparkvCache
    from sparkv.runtime.generate import context_memory

    if not ref_tokens:
        return []
    ids = list(question_ids) + list(ref_tokens[:-1])
    pos = torch.arange(context_len, context_len + len(ids), device=lm.device)
    memory = context_memory(lm, kv, context_len)
    try:
        with torch.inference_mode():
            out = lm.model(input_ids=torch.tensor([ids], device=lm.device),
                           past_key_values=SparkvCache(memory), position_ids=pos[None],
                           cache_position=pos, use_cache=True)
    finally:
        memory.truncate()
    top = out.logits[0, len(question_ids) - 1:].float().topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def score_row(lm: Any, ctx: QualityContext, probe: Probe, config: Config, ref: Any, res: Any,
              suffix: Sequence[int], ref_margins: Sequence[float] | None = None
              ) -> dict[str, Any]:
    """:func:`score_answer` of one ``EdgeSession.ask`` result."""
    return score_answer(lm, ctx, probe, config, ref, suffix, res.answer, res.tokens,
                        res.first_logits, res.load.kv, res.breakdown, res.breakdown.ttft_s,
                        ref_margins)


def answer_over_load(lm: Any, ctx: QualityContext, probe: Probe, config: Config, ref: Any,
                     suffix: Sequence[int], res: Any,
                     ref_margins: Sequence[float] | None = None) -> dict[str, Any]:
    """Answers ``probe`` over the cache an earlier ask of the same context and configuration
    assembled (``res``), with the same :func:`~sparkv.runtime.generate.greedy_generate` that
    ``ask`` ends with; ``ttft_s`` is ``None`` and ``reused_load`` true."""
    from sparkv.runtime.generate import greedy_generate

    gen = greedy_generate(lm, res.load.kv, len(ctx.token_ids), suffix, probe.new_tokens,
                          stop_at_eos=probe.stop_at_eos)
    row = score_answer(lm, ctx, probe, config, ref, suffix, gen.text, gen.tokens,
                       gen.first_logits, res.load.kv, res.breakdown, None, ref_margins)
    row["reused_load"] = True
    return row


def base_row(ctx: QualityContext, probe: Probe, config: Config) -> dict[str, Any]:
    return {"family": ctx.family, "size": ctx.size, "tokens": len(ctx.token_ids),
            "context": ctx.id, "probe": probe.id, **probe.info(), "config": config.name,
            "group": config.group, "strategy": config.strategy, "level": config.level,
            "backend": config.backend, "link": config.link, "codec": _CODEC.get("signature"),
            "error": None}


#: the codec signature of this process (set by :func:`measure`; recorded in every answer)
_CODEC: dict[str, str] = {}


def _create_context(client: Any, ctx: QualityContext, chunk_tokens: int,
                    encode_levels: Sequence[str], attempts: int = 3) -> str:
    """The server encodes ``ctx`` (asked again when a request times out on a starved machine:
    the id is content-derived, so a repeated request names the same context)."""
    from sparkv.protocol.errors import ServerUnavailable

    for i in range(attempts):
        try:
            return str(client.create_context(token_ids=ctx.token_ids, chunk_tokens=chunk_tokens,
                                              levels=list(encode_levels)))
        except ServerUnavailable:
            if i == attempts - 1:
                raise
            time.sleep(5.0)
    raise AssertionError("unreachable")


def measure(lm: Any, url: str, contexts: Sequence[QualityContext], configs: Sequence[Config], *,
            encode_levels: Sequence[str], chunk_tokens: int = 512, rtt_ms: float = 20.0,
            rows_path: str | Path | None = None, progress: bool = True) -> list[dict[str, Any]]:
    """Every probe under every configuration, through the server at ``url``; one row per answer
    (dense reference rows included; ``configs[0]`` must be the dense reference). Each context is
    encoded by the server, answered, then deleted from it.

    Every answer is one ``EdgeSession.ask``, except in the level and backend groups, whose load
    depends neither on the question nor on timing: there a context with several questions (a QA
    slice) is loaded once per configuration and the other questions are answered over that
    cache (:func:`answer_over_load`). An ask of those groups that fell back to local compute is
    asked again (:data:`FALLBACK_RETRIES` times), then recorded as an error."""
    import httpx
    from tqdm import tqdm

    from sparkv.edge.session import EdgeSession
    from sparkv.predictor.quality import codec_signature

    if not configs or configs[0].group != "dense":
        raise ValueError("the first configuration must be the dense reference")
    _CODEC["signature"] = codec_signature(lm.config.num_hidden_layers)
    rows: list[dict[str, Any]] = []
    sink = open(rows_path, "a") if rows_path else None
    total = sum(len(c.probes) for c in contexts) * len(configs)
    bar = tqdm(total=total, desc="quality", unit="answer", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, mininterval=2.0)

    def emit(row: dict[str, Any]) -> None:
        rows.append(row)
        _sink(sink, row)
        bar.update(1)

    # the server shares this machine's cores: allow its REST answers a minute
    session = EdgeSession.connect(url, model=lm, timeout_s=60.0)
    try:
        for ctx in contexts:
            bar.set_postfix_str(f"{ctx.id}: encoding")
            cid = _create_context(session.client, ctx, chunk_tokens, encode_levels)
            bar.set_postfix_str(f"{ctx.id}: dense reference")
            refs, suffixes, margins = _dense_reference(lm, ctx, configs[0], emit)
            for config in configs[1:]:
                bar.set_postfix_str(f"{ctx.id}: {config.name}")
                _config_rows(lm, session, cid, ctx, config, refs, suffixes, margins, rtt_ms,
                             emit)
            try:
                httpx.delete(f"{url}/v1/contexts/{cid}", timeout=60.0)
            except httpx.HTTPError:
                pass
            bar.write(_context_line(ctx, [r for r in rows if r["context"] == ctx.id]))
    finally:
        bar.close()
        session.close()
        if sink is not None:
            sink.close()
    return rows


def _dense_reference(lm: Any, ctx: QualityContext, dense: Config,
                     emit: Callable[[dict[str, Any]], None]
                     ) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, list[float]]]:
    """The dense reference answer of every probe (full prefill on this device), emitted as the
    ``dense`` configuration's rows: ``(reference generations, question suffixes, the
    reference's margins of the QA probes)``, each by probe id."""
    import torch

    from sparkv.edge.prompts import question_suffix
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.generate import greedy_generate, reference_prefill
    from sparkv.runtime.kvcache import memory_from_layers

    n = len(ctx.token_ids)
    with torch.inference_mode():
        ref_layers = reference_prefill(lm, ctx.token_ids)
    ref_mem = memory_from_layers(ref_layers, ChunkGeometry.from_config(lm.config, n, n),
                                 spare_tokens=128)
    del ref_layers
    refs, suffixes, margins = {}, {}, {}
    for probe in ctx.probes:
        suffixes[probe.id] = question_suffix(lm, probe.question)
        ref = greedy_generate(lm, ref_mem, n, suffixes[probe.id], probe.new_tokens,
                              stop_at_eos=probe.stop_at_eos)
        if probe.family == "qa":  # where dense itself is a near-tie
            margins[probe.id] = reference_margins(lm, ref_mem, n, suffixes[probe.id],
                                                  ref.tokens)
        refs[probe.id] = ref
        row = base_row(ctx, probe, dense)
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


def _config_rows(lm: Any, session: Any, cid: str, ctx: QualityContext, config: Config,
                 refs: dict[str, Any], suffixes: dict[str, list[int]],
                 margins: dict[str, list[float]], rtt_ms: float,
                 emit: Callable[[dict[str, Any]], None]) -> None:
    """Every probe of ``ctx`` under ``config``, scored against the dense reference; in the
    level and backend groups the first successful load is reused for the other probes. A failed
    answer is emitted as an error row."""
    reuse = config.group in REUSED_GROUPS
    loaded: Any = None
    for probe in ctx.probes:
        ref, suffix = refs[probe.id], suffixes[probe.id]
        try:
            if loaded is not None:
                row = answer_over_load(lm, ctx, probe, config, ref, suffix, loaded,
                                       margins.get(probe.id))
            else:
                res = _ask(session, cid, probe, config, rtt_ms,
                           FALLBACK_RETRIES if reuse else 0)
                row = score_row(lm, ctx, probe, config, ref, res, suffix,
                                margins.get(probe.id))
                if reuse and row["fallback"]:
                    row["error"] = f"fell back to local compute: {row['fallback']}"
                elif reuse:
                    loaded = res
                del res
        except Exception as exc:  # noqa: BLE001 - one failed answer is a result
            row = base_row(ctx, probe, config)
            row.update({"answer": "", "score": 0.0, "correct": False,
                        "error": f"{type(exc).__name__}: {exc}"})
        emit(row)


def _ask(session: Any, cid: str, probe: Probe, config: Config, rtt_ms: float,
         retries: int) -> Any:
    """One ``EdgeSession.ask`` under ``config`` (a fresh link shaper; shaped asks forget the
    learned bandwidth and fetch the manifest again, as a first question would); asked again up
    to ``retries`` times while the load falls back to local compute."""
    from sparkv.edge.options import AskOptions

    options = AskOptions(max_new_tokens=probe.new_tokens, stop_at_eos=probe.stop_at_eos,
                         use_cache=config.link is None, **config.ask_kwargs())
    for attempt in range(retries + 1):
        session.client.shaper = _shaper(config.link, rtt_ms)
        if config.link is not None:
            session.priors.bandwidth_Bps = None
        res = session.ask(cid, probe.question, options)
        if not res.breakdown.fallback or attempt == retries:
            return res
        del res
    raise AssertionError("unreachable")


def _sink(sink: Any, row: dict[str, Any]) -> None:
    if sink is not None:
        sink.write(json.dumps(row, default=str) + "\n")
        sink.flush()


def _context_line(ctx: QualityContext, rows: list[dict[str, Any]]) -> str:
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


# ---- aggregation ----------------------------------------------------------------------------------
def parity_ok(kept: int, dense_correct: int) -> bool:
    """At most one miss per 30 tasks the dense reference answers ("29 of 30 where dense gets 30
    of 30"); with fewer than 30 dense-correct tasks, none may be missed."""
    return kept >= dense_correct - dense_correct // PARITY_MISSES_PER


def _mean(xs: Iterable[Any]) -> float | None:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return statistics.mean(v) if v else None


def aggregate(rows: Sequence[dict[str, Any]], configs: Sequence[Config] | None = None,
              seed: int = 0) -> list[dict[str, Any]]:
    """One result per (family, size, configuration); QA sizes pooled (``size`` None). Retrieval:
    ``correct``/``n``, ``accuracy``, ``dense_correct``, ``kept`` (correct here and in dense),
    ``relative`` (kept / dense_correct), ``parity``; every family: mean ``greedy_agreement``,
    ``teacher_forced``, ``first_token_kl``, ``mb`` streamed per answer, ``ttft_s``, ``errors``,
    ``fallbacks``; QA: ``keyword_hits``, ``qa_ok`` (teacher-forced >= 0.9), ``greedy_ok``. Every
    row but dense's also has ``verdict``: the decision rule on that slice alone
    (:func:`sparkv.bench.verdict.decide`, bootstrap seeded with ``seed``; ``Verdict.to_dict``)."""
    order = {c.name: i for i, c in enumerate(configs or [])}
    dense_ok = {r["probe"]: bool(r["correct"]) for r in rows if r["config"] == "dense"}
    dense_rows = {r["probe"]: r for r in rows if r["config"] == "dense"}
    groups: dict[tuple[str, Any, str], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["size"], r["config"]), []).append(r)
    out = []
    for (fam, size, name), rs in groups.items():
        ok = [r for r in rs if not r.get("error")]
        n = len(rs)
        correct = sum(1 for r in rs if r.get("correct"))
        dense_correct = sum(1 for r in rs if dense_ok.get(r["probe"]))
        kept = sum(1 for r in rs if r.get("correct") and dense_ok.get(r["probe"]))
        tokens = [r["tokens"] for r in rs]
        first = rs[0]
        res: dict[str, Any] = {
            "family": fam, "size": size, "tokens_min": min(tokens), "tokens_max": max(tokens),
            "config": name, "group": first["group"], "strategy": first["strategy"],
            "level": first["level"], "backend": first["backend"], "link": first["link"],
            "n": n, "correct": correct, "accuracy": correct / n if n else 0.0,
            "dense_correct": dense_correct, "kept": kept,
            "relative": kept / dense_correct if dense_correct else None,
            "mean_score": _mean(r.get("score") for r in rs),
            "greedy_agreement": _mean(r.get("greedy_agreement") for r in ok),
            "teacher_forced": _mean(r.get("teacher_forced") for r in ok),
            "first_token_kl": _mean(r.get("first_token_kl") for r in ok),
            "first_token_kl_max": max((r["first_token_kl"] for r in ok
                                       if r.get("first_token_kl") is not None), default=None),
            "mb": _mean(r.get("mb") for r in ok),
            "bytes_per_token": _mean((r["mb"] * 1e6 / r["tokens"]) for r in ok
                                     if r.get("mb") is not None),
            "ttft_s": _mean(r.get("ttft_s") for r in ok),
            "errors": n - len(ok),
            "fallbacks": sum(1 for r in ok if r.get("fallback")),
        }
        if fam == "qa":
            res["keyword_hits"] = correct
            div = [r for r in ok if r.get("divergence_pos") is not None]
            res["divergences"] = len(div)
            res["near_tie_divergences"] = sum(1 for r in div if r.get("near_tie"))
            tf, gr = res["teacher_forced"], res["greedy_agreement"]
            # a tiny tolerance: a mean of 32-token fractions that is 0.9 must pass 0.9
            res["qa_ok"] = (tf is not None and tf >= QA_MIN_TEACHER_FORCED - 1e-9
                            and not res["errors"])
            res["greedy_ok"] = gr is not None and gr >= QA_MIN_GREEDY - 1e-9 and not res["errors"]
        else:
            res["parity"] = parity_ok(kept, dense_correct) and not res["errors"]
        if name != "dense":
            res["verdict"] = _slice_verdict(rs, dense_rows, name, seed)
        out.append(res)
    fam_order = {f: i for i, f in enumerate(FAMILIES)}
    out.sort(key=lambda r: (fam_order.get(r["family"], 9), r["size"] or 0,
                            order.get(r["config"], len(order)), r["config"]))
    return out


def _slice_verdict(rs: Sequence[dict[str, Any]], dense_rows: dict[str, dict[str, Any]],
                   name: str, seed: int) -> dict[str, Any] | None:
    """The decision rule on one (family, size, configuration) slice (``None``: no dense pair)."""
    from sparkv.bench.verdict import decide

    paired = [dense_rows[r["probe"]] for r in rs if r["probe"] in dense_rows]
    return decide([*paired, *rs], name, seed).to_dict() if paired else None


def verdicts(results: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]] | None = None,
             seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per configuration: parity per retrieval family (over every size), the QA means, and
    ``keeps_quality``: pass-key parity at every size and QA teacher-forced >= 0.9 (each only
    where measured; the thresholds before the decision rule, kept for comparison). With the
    answer ``rows``, also ``verdict``: the decision rule over every answer of the configuration
    (every size and family pooled; :func:`sparkv.bench.verdict.decide`, ``Verdict.to_dict``:
    verdict, summary, per metric estimate, interval, margin), bootstrap seeded with ``seed``."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        if r["config"] == "dense":
            continue
        v = out.setdefault(r["config"], {"group": r["group"]})
        if r["family"] == "qa":
            v.update({"qa_teacher_forced": r["teacher_forced"],
                      "qa_divergences": r.get("divergences"),
                      "qa_near_tie_divergences": r.get("near_tie_divergences"),
                      "qa_greedy_agreement": r["greedy_agreement"],
                      "qa_first_token_kl": r["first_token_kl"], "qa_ok": r["qa_ok"],
                      "qa_greedy_ok": r["greedy_ok"]})
        else:
            key = f"{r['family']}_parity"
            v[key] = bool(v.get(key, True) and r["parity"])
            v.setdefault(f"{r['family']}_by_size", {})[str(r["size"])] = \
                f"{r['kept']}/{r['dense_correct']} of dense-correct ({r['correct']}/{r['n']})"
    for v in out.values():
        gates = [v[k] for k in ("passkey_parity", "qa_ok") if k in v]
        v["keeps_quality"] = bool(gates) and all(gates)
    if rows is not None:
        from sparkv.bench.verdict import decide_all

        for name, verdict in decide_all(rows, seed).items():
            out.setdefault(name, {"group": verdict.group})["verdict"] = verdict.to_dict()
    return out


def group_verdicts(verdict: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[str]]]:
    """Per group, the configurations that ``pass``, ``fail`` and are ``undecided`` (from
    :func:`verdicts` with rows; configurations without a verdict are left out)."""
    out: dict[str, dict[str, list[str]]] = {}
    for name, v in verdict.items():
        if v.get("verdict"):
            g = out.setdefault(v["group"], {"pass": [], "fail": [], "undecided": []})
            g[v["verdict"]["verdict"]].append(name)
    return out


# ---- the planner's table -------------------------------------------------------------------------
#: the groups that are not lossy knobs of their own: the reference and the strategies (their
#: split between the paths depends on timing), left out of the quality table
NOT_IN_TABLE = ("dense", "strategy")
#: the row keys that say what a configuration set (a table entry's ``params``)
PARAM_KEYS = ("level", "backend", "dtype", "press", "ratio")


def quality_table(rows: Sequence[dict[str, Any]], configs: Sequence[Config], lm: Any,
                  source: dict[str, Any], seed: int = 0) -> Any:
    """The :class:`~sparkv.predictor.quality.QualityTable` (version 2) from the answer rows: one
    section per group present (``level`` -> ``levels`` in the codec's order, ``backend`` ->
    ``backends``, ``dtype`` -> ``dtypes``, ``press`` -> ``presses``, ``device``, any other group
    under its own name; not ``dense`` nor ``strategy``), each entry with its means, its
    parameters and the decision rule's verdict (bootstrap seeded with ``seed``)."""
    from sparkv.bench.verdict import decide_all
    from sparkv.codec import LEVEL_ORDER
    from sparkv.predictor.quality import SECTION_OF_GROUP, QualityTable

    judged = decide_all(rows, seed)
    rank = {lv: i for i, lv in enumerate(LEVEL_ORDER)}
    sections: dict[str, list[Any]] = {}
    for c in configs:
        if c.group in NOT_IN_TABLE:
            continue
        rs = [r for r in rows if r["config"] == c.name]
        if not rs:
            continue
        e = _table_entry(_entry_name(c, rs[0]), rs, rows)
        e.params = {k: rs[0][k] for k in PARAM_KEYS if rs[0].get(k) is not None}
        e.verdict = judged[c.name].to_dict() if c.name in judged else None
        sections.setdefault(SECTION_OF_GROUP.get(c.group, c.group), []).append(e)
    levels = sorted(sections.pop("levels", []), key=lambda e: rank.get(e.name, 99))
    backends = sections.pop("backends", [])
    codecs = {r.get("codec") for r in rows if r["group"] == "level"}
    if len(codecs) > 1:
        raise ValueError(f"the level rows were measured on {len(codecs)} different codecs "
                         f"({sorted(map(str, codecs))}): re-score runs of one codec only")
    return QualityTable(lm.fingerprint, lm.name, time.time(), levels, backends, source,
                        int(lm.config.num_hidden_layers), str(next(iter(codecs), None) or ""),
                        sections)


def _entry_name(c: Config, row: dict[str, Any]) -> str:
    """A table entry's name: the level, backend, dtype or press spec it set; else the
    configuration's name (``device`` entries carry their ratio in ``params``)."""
    key = {"level": "level", "backend": "backend", "dtype": "dtype", "press": "press"}.get(c.group)
    value = row.get(key) if key else None
    if c.group == "level":
        value = c.level or value
    elif c.group == "backend":
        value = c.backend or value
    if c.group == "press" and value and ":" not in str(value) and row.get("ratio") is not None:
        value = f"{value}:{row['ratio']:g}"
    return str(value) if value else c.name


def _table_entry(name: str, rs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> Any:
    """The means of one configuration's rows ``rs`` (retrieval counted against the dense rows of
    ``rows``) as a :class:`~sparkv.predictor.quality.QualityEntry`."""
    from sparkv.predictor.quality import QualityEntry, RetrievalScore

    dense_ok = {r["probe"]: bool(r["correct"]) for r in rows if r["config"] == "dense"}
    retrieval = {}
    for fam in sorted({r["family"] for r in rs if r["family"] != "qa"}):
        fr = [r for r in rs if r["family"] == fam]
        retrieval[fam] = RetrievalScore(
            len(fr), sum(1 for r in fr if r["correct"]),
            sum(1 for r in fr if dense_ok.get(r["probe"])),
            sum(1 for r in fr if r["correct"] and dense_ok.get(r["probe"])))
    qa = [r for r in rs if r["family"] == "qa" and not r.get("error")]
    ok = [r for r in rs if not r.get("error") and r.get("mb") is not None]
    return QualityEntry(
        name, retrieval, len(qa), _mean(r["greedy_agreement"] for r in qa),
        _mean(r["teacher_forced"] for r in qa), _mean(r["first_token_kl"] for r in qa),
        _mean(r["mb"] * 1e6 / r["tokens"] for r in ok))


# ---- output ---------------------------------------------------------------------------------------
def _f(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _size_label(r: dict[str, Any]) -> str:
    if r["size"] is not None:
        return str(r["size"])
    return f"{r['tokens_min'] / 1e3:.1f}-{r['tokens_max'] / 1e3:.1f}K"


def table_text(results: Sequence[dict[str, Any]]) -> str:
    """The printed table: one line per (family, size, configuration)."""
    rows = []
    for r in results:
        if r["family"] == "qa":
            acc = f"kw {r['correct']}/{r['n']}"
            # answers that left dense's tokens (of them, at a near-tie of dense's own logits)
            rel = ("-" if r["config"] == "dense" or r.get("divergences") is None else
                   f"div {r['divergences']} ({r.get('near_tie_divergences', 0)} tie)")
        else:
            acc = f"{r['correct']}/{r['n']} ({r['accuracy']:.2f})"
            rel = (f"{r['kept']}/{r['dense_correct']}" if r["config"] != "dense" else "-")
        verdict = "" if r["config"] == "dense" else _slice_text(r)
        rows.append([r["family"], _size_label(r), r["config"], acc, rel,
                     _f(r["greedy_agreement"]), _f(r["teacher_forced"]),
                     _f(r["first_token_kl"], 4), _f(r["mb"], 1), _f(r["ttft_s"]),
                     (f"{r['errors']} err " if r["errors"] else "")
                     + (f"{r['fallbacks']} fb " if r["fallbacks"] else "") + verdict])
    return format_table(["family", "size", "config", "correct/n", "kept/dense", "greedy",
                         "teacher-f", "KL", "MB", "TTFT_s", "verdict"], rows)


def _slice_text(r: dict[str, Any]) -> str:
    """A slice's verdict cell: its deciding metric (retrieval: ``rel`` kept/dense_correct; QA:
    ``tf-drop``, the teacher-forced drop), its interval and margin, the metric's verdict."""
    from sparkv.bench.verdict import MetricVerdict

    v = r.get("verdict") or {}
    key, label = (("teacher_forced_drop", "tf-drop") if r["family"] == "qa"
                  else ("retrieval_relative", "rel"))
    m = (v.get("metrics") or {}).get(key)
    if m is None:
        return v.get("verdict", "-") if v else "-"
    return f"{label} {MetricVerdict.from_dict(m).text()}"


def plot(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Accuracy (retrieval) or teacher-forced agreement (QA; greedy as open markers) against MB
    streamed per answer, one panel per family, one point per (configuration, size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = [f for f in FAMILIES if any(r["family"] == f for r in results)]
    fig, axes = plt.subplots(1, max(1, len(fams)), figsize=(4.6 * max(1, len(fams)), 4.0),
                             squeeze=False)
    markers = {"dense": "*", "level": "o", "backend": "s", "strategy": "^"}
    sizes = sorted({r["size"] for r in results if r["size"] is not None})
    cmap = plt.get_cmap("viridis")
    colors = {s: cmap(i / max(1, len(sizes) - 1) * 0.85) for i, s in enumerate(sizes)}
    for ax, fam in zip(axes[0], fams):
        for i, r in enumerate(r for r in results if r["family"] == fam):
            x = r["mb"] or 0.0
            y = r["teacher_forced"] if fam == "qa" else r["accuracy"]
            if y is None:
                continue
            c = colors.get(r["size"], "tab:red")
            ax.scatter([x], [y], marker=markers.get(r["group"], "o"), color=c, s=36, zorder=3)
            if fam == "qa" and r["greedy_agreement"] is not None:
                ax.scatter([x], [r["greedy_agreement"]], marker=markers.get(r["group"], "o"),
                           facecolors="none", edgecolors=c, s=36, zorder=3)
            ax.annotate(r["config"], (x, y), fontsize=6, xytext=(3, 2 - 7 * (i % 4)),
                        textcoords="offset points")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_ylim(-0.05, 1.08)
        ax.set_xlabel("MB streamed per answer")
        ax.set_ylabel("teacher-forced (filled), greedy (open)" if fam == "qa" else "accuracy")
        ax.set_title(fam, fontsize=10)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker=m, linestyle="", color="gray", label=g)
               for g, m in markers.items()]
    handles += [plt.Line2D([], [], marker="o", linestyle="", color=colors[s], label=f"{s} tok")
                for s in sizes]
    axes[0][-1].legend(handles=handles, fontsize=7, loc="lower right")
    fig.suptitle("sparkv bench quality: answers against the dense full-precision reference",
                 fontsize=10)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


# ---- the command ----------------------------------------------------------------------------------
def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def resolve_args(args: argparse.Namespace) -> dict[str, Any]:
    """The options after ``--quick`` filled what was not given."""
    base = QUICK if args.quick else FULL
    opts = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    levels = _csv(opts["levels"])
    encode = list(dict.fromkeys(_csv(args.encode_levels) + levels))
    return {"tasks": _csv(opts["tasks"]), "sizes": [int(x) for x in _csv(opts["sizes"])],
            "trials": opts["trials"], "qa_questions": opts["qa_questions"], "levels": levels,
            "backends": _csv(opts["backends"]), "strategies": _csv(opts["strategies"]),
            "links": _csv(opts["links"]), "encode_levels": encode,
            "chunk_tokens": args.chunk_tokens, "rtt_ms": args.rtt_ms, "seed": args.seed,
            "quick": bool(args.quick), "qa_file": args.qa_file}


def load_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Answer rows from earlier runs: ``quality.json`` files (their ``answers``) or ``--rows``
    JSON-lines files. A (question, configuration) seen twice keeps its last row."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for p in paths:
        text = Path(p).read_text()
        if str(p).endswith(".jsonl"):
            found = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            found = list(json.loads(text).get("answers") or [])
        for r in found:
            rows[(r["probe"], r["config"])] = r
    return list(rows.values())


def configs_from_rows(rows: Sequence[dict[str, Any]]) -> list[Config]:
    """The configurations the rows name, dense first, then in order of appearance."""
    seen: dict[str, Config] = {}
    for r in rows:
        if r["config"] not in seen:
            seen[r["config"]] = Config(r["config"], r["group"], r.get("strategy"),
                                       r.get("level"), r.get("backend"), r.get("link"))
    return sorted(seen.values(), key=lambda c: c.group != "dense")


def run(args: argparse.Namespace) -> int:
    import torch

    from sparkv.runtime import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    opts = resolve_args(args)
    if args.json or args.out:
        result_path("quality", args.out, quick=args.quick)   # a quick run refuses a full file now
    lm = load_model(args.model)
    t0 = time.perf_counter()
    if args.rescore:
        rows = load_rows(_csv(args.rescore))
        configs = configs_from_rows(rows)
        opts["rescored"] = _csv(args.rescore)
        print(f"sparkv bench quality: re-scoring {len(rows)} answers from {args.rescore}")
    else:
        rows, configs = _measure_run(args, opts, lm)
    wall_s = time.perf_counter() - t0
    return report(args, opts, lm, rows, configs, wall_s)


def _measure_run(args: argparse.Namespace, opts: dict[str, Any], lm: Any
                 ) -> tuple[list[dict[str, Any]], list[Config]]:
    import torch

    from sparkv.server.process import ServerProcess

    trials = parse_trials(opts["trials"])
    configs = build_matrix(opts["levels"], opts["backends"], opts["strategies"], opts["links"])
    contexts = build_contexts(lm, opts["tasks"], opts["sizes"], trials, opts["qa_questions"],
                              opts["seed"], args.qa_file)
    n_answers = sum(len(c.probes) for c in contexts)
    print(f"sparkv bench quality: {len(contexts)} contexts, {n_answers} questions, "
          f"{len(configs)} configurations ({', '.join(c.name for c in configs)})", flush=True)
    with tempfile.TemporaryDirectory(prefix="sparkv-bench-quality-") as tmp:
        config_file = None
        if args.model:
            from sparkv.server.process import write_config

            config_file = f"{tmp}/server.yaml"
            write_config(config_file, None, models={"custom": str(args.model)},
                         default_model="custom")
        server = ServerProcess(config_file, f"file://{tmp}/store", log_path=f"{tmp}/server.log",
                               torch_threads=max(1, torch.get_num_threads())).start()
        try:
            rows = measure(lm, server.url, contexts, configs,
                           encode_levels=opts["encode_levels"],
                           chunk_tokens=opts["chunk_tokens"], rtt_ms=opts["rtt_ms"],
                           rows_path=args.rows, progress=not args.no_progress)
        finally:
            server.stop()
    return rows, configs


def report(args: argparse.Namespace, opts: dict[str, Any], lm: Any,
           rows: list[dict[str, Any]], configs: list[Config], wall_s: float) -> int:
    """Prints the table and the verdicts; writes the JSON, the plot and the quality table as
    asked; returns the exit status (``--check``)."""
    import torch

    seed = int(opts.get("seed") or 0)          # the bootstrap's seed is the run's --seed
    results = aggregate(rows, configs, seed)
    verdict = verdicts(results, rows, seed)
    n_questions = len({r["probe"] for r in rows})
    print()
    print(table_text(results))
    print()
    _print_verdicts(verdict)
    print(f"\n{n_questions} questions x {len(configs)} configurations in {wall_s / 60:.1f} min")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(opts)
    config["torch_threads"] = torch.get_num_threads()
    config["new_tokens"] = NEW_TOKENS
    config["context_margin"] = CONTEXT_MARGIN
    config["pinned_floor"] = PINNED_FLOOR
    config["auto_backend"] = auto_backend_name()
    table = None
    if args.save_table is not None:
        from sparkv.predictor.quality import (POLICY_THRESHOLDS, allowed_backends,
                                              allowed_levels, describe_table)

        table = quality_table(rows, configs, lm, {
            "benchmark": "sparkv bench quality", "tasks": sorted({r["family"] for r in rows}),
            "sizes": sorted({r["size"] for r in rows if r["size"] is not None}),
            "trials": opts["trials"], "qa_questions": len({r["probe"] for r in rows
                                                            if r["family"] == "qa"}),
            "chunk_tokens": opts["chunk_tokens"], "rule": rule_margins(),
            "bootstrap_seed": seed}, seed)
        path = table.save(args.save_table or None)
        print(f"quality table -> {path}")
        for line in describe_table(table):
            print(f"  {line}")
        pol = allowed_levels(table, **POLICY_THRESHOLDS)
        print(f"  the default policy may stream {pol}: floor {pol[-1] if pol else 'raw'}; "
              f"backends {allowed_backends(table, **POLICY_THRESHOLDS)} (levels and backends "
              "with a verdict: only pass)")
    if args.json or args.out:
        out = write_result("quality", {
            "configs": [c.to_dict() for c in configs], "results": results,
            "verdicts": verdict, "group_verdicts": group_verdicts(verdict),
            "rule": rule_margins(), "bootstrap_seed": seed,
            "targets": {"passkey_parity": "kept >= dense_correct - floor(dense_correct / 30): "
                                          "29 of 30 where dense gets 30 of 30",
                        "qa_min_teacher_forced": QA_MIN_TEACHER_FORCED,
                        "qa_min_greedy_agreement": QA_MIN_GREEDY},
            "quality_table": table.to_dict() if table is not None else None,
            "wall_s": wall_s, "answers": rows}, config, args.out, quick=args.quick)
        png = plot(results, out.with_suffix(".png"))
        print(f"wrote {out} and {png}")
    if args.check:
        return _check(verdict)
    return 0


def _check(verdict: dict[str, dict[str, Any]]) -> int:
    """``--check``: 1 when a ``default@`` configuration's verdict is ``fail`` (inferior to dense
    with 95% confidence); ``undecided`` is printed, not failed (the data cannot say)."""
    default = {k: v for k, v in verdict.items() if k.startswith("default@")}
    failed = [k for k, v in default.items() if (v.get("verdict") or {}).get("verdict") == "fail"]
    undecided = [f"{k} ({v['verdict']['summary']})" for k, v in default.items()
                 if (v.get("verdict") or {}).get("verdict") == "undecided"]
    if undecided:
        print(f"check: undecided, not failed: {'; '.join(undecided)}")
    if failed:
        print(f"CHECK FAILED: the default policy is inferior to dense in {failed}")
        return 1
    return 0


def rule_margins() -> dict[str, Any]:
    """The decision rule's margins and settings (recorded in the JSON and the table)."""
    from sparkv.bench import verdict as v

    return {"confidence": v.CONFIDENCE, "retrieval_min_relative": v.RETRIEVAL_MIN_RELATIVE,
            "teacher_forced_max_drop": v.TEACHER_FORCED_MAX_DROP,
            "first_token_kl_max": v.FIRST_TOKEN_KL_MAX, "greedy_max_drop": v.GREEDY_MAX_DROP,
            "greedy_gates": "fail only", "min_paired": v.MIN_PAIRED, "resamples": v.RESAMPLES}


def _print_verdicts(verdict: dict[str, dict[str, Any]]) -> None:
    """The verdicts table: one line per configuration, grouped by group, each metric as
    ``estimate [lower, upper] <=margin verdict`` (docs/quality.md, "The decision rule")."""
    from sparkv.bench.verdict import MetricVerdict

    groups = list(dict.fromkeys(v["group"] for v in verdict.values()))
    rows = []
    for g in groups:
        for name, v in verdict.items():
            if v["group"] != g:
                continue
            dv = v.get("verdict") or {}
            metrics = dv.get("metrics") or {}

            def cell(key: str) -> str:
                return MetricVerdict.from_dict(metrics[key]).text() if key in metrics else "-"

            rows.append([name, g, dv.get("summary", "-"), cell("retrieval_relative"),
                         cell("teacher_forced_drop"), cell("first_token_kl"),
                         cell("greedy_drop")])
    print(format_table(["config", "group", "verdict", "retrieval kept/dense",
                        "QA teacher-forced drop", "first-token KL", "greedy drop (fail only)"],
                       rows))
