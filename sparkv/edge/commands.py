"""CLI of the device side: ``sparkv ask`` (docs/cli.md). The link options are shared with
``sparkv demo`` (:mod:`sparkv.demo`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Any, Iterator

from sparkv.cliflags import (PRESS_METAVAR, STRATEGY_NAMES, TRACE_NAMES, add_device_args,
                             add_sampling_args, context_id, non_negative_float, positive_float,
                             positive_int, sampling_args, server_url)
from sparkv.errors import SparkvError


def add_link_args(p: argparse.ArgumentParser, default: str = "an unshaped link") -> None:
    """``--trace`` or ``--mbps`` (one of them), ``--rtt-ms``: the emulated link. ``default``:
    what the help says happens with neither."""
    link = p.add_mutually_exclusive_group()
    link.add_argument("--trace", default=None,
                      help="emulate a link following a bundled trace ("
                           f"{', '.join(TRACE_NAMES)}) or a CSV file whose first line is the "
                           "header time_s,mbps or time_s,mbps,rtt_ms, then one row per step: its "
                           "start (s, the first 0), the rate from then (Mbit/s) and optionally "
                           "the round trip (ms); '#' lines are comments; the trace loops "
                           f"(default: {default})")
    link.add_argument("--mbps", type=link_mbps, default=None,
                      help="emulate a constant link (Mbit/s, > 0) instead")
    p.add_argument("--rtt-ms", type=non_negative_float, default=20.0,
                   help="emulated round trip (ms)")


def link_mbps(text: str) -> float:
    """``--mbps``: a rate > 0. Zero is refused, as a trace of zeros is: a link that carries
    nothing is no link; an unshaped link is the one with neither ``--mbps`` nor ``--trace``."""
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a rate > 0 (Mbit/s); for an unshaped link give neither --mbps nor "
            "--trace") from None


def read_trace(name: str) -> Any:
    """The :class:`~sparkv.scheduler.trace.Trace` ``--trace`` names: a bundled one or a CSV
    file. Raises :class:`~sparkv.scheduler.trace.TraceError` (one line) for anything else."""
    from sparkv.scheduler.trace import SAMPLE_TRACES, Trace, TraceError

    if name in SAMPLE_TRACES:
        return Trace.sample(name)
    try:
        return Trace.from_csv(name)
    except OSError as e:
        raise TraceError(f"--trace {name!r} is neither a bundled trace "
                         f"({', '.join(SAMPLE_TRACES)}) nor a readable CSV file "
                         f"({e.strerror or e})") from None


def shaper_from_args(args: argparse.Namespace) -> Any:
    """The :class:`LinkShaper` the link options describe (a fresh one per call): ``--mbps``,
    else ``--trace`` (the parser lets only one be given), else an unshaped link."""
    from sparkv.edge.shaper import LinkShaper

    if args.mbps is not None:
        return LinkShaper.constant(args.mbps, args.rtt_ms)
    if args.trace:
        return LinkShaper(read_trace(args.trace), rtt_s=args.rtt_ms / 1e3)
    return LinkShaper.unlimited()


def limits_from_args(args: argparse.Namespace) -> Any:
    """The :class:`ClientLimits` of ``--deadline-s`` and ``--max-manifest-mb`` (the defaults
    for what is not given)."""
    from sparkv.edge.bounds import ClientLimits

    given: dict[str, Any] = {}
    if args.deadline_s is not None:
        given["deadline_s"] = args.deadline_s
    if args.max_manifest_mb is not None:
        given["manifest_bytes"] = max(1, int(args.max_manifest_mb * (1 << 20)))
    return ClientLimits(**given)


def register(sub: "argparse._SubParsersAction") -> None:
    a = sub.add_parser("ask", help="answer a question about a context stored on a server")
    a.add_argument("question", help="the question, as text")
    a.add_argument("--server", required=True, type=server_url, help="e.g. http://127.0.0.1:8080")
    a.add_argument("--context", required=True, type=context_id,
                   help="context id (32 hex digits: `sparkv context list`)")
    a.add_argument("--api-key", default=os.environ.get("SPARKV_API_KEY"),
                   help="the tenant's API key, sent as 'Authorization: Bearer <key>' (default: "
                        "$SPARKV_API_KEY; `sparkv apikey` makes one)")
    a.add_argument("--strategy", choices=STRATEGY_NAMES, default="sparkv",
                   help="sparkv (plan stream + compute), local (prefill here), stream (fetch "
                        "every chunk), hybrid (Strong Hybrid)")
    a.add_argument("--level", default="auto", help="auto, or one codec level (raw, q8, q5, ...)")
    a.add_argument("--backend", default="auto", help="attention: auto, block_sparse, dense")
    a.add_argument("--model", default=None, help="local checkpoint (default: bundled SmolLM2)")
    add_device_args(a)
    a.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="answer length, tokens")
    add_sampling_args(a)
    a.add_argument("--decode", default="full", metavar="POLICY",
                   help="decode-time KV policy: full, dynakv, static, local, nocluster, "
                        "dynakv-eager, dynakv-packed, dynakv-lru (docs/dynakv.md)")
    a.add_argument("--decode-budget", type=float, default=None,
                   metavar="BYTES|FRACTION",
                   help="KV bytes the decode policy may keep in RAM, or a fraction <= 1 of the "
                        "final KV (needs --decode other than full; default: the policy's)")
    a.add_argument("--press", default=None, metavar=PRESS_METAVAR,
                   help="answer from the context compressed on the server by this KV press, "
                        "question-agnostically (adakv:0.5, snapkv:20%%, dynamickv:256t; suffix "
                        "@repeat: a fixed probe question as the window): its "
                        "token ids are posted again with the press (encoded once, then found "
                        "by id); only the kept entries stream and are attended (docs/presses.md)")
    a.add_argument("--encryption-key", default=None,
                   help="the encryption key of an encrypted context (printed once when it was "
                        "created; not the API key)")
    a.add_argument("--no-prelude", action="store_true",
                   help="do not compute the first layer steps while the manifest and the plan "
                        "are on their way (sparkv's start-up overlap)")
    a.add_argument("--no-cache", action="store_true",
                   help="do not keep manifests and token ids under the cache dir")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.add_argument("--keep", action="store_true",
                   help="keep the loaded cache as a context of the on-device context service; "
                        "a later --keep ask about the same context answers from it (no load)")
    a.add_argument("--keep-dir", default=None,
                   help="the kept contexts' flash tier and journal "
                        "(default: <sparkv cache>/device/kept)")
    a.add_argument("--keep-budget-mb", type=float, default=256.0,
                   help="KV memory budget of the kept contexts, MB (10^6 bytes)")
    a.add_argument("--deadline-s", type=positive_float, default=None,
                   help="the longest any request to the server may take, connecting to its "
                        "last byte (default 60; docs/edge.md, Bounds)")
    a.add_argument("--ask-deadline-s", type=positive_float, default=None,
                   help="the ask's own time limit, from the start: past it the link is given up "
                        "and what is missing is computed locally (default: 3x the local-prefill "
                        "estimate + 10 s; docs/edge.md, Bounds)")
    a.add_argument("--max-manifest-mb", type=positive_float, default=None,
                   help="the largest manifest accepted, MiB (2^20 bytes; default 16)")
    add_link_args(a)
    a.set_defaults(func=_ask)


def check_ask_args(args: argparse.Namespace) -> str | None:
    """Checks what can be checked before the model loads; returns the canonical ``--press``
    spec (``None`` without one). Raises :class:`SparkvError` (exit status 2)."""
    from sparkv.edge.options import FULL_DECODE
    from sparkv.presses import PressError, canonical_spec

    if args.decode_budget is not None and args.decode == FULL_DECODE:
        raise SparkvError("--decode-budget needs --decode POLICY (dynakv, static, local, ...): "
                          "the full policy keeps the whole KV in RAM")
    from sparkv.codec import LEVEL_ORDER

    if args.level != "auto" and args.level not in LEVEL_ORDER:
        raise SparkvError(f"--level {args.level!r}: choose auto or one of "
                          f"{', '.join(LEVEL_ORDER)}")
    if args.press is None:
        return None
    try:
        return canonical_spec(args.press)
    except PressError as e:
        raise SparkvError(f"--press: {e}") from None


def _ask(args: argparse.Namespace) -> int:
    from sparkv.edge.options import AskOptions, answer_form
    from sparkv.edge.session import EdgeSession
    from sparkv.runtime.heap import owns_process, settle
    from sparkv.runtime.model import cache_dir

    spec = check_ask_args(args)
    shaper = shaper_from_args(args)    # a bad --trace fails here, before the model loads
    cache = None if args.no_cache else cache_dir() / "edge"
    limits = limits_from_args(args)
    options = AskOptions(strategy=args.strategy, level=args.level, backend=args.backend,
                         max_new_tokens=args.max_new_tokens, decode=args.decode,
                         ram_budget=args.decode_budget, keep=args.keep,
                         prelude=False if args.no_prelude else None,
                         ask_deadline_s=args.ask_deadline_s, **sampling_args(args),
                         form=answer_form(args))   # a bad --decode or --seed fails here too
    with api_key_hint(), EdgeSession.connect(
            args.server, args.api_key, args.model, shaper=shaper, cache_dir=cache,
            limits=limits, device=args.device, dtype=args.dtype) as session:
        if args.encryption_key:
            session.client.encryption_keys[args.context] = args.encryption_key
        context = args.context
        if spec is not None:
            context = session.client.pressed_context(args.context, spec, progress=not args.json)
        if owns_process() and session.lm is not None:   # the model loaded now, for good:
            settle()                 # out of full collections (sparkv.runtime.heap)
        if args.keep:
            from sparkv.device import ContextService
            session.context_service = ContextService(
                session.lm, int(args.keep_budget_mb * 1e6),
                args.keep_dir or cache_dir() / "device" / "kept")
        res = session.ask(context, args.question, options)
    if args.json:
        print(json.dumps({"text": res.text, "tokens": res.tokens, "stats": res.stats,
                          "plan": res.plan.counts() if res.plan else None,
                          "kept_id": res.kept_id, "context_id": context}, indent=1))
    else:
        print(res.text.strip())
        if getattr(args, "verbosity", 0) >= 0:       # -q: the answer only
            print()
            print(res.breakdown.table())
        if res.kept_id is not None:
            print(kept_note(res))
    return 0


@contextlib.contextmanager
def api_key_hint(command: str = "sparkv ask") -> Iterator[None]:
    """A 401 or 403 from the server (on any request of ``command``, whatever the device has
    cached: docs/edge.md) says which key the command sent (the server names headers)."""
    from sparkv.protocol.errors import ApiError

    try:
        yield
    except ApiError as e:
        if e.status == 401:
            raise SparkvError(f"{e} ({command} sends the key of --api-key or $SPARKV_API_KEY "
                              "as that header; `sparkv apikey` makes one)") from None
        if e.status == 403:
            raise SparkvError(f"{e} (the key of --api-key or $SPARKV_API_KEY is not allowed "
                              "this request)") from None
        raise


def kept_note(res: Any) -> str:
    """The text output's line about ``--keep``: answered from the kept context, or kept now."""
    bd = res.breakdown
    if bd.strategy == "kept":
        return (f"answered from the kept context {res.kept_id} (the on-device context service): "
                f"{bd.chunks_streamed} chunks restored from the server "
                f"({bd.bytes_streamed / 1e6:.2f} MB), {bd.chunks_computed} recomputed")
    return f"kept as context {res.kept_id}: a later --keep ask about it answers from it"
