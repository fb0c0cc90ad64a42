"""What the device service keeps private: its swap directory, its files and its Unix socket.

The contexts hold people's conversations (their token ids are in the journal and the token chunk
records are their KV), so by default only the service's own user can reach any of it:

* directories (the swap dir, ``journal/``, ``contexts/``, each context's directory,
  ``responses/``, ``conversations/``): ``0700``, owned by this user (:func:`private_dir`
  makes them so, tightens an existing one, and refuses a directory another user owns: it
  could have been planted to read what the service writes);
* files (journal records, token chunk segments and files, ``io-profile.json``, the token, the
  kept responses of :mod:`sparkv.asks.respfiles`, the conversations of
  :mod:`sparkv.asks.convfiles`): created ``0600`` (:data:`FILE_MODE`, given to
  the atomic write, so no file is ever readable by others, not even between its creation and a
  ``chmod``); :func:`tighten` narrows a file an older version left wider;
* the Unix socket: ``0600`` (:func:`bind_unix_socket`: bound under a ``umask`` that makes it so,
  never ``0666`` for a moment), or ``0660`` for one group (``--socket-group``);
* the whole path, as OpenSSH's ``StrictModes`` checks it (:func:`check_path`): every directory
  from the flash dir, the socket's directory or the token file's directory up to ``/`` (and, for
  a path through a symlink, every directory up to ``/`` of where it leads) must belong to this
  user or root and not be writable by its group or others (unless sticky, as ``/tmp``); a
  symlink on the way must belong to this user or root. Otherwise another user could replace a
  directory on the way, unlink the socket and bind their own, or point the flash dir elsewhere.

No state, no locks (functions).
"""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path
from typing import Callable

from sparkv.device.errors import DeviceError

#: directories of the service: its user only
DIR_MODE = 0o700
#: files of the service: its user only
FILE_MODE = 0o600
#: the socket shared with one group (``--socket-group``)
GROUP_SOCKET_MODE = 0o660


def check_owner(path: str | os.PathLike[str], st: os.stat_result | None = None) -> os.stat_result:
    """``path``'s ``stat``; :class:`DeviceError` if another user owns it."""
    st = st or os.stat(path)
    if st.st_uid != os.geteuid():
        raise DeviceError(f"{path} belongs to uid {st.st_uid}, not to this user "
                          f"(uid {os.geteuid()}): the device service keeps its files private")
    return st


def check_path(path: str | os.PathLike[str], what: str, *, leaf_mode: bool = True) -> None:
    """:class:`DeviceError` (naming ``what`` and the component) if another user controls a
    component of ``path`` (module docstring): an existing directory or symlink on the way up to
    ``/`` that belongs to a user other than this one and root, or a directory writable by its
    group or others without the sticky bit (``path`` itself only if ``leaf_mode``: the flash
    dir is narrowed to ``0700`` instead); the same for the path a symlink on the way leads to.
    Components that do not exist yet are skipped (the service makes them, its own)."""
    p = Path(os.path.abspath(path))
    real = Path(os.path.realpath(p))
    for chain in (p,) if real == p else (p, real):
        for part in (chain, *chain.parents):
            _check_component(part, what, path, mode=leaf_mode or part != chain)


def _check_component(part: Path, what: str, path: str | os.PathLike[str], mode: bool) -> None:
    try:
        st = os.lstat(part)
    except FileNotFoundError:
        return
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise DeviceError(f"{what} {path}: {part} belongs to uid {st.st_uid}, not to this user "
                          f"(uid {me}) or root, who could replace it: the device service "
                          "refuses a path another user controls")
    bits = st.st_mode
    if mode and stat.S_ISDIR(bits) and bits & 0o022 and not bits & stat.S_ISVTX:
        raise DeviceError(f"{what} {path}: {part} is writable by its group or others (mode "
                          f"{stat.S_IMODE(bits):04o}), who could replace what is in it: the "
                          "device service refuses a path another user controls")


def existing(path: str | os.PathLike[str], is_kind: Callable[[int], bool],
             kind: str) -> os.stat_result | None:
    """``lstat`` of ``path`` (a link is not followed), or ``None`` if nothing is there;
    :class:`DeviceError` if it is not a ``kind`` (``is_kind`` of its mode) or another user owns
    it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not is_kind(st.st_mode):
        raise DeviceError(f"{path} exists and is not a {kind}: refusing to use it")
    return check_owner(path, st)


def private_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` as a directory of this user's only (``0700``): made if missing (with its
    parents), narrowed if wider; :class:`DeviceError` if it is not a directory or another user
    owns it."""
    p = Path(path)
    p.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    st = check_owner(p)
    if not stat.S_ISDIR(st.st_mode):
        raise DeviceError(f"{p} is not a directory")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(p, DIR_MODE)
    return p


def tighten(path: str | os.PathLike[str], st: os.stat_result | None = None) -> None:
    """Narrows a file of this user's to ``0600`` if others or its group may read it (files an
    older version wrote ``0644``); a file of another user or a missing one is left alone."""
    try:
        st = st or os.stat(path)
        if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, FILE_MODE)
    except OSError:
        pass


def group_id(name: str) -> int:
    """The id of group ``name`` (a name or a number); :class:`DeviceError` if there is none."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)
        raise DeviceError(f"no group {name!r}") from None


def bind_unix_socket(path: str | os.PathLike[str], group: str | None = None) -> socket.socket:
    """A Unix stream socket bound at ``path``, ``0600`` (``0660`` and owned by ``group`` when
    given), not yet listening.

    A stale socket at ``path`` is replaced; anything else there (a file, a link, a directory) is
    left and refused. The socket is bound under ``umask 0177`` so that it is never reachable by
    others, then widened for ``group`` explicitly (``umask`` is per process: the serve process
    binds once, before it starts any thread)."""
    p = Path(path)
    gid = group_id(group) if group is not None else None
    check_path(p.parent, "the socket's directory")
    if existing(p, stat.S_ISSOCK, "socket") is not None:
        p.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(p))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    try:
        if gid is not None:
            os.chown(p, -1, gid)
            os.chmod(p, GROUP_SOCKET_MODE)
    except OSError as e:
        sock.close()
        p.unlink(missing_ok=True)
        raise DeviceError(f"cannot give socket {p} to group {group!r}: {e}") from e
    return sock
