"""Who may talk to the device service: loopback Host names only, and over TCP a bearer token.

* **Host** (both transports): only ``localhost``, ``127.0.0.1`` and ``[::1]``, with or without a
  port (:func:`loopback_host`). Any other Host (or none) is answered ``421 misdirected_request``:
  a web page that rebinds its own DNS name to 127.0.0.1 sends its own name, so it never reaches a
  route.
* **Token** (over TCP, ``--port``; the Unix socket's file mode is its access control, also when
  one service listens on both: a request with the socket's peer credentials needs no token):
  every TCP request carries ``Authorization: Bearer <token>``, exactly that (the scheme ``Bearer``, one space, the
  token), compared in constant time; anything else is ``401 missing_token`` or
  ``401 invalid_token`` with ``WWW-Authenticate: Bearer``.
* **The token file** (:func:`ensure_token`, :func:`read_token`): made on the first start with
  :func:`secrets.token_urlsafe`, written ``0600`` by an atomic write (never readable by others),
  at ``--token-file``, else ``$SPARKV_DEVICE_TOKEN_FILE``, else ``<sparkv cache>/device/token``
  (:func:`default_token_file`), where ``sparkv device`` clients find it.

* **The app** (:mod:`sparkv.device.identity`): a bearer token that is an app token (either
  transport) makes the request that app's; the service's own token (TCP) or no token on the Unix
  socket makes it the peer's (``SO_PEERCRED``: this user, or ``uid:N``). A bearer token that is
  neither is ``401 invalid_token`` on the socket too. The app id reaches the routes as
  ``scope["state"]["sparkv.app"]``.

Errors have the service's one JSON shape (:func:`sparkv.protocol.error_body`).

:class:`AccessGuard` is pure ASGI (no ``BaseHTTPMiddleware``): it runs before routing and holds no
state beyond the token (read-only after start; no locks).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from sparkv.fileio import atomic_write
from sparkv.device.identity import APP_SCOPE_KEY, USER, peer_app, token_app
from sparkv.device.private import FILE_MODE, check_path, existing
from sparkv.protocol.errors import error_body
from sparkv.rest.peer import scope_peer

if TYPE_CHECKING:   # the guard runs inside the HTTP app (the server extra); the token helpers don't
    from starlette.types import ASGIApp, Receive, Scope, Send

TOKEN_ENV = "SPARKV_DEVICE_TOKEN_FILE"
#: the Host names the service answers (any port)
_LOOPBACK = re.compile(r"(?:localhost|127\.0\.0\.1|\[::1\])(?::[0-9]{1,5})?", re.IGNORECASE)
#: what :func:`secrets.token_urlsafe` writes
_TOKEN = re.compile(r"[A-Za-z0-9_-]{32,512}")
_SCHEME = "Bearer "


def loopback_host(host: str | None) -> bool:
    """Whether a Host header names this machine's loopback (``localhost``, ``127.0.0.1``,
    ``[::1]``, each with or without ``:port``)."""
    return host is not None and _LOOPBACK.fullmatch(host) is not None


def bearer_token(values: list[str]) -> str | None:
    """The token of the request's ``Authorization`` headers: exactly one header, exactly
    ``Bearer <token>`` (one space, a non-empty token without spaces); else ``None``."""
    if len(values) != 1 or not values[0].startswith(_SCHEME):
        return None
    token = values[0][len(_SCHEME):]
    return token if token and not any(c.isspace() for c in token) else None


def token_matches(given: str, token: str) -> bool:
    """Constant-time comparison (as bytes: a non-ASCII header byte is just a mismatch)."""
    return hmac.compare_digest(given.encode("utf-8", "replace"), token.encode())


# ---- the token file ------------------------------------------------------------------------------
def default_token_file() -> Path:
    """``$SPARKV_DEVICE_TOKEN_FILE``, else ``<sparkv cache>/device/token``."""
    env = os.environ.get(TOKEN_ENV)
    if env:
        return Path(env).expanduser()
    from sparkv.runtime.model import cache_dir

    return cache_dir() / "device" / "token"


def read_token(path: str | os.PathLike[str] | None = None) -> str | None:
    """The token in ``path`` (default :func:`default_token_file`), or ``None`` if there is
    none (a client then sends no token and is told 401)."""
    try:
        token = Path(path or default_token_file()).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return token if _TOKEN.fullmatch(token) else None


def ensure_token(path: str | os.PathLike[str] | None = None) -> str:
    """The service's token: the one in ``path`` if it is a regular ``0600`` file of this
    user's holding a token, else a new one written there ``0600`` (a file others could read is
    replaced: its token may be known). :class:`DeviceError` if ``path`` is another user's or not a
    regular file."""
    p = Path(path or default_token_file())
    check_path(p.parent, "the token file's directory")
    st = existing(p, stat.S_ISREG, "regular file")
    if st is not None and not stat.S_IMODE(st.st_mode) & 0o077:
        token = read_token(p)
        if token is not None:
            return token
    token = secrets.token_urlsafe(32)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, (token + "\n").encode(), mode=FILE_MODE)
    return token


# ---- the guard -----------------------------------------------------------------------------------
def _headers(scope: Scope, name: bytes) -> list[str]:
    return [v.decode("latin-1") for k, v in scope.get("headers", ()) if k == name]


class AccessGuard:
    """ASGI middleware: the Host check on every request, the bearer token when ``token`` is set,
    the app making the request (app tokens checked with ``app_key``; module docstring)."""

    def __init__(self, app: ASGIApp, token: str | None = None,
                 app_key: bytes | None = None) -> None:
        self.app = app
        self.token = token
        self.app_key = app_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            scope.setdefault("state", {})[APP_SCOPE_KEY] = self.caller(scope)
            await self.app(scope, receive, send)
            return
        status, code, message = refusal
        headers = {"WWW-Authenticate": 'Bearer realm="sparkv-device"'} if status == 401 else None
        from fastapi.responses import JSONResponse

        await JSONResponse(error_body(status, code, message), status_code=status,
                           headers=headers)(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """``(status, code, message)`` if the request is refused, else ``None``."""
        hosts = _headers(scope, b"host")
        if len(hosts) != 1 or not loopback_host(hosts[0]):
            return (421, "misdirected_request", "the device service answers only requests for "
                    "localhost, 127.0.0.1 or [::1] (Host header)")
        values = _headers(scope, b"authorization")
        if not values:
            if self.token is None or scope_peer(scope) is not None:   # no token, or the socket
                return None
            return (401, "missing_token", "send 'Authorization: Bearer <token>' (the token is in "
                    "the service's token file, docs/device-service.md)")
        given = bearer_token(values)
        if given is not None and (token_app(self.app_key, given) is not None or (
                self.token is not None and token_matches(given, self.token))):
            return None
        return (401, "invalid_token", "the Authorization header is not 'Bearer <token>' with "
                "the service's token or an app token (sparkv device app-token)")

    def caller(self, scope: Scope) -> str:
        """The app of an admitted request: its app token's, else its peer's (module
        docstring)."""
        given = bearer_token(_headers(scope, b"authorization"))
        app = token_app(self.app_key, given) if given is not None else None
        if app is not None:
            return app
        if given is not None:      # the service's own token
            return USER
        peer = scope_peer(scope)
        return peer_app(peer.uid if peer is not None else None)

