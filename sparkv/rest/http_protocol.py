"""uvicorn's HTTP/1.1 protocols, answering requests they cannot parse with the JSON error shape
and closing connections whose headers do not arrive in time.

A request that breaks HTTP/1.1 syntax (an unparsable or duplicated ``Content-Length``, a bad chunk
size, a malformed request line) never reaches the app: the parser (httptools, or h11 when
httptools is missing) refuses it, and uvicorn answers a plain-text 400. These subclasses answer
the same 400 (and close the connection, as uvicorn does) with a JSON body::

    {"error": {"status": 400, "code": "bad_content_length", "message": "..."}}

``code`` is ``bad_content_length`` when the parser's reason names the Content-Length header,
``malformed_http`` otherwise.

**Header deadline.** uvicorn times only the idle wait between requests (``timeout_keep_alive``):
a client that connects and sends nothing, or sends a request's headers a byte at a time
(slowloris), would hold its connection forever. Here a request's headers must be complete within
``header_timeout_s`` of the connection (for its first request) or of the request's first byte
(for a later one); otherwise the connection is closed, after a JSON 408 ``header_timeout`` when
part of a request arrived (none when nothing did: an unsolicited 408 could be read as the
answer to a request the client sends later). :func:`json_error_protocol` picks the class
matching uvicorn's own choice (``http="auto"``) with the deadline set.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any, Iterable

from sparkv.protocol.errors import error_body
from sparkv.rest.limits import DEFAULT_HEADER_TIMEOUT_S

STATUS_LINE_400 = b"HTTP/1.1 400 Bad Request\r\n"
STATUS_LINE_408 = b"HTTP/1.1 408 Request Timeout\r\n"


def parse_error_body(exc: BaseException | None) -> bytes:
    """The JSON error body for a request the HTTP parser refused with ``exc``."""
    reason = str(exc) if exc is not None else ""
    if "content-length" in reason.lower():
        code = "bad_content_length"
        message = f"invalid Content-Length: {reason}"
    else:
        code = "malformed_http"
        message = "the request is not valid HTTP/1.1" + (f": {reason}" if reason else "")
    return json.dumps(error_body(400, code, message)).encode()


def header_timeout_body(timeout_s: float) -> bytes:
    """The JSON body of a 408 ``header_timeout``."""
    return json.dumps(error_body(
        408, "header_timeout",
        f"the request's headers did not arrive completely within {timeout_s:g} s",
        timeout_s=timeout_s)).encode()


def raw_json_response(status_line: bytes, body: bytes,
                      default_headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 response with a JSON body that closes the connection, as bytes (written
    straight to the transport, outside any request cycle)."""
    content = [status_line]
    for name, value in default_headers:
        content.extend([name, b": ", value, b"\r\n"])
    content.extend([b"content-type: application/json\r\n",
                    b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                    b"connection: close\r\n", b"\r\n", body])
    return b"".join(content)


class HeaderDeadline:
    """The header deadline of one connection: a mixin placed before uvicorn's protocol class
    (it arms the deadline when the connection is made and drops it when the connection is lost;
    the subclasses arm it again when a request begins and drop it when its headers are complete).

    State: ``_header_timer`` (the pending deadline, or ``None``) and ``_request_begun`` (part of
    a request has arrived since the last complete headers). Used only from the event loop (the
    protocol's callbacks), so no lock.
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None
    _request_begun: bool = False
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    server_state: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self.arm_header_deadline(begun=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def arm_header_deadline(self, begun: bool) -> None:
        """Starts the deadline unless it is running (``begun``: part of a request arrived)."""
        self._request_begun = self._request_begun or begun
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s,
                                                      self._header_deadline_passed)

    def disarm_header_deadline(self) -> None:
        """The headers are complete (or the connection is gone): no deadline."""
        self._request_begun = False
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_deadline_passed(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self._request_begun:
            self.transport.write(raw_json_response(
                STATUS_LINE_408, header_timeout_body(self.header_timeout_s),
                self.server_state.default_headers))
        self.transport.close()


def _httptools_class() -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class JsonErrorHttpToolsProtocol(HeaderDeadline, HttpToolsProtocol):  # type: ignore[misc]
        """httptools-based HTTP/1.1 whose parse errors are answered in JSON, with a header
        deadline."""

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.arm_header_deadline(begun=True)

        def on_headers_complete(self) -> None:
            self.disarm_header_deadline()
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            # Called from the parser's ``except`` block: the exception names the reason.
            self.disarm_header_deadline()
            self.transport.write(raw_json_response(
                STATUS_LINE_400, parse_error_body(sys.exc_info()[1]),
                self.server_state.default_headers))
            self.transport.close()

    return JsonErrorHttpToolsProtocol


def _h11_class() -> type[Any]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrorH11Protocol(HeaderDeadline, H11Protocol):  # type: ignore[misc]
        """h11-based HTTP/1.1 whose parse errors are answered in JSON, with a header
        deadline."""

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.arm_header_deadline(begun=True)  # part of a request's headers is buffered
            else:
                self.disarm_header_deadline()

        def send_400_response(self, msg: str) -> None:
            self.disarm_header_deadline()
            body = parse_error_body(sys.exc_info()[1])
            headers = [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode("ascii")),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                          h11.Data(data=body), h11.EndOfMessage()):
                output = self.conn.send(event)
                if output:
                    self.transport.write(output)
            self.transport.close()

    return JsonErrorH11Protocol


def json_error_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> type[Any]:
    """The protocol class for ``uvicorn.run(http=...)``: httptools when it is installed (what
    uvicorn's ``auto`` picks), else h11; headers must arrive within ``header_timeout_s``."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        base = _h11_class()
    else:
        base = _httptools_class()
    return type(base.__name__, (base,), {"header_timeout_s": float(header_timeout_s),
                                         "__doc__": base.__doc__})
