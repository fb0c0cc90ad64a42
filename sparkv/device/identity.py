"""Which app is calling the device service (docs/device-service.md, "Apps").

Every request is made by one **app**, named by a short string:

* ``app:NAME``: the request carries an **app token** (``Authorization: Bearer <token>``, on
  either transport): ``sparkv-app.NAME.<mac>``, the MAC an HMAC-SHA256 of ``NAME`` under the
  service's app key (:func:`app_key`: 32 random bytes in ``<flash dir>/apps.key``, ``0600``,
  made on first use). The service's user mints one with ``sparkv device app-token NAME``
  (:func:`app_token`) and gives it to the app; nothing about apps is stored;
* ``uid:N``: a request without a token on the Unix socket from another user (a member of
  ``--socket-group``), told apart by the socket's peer credentials (``SO_PEERCRED``,
  :mod:`sparkv.rest.peer`): as Android gives each app its own user;
* :data:`USER`: the service's own user (on the socket without a token, or over TCP with the
  service's bearer token).

An app sees only the contexts it made or kept, and those shared with it
(:mod:`sparkv.device.owners`). No locks: the key is read once, then read-only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from sparkv.device.errors import DeviceError
from sparkv.device.private import FILE_MODE
from sparkv.fileio import atomic_write

__all__ = ["USER", "EVERY_APP", "APP_ID_PATTERN", "APP_NAME_PATTERN", "APP_SCOPE_KEY", "app_key",
           "app_token", "token_app", "peer_app"]

#: the service's own user
USER = "user"
#: in a share list: every app
EVERY_APP = "*"
#: an app's name in its token (lower case letters, digits, ``_``, ``-``; at most 32)
APP_NAME_PATTERN = r"[a-z0-9][a-z0-9_-]{0,31}"
#: an app id as requests and share lists spell it
APP_ID_PATTERN = rf"^(user|uid:[0-9]{{1,10}}|app:{APP_NAME_PATTERN})$"
#: the key of the caller's app id in a request's ``scope["state"]`` (set by the access guard)
APP_SCOPE_KEY = "sparkv.app"
#: the file of the app key in the flash dir
APP_KEY_FILE = "apps.key"

_PREFIX = "sparkv-app"
_TOKEN = re.compile(rf"{_PREFIX}\.({APP_NAME_PATTERN})\.([0-9a-f]{{64}})")


def app_key(flash_dir: str | os.PathLike[str]) -> bytes:
    """The service's app key (``<flash_dir>/apps.key``), made ``0600`` on first use."""
    path = Path(flash_dir) / APP_KEY_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if re.fullmatch(r"[0-9a-f]{64}", text):
        return bytes.fromhex(text)
    key = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, key.hex().encode() + b"\n", mode=FILE_MODE)
    return key


def _mac(key: bytes, name: str) -> str:
    return hmac.new(key, name.encode(), hashlib.sha256).hexdigest()


def app_token(key: bytes, name: str) -> str:
    """The token of app ``name`` under ``key`` (:class:`DeviceError` for a name that is not
    :data:`APP_NAME_PATTERN`)."""
    if not re.fullmatch(APP_NAME_PATTERN, name):
        raise DeviceError(f"an app's name is 1-32 lower case letters, digits, '_' or '-' "
                          f"(starting with a letter or digit), not {name!r}")
    return f"{_PREFIX}.{name}.{_mac(key, name)}"


def token_app(key: bytes | None, token: str) -> str | None:
    """``app:NAME`` when ``token`` is app ``NAME``'s token under ``key`` (compared in constant
    time), else ``None``."""
    m = _TOKEN.fullmatch(token) if key is not None else None
    if m is None:
        return None
    assert key is not None
    return f"app:{m.group(1)}" if hmac.compare_digest(m.group(2), _mac(key, m.group(1))) else None


def peer_app(uid: int | None) -> str:
    """The app of a request without a token on the Unix socket: :data:`USER` for this user (or
    when the peer is unknown), ``uid:N`` for another."""
    return USER if uid is None or uid == os.geteuid() else f"uid:{uid}"
