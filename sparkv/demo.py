"""``sparkv demo``: the README's main job. A server on loopback (a real ``sparkv serve`` process)
encodes the bundled sample context; the device answers one question about it with every
strategy under an emulated link; the answers, the dense reference and a TTFT table are printed,
and a timeline plot and JSON are written. The sparkv run keeps its loaded cache in the device's
context service (``sparkv.device``), and a follow-up question is answered from it: no stream, only
its own prefill. Last, the device's system service is asked by two apps at once through the
``openai`` client, then asked their follow-ups at once (:mod:`sparkv.demoapps`).

This module sits above both sides (it starts the server and drives the edge), beside the CLI.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import statistics
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from sparkv.cliflags import PRESS_METAVAR, STRATEGY_NAMES, add_device_args
from sparkv.edge.commands import add_link_args, shaper_from_args

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

log = logging.getLogger("sparkv.demo")

DEMO_QUESTION = "What does this text say about warranty? Answer in one sentence."
FOLLOW_UP = "Who may copy and distribute this text? Answer in one sentence."
#: the follow-up asked again for a JSON answer of this schema (OpenAI's structured outputs)
FOLLOW_UP_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
                    "properties": {"answer": {"type": "string", "maxLength": 200}}}
#: the JSON answer's token cap (a sentence inside its braces)
JSON_TOKENS = 64
#: the follow-up asked a third time with a tool the answer must call (OpenAI's tools)
FOLLOW_UP_TOOL: dict[str, Any] = {"name": "record_answer",
                                  "description": "Records the answer to the question",
                                  "parameters": FOLLOW_UP_SCHEMA}
#: the tool call's token cap (its tags, its name, a sentence)
TOOL_TOKENS = 96


def register(sub: "argparse._SubParsersAction") -> None:
    d = sub.add_parser("demo", help="the main job: a server on loopback, the sample context, every "
                                    "strategy under a link trace, a TTFT table and a plot")
    d.add_argument("--model", default=None, help="local checkpoint (default: bundled SmolLM2)")
    d.add_argument("--tokens", type=int, default=2048, help="context tokens (of the sample text)")
    d.add_argument("--chunk-tokens", type=int, default=512,
                   help="T the server encodes the context with (the TTFT benchmarks' T)")
    d.add_argument("--levels", default="raw,q8,q5", help="levels the server encodes")
    d.add_argument("--question", default=DEMO_QUESTION, help="the question every strategy answers")
    d.add_argument("--max-new-tokens", type=int, default=40,
                   help="answer length, tokens")
    d.add_argument("--runs", type=int, default=3,
                   help="timed asks of every answer, interleaved (the table's TTFT is their "
                        "median; the first also answers in full, the others stop at the first "
                        "token): one run on a shared or drifting CPU moves the ratios by 5%%")
    d.add_argument("--strategies", default="local,stream,hybrid,sparkv",
                   help="strategies to answer with, comma-separated")
    d.add_argument("--press", default="auto", metavar=PRESS_METAVAR,
                   help="also answer with sparkv from a variant of the context compressed on the "
                        "server by this KV press (docs/presses.md; 'none' to skip; 'auto': the "
                        "most compressing press that passes the model's quality table, else the "
                        "most compressing codec level that passes, for every streamed chunk; the "
                        "verdict is printed beside the answer)")
    d.add_argument("--out-dir", default="sparkv-demo",
                   help="directory for the plot and JSON")
    d.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    d.add_argument("--no-apps", action="store_true",
                   help="skip the last part: the device service (sparkv device serve) asked by "
                        "two apps at once through the openai client")
    add_device_args(d)
    add_link_args(d, default="lte")
    d.set_defaults(func=run_demo, trace="lte")


ROW_HEADERS = ["strategy", "TTFT_s", "loading_s", "link_s", "compute_s", "question_s", "MB",
               "streamed/computed", "migr", "agree"]
"""The printed table's columns (one row per answer: :func:`_row`)."""
ROW_KEYS = ["strategy", "ttft_s", "loading_s", "link_s", "compute_s", "question_s", "MB",
            "streamed_computed", "migrations", "agreement"]
"""The same columns as keys of demo.json's rows."""


@dataclass
class Answers:
    """What the demo answered, one entry per answer: its label, its result (``runs``: the plot's
    title and the result), its table row (:func:`_row`), an ask that times it again
    (``again``) and the TTFT of each of its runs; ``apps``: the device service's part
    (:mod:`sparkv.demoapps`)."""

    ref: list[int]
    runs: list[tuple[str, Any]] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    again: list[tuple[str, Callable[[], Any]]] = field(default_factory=list)
    ttfts: dict[str, list[float]] = field(default_factory=dict)
    apps: dict[str, Any] | None = None

    def add(self, label: str, title: str, res: Any, again: Callable[[], Any]) -> None:
        self.runs.append((f"{title}: TTFT {res.breakdown.ttft_s:.2f} s", res))
        self.rows.append(_row(label, res, self.ref))
        self.again.append((label, again))
        self.ttfts[label] = [res.breakdown.ttft_s]

    def time_again(self, runs: int) -> None:
        """``runs - 1`` more rounds of every answer's ask, each round in a rotated order (a
        drifting CPU's speed is shared out); each row's TTFT becomes the median of its runs."""
        for r in range(1, runs):
            log.info("timing every answer again: run %d of %d ...", r + 1, runs)
            order = self.again[r % len(self.again):] + self.again[:r % len(self.again)]
            for label, ask in order:
                self.ttfts[label].append(ask().breakdown.ttft_s)
        for row in self.rows:
            row[1] = statistics.median(self.ttfts[row[0]])


def run_demo(args: argparse.Namespace) -> int:
    import torch

    from sparkv.extras import SERVER_MODULES, require_all

    require_all((*SERVER_MODULES, "matplotlib"), feature="sparkv demo")   # a server, and plots
    from sparkv.edge.prompts import chat_context
    from sparkv.predictor.dtypes import load_model_in_dtype
    from sparkv.runtime.heap import settle
    from sparkv.runtime import sample_context_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGY_NAMES]
    from sparkv.errors import SparkvError
    if bad:
        raise SparkvError(f"unknown strategies {bad}; choose from {list(STRATEGY_NAMES)}")
    if args.runs < 1:
        raise SparkvError(f"--runs must be at least 1 (got {args.runs})")
    shaper_from_args(args)          # a bad --trace fails now, before the model loads
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log.info("sparkv demo: loading the model ...")
    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    choice = lm.extra["dtype_choice"]
    log.info("computing in %s on %s (%s)", choice.compute, lm.device, choice.reason)
    settle()             # the model for good: out of full collections (sparkv.runtime.heap)
    context = chat_context(lm, sample_context_ids(lm, args.tokens))
    link = (f"{args.mbps:g} Mbit/s" if args.mbps else
            f"trace {args.trace!r}" if args.trace else "unshaped loopback")
    with tempfile.TemporaryDirectory(prefix="sparkv-demo-") as tmp:
        server = _server(args, tmp)
        log.info("starting the server on loopback ...")
        with server:
            answers, follow = _ask_everything(args, lm, context, server.url, tmp, strategies,
                                              link)
    _print_summary(lm, answers, args.runs)
    png = _write_results(out, args, context, link, answers, follow)
    log.info("timeline plot: %s", png)
    sys.stdout.flush()
    return 0


def _server(args: argparse.Namespace, tmp: str) -> Any:
    """The ``sparkv serve`` process (not started) with its store in ``tmp``, encoding with the
    device's checkpoint when ``--model`` names one."""
    import torch

    from sparkv.server.process import ServerProcess, write_config

    config = None
    if args.model:  # the server encodes with the same checkpoint as the device
        config = f"{tmp}/server.yaml"
        write_config(config, None, models={"custom": str(args.model)}, default_model="custom")
    return ServerProcess(config, f"file://{tmp}/store", log_path=f"{tmp}/server.log",
                         torch_threads=max(1, torch.get_num_threads()),
                         extra_args=["--device", str(args.device), "--dtype", str(args.dtype)])


def _ask_everything(args: argparse.Namespace, lm: LoadedModel, context: list[int], url: str,
                    tmp: str, strategies: list[str], link: str) -> tuple[Answers, Any]:
    """Has the server encode the context, then asks the question with every strategy (and the
    pressed variant, and the follow-up, when sparkv is among them), then times every answer's
    ask ``--runs - 1`` more times: ``(the answers, the follow-ups or None)``: the follow-up's
    result and its JSON answer's summary."""
    from sparkv.device import ContextService
    from sparkv.edge.options import AskOptions
    from sparkv.edge.prompts import question_suffix
    from sparkv.edge.session import EdgeSession
    from sparkv.runtime.generate import reference_generate

    # encoding the context can take longer than a request's default 10 s on a busy CPU
    session = EdgeSession.connect(url, model=lm, timeout_s=120.0)
    t0 = time.perf_counter()
    levels = [x for x in args.levels.split(",") if x]
    cid = session.client.create_context(token_ids=context, levels=levels,
                                        chunk_tokens=args.chunk_tokens, progress=True)
    log.info("context %s: %d tokens encoded by the server in %.1f s", cid, len(context),
             time.perf_counter() - t0)
    suffix = question_suffix(lm, args.question)
    print(f"question: {args.question!r}; link: {link}\n", flush=True)
    answers = Answers(reference_generate(lm, context + suffix, args.max_new_tokens))
    _warm_up(session, cid, args, strategies)
    # the sparkv run keeps what it loaded as a context of the device's context service
    session.context_service = ContextService(lm, 1 << 30, Path(tmp) / "kept", compression="fp")
    follow: tuple[Any, dict[str, Any]] | None = None
    for strat in strategies:
        options = AskOptions(strategy=strat, max_new_tokens=args.max_new_tokens,
                             use_cache=False, keep=strat == "sparkv")
        res = _ask(session, cid, args, options)
        answers.add(strat, strat, res, _again(session, cid, args, options))
        print(f"[{strat:>6}] {res.text.strip()}", flush=True)
    press = (args.press or "").strip()
    if "sparkv" in strategies and press.lower() not in ("", "none"):
        _ask_variant(session, cid, press, args, answers)
    if "sparkv" in strategies:
        follow = (_ask_follow_up(session, cid, lm, context, args, answers.rows),
                  _ask_structured(session, cid, lm, context))
    answers.time_again(args.runs)
    session.close()
    if not args.no_apps:
        from sparkv.demoapps import ask_as_apps

        answers.apps = ask_as_apps(args, lm, context, cid, url, tmp, FOLLOW_UP)
    return answers, follow


def _warm_up(session: Any, cid: str, args: argparse.Namespace, strategies: list[str]) -> None:
    """One unshaped ask of every strategy (local first) before the measured ones, as ``bench
    ttft`` does: the cost model's calibration and the first use of each path's kernels, threads
    and tables are paid here, not by whichever strategy asks first (local's TTFT carried ~0.75 s
    of them; a session's first sparkv ask after a local one took 3.4-3.7 s on the LTE trace, the
    next ones 1.8-2.6, session 70)."""
    from sparkv.edge.options import AskOptions
    from sparkv.edge.shaper import LinkShaper

    session.client.shaper = LinkShaper.unlimited()
    for strat in ["local", *[s for s in strategies if s != "local"]]:
        session.ask(cid, args.question, AskOptions(strategy=strat, max_new_tokens=2,
                                                    use_cache=False))


def _ask_follow_up(session: Any, cid: str, lm: LoadedModel, context: list[int],
                   args: argparse.Namespace, rows: list[list[Any]]) -> Any:
    """The follow-up, answered from the context the sparkv ask kept, beside whether it is what
    a dense full prefill of it answers."""
    from sparkv.edge.options import AskOptions
    from sparkv.edge.prompts import question_suffix
    from sparkv.runtime.generate import reference_generate

    follow = session.ask(cid, FOLLOW_UP, AskOptions(max_new_tokens=args.max_new_tokens, keep=True))
    first = next(r for r in rows if r[0] == "sparkv")
    print(f"\nfollow-up {FOLLOW_UP!r}, answered from the kept context: "
          f"TTFT {follow.breakdown.ttft_s:.2f} s (the first sparkv ask: {first[1]:.2f} s),"
          f" {follow.breakdown.bytes_streamed} bytes streamed\n"
          f"[kept] {follow.text.strip()}", flush=True)
    ref = reference_generate(lm, context + question_suffix(lm, FOLLOW_UP), args.max_new_tokens)
    print(f"  {reference_note(ref, follow.tokens)} (a dense full prefill of the follow-up)",
          flush=True)
    return follow


def _ask_structured(session: Any, cid: str, lm: LoadedModel, context: list[int]
                    ) -> dict[str, Any]:
    """The follow-up as JSON of a schema, then as a tool call (both from the kept context),
    each beside what a dense prefill answers under the same form: ``demo.json``'s
    ``json_follow_up`` with the call under ``tool_call``."""
    import torch

    from sparkv.runtime.generate import reference_prefill

    with torch.inference_mode():
        kv = reference_prefill(lm, context)
    out = _ask_json(session, cid, lm, (kv, len(context)))
    out["tool_call"] = _ask_tool(session, cid, lm, (kv, len(context)))
    return out


def _dense_note(lm: LoadedModel, dense: tuple[Any, int], question: Any, form: Any,
                tokens: list[int], cap: int) -> bool:
    """Prints whether ``tokens`` are what a dense prefill answers under ``form``; returns it."""
    from sparkv.edge.prompts import question_suffix
    from sparkv.runtime.generate import greedy_generate
    from sparkv.runtime.sampling import Sampling

    kv, n = dense
    ref = greedy_generate(lm, kv, n, question_suffix(lm, question), cap,
                          sampling=Sampling(form=form)).tokens
    print(f"  {reference_note(ref, tokens)} (a dense prefill, the same form)", flush=True)
    return list(ref) == list(tokens)


def _ask_json(session: Any, cid: str, lm: LoadedModel, dense: tuple[Any, int]
              ) -> dict[str, Any]:
    """The follow-up again, its answer JSON of :data:`FOLLOW_UP_SCHEMA` (from the kept
    context)."""
    from sparkv.edge.options import AskOptions
    from sparkv.runtime.jsonform import JsonForm

    form = JsonForm.from_schema(FOLLOW_UP_SCHEMA, "answer")
    res = session.ask(cid, FOLLOW_UP, AskOptions(max_new_tokens=JSON_TOKENS, keep=True,
                                                 form=form))
    whole = len(res.tokens) < JSON_TOKENS
    print(f"\nthe follow-up as JSON of {json.dumps(FOLLOW_UP_SCHEMA['properties'])} (OpenAI's "
          f"response_format json_schema), from the kept context: TTFT "
          f"{res.breakdown.ttft_s:.2f} s\n[json] {res.text.strip()}"
          + ("" if whole else f"  (cut at {JSON_TOKENS} tokens: a prefix of the JSON)"),
          flush=True)
    same = _dense_note(lm, dense, FOLLOW_UP, form, res.tokens, JSON_TOKENS)
    return {"question": FOLLOW_UP, "schema": FOLLOW_UP_SCHEMA, "answer": res.text,
            "whole": whole, "dense_tokens_equal": same}


def _ask_tool(session: Any, cid: str, lm: LoadedModel, dense: tuple[Any, int]
              ) -> dict[str, Any]:
    """The follow-up a third time with :data:`FOLLOW_UP_TOOL`, which the answer must call
    (``tool_choice`` required, one call), from the kept context."""
    from sparkv.edge.options import AskOptions
    from sparkv.runtime.toolform import Tool, ToolSet
    from sparkv.runtime.turns import ChatTurn, Conversation

    tools = ToolSet([Tool(**FOLLOW_UP_TOOL, strict=True)], "required", parallel=False)
    form = tools.form()
    asked = Conversation((ChatTurn("system", tools.instructions()), ChatTurn("user", FOLLOW_UP)))
    res = session.ask(cid, asked, AskOptions(max_new_tokens=TOOL_TOKENS, keep=True, form=form))
    calls = tools.read(res.text)
    cut = f"  (cut at {TOOL_TOKENS} tokens: a call's beginning)"
    shown = (f"[call] {calls[0].name}({calls[0].arguments})"
             + ("" if calls[0].complete else cut) if calls else f"[call] {res.text.strip()}{cut}")
    print(f"\nthe follow-up with a tool to call, {FOLLOW_UP_TOOL['name']}"
          f"{json.dumps(FOLLOW_UP_SCHEMA['properties'])} (OpenAI's tools, tool_choice "
          f"required), from the kept context: TTFT {res.breakdown.ttft_s:.2f} s\n{shown}",
          flush=True)
    same = _dense_note(lm, dense, asked, form, res.tokens, TOOL_TOKENS)
    return {"tool": FOLLOW_UP_TOOL, "text": res.text,
            "calls": [{"name": c.name, "arguments": c.arguments, "complete": c.complete}
                      for c in calls],
            "dense_tokens_equal": same}


def _ask(session: Any, cid: str, args: argparse.Namespace, options: Any) -> Any:
    """One ask that meets the link trace from its start, with nothing learned of the link."""
    session.client.shaper = shaper_from_args(args)
    session.priors.bandwidth_Bps = None
    return session.ask(cid, args.question, options)


def _again(session: Any, cid: str, args: argparse.Namespace, options: Any) -> Callable[[], Any]:
    """The ask of ``options`` again, to time it: it stops at its first token and keeps
    nothing."""
    again = replace(options, max_new_tokens=1, keep=False)
    return lambda: _ask(session, cid, args, again)


def _ask_variant(session: Any, cid: str, press: str, args: argparse.Namespace,
                 answers: Answers) -> None:
    """The compressed variant: the press ``press`` (:func:`choose_press`); for ``auto`` without
    a passing press, the most compressing codec level that passes (:func:`passing_level`), else
    nothing. Says in one line why a press was not used."""
    from sparkv.edge.options import AskOptions

    spec, note = choose_press(session.lm.fingerprint, press)
    if spec is not None:
        _ask_pressed(session, cid, spec, note, args, answers)
        return
    levels = [x for x in args.levels.split(",") if x]
    level = passing_level(session.lm.fingerprint, levels)
    if level is None:
        print(f"\n--press auto: {note}, nor does a codec level the server encoded "
              f"({args.levels}): no compressed variant is shown", flush=True)
        return
    name, entry = level
    print(f"\n--press auto: {note}; shown instead, the most compressing configuration that "
          f"passes: every streamed chunk at {name} ({entry.bytes_per_token / 1e3:.1f} kB per "
          f"token, quality table: {entry.verdict_summary})", flush=True)
    options = AskOptions(strategy="sparkv", level=name, max_new_tokens=args.max_new_tokens,
                         use_cache=False)
    res = _ask(session, cid, args, options)
    label = f"sparkv@{name}"
    answers.add(label, label, res, _again(session, cid, args, options))
    print(f"[{label}] {res.text.strip()}", flush=True)
    print(f"  {reference_note(answers.ref, res.tokens)}", flush=True)


def _ask_pressed(session: Any, cid: str, spec: str, note: str, args: argparse.Namespace,
                 answers: Answers) -> None:
    """Has the server compress the context with the press ``spec`` and asks sparkv over the
    compressed variant (added to ``answers`` as ``sparkv+press``); ``note``: the quality
    table's verdict on it."""
    from sparkv.edge.client import QualityWarning
    from sparkv.edge.options import AskOptions
    from sparkv.presses import canonical_spec

    spec = canonical_spec(spec)
    t0 = time.perf_counter()
    with warnings.catch_warnings():      # the demo prints the warning as its own line below
        warnings.simplefilter("ignore", QualityWarning)
        pcid = session.client.pressed_context(cid, spec, progress=True)
    print(f"\ncompressed variant {pcid} ({spec}): encoded by the server in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if session.client.quality_warnings.get(pcid):
        print(f"  the server warns: {session.client.quality_warnings[pcid]}", flush=True)
    options = AskOptions(strategy="sparkv", max_new_tokens=args.max_new_tokens, use_cache=False)
    res = _ask(session, pcid, args, options)
    label = "sparkv+press"
    answers.add(label, f"{label} ({spec})", res, _again(session, pcid, args, options))
    print(f"[{label}] {res.text.strip()}\n  (quality table, {spec}: {note})", flush=True)
    print(f"  {reference_note(answers.ref, res.tokens)}", flush=True)


def reference_note(ref: list[int], tokens: list[int]) -> str:
    """Whether an answer is the dense reference's, said beside it: the demo never shows an
    answer worse than dense without saying so."""
    from sparkv.runtime.generate import greedy_agreement

    if list(tokens) == list(ref):
        return "the same tokens as the dense reference"
    return (f"NOT the dense reference's answer: greedy agreement {greedy_agreement(ref, tokens):.2f}"
            " (this configuration changes what the model says; docs/quality.md)")


def _fewest_bytes(entries: list[Any]) -> Any:
    """The entry that streams the fewest bytes per token (the first with equal or unknown
    bytes), or ``None``."""
    return min(entries, key=lambda e: e.bytes_per_token if e.bytes_per_token is not None
               else float("inf"), default=None)


def choose_press(model_fingerprint: str, requested: str) -> tuple[str | None, str]:
    """``(press spec, what the model's quality table says of it)``. ``auto``: the passing press
    of the table's ``presses`` section that streams the fewest bytes per token, else ``(None,
    why no press is used)``; another spec is taken as given. The note is the entry's verdict
    summary (``pass``, ``FAIL (...)``, ``undecided: ...``) or ``not measured`` (no row, or a
    version 1 table)."""
    from sparkv.predictor.quality import passing_entries, usable_table
    from sparkv.presses import canonical_spec

    table = usable_table(model_fingerprint, check_codec=False)
    spec = requested
    if requested.strip().lower() == "auto":
        best = _fewest_bytes(passing_entries(table, "presses") if table is not None else [])
        if best is None:
            return None, _no_press_passes(table)
        spec = best.name
    entry = table.entry("presses", canonical_spec(spec)) if table is not None else None
    if entry is None or not entry.verdict:
        return spec, "not measured"
    return spec, entry.verdict_summary


def _no_press_passes(table: Any) -> str:
    """Why ``--press auto`` uses no press (the table's press verdicts, when it has some)."""
    if table is None:
        return "this model has no quality table, so no KV press is known to pass"
    judged = [e for e in table.section("presses") if e.verdict]
    if not judged:
        return "this model's quality table judged no KV press"
    return ("no KV press passes this model's quality table ("
            + ", ".join(f"{e.name} {e.verdict_summary}" for e in judged) + ")")


def passing_level(model_fingerprint: str, encoded: list[str]) -> tuple[str, Any] | None:
    """The most compressing codec level (fewest bytes per token) of those the server encoded
    (``encoded``) that the model's quality table passes (:func:`allowed_levels
    <sparkv.predictor.quality.allowed_levels>`), with its table entry; ``None`` when no lossy
    one does (or there is no usable table)."""
    from sparkv.predictor.quality import LOSSLESS, allowed_levels, usable_table

    table = usable_table(model_fingerprint)
    if table is None:
        return None
    allowed = set(allowed_levels(table)) & set(encoded) - {LOSSLESS}
    best = _fewest_bytes([e for e in table.levels if e.name in allowed])
    return None if best is None else (best.name, best)


def _row(label: str, res: Any, ref: list[int]) -> list[Any]:
    """One answer's table row (:data:`ROW_HEADERS`)."""
    from sparkv.runtime.generate import greedy_agreement

    bd = res.breakdown
    return [label, bd.ttft_s, bd.loading_s, bd.streaming_s, bd.local_compute_s,
            bd.question_prefill_s, bd.bytes_streamed / 1e6,
            f"{bd.chunks_streamed}/{bd.chunks_computed}", bd.migrations,
            greedy_agreement(ref, res.tokens)]


def _print_summary(lm: LoadedModel, answers: Answers, runs: int) -> None:
    from sparkv.tables import format_table

    rows = answers.rows
    print(f"[reference, dense full prefill] {lm.decode_tokens(answers.ref).strip()}\n")
    print(format_table(ROW_HEADERS, rows))
    if runs > 1:
        print(f"TTFT_s: the median of {runs} runs of each, interleaved (the other columns: the "
              f"run that answered in full; every run's TTFT in demo.json)")
    base = [r[1] for r in rows if not r[0].startswith("sparkv")]
    best = min(base) if base else None
    sp = [r[1] for r in rows if r[0] == "sparkv"]
    if best and sp:
        print(f"\nsparkv TTFT / best baseline = {sp[0] / best:.2f}")
    variant = [r for r in rows if r[0].startswith(("sparkv+", "sparkv@"))]
    if best and variant:
        print(f"{variant[0][0]}, TTFT / best baseline = {variant[0][1] / best:.2f}")


def _write_results(out: Path, args: argparse.Namespace, context: list[int], link: str,
                   answers: Answers, follow: tuple[Any, dict[str, Any]] | None) -> Any:
    """Writes ``timeline.png`` and ``demo.json`` into ``out``; returns the plot's path."""
    from sparkv.edge.plots import plot_timelines, timeline_of

    png = plot_timelines([(label, timeline_of(res)) for label, res in answers.runs],
                         out / "timeline.png",
                         title=f"{len(context)} tokens, {link}: both paths per strategy "
                               f"(each one's first run)")
    (out / "demo.json").write_text(json.dumps({
        "context_tokens": len(context), "link": link, "question": args.question,
        "rows": [dict(zip(ROW_KEYS, r)) for r in answers.rows],
        "ttft_runs_s": answers.ttfts,
        "answers": {label: res.text for label, res in answers.runs},
        "follow_up": None if follow is None else {
            "question": FOLLOW_UP, "answer": follow[0].text,
            "ttft_s": follow[0].breakdown.ttft_s,
            "bytes_streamed": follow[0].breakdown.bytes_streamed},
        "json_follow_up": None if follow is None else follow[1],
        "apps": answers.apps}, indent=1))
    return png
