"""The type checker over ``sparkv/`` (docs/architecture.md, "Types"): mypy, pinned in
pyproject.toml's ``[dev]``, with the configuration of its ``[tool.mypy]``, reports no error.

Slow by nature (``typecheck`` marker): one full mypy run over ``sparkv/`` and the inline types
and stubs of torch, transformers, numpy, pydantic and fastapi it follows. On a fresh clone (CI)
the run is cold: 16 s on 2 idle cores with two workers, most of it in the third-party packages
(50 s before the parts of torch and transformers that sparkv never imports were skipped; the
config's ``follow_imports = "skip"`` overrides, checked below); afterwards its cache
(``.mypy_cache/``, ignored by git) makes a rerun take seconds. Deselect it while iterating on
something else with ``-m "not typecheck"``.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _mypy(*args: str, timeout: float = 1800) -> subprocess.CompletedProcess[str]:
    """mypy run from the project root (its ``[tool.mypy]`` config, its cache)."""
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_mypy_is_pinned_and_installed_at_the_pin():
    """The errors mypy finds depend on its version: CI runs the pinned one."""
    pins = [d for d in PYPROJECT["project"]["optional-dependencies"]["dev"]
            if re.match(r"mypy\b", d)]
    assert len(pins) == 1 and "==" in pins[0], pins
    assert metadata.version("mypy") == pins[0].split("==")[1].split()[0]


#: mypy's parallel workers (its ``--num-workers``): CI has 2 cores; more do not pay on 2
WORKERS = 2


def test_the_config_checks_sparkv_and_fails_on_errors():
    cfg = PYPROJECT["tool"]["mypy"]
    assert cfg["files"] == ["sparkv"] and cfg["check_untyped_defs"] is True
    assert cfg["disallow_untyped_defs"] is True and cfg["disallow_incomplete_defs"] is True
    assert not cfg.get("ignore_errors") and not cfg.get("ignore_missing_imports")
    for override in cfg.get("overrides", []):
        modules = set(override["module"])
        assert not override.get("ignore_errors"), modules
        if override.get("ignore_missing_imports"):          # third-party only
            assert not any(m.startswith("sparkv") for m in modules), modules
        # every package is held to fully annotated functions: none may be relaxed
        assert override.get("disallow_untyped_defs") is not False, modules
        assert override.get("disallow_incomplete_defs") is not False, modules


def _follows(module: str, overrides: list[dict]) -> bool:
    """Whether mypy follows ``module``'s import under these overrides: an exact pattern wins
    over a wildcard one, a longer wildcard over a shorter (mypy's precedence)."""
    best: tuple[int, int] = (-1, -1)
    setting = "normal"
    for override in overrides:
        if "follow_imports" not in override:
            continue
        for pattern in override["module"]:
            exact = pattern == module
            prefix = pattern.removesuffix(".*")
            wild = pattern.endswith(".*") and (module == prefix or module.startswith(prefix + "."))
            rank = (1, len(pattern)) if exact else (0, len(prefix)) if wild else None
            if rank is not None and rank > best:
                best, setting = rank, override["follow_imports"]
    return setting != "skip"


def _sparkv_imports() -> set[str]:
    """Every module an ``import`` or ``from ... import`` in sparkv/ names (absolute only)."""
    names: set[str] = set()
    for path in (ROOT / "sparkv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_mypy_skips_only_third_party_modules_sparkv_never_imports():
    """A skipped module's names read as Any: skipping is for speed over code sparkv does not
    use (torch's compiler and distributed stacks, transformers' other models), never for code
    it calls."""
    overrides = PYPROJECT["tool"]["mypy"].get("overrides", [])
    skipped = {p for o in overrides if o.get("follow_imports") == "skip" for p in o["module"]}
    assert skipped and not any(p.startswith("sparkv") for p in skipped), skipped
    imported = _sparkv_imports()
    assert {"transformers.models.llama.modeling_llama", "torch.nn.attention.flex_attention",
            "transformers.cache_utils"} <= imported
    assert [m for m in sorted(imported) if not _follows(m, overrides)] == []
    assert not _follows("transformers.models.qwen2.modeling_qwen2", overrides)
    assert _follows("transformers.models", overrides)


def test_mypy_reports_a_type_error(tmp_path):
    """The configuration (the same file, other files checked) does report an error."""
    bad = tmp_path / "bad.py"
    bad.write_text("def half(x: int) -> int:\n    return x / 2\n")
    r = _mypy("--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "c"),
              str(bad), timeout=600)
    assert r.returncode == 1 and "bad.py:2: error" in r.stdout, r.stdout + r.stderr


@pytest.mark.typecheck
def test_mypy_finds_no_error_in_sparkv():
    r = _mypy("--num-workers", str(WORKERS))
    assert r.returncode == 0, f"mypy found errors:\n{r.stdout[-20000:]}\n{r.stderr[-5000:]}"
    assert r.stdout.strip().startswith("Success: no issues found"), r.stdout
