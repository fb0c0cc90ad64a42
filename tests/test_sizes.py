"""Small classes where a target says so (issue 43: "no class in sparkv/cache over 300 lines").

The KV memory's classes are the ones every layer above uses; a class that grows past the limit is
split by responsibility (as ``HeldChunks``, what a context holds, and ``ChunkMemory``, its
writes), not by line count alone."""

from __future__ import annotations

import ast
from pathlib import Path

import sparkv

PACKAGE = Path(sparkv.__file__).parent
LIMITS = {"cache": 300}


def class_lengths(root: Path) -> dict[str, int]:
    """``path:Class -> lines`` of every module-level class under ``root`` (decorators aside)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                found[f"{path.relative_to(root.parent)}:{node.name}"] = \
                    node.end_lineno - node.lineno + 1
    return found


def test_no_class_of_the_kv_memory_is_over_its_limit():
    for part, limit in LIMITS.items():
        over = {k: n for k, n in class_lengths(PACKAGE / part).items() if n > limit}
        assert not over, f"classes over {limit} lines in sparkv/{part}: {over}"


def test_the_length_check_sees_a_long_class(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class Long:\n" + "    x = 1\n" * 301 + "class Short:\n    y = 2\n")
    assert class_lengths(pkg) == {"pkg/a.py:Long": 302, "pkg/a.py:Short": 2}
