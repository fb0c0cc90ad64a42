"""``sparkv device``: the local context service and its command-line client.

    sparkv device serve --flash-dir DIR --memory-budget-mb 256 [--socket PATH [--socket-group GROUP]]
                        [--port N [--token-file PATH]] [--model PATH] [--policy llms]
                        [--device auto] [--host-tier-mb MB] [--turn-cache-mb MB]
                        [--ratio 0.75] [--serial-turns] [--no-shared-reads]
                        # --socket and --port: both at once
    sparkv device create [--system "You are ..." | --system-file FILE] [--label NAME]
                                                           # prints the new context's id
    sparkv device call ID "prompt" [--max-new-tokens 32] [--no-grow] [--json]
    sparkv device delete ID
    sparkv device list [--json]                            # one line each
    sparkv device describe ID [--json]                     # every field, the whole prompt
    sparkv device stats                                    # JSON
    sparkv device app-token NAME [--flash-dir DIR]         # an app's token (docs: "Apps")

The client commands find the service at ``--socket`` (default ``$SPARKV_DEVICE_SOCKET``, else
``<sparkv cache>/device/sparkv-device.sock``) or ``--url`` (with the token of ``--token-file``,
default ``$SPARKV_DEVICE_TOKEN_FILE``, else ``<sparkv cache>/device/token``).

The service is private to its user: the socket ``0600`` (``0660`` for ``--socket-group``), the
swap dir ``0700`` and its files ``0600``; over ``--port``, every request needs the bearer token
the service writes (``0600``) to its token file on its first start. See docs/device-service.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from sparkv.cliflags import add_sampling_args, response_format, sampling_args
from sparkv.errors import SparkvError
from sparkv.rest.limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                DEFAULT_MAX_BODY_BYTES)

log = logging.getLogger("sparkv.device")

if TYPE_CHECKING:
    from sparkv.device.client import DeviceClient
    from sparkv.device.config import ServiceConfig
    from sparkv.device.flashlock import FlashDirLock
    from sparkv.device.service import ContextService

POLICIES = ("llms", "llms-no-compression", "llms-no-pipeline", "llms-no-lifecycle", "vllm-s",
            "vllm-sq")


def client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=None, help="the service's Unix socket")
    p.add_argument("--url", default=None, help="http://127.0.0.1:PORT (a loopback service)")
    p.add_argument("--token-file", default=None,
                   help="with --url: the service's token file (default: $SPARKV_DEVICE_TOKEN_FILE, "
                        "else <sparkv cache>/device/token)")


def register(sub: "argparse._SubParsersAction") -> None:
    d = sub.add_parser("device", help="the on-device context service (LLMS): serve, create, "
                                      "call, delete, list, describe, stats")
    dsub = d.add_subparsers(dest="device_command", metavar="ACTION")
    _add_serve(dsub)

    c = dsub.add_parser("create", help="make a context; prints its id")
    system = c.add_mutually_exclusive_group()
    system.add_argument("--system", default=None, help="system prompt")
    system.add_argument("--system-file", default=None,
                        help="read the system prompt from this UTF-8 file ('-': stdin)")
    c.add_argument("--label", type=device_label, default=None,
                   help="a name for the context, listed with it (1-100 characters, no '#')")
    client_args(c)
    c.set_defaults(func=_create)

    k = dsub.add_parser("call", help="run a prompt in a context; prints the answer")
    k.add_argument("context", help="the context's id (from `sparkv device create`)")
    k.add_argument("prompt", help="the user's turn")
    k.add_argument("--max-new-tokens", type=int, default=64, help="answer length, tokens")
    k.add_argument("--no-grow", action="store_true",
                   help="answer over the context without keeping the turn in it")
    add_sampling_args(k)
    k.add_argument("--json", action="store_true",
                   help="print the whole result as JSON (timings included)")
    client_args(k)
    k.set_defaults(func=_call)

    x = dsub.add_parser("delete", help="delete a context")
    x.add_argument("context", help="the context's id")
    client_args(x)
    x.set_defaults(func=_delete)

    ls = dsub.add_parser("list", help="the contexts, one line each (system prompts cut to a line)")
    ls.add_argument("--json", action="store_true",
                    help="print the service's whole list as JSON (whole system prompts)")
    client_args(ls)
    ls.set_defaults(func=_list)

    de = dsub.add_parser("describe", help="one context: every field, its whole system prompt")
    de.add_argument("context", help="the context's id")
    de.add_argument("--json", action="store_true", help="print it as JSON")
    client_args(de)
    de.set_defaults(func=_describe)

    st = dsub.add_parser("stats", help="budget, bytes, evictions, I/O (JSON)")
    client_args(st)
    st.set_defaults(func=_stats)

    t = dsub.add_parser("app-token", help="print an app's token for the service of a flash dir "
                                          "(the app's requests are then its own)")
    t.add_argument("name", help="the app's name: 1-32 of a-z, 0-9, _ and -")
    t.add_argument("--flash-dir", default=None,
                   help="the service's flash dir (default: <sparkv cache>/device/swap)")
    t.set_defaults(func=_app_token)
    d.set_defaults(func=lambda args: (d.print_help(), 2)[1])


def _add_serve(dsub: "argparse._SubParsersAction") -> None:
    s = dsub.add_parser("serve", help="run the context service on a Unix socket (or loopback)")
    s.add_argument("--flash-dir", default=None,
                   help="flash tier + journal (default: <sparkv cache>/device/swap)")
    s.add_argument("--memory-budget-mb", type=float, required=True,
                   help="KV memory budget, MB (10^6 bytes)")
    s.add_argument("--host-tier-mb", type=float, default=None,
                   help="host RAM kept for copies of flash records, between the device's memory "
                        "and flash, MB (default: none on the CPU; on a GPU 4x the budget, at most "
                        "a quarter of the free memory)")
    s.add_argument("--turn-cache-mb", type=float, default=None,
                   help="host RAM for the KV of recent turns after a context, reused by the next "
                        "ask of the same conversation (its earlier turns are not run again), MB; "
                        "0: none (default: 2,048 tokens of the model's KV, at least 64 MB)")
    s.add_argument("--serial-turns", action="store_true",
                   help="run calls on kept contexts one at a time, whole (by default a call's "
                        "turn gives the model lock back: calls on other contexts switch in and "
                        "answer meanwhile); for comparison")
    s.add_argument("--no-shared-reads", action="store_true",
                   help="make asks about one kept context take turns (by default those running "
                        "at once, as the n sampled choices of a request, read one working memory "
                        "together, their answer tokens batched); for comparison")
    s.add_argument("--socket", default=None,
                   help="Unix socket path, mode 0600 (default: $SPARKV_DEVICE_SOCKET, else "
                        "<sparkv cache>/device/sparkv-device.sock)")
    s.add_argument("--socket-group", default=None,
                   help="let this group use the socket too (mode 0660, owned by GROUP)")
    s.add_argument("--port", type=int, default=None,
                   help="listen on 127.0.0.1:PORT instead (every request needs the bearer "
                        "token); with --socket as well: both at once")
    s.add_argument("--token-file", default=None,
                   help="with --port: where the token is kept, made 0600 on the first start "
                        "(default: $SPARKV_DEVICE_TOKEN_FILE, else <sparkv cache>/device/token)")
    s.add_argument("--model", default=None, help="local checkpoint (default: bundled SmolLM2)")
    s.add_argument("--device", default="auto",
                   help="cpu, cuda[:N] or auto (CUDA when available): where the model runs and "
                        "the contexts' KV memory lives (its budget is that device's memory; "
                        "docs/device-service.md)")
    s.add_argument("--dtype", default="auto",
                   help="the compute configuration (docs/dtypes.md: auto, float32, bfloat16, "
                        "mixed, int8, int4, ...); a context journaled in another has its KV "
                        "recomputed")
    s.add_argument("--policy", choices=POLICIES, default="llms",
                   help="how contexts are kept: LLMS, an LLMS ablation, or a vLLM-style "
                        "swapping baseline (docs/device-service.md)")
    s.add_argument("--ratio", type=float, default=None,
                   help="global compression ratio, bytes relative to int8 (0.25-4; the first "
                        "chunk, the attention sinks, is kept at fp outside it): 1 keeps every "
                        "chunk at int8, 0.75-1 the sparsest at k8v4 (K int8, V int4), lower "
                        "ones int4 and int2 too; default: the quality table's")
    s.add_argument("--chunk-tokens", type=int, default=16,
                   help="tokens per chunk of a context, across all layers: the unit of "
                        "compression, swapping and eviction (LLMS's 16; docs/device-service.md)")
    s.add_argument("--threads", type=int, default=None, help="torch threads")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 body_too_large, unread (default 4 MiB)")
    s.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="a request body must arrive within this many seconds of its headers, "
                        "else 408 body_timeout")
    s.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="a request's headers must arrive within this many seconds, else the "
                        "connection is closed (after a 408 header_timeout)")
    s.set_defaults(func=_serve)


@contextlib.contextmanager
def device_client(args: argparse.Namespace,
                  token: str | None = None) -> Iterator["DeviceClient"]:
    """The service's client; a service that cannot be reached is a :class:`SparkvError` naming
    where it was looked for (the CLI prints it as one line, exit status 2)."""
    import httpx

    from sparkv.device.client import DeviceClient, default_socket

    where = args.url or str(args.socket or default_socket())
    try:
        with DeviceClient(args.socket, url=args.url, token=token,
                          token_file=args.token_file) as client:
            yield client
    except httpx.TransportError as exc:
        raise SparkvError(f"the device service at {where} is unreachable ({exc}): start it with "
                          "`sparkv device serve`, or name it with --socket or --url") from None


def _serve(args: argparse.Namespace) -> int:
    from sparkv.extras import require_all

    require_all(("fastapi", "uvicorn"), feature="sparkv device serve (the HTTP app)")
    os.umask(0o077)              # whatever this process creates is its user's only
    _check_limits(args)
    sockets = None
    if args.port:                # a port in use is one line before anything loads
        from sparkv.rest.listen import bind_tcp

        sockets = bind_tcp("127.0.0.1", args.port)
    from sparkv.launch import exit_with_parent
    from sparkv.runtime.model import cache_dir

    exit_with_parent()           # started by a benchmark or a test: ends with it
    swap = Path(args.flash_dir) if args.flash_dir else cache_dir() / "device" / "swap"
    lock = _claim(args, swap)    # before the model loads: a refusal is one line, at once
    try:
        return _run_service(args, swap, sockets)
    finally:
        lock.release()


def _run_service(args: argparse.Namespace, swap: Path, sockets: list | None) -> int:
    """Loads the model, opens the service over ``swap`` and answers until stopped."""
    import torch

    from sparkv.device.hosttier import default_capacity
    from sparkv.device.service import ContextService, ServiceConfig
    from sparkv.predictor.dtypes import load_model_in_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    budget = int(args.memory_budget_mb * 1e6)
    lm = load_model_in_dtype(args.model, dtype=args.dtype, device=args.device)
    config = ServiceConfig.preset(args.policy, chunk_tokens=args.chunk_tokens)
    ratio = args.ratio if args.ratio is not None else default_ratio(lm.fingerprint, config)
    host = (int(args.host_tier_mb * 1e6) if args.host_tier_mb is not None
            else default_capacity(lm.device.type, budget))
    config = ServiceConfig.preset(args.policy, chunk_tokens=args.chunk_tokens, ratio=ratio,
                                  host_tier_bytes=host,
                                  turn_cache_bytes=None if args.turn_cache_mb is None
                                  else int(args.turn_cache_mb * 1e6),
                                  overlap_turns=not args.serial_turns,
                                  shared_reads=not args.no_shared_reads)
    service = ContextService(lm, budget, swap, config=config)
    try:
        need = service.min_budget()
        if budget < need:
            raise SparkvError(f"a {args.memory_budget_mb:g} MB budget cannot hold even one small "
                              f"context while it runs (needs at least {need / 1e6:.2f} MB)")
        damaged = f", {len(service.damaged)} damaged" if service.damaged else ""
        log.info("sparkv device: %s in %s on %s, budget %.1f MB, host tier %.1f MB, turn cache "
                 "%.1f MB, policy %s (ratio %g), swap %s, %d contexts reopened%s", lm.name,
                 lm.compute.name, lm.device, budget / 1e6, host / 1e6,
                 (service.config.turn_cache_bytes or 0) / 1e6, config.name,
                 config.ratio, swap, service.reopened, damaged)
        _listen(service, args, sockets)
        return 0
    finally:
        service.close()


def _claim(args: argparse.Namespace, swap: Path) -> "FlashDirLock":
    """Checks every path ``serve`` uses (the flash dir, the socket's or the token file's
    directory: :func:`~sparkv.device.private.check_path`) and takes the flash dir's lock
    (:mod:`sparkv.device.flashlock`); :class:`~sparkv.device.errors.DeviceError` if another
    user controls a path or another service holds the flash dir."""
    from sparkv.device.access import default_token_file
    from sparkv.device.client import default_socket
    from sparkv.device.flashlock import FlashDirLock
    from sparkv.device.private import check_path, private_dir

    check_path(swap, "the flash dir", leaf_mode=False)
    if args.port:
        token = Path(args.token_file) if args.token_file else default_token_file()
        check_path(token.parent, "the token file's directory")
    if args.socket or not args.port:
        sock = Path(args.socket) if args.socket else default_socket()
        check_path(sock.parent, "the socket's directory")
    return FlashDirLock(private_dir(swap))


def _check_limits(args: argparse.Namespace) -> None:
    """The HTTP limits are positive (:class:`SparkvError` naming the flag otherwise)."""
    if args.host_tier_mb is not None and not args.host_tier_mb >= 0:
        raise SparkvError(f"--host-tier-mb must be 0 or more (got {args.host_tier_mb})")
    if args.turn_cache_mb is not None and not args.turn_cache_mb >= 0:
        raise SparkvError(f"--turn-cache-mb must be 0 or more (got {args.turn_cache_mb})")
    for flag, value in (("--max-body-bytes", args.max_body_bytes),
                        ("--body-timeout-s", args.body_timeout_s),
                        ("--header-timeout-s", args.header_timeout_s)):
        if not value > 0:
            raise SparkvError(f"{flag} must be positive (got {value})")


def _serve_app(service: "ContextService", args: argparse.Namespace, sockets: list,
               token: str | None = None) -> None:
    """Runs the app on ``sockets`` with the request limits of ``args``, app tokens checked
    with the app key of the flash dir. A command that extends the service (``extend_app`` in
    ``args``: ``sparkv.asks.commands`` adds the asks) gets the app and the service first, and
    its closer runs once the app stopped."""
    from sparkv.device.app import create_app
    from sparkv.device.identity import app_key
    from sparkv.kernels import FAMILIES
    from sparkv.rest.listen import serve
    from sparkv.rest.limits import BodyLimits
    from sparkv.runtime.heap import settle
    from sparkv.runtime.threads import release_pool

    app = create_app(service, token=token, app_key=app_key(service.swap_dir),
                     limits=BodyLimits(args.max_body_bytes, args.body_timeout_s))
    extend = getattr(args, "extend_app", None)
    close = extend(app, service, args) if extend is not None else None
    # every kernel family: a restarted service's first switch from flash otherwise loaded the
    # dense fill's (0.47-0.56 s against 0.15 s; docs/device-service.md, "A restarted service's
    # first switch")
    frozen = settle(tuple(FAMILIES))
    log.debug("sparkv device: %d objects out of the collector's full collections", frozen)
    release_pool()   # the main thread's compute is done (loading, warming): its idle OpenMP
    #                  workers would slow every ask's compute on another thread (threads.py)
    try:
        serve(app, sockets, header_timeout_s=args.header_timeout_s, log_level="warning")
    finally:
        if close is not None:
            close()


def default_ratio(model_fingerprint: str, config: "ServiceConfig") -> float:
    """The tolerance ratio when ``--ratio`` is not given: the smallest ratio whose verdict passes
    in the model's quality table (``device`` section; docs/quality.md), else 1.0
    (:func:`sparkv.device.config.resolved_ratio`). Only the ``tolerance`` compression has a
    ratio."""
    from sparkv.device.config import resolved_ratio

    return resolved_ratio(config, model_fingerprint)


def _listen(service: "ContextService", args: argparse.Namespace, tcp: list | None) -> None:
    """Serves on the Unix socket (``0600``, ``0660`` for ``--socket-group``) unless only
    ``--port`` is given, and on ``127.0.0.1:port`` (``tcp``, bound) with ``--port``: there every
    request carries the bearer token of the token file (the socket's need none)."""
    from sparkv.device.access import default_token_file, ensure_token
    from sparkv.device.client import default_socket
    from sparkv.device.private import bind_unix_socket

    sockets, token = [], None
    if args.socket or tcp is None:
        sock_path = Path(args.socket) if args.socket else default_socket()
        sock_path.parent.mkdir(parents=True, exist_ok=True)
        sockets.append(bind_unix_socket(sock_path, args.socket_group))
        log.info("listening on %s", sock_path)
    if tcp is not None:
        path = Path(args.token_file) if args.token_file else default_token_file()
        token = ensure_token(path)
        sockets.extend(tcp)
        log.info("listening on 127.0.0.1:%s (bearer token in %s)", args.port, path)
    _serve_app(service, args, sockets, token)


def device_label(text: str) -> str:
    """``--label``: 1-100 characters, no control character, no ``#`` (the service's rule)."""
    if not 1 <= len(text) <= 100 or "#" in text or any(ord(c) < 32 or ord(c) == 127
                                                        for c in text):
        raise argparse.ArgumentTypeError(f"{text[:120]!r} is not a label (1-100 characters, "
                                         "no control character, no '#')")
    return text


def _create(args: argparse.Namespace) -> int:
    system = args.system
    if args.system_file is not None:
        system = _read_system_file(args.system_file)
    with device_client(args) as c:
        print(c.new_context(system, label=args.label))
    return 0


def _read_system_file(path: str) -> str:
    try:
        return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SparkvError(f"--system-file {path}: cannot read it ({exc})") from None


def _call(args: argparse.Namespace) -> int:
    with device_client(args) as c:
        res = c.call(args.context, args.prompt, args.max_new_tokens, grow=not args.no_grow,
                     **sampling_args(args), response_format=response_format(args))
    if args.json:
        print(res.model_dump_json(indent=1))
    else:
        st = res.stats
        print(res.text.strip())
        print(f"\n(switch {st['switch_s'] * 1e3:.1f} ms, first token {st['ttft_s'] * 1e3:.0f} ms, "
              f"context {st['context_tokens']} tokens)", file=sys.stderr)
    return 0


def _delete(args: argparse.Namespace) -> int:
    with device_client(args) as c:
        c.delete(args.context)
    return 0


#: characters of a system prompt ``device list`` shows (``device describe`` shows it whole)
PROMPT_COLUMN = 48


def _list(args: argparse.Namespace) -> int:
    from sparkv.tables import format_table

    with device_client(args) as c:
        listed = c.list()
        if args.json:
            print(json.dumps(listed, indent=1))
        elif listed:
            print(format_table(["id", "label", "tokens", "calls", "MB", "system prompt"],
                               [[x["id"], x.get("label") or "-", x["tokens"], x["calls"],
                                 f"{x['bytes'] / 1e6:.2f}", one_line(x.get("system_prompt"))]
                                for x in listed]))
        else:
            print("no contexts")
        for d in c.damaged():
            print(f"damaged context {d['id']}: {d['reason']} (sparkv device delete {d['id']})",
                  file=sys.stderr)
    return 0


def one_line(text: str | None, width: int = PROMPT_COLUMN) -> str:
    """``text`` on one line of at most ``width`` characters (white space runs made one space;
    cut with '...'); ``-`` for none."""
    if not text:
        return "-"
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[:width - 3] + "..."


def _describe(args: argparse.Namespace) -> int:
    with device_client(args) as c:
        info = c.describe(args.context)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    for key, value in info.items():
        if key == "system_prompt":
            continue
        shown = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) \
            else ", ".join(map(str, value)) if isinstance(value, list) else value
        print(f"{key}: {'-' if shown is None or shown == '' else shown}")
    print("system_prompt:")
    print(info.get("system_prompt") or "-")
    return 0


def _stats(args: argparse.Namespace) -> int:
    with device_client(args) as c:
        print(json.dumps(c.stats(), indent=1))
    return 0


def _app_token(args: argparse.Namespace) -> int:
    from sparkv.device.identity import app_key, app_token
    from sparkv.device.private import check_path, private_dir
    from sparkv.launch import exit_with_parent
    from sparkv.runtime.model import cache_dir

    exit_with_parent()           # started by a benchmark or a test: ends with it
    swap = Path(args.flash_dir) if args.flash_dir else cache_dir() / "device" / "swap"
    check_path(swap, "the flash dir", leaf_mode=False)
    print(app_token(app_key(private_dir(swap)), args.name))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(os.EX_USAGE)
