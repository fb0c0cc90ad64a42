"""Starting one of sparkv's own commands as a process of its own (a ``sparkv serve``, a
``sparkv device serve``): one replaceable launcher.

:class:`sparkv.server.process.ServerProcess` and :class:`sparkv.device.client.DeviceProcess`
start their command with :func:`launch`, whose default is :func:`popen` (``subprocess.Popen``,
the command's output appended to a log file). A caller that starts many such processes can
install another launcher with :func:`use_launcher`: the test suite installs a fork server's
(tests/forklaunch.py), whose processes skip the 5-8 s of CPU that importing torch and
transformers costs each new Python process. Whatever it does, a launcher returns a handle with
``subprocess.Popen``'s process methods (:class:`Proc`), and its process is a real one: its own
pid, sockets and signals.
"""

from __future__ import annotations

import subprocess
from typing import IO, Callable, Protocol


class Proc(Protocol):
    """What a launched process's handle offers: ``subprocess.Popen``'s process methods."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


#: ``(command line, environment, log file opened for appending bytes) -> a running process``
Launcher = Callable[[list[str], dict[str, str], IO[bytes]], Proc]


def popen(cmd: list[str], env: dict[str, str], log: IO[bytes]) -> Proc:
    """The default launcher: ``subprocess.Popen``, stdout and stderr into ``log``."""
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


_launcher: Launcher = popen


def launch(cmd: list[str], *, env: dict[str, str], log: IO[bytes]) -> Proc:
    """Starts ``cmd`` with the installed launcher (:func:`popen` unless
    :func:`use_launcher` installed another)."""
    return _launcher(cmd, env, log)


def use_launcher(launcher: Launcher | None) -> Launcher:
    """Installs ``launcher`` (``None``: :func:`popen`) for every later :func:`launch`; returns
    the one it replaces."""
    global _launcher
    previous, _launcher = _launcher, launcher or popen
    return previous
