"""``sparkv context``: the contexts stored on a sparkv server, from the command line (create from
a file, list, describe, delete), through :class:`~sparkv.edge.client.EdgeClient` (REST only:
docs/rest-api.md). ``sparkv ask --context ID`` then answers questions about one.

Output: ``create`` prints the context's id alone on stdout (``CID=$(sparkv context create ...)``),
its notes on stderr; ``list`` a table (``--json``: the server's list); ``describe`` one
``field: value`` line each; ``delete`` the line ``deleted ID``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from typing import Any, Iterator

from sparkv.cliflags import PRESS_METAVAR, context_id, context_name, server_url
from sparkv.edge.commands import api_key_hint
from sparkv.errors import SparkvError

log = logging.getLogger("sparkv.edge")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", required=True, type=server_url, help="e.g. http://127.0.0.1:8080")
    p.add_argument("--api-key", default=os.environ.get("SPARKV_API_KEY"),
                   help="the tenant's API key (default: $SPARKV_API_KEY; `sparkv apikey` makes "
                        "one)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def register(sub: "argparse._SubParsersAction") -> None:
    c = sub.add_parser("context", help="contexts stored on a server: create, list, describe, "
                                       "delete")
    csub = c.add_subparsers(dest="context_command", metavar="ACTION")
    cr = csub.add_parser("create", help="have the server encode a text file; prints the id")
    cr.add_argument("file", help="a UTF-8 text file; '-' reads stdin")
    cr.add_argument("--name", type=context_name, default=None,
                    help="a label, listed by `sparkv context list` (not part of the id: the same "
                         "text under another name is the same context)")
    cr.add_argument("--press", default=None, metavar=PRESS_METAVAR,
                    help="compress it on the server with a KV press first (docs/presses.md)")
    cr.add_argument("--no-wait", action="store_true",
                    help="print the id once the job is queued, without waiting for the encode")
    _client_args(cr)
    cr.set_defaults(func=_create)
    ls = csub.add_parser("list", help="the server's contexts: id, name, tokens, model, press")
    _client_args(ls)
    ls.set_defaults(func=_list)
    de = csub.add_parser("describe", help="one context: its manifest's summary")
    de.add_argument("context", type=context_id, help="the context's id")
    _client_args(de)
    de.set_defaults(func=_describe)
    rm = csub.add_parser("delete", help="delete a context (and cancel its encode job)")
    rm.add_argument("context", type=context_id, help="the context's id")
    _client_args(rm)
    rm.set_defaults(func=_delete)
    c.set_defaults(func=lambda args: (c.print_help(), 2)[1])


@contextlib.contextmanager
def _open(args: argparse.Namespace) -> Iterator[Any]:
    """The server's client; a 401 or 403 says which key was sent (as ``sparkv ask`` does)."""
    from sparkv.edge.client import EdgeClient

    with api_key_hint("sparkv context"), EdgeClient(args.server, args.api_key) as client:
        yield client


def read_text(path: str) -> str:
    """The text of ``path`` (``-``: stdin), UTF-8; a :class:`SparkvError` when it cannot be
    read or holds nothing but white space."""
    try:
        text = sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as e:
        raise SparkvError(f"cannot read {path}: {e}") from None
    if not text.strip():
        raise SparkvError(f"{path} holds no text")
    return text


def _create(args: argparse.Namespace) -> int:
    from sparkv.presses import PressError, canonical_spec

    press = None
    if args.press is not None:
        try:
            press = canonical_spec(args.press)
        except PressError as e:
            raise SparkvError(f"--press: {e}") from None
    text = read_text(args.file)
    with _open(args) as client:
        cid = client.create_context(text=text, name=args.name, press=press,
                                    wait=not args.no_wait, progress=False)
        summary = None if args.no_wait else _summary(client, cid)
    if args.json:
        print(json.dumps(summary or {"context_id": cid, "status": "queued"}, indent=1))
        return 0
    if summary is not None:
        log.info("context %s%s: %d tokens, encoded", cid, _named(summary.get("name")),
                 summary.get("num_tokens") or 0)
    print(cid)
    return 0


def _summary(client: Any, cid: str) -> dict[str, Any] | None:
    """The server's list entry of context ``cid`` (``None``: not listed)."""
    return next((c for c in client.list_contexts()["contexts"] if c["context_id"] == cid), None)


def _named(name: str | None) -> str:
    return f" ({name})" if name else ""


def _list(args: argparse.Namespace) -> int:
    from sparkv.tables import format_table

    with _open(args) as client:
        listed = client.list_contexts()
    if args.json:
        print(json.dumps(listed, indent=1))
        return 0
    rows = [[c["context_id"], c.get("name") or "-", _or_dash(c.get("num_tokens")),
             c.get("model") or "-", c.get("press") or "-"] for c in listed["contexts"]]
    if rows:
        print(format_table(["context", "name", "tokens", "model", "press"], rows))
    else:
        print("no contexts")
    for p in listed.get("pending", []):
        print(f"being encoded: {p['context_id']} (job {p['job_id']}, {p['state']})")
    return 0


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _describe(args: argparse.Namespace) -> int:
    with _open(args) as client:
        m = client.manifest(args.context, use_cache=False)
    g = m.geometry
    fields: dict[str, Any] = {
        "context_id": m.context_id, "name": m.name, "num_tokens": m.num_tokens,
        "model": m.model.name, "levels": list(m.levels), "chunk_tokens": g.chunk_tokens,
        "chunks": g.num_chunks, "bytes": dict(m.total_bytes),
        "press": m.press.spec if m.press is not None else None, "encrypted": m.encrypted,
        "created_unix": m.created_unix,
    }
    if args.json:
        print(json.dumps(fields, indent=1))
        return 0
    for key, value in fields.items():
        shown = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict) \
            else ", ".join(value) if isinstance(value, list) else _or_dash(value)
        print(f"{key}: {shown}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    with _open(args) as client:
        client.delete_context(args.context)
    if args.json:
        print(json.dumps({"deleted": args.context}))
    else:
        print(f"deleted {args.context}")
    return 0
