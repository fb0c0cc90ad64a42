"""What ``sparkv device`` gains from the asks (docs/device-service.md, "Asks"): the ask service's
flags and routes on ``device serve``, and ``device ask``, its client.

    sparkv device serve ... [--ask-slots 2] [--ask-queue 16] [--ask-server URL]
                            [--link-mbps N | --link-trace FILE] [--link-rtt-ms 20]
    sparkv device ask --context ID [--server URL] "question" [--strategy sparkv] [--json]

:func:`register` runs after :mod:`sparkv.device.commands` registered ``device``: it adds the
flags to ``device serve`` and hands it :func:`install` (``extend_app``), which makes the
:class:`~sparkv.asks.service.AskService` over the service's contexts and adds its routers; and
it adds ``device ask``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable

from sparkv.asks.cores import DECODE_BATCH, GRANT_ORDERS
from sparkv.asks.orders import DEFAULT_ORDER
from sparkv.asks.linkplan import LINK_PLANS
from sparkv.asks.convstore import DEFAULT_MAX_CONVERSATIONS, DEFAULT_MAX_MB as DEFAULT_CONV_MB
from sparkv.asks.respstore import DEFAULT_MAX_MB, DEFAULT_MAX_RESPONSES, DEFAULT_TTL_S
from sparkv.cliflags import (STRATEGY_NAMES, add_sampling_args, context_id, positive_int,
                             response_format, sampling_args, server_url)

log = logging.getLogger("sparkv.asks")

__all__ = ["register", "install"]


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    raise KeyError(name)


def register(sub: "argparse._SubParsersAction") -> None:
    device = sub.choices["device"]
    _add_ask(next(a for a in device._actions if isinstance(a, argparse._SubParsersAction)))
    serve = _subcommand(device, "serve")
    g = serve.add_argument_group("asks (POST /v1/asks, /v1/chat/completions, /v1/responses)")
    g.add_argument("--ask-slots", type=int, default=2,
                   help="asks running at once (each holds its loaded cache until it answers)")
    g.add_argument("--ask-queue", type=int, default=16,
                   help="asks waiting beyond the slots; past them an ask gets 429 queue_full")
    g.add_argument("--ask-core-order", choices=GRANT_ORDERS, default=DEFAULT_ORDER,
                   help="the order the cores go to the asks' units: oldest (the oldest ask's "
                        "first; its answer streams at full speed, the others' first tokens "
                        "wait), first-tokens (the asks still loading before those already "
                        "answering, oldest first; an answer token that waited 1 s goes first: "
                        "sooner first tokens, slower answers) or turns (round robin: the asks "
                        "progress together)")
    g.add_argument("--ask-batch", choices=("on", "off"), default="off",
                   help="run the layer steps several asks wait with at the same layer as one "
                        "call (one set of GEMMs over their rows: up to 4 steps, 256 rows), or "
                        "each alone")
    g.add_argument("--ask-decode-batch", type=int, default=DECODE_BATCH,
                   help="the most answer tokens (one per ask) one forward pass runs: the asks' "
                        "next tokens waiting for the cores together go as one pass (a decode "
                        "pass reads the weights once for all of them); 1: each its own pass")
    g.add_argument("--ask-early-keep", choices=("on", "off"), default="on",
                   help="when other asks of an app wait for a context one of its asks loads "
                        "(a request's other choices), keep it at that ask's first answer token, "
                        "so that they read it while it answers (on), or after its answer (off)")
    g.add_argument("--ask-link-plan", choices=tuple(LINK_PLANS), default="oldest",
                   help="how the asks share the one link: oldest (the oldest SparKV ask's "
                        "requests first; the others compute while they wait), shortest (the "
                        "fewest bytes left first), even (no plan: every ask fetches freely "
                        "with an even share), oldest-all (oldest, for every strategy's asks)")
    g.add_argument("--responses-kept", type=int, default=DEFAULT_MAX_RESPONSES,
                   help="the Responses API's responses kept (in memory and in the flash dir's "
                        "responses/, so a restart keeps them) for GET /v1/responses/{id} and a "
                        "later previous_response_id (the least recently used that none "
                        "continues, of the app holding the most, go first); 0: none kept")
    g.add_argument("--responses-kept-mb", type=float, default=DEFAULT_MAX_MB,
                   help="the memory the kept responses hold at most (MB; each holds its own "
                        "turn, a conversation is held once)")
    g.add_argument("--responses-ttl-hours", type=float, default=DEFAULT_TTL_S / 3600,
                   help="how long a kept response is kept at most, from when it was made "
                        "(hours; default 720, 30 days, as OpenAI keeps them; 0: until evicted "
                        "or deleted)")
    g.add_argument("--conversations-kept", type=int, default=DEFAULT_MAX_CONVERSATIONS,
                   help="the Conversations API's conversations kept (in memory and in the "
                        "flash dir's conversations/, so a restart keeps them; the least "
                        "recently used of the app holding the most go first); 0: none")
    g.add_argument("--conversations-kept-mb", type=float, default=DEFAULT_CONV_MB,
                   help="the memory the conversations' items hold at most (MB)")
    g.add_argument("--ask-server", default=None, type=server_url,
                   help="the server of asks that name none (its key: $SPARKV_API_KEY)")
    link = g.add_mutually_exclusive_group()
    link.add_argument("--link-mbps", type=float, default=None,
                      help="emulate one constant link (Mbit/s) that every ask's stream shares")
    link.add_argument("--link-trace", default=None,
                      help="emulate one link following this trace (a CSV file or wifi, lte, "
                           "deep-fade) that every ask's stream shares")
    g.add_argument("--link-rtt-ms", type=float, default=20.0,
                   help="the emulated link's round trip (ms)")
    serve.set_defaults(extend_app=install)


def _shaper(args: argparse.Namespace) -> Any:
    from sparkv.edge.commands import read_trace
    from sparkv.edge.shaper import LinkShaper

    if args.link_mbps:
        return LinkShaper.constant(args.link_mbps, args.link_rtt_ms)
    if args.link_trace:
        return LinkShaper(read_trace(args.link_trace), rtt_s=args.link_rtt_ms / 1e3)
    return LinkShaper.unlimited()


def install(app: Any, service: Any, args: argparse.Namespace) -> Callable[[], None]:
    """Adds the asks to the service's ``app``; returns what closes them."""
    from sparkv.asks.chat import chat_router
    from sparkv.asks.models import models_router
    from sparkv.asks.convroutes import conversations_router
    from sparkv.asks.respkept import kept_router
    from sparkv.asks.resptokens import tokens_router
    from sparkv.asks.responses import responses_router
    from sparkv.asks.routes import asks_router
    from sparkv.asks.service import AskService, BadServerUrl
    from sparkv.asks.textcompletion import completions_router
    from sparkv.errors import SparkvError

    if args.ask_slots < 1 or args.ask_queue < 0 or args.ask_decode_batch < 1:
        raise SparkvError(f"--ask-slots and --ask-decode-batch must be at least 1 and "
                          f"--ask-queue at least 0 (got {args.ask_slots}, "
                          f"{args.ask_decode_batch} and {args.ask_queue})")
    if (args.responses_kept < 0 or not args.responses_kept_mb >= 0
            or not args.responses_ttl_hours >= 0 or args.conversations_kept < 0
            or not args.conversations_kept_mb >= 0):
        raise SparkvError(f"--responses-kept, --responses-kept-mb, --responses-ttl-hours, "
                          f"--conversations-kept and --conversations-kept-mb must be at least "
                          f"0 (got {args.responses_kept}, {args.responses_kept_mb}, "
                          f"{args.responses_ttl_hours}, {args.conversations_kept} and "
                          f"{args.conversations_kept_mb})")
    asks = AskService(service, app.state.owners, slots=args.ask_slots, queue=args.ask_queue,
                      shaper=_shaper(args), default_server=args.ask_server,
                      default_api_key=os.environ.get("SPARKV_API_KEY"),
                      core_order=args.ask_core_order, link_plan=args.ask_link_plan,
                      batch=args.ask_batch == "on", decode_batch=args.ask_decode_batch,
                      early_keep=args.ask_early_keep == "on")
    try:
        took = asks.warm()
    except BadServerUrl as e:     # an --ask-server no client can address: said at the start
        asks.close()
        raise SparkvError(f"--ask-server: {e}") from None
    log.info("sparkv device: the asks warmed (step-cost model, chat template, vocabulary, "
             "server client) in %.2f s", took)
    app.state.asks = asks
    app.state.responses = store = _response_store(service, args)
    app.state.background = background = _background(service, store)
    app.state.conversations = _conversation_store(service, args)
    app.include_router(asks_router)
    app.include_router(chat_router)
    app.include_router(completions_router)
    app.include_router(tokens_router)          # before /v1/responses/{id}'s routes
    app.include_router(responses_router)
    app.include_router(kept_router)
    app.include_router(conversations_router)
    app.include_router(models_router)

    def close() -> None:
        background.close()
        asks.close()
    return close


def _flash_folder(service: Any, name: str, on: bool) -> Path | None:
    """``<flash dir>/<name>`` when ``on`` and the service has a flash dir (a scripted service
    in the tests has none); else ``None``: nothing written."""
    swap_dir = getattr(service, "swap_dir", None)
    return Path(swap_dir) / name if on and swap_dir is not None else None


def _response_store(service: Any, args: argparse.Namespace) -> Any:
    """The kept responses, their files in the flash dir read back."""
    from sparkv.asks.respfiles import RESPONSES_DIR, ResponseFiles
    from sparkv.asks.respstore import ResponseStore

    folder = _flash_folder(service, RESPONSES_DIR,
                           args.responses_kept > 0 and args.responses_kept_mb > 0)
    store = ResponseStore(args.responses_kept, int(args.responses_kept_mb * 1e6),
                          files=ResponseFiles(folder) if folder else None,
                          ttl_s=args.responses_ttl_hours * 3600 or None)
    if store.load():
        log.info("sparkv device: %d kept responses read back from %s",
                 store.stats()["responses"], folder)
    return store


def _background(service: Any, store: Any) -> Any:
    """The background responses, the events of the streamed ones read back from the flash dir
    (for the responses still kept)."""
    from sparkv.asks.respbackground import BackgroundResponses
    from sparkv.asks.resplogfiles import RESPONSE_EVENTS_DIR, EventFiles

    folder = _flash_folder(service, RESPONSE_EVENTS_DIR, store.files is not None)
    background = BackgroundResponses(files=EventFiles(folder) if folder else None)

    def kept(app: str, rid: str) -> dict[str, Any] | None:
        got = store.get(app, rid)
        return got.response if got is not None else None
    n = background.logs.load(kept)
    if n:
        log.info("sparkv device: the events of %d streamed background responses read back "
                 "from %s", n, folder)
    return background


def _conversation_store(service: Any, args: argparse.Namespace) -> Any:
    """The conversations, their files in the flash dir read back."""
    from sparkv.asks.convfiles import CONVERSATIONS_DIR, ConversationFiles
    from sparkv.asks.convstore import ConversationStore

    folder = _flash_folder(service, CONVERSATIONS_DIR,
                           args.conversations_kept > 0 and args.conversations_kept_mb > 0)
    store = ConversationStore(args.conversations_kept, int(args.conversations_kept_mb * 1e6),
                              files=ConversationFiles(folder) if folder else None)
    if store.load():
        log.info("sparkv device: %d conversations read back from %s",
                 store.stats()["conversations"], folder)
    return store


def _add_ask(dsub: "argparse._SubParsersAction") -> None:
    from sparkv.device.commands import client_args

    a = dsub.add_parser("ask", help="ask about a server context through the service: the answer "
                                    "streamed, the context kept in its memory")
    a.add_argument("question", help="the question")
    a.add_argument("--context", required=True, type=context_id,
                   help="the context's id on the server")
    a.add_argument("--server", default=None, type=server_url,
                   help="the server's URL (default: the service's --ask-server)")
    a.add_argument("--api-key", default=os.environ.get("SPARKV_API_KEY"),
                   help="the server's API key (default: $SPARKV_API_KEY, else the service's)")
    a.add_argument("--strategy", choices=STRATEGY_NAMES, default="sparkv",
                   help="how the context is loaded (docs/edge.md)")
    a.add_argument("--max-new-tokens", type=positive_int, default=64,
                   help="answer length, tokens")
    add_sampling_args(a)
    a.add_argument("--no-keep", action="store_true",
                   help="do not keep the loaded context in the service")
    a.add_argument("--share", action="append", default=None, metavar="APP",
                   help="share the kept context with this app (app:NAME, uid:N, user; * : every "
                        "app); repeatable")
    a.add_argument("--app-token", default=None,
                   help="ask as this app (its token: sparkv device app-token)")
    a.add_argument("--json", action="store_true", help="print the done event as JSON")
    client_args(a)
    a.set_defaults(func=_ask)


def _ask(args: argparse.Namespace) -> int:
    """Prints the answer's text as it streams (stderr: the TTFT and what was streamed)."""
    from sparkv.device.commands import device_client

    def show(event: dict) -> None:
        if not args.json:
            print(event["text"], end="", flush=True)

    with device_client(args, args.app_token) as c:
        done = c.ask(args.context, args.question, on_token=show, server=args.server,
                     api_key=args.api_key, strategy=args.strategy,
                     max_new_tokens=args.max_new_tokens, keep=not args.no_keep,
                     share=args.share, **sampling_args(args),
                     response_format=response_format(args))
    if args.json:
        print(done.model_dump_json(indent=1))
        return 0
    st = done.stats
    print(f"\n({st['strategy']}: TTFT {st['ttft_s']:.2f} s, {st['bytes_streamed'] / 1e6:.2f} MB "
          f"streamed, {st['chunks_streamed']} / {st['chunks_computed']} chunks streamed / "
          f"computed, kept as {done.kept_id})", file=sys.stderr)
    return 0
