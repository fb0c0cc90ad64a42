"""Who is at the other end of a Unix socket: the peer's credentials (``SO_PEERCRED``), read
once per connection by the HTTP protocol (:mod:`sparkv.rest.http_protocol`) and handed to the app
in every request's ``scope["state"]`` (:func:`scope_peer`).

Over TCP there are none (a loopback port tells nothing about who connected): an app then proves
who it is with a token. Linux only (``SO_PEERCRED``); elsewhere :func:`peer_credentials` returns
``None``."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["PEER_STATE_KEY", "PeerCredentials", "peer_credentials", "scope_peer"]

#: the key of a connection's :class:`PeerCredentials` in a request's ``scope["state"]``
PEER_STATE_KEY = "sparkv.peer"


@dataclass(frozen=True)
class PeerCredentials:
    """The process that connected: its id, user and group (as the kernel saw them when it
    connected)."""

    pid: int
    uid: int
    gid: int


def peer_credentials(sock: Any) -> PeerCredentials | None:
    """The credentials of a connected Unix socket's peer, or ``None`` (another family, a
    platform without ``SO_PEERCRED``, a closed socket)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None or sock is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCredentials(pid, uid, gid)


def scope_peer(scope: Mapping[str, Any]) -> PeerCredentials | None:
    """The peer credentials of the request's connection (``None`` over TCP)."""
    state = scope.get("state") or {}
    peer = state.get(PEER_STATE_KEY)
    return peer if isinstance(peer, PeerCredentials) else None
