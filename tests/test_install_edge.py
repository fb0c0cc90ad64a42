"""Install profiles (docs/python-api.md, "Install profiles"): the device side works without the
server, queue, benchmark and plotting stacks, and whatever needs one of them names its extra.

* fast, always: in a subprocess, a meta-path finder makes fastapi, starlette, uvicorn, redis,
  prometheus-client, pulp, scikit-learn, matplotlib and aiohttp unimportable; every module of the
  package then imports or raises :class:`~sparkv.extras.MissingExtra`, every device-side module
  imports, ``sparkv ask --help`` works and ``sparkv serve`` is one line and exit 2.
* slow, opt-in (``SPARKV_SLOW_TESTS=1``; it needs pip's package index): ``pip install
  torch==2.13.0 '.[edge]'`` into a fresh virtualenv, then a real ``sparkv ask`` from it against a
  server started from the full install (this process's), on loopback. Minutes (11 to 15 here,
  nearly all of it pip): CI does not run it. ``SPARKV_EDGE_VENV=DIR`` keeps the virtualenv there
  and reuses it on the next run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sparkv.extras import EXTRA_OF, MissingExtra, require

ROOT = Path(__file__).resolve().parent.parent
#: import names of the stacks an edge install leaves out
ABSENT = ("fastapi", "starlette", "uvicorn", "redis", "prometheus_client", "pulp", "sklearn",
          "matplotlib", "aiohttp")
#: the modules that belong to another profile (they may raise MissingExtra there)
# the HTTP apps and the plumbing only they use (sparkv.rest's limits, fields and listen are
# plain Python, used by the edge-side commands too)
NOT_EDGE = ("sparkv.server", "sparkv.bench", "sparkv.demo", "sparkv.device.app",
            "sparkv.rest.handlers", "sparkv.rest.middleware", "sparkv.rest.routing",
            "sparkv.asks.routes", "sparkv.asks.chat", "sparkv.asks.completion",
            "sparkv.asks.models", "sparkv.asks.responses", "sparkv.asks.respkept",
            "sparkv.asks.convroutes", "sparkv.asks.resptokens", "sparkv.asks.textcompletion")

BLOCKED_RUN = r"""
import contextlib, importlib, importlib.abc, io, json, pkgutil, sys
BLOCK = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCK:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, Block())
import sparkv
from sparkv.cli import main
from sparkv.extras import MissingExtra
out = {"imported": [], "missing_extra": {}, "other": {}}
for info in pkgutil.walk_packages(sparkv.__path__, "sparkv.", onerror=lambda name: None):
    try:
        importlib.import_module(info.name)
        out["imported"].append(info.name)
    except MissingExtra as exc:
        out["missing_extra"][info.name] = str(exc)
    except Exception as exc:
        out["other"][info.name] = repr(exc)
for name in ("EdgeSession", "AskOptions", "ContextService", "ServiceConfig", "SparkvCache",
             "load_model", "generate", "SnapKVPress"):
    getattr(sparkv, name)
runs = {}
for argv in (["ask", "--help"], ["serve"], ["device", "serve", "--memory-budget-mb", "64"],
             ["demo"]):
    err, stdout = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(stdout):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = exc.code
    runs[" ".join(argv[:2])] = {"rc": rc, "err": err.getvalue(), "out": stdout.getvalue()}
out["runs"] = runs
out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCK)
print(json.dumps(out))
"""


def _edge_side(name: str) -> bool:
    return not any(name == p or name.startswith(p + ".") for p in NOT_EDGE)


@pytest.fixture(scope="module")
def blocked() -> dict:
    """What the package does with the other profiles' stacks unimportable (one subprocess)."""
    proc = subprocess.run([sys.executable, "-c", BLOCKED_RUN, ",".join(ABSENT)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_device_side_module_imports_without_the_other_stacks(blocked):
    assert blocked["other"] == {}
    assert blocked["loaded"] == []
    edge_failures = {m: e for m, e in blocked["missing_extra"].items() if _edge_side(m)}
    assert edge_failures == {}
    for part in ("sparkv.edge.session", "sparkv.device.service", "sparkv.presses",
                 "sparkv.decode", "sparkv.cache", "sparkv.runtime.model", "sparkv.cli"):
        assert part in blocked["imported"]


def test_other_profiles_modules_name_their_extra(blocked):
    assert "sparkv.server.app" in blocked["missing_extra"]
    for module, message in blocked["missing_extra"].items():
        assert not _edge_side(module), module
        assert "pip install 'sparkv[server]'" in message or "pip install 'sparkv[bench]'" in message


def test_the_cli_without_the_server_extra(blocked):
    runs = blocked["runs"]
    assert runs["ask --help"]["rc"] == 0 and "--server" in runs["ask --help"]["out"]
    for command in ("serve", "device serve"):
        run = runs[command]
        assert run["rc"] == 2, run
        assert run["err"].strip().splitlines() == [
            f"sparkv: error: sparkv {command}{' (the HTTP app)' if command != 'serve' else ''} "
            "needs 'fastapi', which is not installed: pip install 'sparkv[server]'"]
    assert runs["demo"]["rc"] == 2
    assert runs["demo"]["err"].strip() == ("sparkv: error: sparkv demo needs 'fastapi', which is "
                                           "not installed: pip install 'sparkv[server]'")


def test_require_names_the_extra():
    assert require("json", extra="server").__name__ == "json"
    with pytest.raises(MissingExtra, match=r"pip install 'sparkv\[bench\]'") as info:
        require("matplotlib.no_such_module_here", feature="plotting")
    assert isinstance(info.value, ImportError) and info.value.extra == "bench"
    with pytest.raises(ValueError, match="no extra is known"):
        require("no_such_top_level_module")


def _distribution(requirement: str) -> str:
    name = requirement.split(";")[0].split("[")[0]
    for op in "<>=!~ ":
        name = name.split(op)[0]
    return name.strip().lower().replace("_", "-")


def test_pyproject_profiles_match_the_extras_table():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    dist_of = {"sklearn": "scikit-learn", "yaml": "pyyaml", "prometheus_client": "prometheus-client",
               "starlette": "fastapi"}        # starlette comes with fastapi
    base = {_distribution(r) for r in project["dependencies"]}
    for module, extra in EXTRA_OF.items():
        dist = dist_of.get(module, module)
        assert dist in {_distribution(r) for r in extras[extra]}, (module, extra)
        assert dist not in base, f"{dist} is in the base dependencies"
    assert set(extras) >= {"edge", "server", "bench", "all", "dev"}
    assert extras["all"] == ["sparkv[edge,server,bench]"]
    assert "sparkv[all]" in extras["dev"]
    setup = (ROOT / "deploy" / "setup.sh").read_text()
    assert 'pip install -e ".[all,dev]"' in setup          # the README's commands: everything


# ---- the real edge install (opt-in) --------------------------------------------------------------
slow = pytest.mark.skipif(os.environ.get("SPARKV_SLOW_TESTS") != "1",
                          reason="installs sparkv[edge] into a fresh venv (minutes, needs pip's "
                                 "index): set SPARKV_SLOW_TESTS=1")


def _edge_venv(tmp_path: Path) -> Path:
    """A fresh virtualenv with ``torch==2.13.0 '.[edge]'``; ``SPARKV_EDGE_VENV=DIR`` reuses one
    made so before (only sparkv itself is reinstalled, without dependencies)."""
    reuse = os.environ.get("SPARKV_EDGE_VENV")
    venv = Path(reuse) if reuse else tmp_path / "venv-edge"
    py = venv / "bin" / "python"
    if reuse and py.is_file():
        args = ["--no-deps", "--force-reinstall", str(ROOT)]
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        # torch first and pinned, as deploy/setup.sh does (a bare `torch` pulls a CUDA build);
        # pip's find-links folder holds its CPU wheel here
        args = ["torch==2.13.0", f"{ROOT}[edge]"]
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           *args], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return venv


@slow
@pytest.mark.install
def test_an_edge_install_asks_a_server_of_the_full_install(smollm2, tmp_path):
    from sparkv.edge import EdgeClient
    from sparkv.runtime.generate import sample_text
    from sparkv.server.process import ServerProcess

    venv = _edge_venv(tmp_path)
    py = str(venv / "bin" / "python")
    probe = ("import importlib.util, json, sys; import sparkv.edge, sparkv.device, sparkv.presses,"
             " sparkv.decode; print(json.dumps([m for m in sys.argv[1:] "
             "if importlib.util.find_spec(m) is not None]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    found = subprocess.run([py, "-c", probe, *ABSENT], capture_output=True, text=True, env=env,
                           cwd=tmp_path, timeout=300)
    assert found.returncode == 0, found.stderr[-3000:]
    assert json.loads(found.stdout) == []
    srv = ServerProcess(None, f"file://{tmp_path}/store", log_path=tmp_path / "server.log").start()
    try:
        with EdgeClient(srv.url, timeout_s=300.0) as client:    # the first encode loads the model
            cid = client.create_context(text=sample_text()[:1500], levels=["raw", "q8"])
        ask = subprocess.run([str(venv / "bin" / "sparkv"), "ask", "--server", srv.url,
                              "--context", cid, "What is this text about?", "--mbps", "100",
                              "--max-new-tokens", "4", "--json", "--no-cache"],
                             capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    finally:
        srv.stop()
    assert ask.returncode == 0, ask.stderr[-3000:]
    out = json.loads(ask.stdout)
    assert out["text"].strip() and out["stats"]["ttft_s"] > 0


def test_the_server_profile_needs_no_bench_stack():
    """``sparkv[server]`` without ``[bench]``: the server, its workers and the encoder import."""
    code = BLOCKED_RUN.split("import sparkv\n")[0] + (
        "import sparkv.server.app, sparkv.server.worker, sparkv.server.encoder\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in BLOCK))\n")
    proc = subprocess.run([sys.executable, "-c", code, "pulp,sklearn,matplotlib,aiohttp"],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
