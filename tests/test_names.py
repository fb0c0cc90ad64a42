"""One name per idea (docs/architecture.md): no two public classes in ``sparkv`` share a name.

A second class with a name already taken (two ``Level``s, two ``Plan``s) makes every import site
ambiguous to a reader; give the new idea its own name (``StreamLevel``, ``PressPlan``)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import sparkv

PACKAGE = Path(sparkv.__file__).parent


def public_classes(root: Path) -> dict[str, list[str]]:
    """Every module-level class whose name does not start with ``_``, by name."""
    found: dict[str, list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                found[node.name].append(str(path.relative_to(root.parent)))
    return found


def test_no_two_public_classes_share_a_name():
    shared = {name: where for name, where in public_classes(PACKAGE).items() if len(where) > 1}
    assert not shared, f"public classes defined twice: {shared}"


def test_the_check_sees_a_collision(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("class Level:\n    pass\n")
    (pkg / "b.py").write_text("class Level:\n    pass\nclass _Private:\n    pass\n")
    assert public_classes(pkg) == {"Level": ["pkg/a.py", "pkg/b.py"]}
