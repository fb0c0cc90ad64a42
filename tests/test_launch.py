"""How sparkv starts its servers as processes (sparkv/launch.py), and the suite's fork server
(tests/forklaunch.py): a forked server is a process of its own that behaves as an exec'd one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from forklaunch import ForkedProc, ForkLauncher

from sparkv.launch import launch, popen, use_launcher
from sparkv.server.process import ServerProcess, ServerProcessError


def test_use_launcher_swaps_the_launcher_every_server_start_goes_through(tmp_path):
    seen = []

    def recording(cmd, env, log):
        seen.append((cmd, env["OMP_NUM_THREADS"], log.name))
        return popen([sys.executable, "-c", "pass"], env, log)

    previous = use_launcher(recording)
    try:
        with open(tmp_path / "a", "ab") as log:
            proc = launch(["x"], env={"OMP_NUM_THREADS": "3"}, log=log)
            assert proc.wait(30) == 0 and seen == [(["x"], "3", str(tmp_path / "a"))]
        srv = ServerProcess(None, f"file://{tmp_path}/store", log_path=tmp_path / "log",
                            torch_threads=2)
        with pytest.raises(ServerProcessError, match="exited with 0"):
            srv.start(timeout=60)           # `pass` exits without answering /healthz
        cmd, threads, log = seen[1]
        assert cmd[1:4] == ["-m", "sparkv.cli", "serve"] and threads == "2"
        assert log == str(tmp_path / "log")
    finally:
        assert use_launcher(previous) is recording
    assert use_launcher(None) is previous and use_launcher(previous) is popen


def test_a_forked_server_is_a_real_process_that_signals_end_as_they_end_an_execd_one(tmp_path):
    """Its own pid (not a child of the test's process), the caller's working directory, its
    output in its log; SIGTERM: the graceful shutdown, then uvicorn's re-raised SIGTERM (-15),
    SIGKILL: -9, as for a ``subprocess.Popen``'s."""
    previous = use_launcher(ForkLauncher())
    try:
        servers = []
        for i in range(2):
            srv = ServerProcess(None, f"file://{tmp_path}/store{i}",
                                log_path=tmp_path / f"log{i}").start()
            servers.append(srv)
            assert isinstance(srv.proc, ForkedProc) and srv.proc.pid != os.getpid()
            assert os.readlink(f"/proc/{srv.proc.pid}/cwd") == os.getcwd()
            with open(f"/proc/{srv.proc.pid}/stat") as fh:
                assert int(fh.read().rsplit(")", 1)[1].split()[1]) != os.getpid()   # ppid
            assert srv.proc.poll() is None and srv.proc.returncode is None
            with pytest.raises(subprocess.TimeoutExpired):
                srv.proc.wait(0.1)
        servers[0].stop()
        servers[1].kill()
        assert servers[0].proc.returncode == -signal.SIGTERM
        assert servers[1].proc.returncode == -signal.SIGKILL
        assert "Application shutdown complete" in servers[0].log()
        assert "Application startup complete" in servers[1].log()
        assert "shutdown" not in servers[1].log()
        servers[1].proc.send_signal(signal.SIGTERM)      # an ended process: nothing is sent
    finally:
        use_launcher(previous)


def test_commands_other_than_sparkvs_cli_are_started_as_before(tmp_path):
    with open(tmp_path / "log", "ab") as log:
        proc = ForkLauncher()([sys.executable, "-c", "print('plain')"], dict(os.environ), log)
        assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
    assert (tmp_path / "log").read_text() == "plain\n"


def _ended(pid: int) -> bool:
    """The process is gone, or a zombie nobody reaped (its parent died: init's to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_server_ends_when_the_process_that_started_it_is_killed(tmp_path):
    """A benchmark killed outright (SIGKILL: no cleanup runs) must not leave its server behind:
    the server, re-parented, shuts itself down (gracefully: SIGTERM to itself)."""
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import time
        from sparkv.server.process import ServerProcess
        srv = ServerProcess(None, "file://{tmp_path}/store", log_path="{tmp_path}/log")
        srv.start(timeout=240)
        print(srv.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        assert not _ended(pid)
    finally:
        parent.kill()
        parent.wait(60)
    deadline = time.monotonic() + 120     # a bound on a hang, not a speed: it polls every 1 s
    while not _ended(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ended(pid)
    assert "Application shutdown complete" in (tmp_path / "log").read_text()
