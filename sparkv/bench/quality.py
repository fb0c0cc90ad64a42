"""``sparkv bench quality``: a quality suite that can fail. Retrieval tasks (RULER-style pass key,
multi-key, multi-value) and natural questions about the bundled license texts, answered under
each configuration and judged against the dense full-precision reference on the same inputs.

The matrix (docs/quality.md): each group varies one factor and holds the others at a value that
isolates it. The groups that depend neither on the question nor on timing are made in process,
paired, from one dense prefill per task (:mod:`sparkv.bench.variants`, :mod:`sparkv.bench.paired`);
only the strategy group goes through the real pipeline (a ``sparkv serve`` process on loopback,
real frames, the edge's engine):

=========  ===============================================  =====================================
group      configurations                                   what it isolates
=========  ===============================================  =====================================
dense      ``dense``: the model's own full prefill (fp32)   the reference every row is judged by
level      ``stream@L``: every chunk through the codec at   the codec (bit for bit what streaming
           level L                                          L delivers)
backend    ``local/B``: every chunk computed with           local attention (nothing streamed)
           attention backend B
dtype      ``local/dense@D``: local compute in dtype D      the compute dtype
press      ``press/SPEC``: the server's question-agnostic   the press and its kept ratio
           press
device     ``device@R``: the device service's tolerance     the device service's compression
           compression at global ratio R
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
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from sparkv.bench.answers import (NEAR_TIE_LOGITS, PINNED_FLOOR, Config, Probe,  # noqa: F401
                                  QualityContext, base_row, context_line, divergence, use_codec,
                                  reference_answers, reference_margins, score_answer)
from sparkv.bench.common import (MODEL_HELP, add_output_args, format_table, result_path,
                                 write_result)

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

#: retrieval families (sparkv.bench.tasks) and the QA set
RETRIEVAL = ("passkey", "multikey", "multivalue")
FAMILIES = (*RETRIEVAL, "qa")
#: greedy tokens generated per answer (multivalue lists three 7-digit numbers)
NEW_TOKENS = {"passkey": 16, "multikey": 24, "multivalue": 64, "qa": 32}
#: a task of nominal size N has a context of N - CONTEXT_MARGIN tokens, so that the context, the
#: question and the longest answer fit in N (SmolLM2's window is 8192)
CONTEXT_MARGIN = 128
#: targets: QA agreement with dense, and pass-key parity (one miss per 30 dense-correct tasks)
QA_MIN_TEACHER_FORCED = 0.9
QA_MIN_GREEDY = 0.9
PARITY_MISSES_PER = 30
#: the in-process groups' defaults (docs/quality.md, "The matrix"): the README demo's press is
#: ``adakv:0.5@repeat``; the device service's ratios are bytes relative to all-int8
VARIANT_DEFAULTS = {"levels": "q8,q6,q5,q4,q3", "backends": "dense,block_sparse",
                    "dtypes": "bfloat16",
                    "presses": "adakv:0.75,adakv:0.5,adakv:0.25,adakv:0.5@repeat",
                    "device_ratios": "1.0,0.75,0.5"}
FULL = {"tasks": "passkey,multikey,multivalue,qa", "sizes": "2048,4096", "trials": "10",
        **VARIANT_DEFAULTS, "strategies": "default", "links": "20", "qa_questions": None,
        "group_trials": None}
#: ``--table``: the table build of issue 27 (every QA question, pass key at 2K/4K/8K with 30
#: trials for the deciding groups; the presses on the first 10 of them, and at 8K the device
#: service and bf16 on 10 too: their 8K prefill (densities, a bf16 local prefill) would double
#: the build; q3 is not a candidate floor; no server). Estimated ~2.7 h as two one-thread
#: shards on the loaded 2-core CPU it was measured on (docs/quality.md, "Cost")
TABLE = {**FULL, "tasks": "passkey,qa", "sizes": "2048,4096,8192", "trials": "30",
         "levels": "q8,q6,q5,q4", "strategies": "",
         "group_trials": "press=10,device@8192=10,dtype@8192=10"}
QUICK = {"tasks": "passkey,qa", "sizes": "1024", "trials": "3", "levels": "q8,q5,q4",
         "backends": "dense,block_sparse", "dtypes": "bfloat16",
         "presses": "adakv:0.5@repeat,adakv:0.25", "device_ratios": "1.0,0.5",
         "strategies": "", "links": "20", "qa_questions": 3, "group_trials": None}


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
    p.add_argument("--new-tokens", default=None, metavar="FAMILY=N[,FAMILY=N]",
                   help="greedy tokens per answer, per family (default "
                        + ",".join(f"{k}={v}" for k, v in NEW_TOKENS.items())
                        + "): fewer make a quicker smoke run whose agreement covers fewer "
                          "tokens")
    p.add_argument("--qa-questions", type=int, default=None,
                   help="ask only the first N QA questions (default: all; --quick 3)")
    p.add_argument("--qa-file", default=None,
                   help="QA set files, comma-separated, in the format of "
                        "sparkv/data/qa_licenses.json (default: every bundled set; "
                        "docs/quality.md)")
    p.add_argument("--levels", default=None,
                   help="level group: every chunk through the codec at each level (default "
                        "q8,q6,q5,q4,q3; --quick q8,q5,q4; '' for none)")
    p.add_argument("--backends", default=None,
                   help="backend group: local with each backend (default dense,block_sparse)")
    p.add_argument("--dtypes", default=None,
                   help="dtype group: local dense compute in each compute configuration "
                        "(docs/dtypes.md: bfloat16, mixed, mixed-layers, bf16-weights, int8, "
                        "int4, int4-kernel, int4-decode, mixed-mlp-int4-decode, ...; default "
                        "bfloat16; float32 is local/dense)")
    p.add_argument("--presses", default=None,
                   help="press group: question-agnostic press specs (default adakv:0.75,"
                        "adakv:0.5,adakv:0.25,adakv:0.5@repeat; --quick adakv:0.5@repeat,"
                        "adakv:0.25)")
    p.add_argument("--device-ratios", default=None,
                   help="device group: the device service's tolerance compression at each "
                        "global ratio (default 1.0,0.75,0.5; --quick 1.0,0.5)")
    p.add_argument("--group-trials", default=None, metavar="GROUP=N[,GROUP@SIZE=N]",
                   help="ask an in-process group only the first N retrieval tasks per family "
                        "and size, e.g. press=10,device@8192=10 (default: all; --table "
                        "press=10,device@8192=10,dtype@8192=10)")
    p.add_argument("--strategies", default=None,
                   help="strategy group through a real server: local, stream, hybrid, sparkv, "
                        "default (default: default; --quick and --table: none)")
    p.add_argument("--links", default=None,
                   help="links of the strategy group: Mbit/s numbers and trace names or CSVs "
                        "(default 20)")
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
    p.add_argument("--table", action="store_true",
                   help="the table build: every QA question, pass key at 2048,4096,8192 with "
                        "30 trials (presses: 10; device and bf16 at 8K: 10), every "
                        "in-process group, no server")
    p.add_argument("--shard", default=None, metavar="I/N",
                   help="measure only every N-th context from the I-th (0-based): split a run "
                        "over processes, then merge their --rows with --rescore")
    add_output_args(p, "quality", quick=True,
                     json_help="write bench/results/quality.json and quality.png "
                               "(quality_quick.* with --quick)")
    p.add_argument("--rows", default=None,
                   help="also append every answer as a JSON line here while running; answers "
                        "already in the file are not measured again (a run resumes)")
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
                 links: Sequence[str], dtypes: Sequence[str] = (), presses: Sequence[str] = (),
                 device_ratios: Sequence[str] = ()) -> list[Config]:
    """The configurations, dense first (module docstring): the in-process groups
    (:mod:`sparkv.bench.variants`), then the server's strategy group. Raises ``ValueError``
    (or the group's own error) for an unknown strategy or a bad value."""
    from sparkv.bench.variants import make_variants

    out = [Config("dense", "dense")]
    out += [v.config() for v in make_variants({
        "level": levels, "backend": backends, "dtype": dtypes, "press": presses,
        "device": device_ratios})]
    return out + strategy_configs(strategies, links, backends)


def strategy_configs(strategies: Sequence[str], links: Sequence[str],
                     backends: Sequence[str] = ()) -> list[Config]:
    """The strategy group (through the server): each strategy under each link; ``local`` once
    (``local/auto``), and not at all when ``backends`` has what ``auto`` resolves to."""
    from sparkv.edge.planning import STRATEGIES

    bad = [s for s in strategies if s not in STRATEGIES and s != "default"]
    if bad:
        raise ValueError(f"unknown strategies {bad}; choose from "
                         f"{sorted(STRATEGIES) + ['default']}")
    out = []
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


def parse_new_tokens(text: str | None) -> dict[str, int]:
    """``"qa=8"`` -> :data:`NEW_TOKENS` with QA's answers 8 tokens long; ``ValueError`` for an
    unknown family, a bad item or fewer than one token."""
    out = dict(NEW_TOKENS)
    for part in _csv(text):
        fam, sep, n = part.partition("=")
        if not sep or fam.strip() not in FAMILIES or not n.strip().isdigit() or int(n) < 1:
            raise ValueError(f"--new-tokens takes FAMILY=N (N >= 1) with a family of "
                             f"{', '.join(FAMILIES)}; got {part!r}")
        out[fam.strip()] = int(n)
    return out


def build_contexts(lm: LoadedModel, tasks: Sequence[str], sizes: Sequence[int],
                   trials: Callable[[str, int], int], qa_questions: int | None = None,
                   seed: int = 0, qa_path: str | Path | None = None,
                   new_tokens: Mapping[str, int] = NEW_TOKENS) -> list[QualityContext]:
    """Retrieval contexts (``trials(family, size)`` per family and size, depths spread over
    10-90%, seeded) and one context per QA slice with its questions, in the order of
    ``tasks`` (then sizes); each answer is ``new_tokens[family]`` greedy tokens."""
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
                ctx.probes = [Probe(f"qa/{it.id}", "qa", it.question, new_tokens["qa"], False,
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
                                     chat_context(lm, lm.encode_text(task.document)), trial=i)
                ctx.probes.append(Probe(ctx.id, fam, task.question, new_tokens[fam], True,
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


def score_row(lm: LoadedModel, ctx: QualityContext, probe: Probe, config: Config, ref: Any,
              res: Any, suffix: Sequence[int], ref_margins: Sequence[float] | None = None
              ) -> dict[str, Any]:
    """:func:`score_answer` of one ``EdgeSession.ask`` result."""
    return score_answer(lm, ctx, probe, config, ref, suffix, res.text, res.tokens,
                        res.first_logits, res.load.kv, res.breakdown, res.breakdown.ttft_s,
                        ref_margins)


def answer_over_load(lm: LoadedModel, ctx: QualityContext, probe: Probe, config: Config, ref: Any,
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


def measure(lm: LoadedModel, url: str, contexts: Sequence[QualityContext],
            configs: Sequence[Config], *,
            encode_levels: Sequence[str], chunk_tokens: int = 512, rtt_ms: float = 20.0,
            rows_path: str | Path | None = None, progress: bool = True,
            emit_dense: bool = True) -> list[dict[str, Any]]:
    """Every probe under every configuration, through the server at ``url``; one row per answer
    (dense reference rows included; ``configs[0]`` must be the dense reference). Each context is
    encoded by the server, answered, then deleted from it.

    Every answer is one ``EdgeSession.ask``, except in the level and backend groups, whose load
    depends neither on the question nor on timing: there a context with several questions (a QA
    slice) is loaded once per configuration and the other questions are answered over that
    cache (:func:`answer_over_load`). An ask of those groups that fell back to local compute is
    asked again (:data:`FALLBACK_RETRIES` times), then recorded as an error. Without
    ``emit_dense`` the dense reference answers are computed (every row is judged by them) but
    not emitted (the in-process run already has them)."""
    import httpx
    from sparkv.logs import progress_bar

    from sparkv.edge.session import EdgeSession
    from sparkv.predictor.quality import codec_signature

    if not configs or configs[0].group != "dense":
        raise ValueError("the first configuration must be the dense reference")
    use_codec(codec_signature(lm.config.num_hidden_layers))
    rows: list[dict[str, Any]] = []
    sink = open(rows_path, "a") if rows_path else None
    total = sum(len(c.probes) for c in contexts) * (len(configs) - (not emit_dense))
    bar = progress_bar(total=total, desc="quality", unit="answer", disable=not progress,
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
            refs, suffixes, margins = _dense_reference(lm, ctx, configs[0],
                                                       emit if emit_dense else None)
            for config in configs[1:]:
                bar.set_postfix_str(f"{ctx.id}: {config.name}")
                _config_rows(lm, session, cid, ctx, config, refs, suffixes, margins, rtt_ms,
                             emit)
            try:
                httpx.delete(f"{url}/v1/contexts/{cid}", timeout=60.0)
            except httpx.HTTPError:
                pass
            bar.write(context_line(ctx, [r for r in rows if r["context"] == ctx.id]))
    finally:
        bar.close()
        session.close()
        if sink is not None:
            sink.close()
    return rows


def _dense_reference(lm: LoadedModel, ctx: QualityContext, dense: Config,
                     emit: Callable[[dict[str, Any]], None] | None
                     ) -> tuple[dict[str, Any], dict[str, list[int]], dict[str, list[float]]]:
    """The dense reference answer of every probe (full prefill on this device), emitted as the
    ``dense`` configuration's rows: ``(reference generations, question suffixes, the
    reference's margins of the QA probes)``, each by probe id."""
    import torch

    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.generate import reference_prefill
    from sparkv.runtime.kvcache import memory_from_layers

    n = len(ctx.token_ids)
    with torch.inference_mode():
        ref_layers = reference_prefill(lm, ctx.token_ids)
    ref_mem = memory_from_layers(ref_layers, ChunkGeometry.from_config(lm.config, n, n),
                                 spare_tokens=128)
    del ref_layers
    return reference_answers(lm, ctx, ref_mem, dense, emit)


def _config_rows(lm: LoadedModel, session: Any, cid: str, ctx: QualityContext, config: Config,
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
PARAM_KEYS = ("level", "backend", "dtype", "press", "ratio", "ladder")


def quality_table(rows: Sequence[dict[str, Any]], configs: Sequence[Config], lm: LoadedModel,
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
    """The options after the preset (``--quick``, ``--table`` or the default) filled what was
    not given."""
    if args.quick and getattr(args, "table", False):
        raise ValueError("--quick and --table are two presets: choose one")
    base = QUICK if args.quick else TABLE if getattr(args, "table", False) else FULL
    opts: dict[str, Any] = {k: getattr(args, k, None) if getattr(args, k, None) is not None
                            else v for k, v in base.items()}
    strategies = _csv(opts["strategies"])
    return {"tasks": _csv(opts["tasks"]), "sizes": [int(x) for x in _csv(opts["sizes"])],
            "trials": opts["trials"], "qa_questions": opts["qa_questions"],
            "levels": _csv(opts["levels"]), "backends": _csv(opts["backends"]),
            "dtypes": _csv(opts["dtypes"]), "presses": _csv(opts["presses"]),
            "device_ratios": _csv(opts["device_ratios"]), "group_trials": parse_group_trials(opts["group_trials"]),
            "strategies": strategies, "links": _csv(opts["links"]) if strategies else [],
            "encode_levels": _csv(args.encode_levels), "chunk_tokens": args.chunk_tokens,
            "rtt_ms": args.rtt_ms, "seed": args.seed, "quick": bool(args.quick),
            "table": bool(getattr(args, "table", False)), "qa_file": args.qa_file,
            "shard": getattr(args, "shard", None),
            "new_tokens": parse_new_tokens(getattr(args, "new_tokens", None))}


def parse_group_trials(text: str | None) -> dict[Any, int]:
    """``"press=10,device@8192=5"`` -> ``{"press": 10, ("device", 8192): 5}`` (the keys of
    :func:`sparkv.bench.paired.applies`); ``ValueError`` for an unknown group or a bad item."""
    from sparkv.bench.variants import VARIANTS

    out: dict[Any, int] = {}
    for part in _csv(text):
        key, sep, n = part.partition("=")
        group, _, size = key.strip().partition("@")
        if not sep or group not in VARIANTS:
            raise ValueError(f"--group-trials takes GROUP=N or GROUP@SIZE=N with a group of "
                             f"{', '.join(VARIANTS)}; got {part!r}")
        out[(group, int(size)) if size else group] = int(n)
    return out


def done_answers(rows: Iterable[dict[str, Any]],
                 new_tokens: Mapping[str, int]) -> set[tuple[str, str]]:
    """The (probe, configuration) pairs an earlier run answered without error and at this
    run's answer length (a row without one has the default's): a resumed run skips them."""
    return {(r["probe"], r["config"]) for r in rows if not r.get("error")
            and r.get("new_tokens", NEW_TOKENS[r["family"]]) == new_tokens[r["family"]]}


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"1/4"`` -> ``(1, 4)`` (``None`` -> ``(0, 1)``); ``ValueError`` unless ``0 <= I < N``."""
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (e.g. 0/2), not {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= I < N")
    return i, n


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
                                       r.get("level"), r.get("backend"), r.get("link"),
                                       r.get("dtype"), r.get("press"), r.get("ratio"))
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


def _measure_run(args: argparse.Namespace, opts: dict[str, Any], lm: LoadedModel
                 ) -> tuple[list[dict[str, Any]], list[Config]]:
    """The in-process groups (:func:`sparkv.bench.paired.evaluate`), then the strategy group
    through a server; with ``--rows``, answers already in that file are kept, not measured."""
    from sparkv.bench.paired import evaluate
    from sparkv.bench.variants import make_variants

    variants = make_variants({"level": opts["levels"], "backend": opts["backends"],
                              "dtype": opts["dtypes"], "press": opts["presses"],
                              "device": opts["device_ratios"]})
    configs = [Config("dense", "dense"), *(v.config() for v in variants),
               *strategy_configs(opts["strategies"], opts["links"], opts["backends"])]
    i, n = parse_shard(opts["shard"])
    contexts = build_contexts(lm, opts["tasks"], opts["sizes"], parse_trials(opts["trials"]),
                              opts["qa_questions"], opts["seed"], args.qa_file,
                              opts["new_tokens"])[i::n]
    earlier = load_rows([args.rows]) if args.rows and Path(args.rows).exists() else []
    done = done_answers(earlier, opts["new_tokens"])
    resumed = f"; {len(done)} answers already in {args.rows}" if done else ""
    print(f"sparkv bench quality: {len(contexts)} contexts, "
          f"{sum(len(c.probes) for c in contexts)} questions, {len(configs)} configurations "
          f"({', '.join(c.name for c in configs)}){resumed}", flush=True)
    rows: list[dict[str, Any]] = []
    with open(args.rows, "a") if args.rows else nullcontext() as sink:
        def emit(row: dict[str, Any]) -> None:
            rows.append(row)
            _sink(sink, row)

        evaluate(lm, contexts, variants, emit=emit, done=done, max_trials=opts["group_trials"],
                 chunk_tokens=opts["chunk_tokens"], progress=not args.no_progress)
    strategies = [c for c in configs if c.group == "strategy"]
    if strategies:
        rows += _server_run(args, opts, lm, contexts, [configs[0], *strategies])
    fresh = {(r["probe"], r["config"]) for r in rows}
    return [r for r in earlier if (r["probe"], r["config"]) not in fresh] + rows, configs


def _server_run(args: argparse.Namespace, opts: dict[str, Any], lm: LoadedModel,
                contexts: Sequence[QualityContext], configs: Sequence[Config]
                ) -> list[dict[str, Any]]:
    """The strategy group's answers through a ``sparkv serve`` process on loopback (the dense
    rows come from the in-process run)."""
    import torch

    from sparkv.server.process import ServerProcess

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
            return measure(lm, server.url, contexts, configs,
                           encode_levels=opts["encode_levels"],
                           chunk_tokens=opts["chunk_tokens"], rtt_ms=opts["rtt_ms"],
                           rows_path=args.rows, progress=not args.no_progress,
                           emit_dense=False)
        finally:
            server.stop()


def report(args: argparse.Namespace, opts: dict[str, Any], lm: LoadedModel,
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
