"""uvicorn's HTTP/1.1 protocols, answering requests they cannot parse with the JSON error shape.

A request that breaks HTTP/1.1 syntax (an unparsable or duplicated ``Content-Length``, a bad chunk
size, a malformed request line) never reaches the app: the parser (httptools, or h11 when
httptools is missing) refuses it, and uvicorn answers a plain-text 400. These subclasses answer
the same 400 (and close the connection, as uvicorn does) with a JSON body::

    {"error": {"status": 400, "code": "bad_content_length", "message": "..."}}

``code`` is ``bad_content_length`` when the parser's reason names the Content-Length header,
``malformed_http`` otherwise. :func:`json_error_protocol` picks the class matching uvicorn's own
choice (``http="auto"``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

STATUS_LINE_400 = b"HTTP/1.1 400 Bad Request\r\n"


def parse_error_body(exc: BaseException | None) -> bytes:
    """The JSON error body for a request the HTTP parser refused with ``exc``."""
    reason = str(exc) if exc is not None else ""
    if "content-length" in reason.lower():
        code = "bad_content_length"
        message = f"invalid Content-Length: {reason}"
    else:
        code = "malformed_http"
        message = "the request is not valid HTTP/1.1" + (f": {reason}" if reason else "")
    return json.dumps({"error": {"status": 400, "code": code, "message": message}}).encode()


def _httptools_class() -> type[Any]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class JsonErrorHttpToolsProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """httptools-based HTTP/1.1 whose parse errors are answered in JSON."""

        def send_400_response(self, msg: str) -> None:
            # Called from the parser's ``except`` block: the exception names the reason.
            body = parse_error_body(sys.exc_info()[1])
            content = [STATUS_LINE_400]
            for name, value in self.server_state.default_headers:
                content.extend([name, b": ", value, b"\r\n"])
            content.extend([b"content-type: application/json\r\n",
                            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n",
                            b"connection: close\r\n", b"\r\n", body])
            self.transport.write(b"".join(content))
            self.transport.close()

    return JsonErrorHttpToolsProtocol


def _h11_class() -> type[Any]:
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class JsonErrorH11Protocol(H11Protocol):  # type: ignore[misc]
        """h11-based HTTP/1.1 whose parse errors are answered in JSON."""

        def send_400_response(self, msg: str) -> None:
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


def json_error_protocol() -> type[Any]:
    """The protocol class for ``uvicorn.run(http=...)``: httptools when it is installed (what
    uvicorn's ``auto`` picks), else h11."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return _h11_class()
    return _httptools_class()
