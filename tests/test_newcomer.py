"""The newcomer's first hour, as README.md writes it ("Your own text, from key to answer"): a key,
the server, a text file put on it, listed, asked about, deleted. The two README blocks are run as
written (the server's port aside) from a clean ``SPARKV_CACHE_DIR``, and every step's output must
be what the page shows (tests/docsrun.py's rules: ``...`` stands for any text).

A clean cache is a new user's: nothing measured, nothing cached of any server. Only the bundled
model's converted checkpoint is shared (a link to the one the other tests use), so that the test
does not spend minutes converting the GGUF again (tests/test_runtime_model.py covers that). Kept
cheap: one server, the docs' short document (two token chunks), one ask.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from docsrun import DocsEnv, collect, output_matches, run_block, split_console

ROOT = Path(__file__).resolve().parent.parent
#: the README's blocks of the path, in order: the key and the server; the context commands
MARK = "tests/test_newcomer.py"
#: characters of the bundled sample text in document.txt (as tests/test_docs_run.py writes it)
DOCUMENT_CHARS = 1500


def _blocks() -> list:
    blocks = [b for b in collect(ROOT, ["README.md"]) if MARK in (b.marker.skip or "")]
    assert len(blocks) == 2, [b.where for b in blocks]
    return blocks


def _scratch(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A new user's directory (document.txt) and environment: a clean cache that holds only
    the converted bundled model, ``sparkv`` on the PATH, one torch thread."""
    from sparkv.runtime.generate import sample_text
    from sparkv.runtime.model import cache_dir

    work = tmp / "work"
    work.mkdir()
    text = sample_text()[:DOCUMENT_CHARS]
    (work / "document.txt").write_text(text[:text.rindex("\n") + 1])
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_dir() / "models", target_is_directory=True)
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "sparkv").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m sparkv.cli "$@"\n')
    (bin_dir / "sparkv").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKV_")}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])),
                "SPARKV_CACHE_DIR": str(cache), "SPARKV_TORCH_THREADS": "1"})
    return work, env


def _free_port() -> int:
    from sparkv.server.process import free_port

    return free_port()


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"the server did not start in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")


def test_the_readme_first_hour_path_runs_as_written(tmp_path):
    serving, asking = _blocks()
    work, env = _scratch(tmp_path)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    lines = split_console(serving.text)[0].splitlines()
    key_line, serve_line = lines
    assert key_line.startswith("export SPARKV_API_KEY=$(sparkv apikey ")

    # 1. the key: the config file holds its hash, the shell the key
    out = subprocess.run(["bash", "-euo", "pipefail", "-c",
                          f'{key_line}\nprintf "%s" "$SPARKV_API_KEY"'], cwd=work, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    key = out.stdout
    assert re.fullmatch(r"skv_[A-Za-z0-9_-]{20,}", key), key
    config = re.search(r"--config ([^\s)]+)", key_line).group(1)
    assert "sha256:" in (work / config).read_text() and key not in (work / config).read_text()
    env["SPARKV_API_KEY"] = key

    # 2. the server, as the page starts it (on a free port), its first lines as the page shows
    log = tmp_path / "serve.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(["bash", "-c", f"exec {serve_line} --port {port}"], cwd=work,
                                env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        _wait_healthy(url, proc, log)
        shown = split_console(serving.text)[1].replace("127.0.0.1:8080", f"127.0.0.1:{port}")
        assert output_matches(shown, log.read_text()), log.read_text()

        # 3-6. create from the file, list, ask, delete: the block's commands and its output
        docs_env = DocsEnv(cwd=work, env=env,
                           substitutions={"127.0.0.1:8080": f"127.0.0.1:{port}"})
        run_block(asking, docs_env)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}) as c:
            assert c.get("/v1/contexts").json() == {"contexts": [], "pending": []}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert (tmp_path / "cache" / "edge").is_dir()     # the ask cached into the clean cache
