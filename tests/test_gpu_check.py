"""``bench/gpu_check.sh`` stays runnable while no GPU is lent (issue 46): a session that gets
one has 15 minutes of device time in all, which a stale flag or a renamed test would waste.
Every phase's command is parsed by the ``sparkv`` CLI's parser (the random model shapes, the
prefill variants and the contexts systems it names are known ones), every test file and node
id of the ``tests`` phase exists, and every phase's limit fits the device tool's 10 minutes a
command. Nothing here needs CUDA: the script itself exits at once on a machine without one."""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "gpu_check.sh"
#: the device tool's limit on one command (seconds)
COMMAND_LIMIT_S = 600
#: the phases docs/gpu.md tells the next GPU session to run first, within 13 minutes
FIRST_RUN = ("tests", "attention", "prefill1k", "devicekv")


def _phases() -> dict[str, tuple[int, list[str]]]:
    """``phase NAME LIMIT CMD...`` lines (continuations joined) -> {name: (limit, argv)}, with
    the script's variables written as the values a run gives them."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    subs = {"$BENCH": "sparkv bench", "$PY -m sparkv.cli": "sparkv", "$PY -m pytest": "pytest",
            '"$tmp/': '"/tmp/out/', '$tag': 'h200', '"$tok"': "/tmp/tok"}
    out: dict[str, tuple[int, list[str]]] = {}
    for line in text.splitlines():
        if not line.startswith("phase ") or line.startswith("phase()"):
            continue
        for old, new in subs.items():
            line = line.replace(old, new)
        words = shlex.split(line, comments=True)
        name, limit, argv = words[1], int(words[2]), words[3:]
        while argv and (argv[0] == "env" or re.match(r"^[A-Z_]+=", argv[0])):
            argv = argv[1:]
        out[name] = (limit, argv)
    return out


PHASES = _phases()


def test_the_script_has_every_phase_its_header_names():
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    named = set(re.findall(r"\b(tests|attention|prefill1kprof|prefill1k|prefill|profile|"
                           r"ttftlong|ttftswitch|ttftnetns|ttft|devicekv)\b", header))
    assert named <= set(PHASES) and set(FIRST_RUN) <= set(PHASES), (named, set(PHASES))
    assert all(limit <= COMMAND_LIMIT_S for limit, _ in PHASES.values())
    assert sum(PHASES[p][0] for p in FIRST_RUN) <= 13 * 60


def test_the_script_parses_and_exits_at_once_without_cuda(tmp_path):
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run its phases")
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PYTHON": sys.executable})
    assert r.returncode == 0 and "no CUDA device here" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("name", sorted(n for n in PHASES if n != "tests"))
def test_each_phases_command_parses(name):
    from sparkv.cli import build_parser

    argv = PHASES[name][1]
    assert argv[0] == "sparkv", argv
    args = build_parser().parse_args(argv[1:])
    model = getattr(args, "model", None)
    if model and model.startswith("random:"):
        from sparkv.runtime.shapes import parse_random_spec

        parse_random_spec(model)
    if getattr(args, "variants", None) and argv[1:3] == ["bench", "prefill"]:
        from sparkv.bench.prefill import parse_variants

        assert parse_variants(args.variants)
    if getattr(args, "systems", None):
        from sparkv.bench.contexts import SYSTEMS

        assert set(args.systems.split(",")) <= set(SYSTEMS)
    if hasattr(args, "device"):
        assert args.device == "cuda", name
    if argv[1:3] == ["bench", "ttft"]:
        _fits_the_servers_frames(args)


def _fits_the_servers_frames(args):
    """The context a TTFT phase creates is accepted by a default server: its largest chunk's
    raw frame within ``max_frame_bytes`` (the H200's run 3 was refused at 1,024-token chunks
    of the Llama-3.2-1B shape: 72 bytes over)."""
    from sparkv.layout import ChunkGeometry
    from sparkv.runtime.shapes import SHAPES, parse_random_spec
    from sparkv.server.config import Settings
    from sparkv.server.encoder import frame_cap_error

    shape = SHAPES[parse_random_spec(args.model)[0]]
    for n in args.sizes.split(","):
        geometry = ChunkGeometry(int(n), args.chunk_tokens, shape["num_hidden_layers"],
                                 shape["num_key_value_heads"], shape["head_dim"])
        limit = Settings().max_frame_bytes
        assert frame_cap_error(geometry, 2, encrypted=True, limit=limit) is None, (n, limit)


def _functions(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_tests_phase_names_existing_tests():
    argv = PHASES["tests"][1]
    assert argv[0] == "pytest"
    targets = [a for a in argv[1:] if a.startswith("tests/")]
    assert len(targets) >= 5
    for target in targets:
        file, _, func = target.partition("::")
        assert (ROOT / file).is_file(), target
        if func:
            assert func in _functions(ROOT / file), target


def test_the_prepare_script_pins_packages_this_venv_has():
    """bench/gpu_prepare.sh downloads each package at the version this venv runs: every name
    it lists is installed here (else its pin lookup fails), among them opentelemetry-api, which
    fastapi imports and the device image lacked (the H200's run 3)."""
    import importlib.metadata as metadata

    script = ROOT / "bench" / "gpu_prepare.sh"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    listed = script.read_text().split('PACKAGES="', 1)[1].split('"', 1)[0].split()
    assert "opentelemetry-api" in listed and "fastapi" in listed
    for name in listed:
        assert metadata.version(name), name
