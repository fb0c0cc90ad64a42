"""The package's import structure (docs/architecture.md): no import cycles between sparkv's
modules (imports inside functions count), layers import only downward, the edge imports nothing
from the server or the benchmarks, and production code imports no ``testing`` module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "sparkv"

#: top-level part of sparkv -> rank: a module may import its own part and parts of lower rank.
#: The integer is the layer of docs/architecture.md (0-1 vocabulary and wire, 2 engines,
#: 3 services, 4 entry points); the decimals order the parts within a layer.
LAYERS = {
    "__init__": 0.0, "lazy": 0.0, "errors": 0.0, "extras": 0.05, "generation": 0.0, "layout": 0.1, "tables": 0.1, "fileio": 0.1, "launch": 0.1,
    "cliflags": 0.1, "logs": 0.1, "kernels": 0.1,
    "protocol": 1.0, "rest": 1.5,
    "codec": 2.0, "cache": 2.1, "runtime": 2.2, "scheduler": 2.3, "predictor": 2.4,
    "presses": 2.5, "decode": 2.6,
    "server": 3.0, "device": 3.1, "edge": 3.2, "asks": 3.3,
    "bench": 4.0, "demoapps": 4.05, "demo": 4.1, "warm": 4.15, "cli": 4.2, "clidoc": 4.3,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = ("sparkv",) + f.relative_to(PKG).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    return mods


MODS = _modules()


def _imports(name: str, path: Path) -> set[str]:
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_pkg else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.add(full if full in MODS else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in MODS and m != name}


GRAPH = {m: _imports(m, p) for m, p in MODS.items()}


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles() -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_the_package():
    assert "sparkv.edge.engine" in GRAPH and "sparkv.protocol.manifest" in GRAPH
    # imports inside functions count
    assert "sparkv.runtime.generate" in GRAPH["sparkv.edge.session"]


def test_no_import_cycles():
    assert _cycles() == []


def test_edge_imports_nothing_from_server_or_bench():
    bad = sorted(f"{m} -> {d}" for m in GRAPH if m.startswith("sparkv.edge")
                 for d in GRAPH[m] if d.startswith(("sparkv.server", "sparkv.bench")))
    assert bad == []


def test_production_code_imports_no_testing_module():
    assert not any(m.endswith(".testing") for m in MODS), "testing helpers live under tests/"
    bad = sorted(f"{m} -> {d}" for m in GRAPH for d in GRAPH[m] if d.endswith("testing"))
    assert bad == []


def test_layers_import_only_downward():
    unknown = sorted({_part(m) for m in MODS} - set(LAYERS))
    assert unknown == [], f"add these parts of sparkv to LAYERS: {unknown}"
    bad = []
    for m, deps in GRAPH.items():
        a = _part(m)
        for d in deps:
            b = _part(d)
            if a == b or b == "__init__":
                continue
            if LAYERS[b] >= LAYERS[a]:
                bad.append(f"{m} (rank {LAYERS[a]}) -> {d} (rank {LAYERS[b]})")
    assert bad == [], "\n".join(sorted(bad))


@pytest.mark.parametrize("part", ["protocol", "codec"])
def test_the_wire_needs_no_torch_model_code(part):
    """The wire contract and the codec stay importable without the runtime or the server."""
    bad = sorted(f"{m} -> {d}" for m in GRAPH if _part(m) == part for d in GRAPH[m]
                 if _part(d) in ("runtime", "server", "edge", "scheduler", "predictor"))
    assert bad == []


def private_imports(modules: dict[str, Path]) -> list[str]:
    """``module: from other import _name`` for every import of another module's private name
    (``__version__`` and other dunders aside)."""
    bad = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sparkv"):
                bad += [f"{name}: from {node.module} import {a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")
                        and node.module != name]
    return sorted(bad)


def test_no_module_imports_another_modules_private_name():
    """A name shared across modules is public (``runtime.attention.check_shapes``); a private
    one is its module's own business."""
    assert private_imports(MODS) == []


def test_the_private_import_check_sees_one(tmp_path):
    (tmp_path / "a.py").write_text("from sparkv.runtime.attention import _hidden, shown\n"
                                   "from sparkv.server.version import __version__\n")
    assert private_imports({"a": tmp_path / "a.py"}) == [
        "a: from sparkv.runtime.attention import _hidden"]


def private_reaches(path: Path) -> list[str]:
    """``line: obj._name`` for every private attribute read on something other than ``self``
    or ``cls``: a reach into another object's state instead of its public accessors."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("module", ["runtime/stepper.py"])
def test_owners_give_public_accessors(module):
    """The stepper uses the public API of what it drives (ContextKV, its own step cache)."""
    assert private_reaches(PKG / module) == []


def test_the_reach_check_sees_one(tmp_path):
    (tmp_path / "a.py").write_text("def f(st):\n    return st._tokens(0, 1), self._ok\n")
    assert private_reaches(tmp_path / "a.py") == ["2: st._tokens"]
