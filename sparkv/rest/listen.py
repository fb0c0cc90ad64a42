"""Running an app under uvicorn on sockets bound first (both ``sparkv serve`` and
``sparkv device serve``).

uvicorn binds its port only after the app's startup: a port already in use gave "Application
startup complete", then ``[Errno 98]``, then exit status 3. :func:`bind_tcp` binds before
anything is loaded, so such a port is one :class:`~sparkv.errors.SparkvError` (the CLI's one
``sparkv: error:`` line, exit status 2); :func:`serve` then runs uvicorn on the bound sockets with
:mod:`sparkv.rest.http_protocol` (JSON answers to unparsable requests, the header deadline).
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from sparkv.errors import SparkvError

def bind_tcp(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of ``host`` (``localhost``: 127.0.0.1 and ::1, as uvicorn
    binds them), ``SO_REUSEADDR`` set, not yet listening. Raises :class:`SparkvError` naming the
    address when one cannot be bound (a port in use, an address this machine lacks)."""
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                                   socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SparkvError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    addresses = list(dict.fromkeys((family, kind, proto, address)
                                   for family, kind, proto, _, address in infos))
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, address in addresses:
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                hint = (": the port is in use (stop what holds it, or choose another port)"
                        if exc.errno == errno.EADDRINUSE else f": {exc.strerror}")
                raise SparkvError(f"cannot listen on {host}:{port}{hint}") from None
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def serve(app: Any, sockets: list[socket.socket], *, header_timeout_s: float,
          **options: Any) -> None:
    """Runs ``app`` under uvicorn on ``sockets`` (bound: :func:`bind_tcp`, or a Unix socket)
    until SIGINT or SIGTERM, with the JSON-answering protocol and its header deadline;
    ``options`` are ``uvicorn.Config``'s. Raises :class:`SparkvError` when the app's startup
    fails (uvicorn has logged why). Closes the sockets."""
    import uvicorn

    from sparkv.rest.http_protocol import json_error_protocol

    config = uvicorn.Config(app, http=json_error_protocol(header_timeout_s), **options)
    server = uvicorn.Server(config)
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    if not server.started:
        raise SparkvError("the server did not start (its log says why)")
