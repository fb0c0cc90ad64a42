"""One name per idea (docs/architecture.md): no two public classes in ``sparkv`` share a name,
and no class has a second public name.

A second class with a name already taken (two ``Level``s, two ``Plan``s) makes every import site
ambiguous to a reader; give the new idea its own name (``StreamLevel``, ``PressPlan``). A second
name for one class (``SnapKV = SnapKVPress``, ``from x import A as B``) makes a reader wonder
which to use: there is no released API to stay compatible with, so rename everywhere instead."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
from collections import defaultdict
from pathlib import Path
from types import ModuleType

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


def class_aliases(package: ModuleType) -> list[str]:
    """``module.name -> class`` for every public module-level name of ``package`` and its
    modules bound to a class whose ``__name__`` differs (builtins' own types aside:
    ``types.ModuleType`` is named ``module``)."""
    found = []
    modules = [package.__name__, *(m.name for m in pkgutil.walk_packages(
        package.__path__, f"{package.__name__}."))]
    for name in modules:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if (not attr.startswith("_") and isinstance(value, type) and attr != value.__name__
                    and value.__module__ != "builtins"):
                found.append(f"{name}.{attr} -> {value.__module__}.{value.__qualname__}")
    return found


def test_no_class_has_a_second_public_name():
    for name in sparkv.__all__:          # the top-level names load lazily (PEP 562): load them
        getattr(sparkv, name)
    aliases = class_aliases(sparkv)
    assert not aliases, f"a class under a second public name: {aliases}"


def test_the_alias_check_sees_an_alias(tmp_path, monkeypatch):
    pkg = tmp_path / "aliaspkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from types import ModuleType\nclass SnapKVPress:\n    pass\n"
                              "SnapKV = SnapKVPress\n_Private = SnapKVPress\n")
    (pkg / "b.py").write_text("from aliaspkg.a import SnapKVPress as Snap\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert class_aliases(importlib.import_module("aliaspkg")) == [
            "aliaspkg.a.SnapKV -> aliaspkg.a.SnapKVPress",
            "aliaspkg.b.Snap -> aliaspkg.a.SnapKVPress"]
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] == "aliaspkg"]:
            del sys.modules[name]
