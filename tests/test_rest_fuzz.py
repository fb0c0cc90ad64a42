"""Schema-driven fuzzing of both HTTP apps (schemathesis, pinned in ``[dev]``), each a real
process on loopback: the REST server (``sparkv serve``, the tiny model) and the device service
(``sparkv device serve --port``, the tiny model, with its token).

Every generated request must get no 5xx and a status its operation declares ("the schemas state
every status a route can return", issue 42), and a method a path lacks a 405 naming the path's
methods in ``Allow``. The example count and the run time are bounded (a fixed seed, a few
examples per operation) so that each app's run takes well under a minute; the run is a search
for bugs, not a timing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkv.device.client import DeviceProcess
from sparkv.server.process import free_port
from helpers import shared_tiny_checkpoint, start_tiny_server, stop_checked

CHECKS = "not_a_server_error,status_code_conformance,unsupported_method,allow_header_conformance"
RUN_S = 15  # schemathesis's own budget per app (--max-time); the hang guard below is larger


def schemathesis(url: str, headers: list[str], workdir: Path) -> str:
    """Runs ``st run`` against ``url``/openapi.json; returns its output (asserted passing)."""
    st = shutil.which("st", path=str(Path(sys.executable).parent))
    if st is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    cmd = [st, "run", f"{url}/openapi.json", "--checks", CHECKS, "--max-examples", "5",
           "--workers", "1", "--seed", "7", "--generation-database", "none",
           "--request-timeout", "20", "--phases", "coverage,fuzzing,stateful",
           "--max-time", str(RUN_S), "--no-color"]
    for header in headers:
        cmd += ["-H", header]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_S + 120, cwd=workdir)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    summary = out.split("SUMMARY")[-1]
    assert " passed" in summary and "failed" not in summary and "error" not in summary.lower(), \
        out[-3000:]
    return out


def test_the_server_answers_fuzzed_requests_as_its_schema_says(tmp_path):
    srv = start_tiny_server(tmp_path)
    try:
        schemathesis(srv.url, [f"Authorization: Bearer {srv.keys['alice']}"], tmp_path)
    finally:
        stop_checked(srv)
    assert "internal_error" not in srv.log()


def test_the_device_service_answers_fuzzed_requests_as_its_schema_says(tmp_path):
    proc = DeviceProcess(tmp_path / "swap", 50, model=str(shared_tiny_checkpoint()),
                         port=free_port(), token_file=tmp_path / "token").start()
    try:
        token = (tmp_path / "token").read_text().strip()
        schemathesis(proc.url, [f"Authorization: Bearer {token}", "Host: 127.0.0.1"], tmp_path)
    finally:
        proc.stop()
    log = proc.log()
    assert "Traceback" not in log and "internal_error" not in log, log[-3000:]
