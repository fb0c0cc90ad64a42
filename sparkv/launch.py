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

Every launched process is told (:data:`EXIT_WITH_PARENT`) to end with the process that started
it: the commands call :func:`exit_with_parent`, so a benchmark or demo killed outright (SIGKILL,
or a SIGTERM that runs no cleanup) leaves no server holding a model and a port behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import IO, Callable, Protocol

#: set to ``1`` in the environment of every process :func:`launch` starts
EXIT_WITH_PARENT = "SPARKV_EXIT_WITH_PARENT"


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
    :func:`use_launcher` installed another), :data:`EXIT_WITH_PARENT` set in its
    environment."""
    return _launcher(cmd, {**env, EXIT_WITH_PARENT: "1"}, log)


def exit_with_parent(interval_s: float = 1.0) -> bool:
    """In a command :func:`launch` started (:data:`EXIT_WITH_PARENT` set): a daemon thread
    that sends this process SIGTERM (its graceful shutdown) once the process that started it is
    gone (its parent pid changes: it was re-parented). Returns whether it watches."""
    if os.environ.get(EXIT_WITH_PARENT) != "1":
        return False
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="sparkv-parent-watch", daemon=True).start()
    return True


def use_launcher(launcher: Launcher | None) -> Launcher:
    """Installs ``launcher`` (``None``: :func:`popen`) for every later :func:`launch`; returns
    the one it replaces."""
    global _launcher
    previous, _launcher = _launcher, launcher or popen
    return previous
