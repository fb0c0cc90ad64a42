"""The suite's launcher for ``python -m sparkv.cli ...`` processes (servers, device services): a
fork server that has imported torch, transformers and the web stack once, so that each process
the suite starts skips the 5-8 s of CPU those imports cost a new interpreter (about 70 such
processes per run: a fifth of the suite's CPU on 2 cores).

Each process is a real one, forked from that server: its own pid, sockets, files and signals
(``kill()`` is a SIGKILL, ``stop()`` a SIGTERM; the exit code is the command's). It runs the
command as ``python -m sparkv.cli`` does (:func:`sparkv.cli.main` with the process's own
arguments), in the environment and working directory it was given, its output appended to the
log file; sparkv's own modules are imported afresh in it (the fork server never imports them),
so whatever they read from the environment at import is the process's own. Nothing else goes
through it: commands that are not ``sparkv.cli`` (redis-server, shell blocks, ``sparkv`` on the
PATH) are started as before, and ``SPARKV_TEST_FORK=0`` turns it off.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import subprocess
import sys
from typing import IO

from sparkv.launch import Proc, popen

#: third-party modules the fork server imports once (none of sparkv's)
PRELOAD = ["numpy", "torch", "transformers", "transformers.modeling_utils",
           "transformers.models.llama.modeling_llama", "fastapi", "starlette", "uvicorn",
           "httpx", "yaml", "numba"]
#: the command line prefix this launcher takes
CLI = [sys.executable, "-m", "sparkv.cli"]


class ForkedProc:
    """``subprocess.Popen``'s process methods over a process of the fork server."""

    def __init__(self, process: multiprocessing.process.BaseProcess, cmd: list[str]) -> None:
        self._process = process
        self._cmd = cmd
        self.pid = int(process.pid or 0)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self._cmd, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:          # never a pid the system may have reused
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_cli(args: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked process: the environment, directory, output and arguments of
    ``python -m sparkv.cli ARGS``, then its main; exits with its code."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from sparkv import cli

    sys.argv = [cli.__file__, *args]
    try:
        code = cli.main()
    finally:
        atexit._run_exitfuncs()                # what an interpreter's exit would run
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


class ForkLauncher:
    """A :data:`sparkv.launch.Launcher`: ``sparkv.cli`` commands from the fork server, any
    other command through :func:`sparkv.launch.popen`."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)

    def __call__(self, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> Proc:
        if cmd[:3] != CLI or not getattr(log, "name", None):
            return popen(cmd, env, log)
        log.flush()
        process = self._ctx.Process(target=_run_cli, args=(cmd[3:], dict(env), os.getcwd(),
                                                           str(log.name)),
                                    name="sparkv " + " ".join(cmd[3:5]), daemon=True)
        process.start()
        return ForkedProc(process, cmd)
