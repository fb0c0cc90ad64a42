"""``sparkv warm`` (sparkv/warm.py, over sparkv/kernels.py): every cached numba kernel sparkv
defines is compiled (or loaded from numba's cache) by the warm-up, so a kernel added without one
fails here."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import pytest

import sparkv
from sparkv.kernels import FAMILIES, warm_kernels

#: cached kernels only other kernels call (compiled with their caller; loaded from the cache,
#: their caller's machine code holds them and they list no signature of their own)
CALLED_BY_KERNELS = {"sparkv.codec.huffman._decode_group": "sparkv.codec.huffman._decode_serial"}


def _cached_kernels() -> dict[str, object]:
    """Every numba dispatcher with ``cache=True`` in sparkv's modules that import numba, but
    those numba inlines into their callers (never compiled on their own)."""
    from numba.core.registry import CPUDispatcher

    found: dict[str, object] = {}
    for mod in pkgutil.walk_packages(sparkv.__path__, "sparkv."):
        spec = importlib.util.find_spec(mod.name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as f:
            if "cache=True" not in f.read() or mod.name.startswith("sparkv.bench"):
                continue
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, CPUDispatcher) and obj.__module__ == mod.name
                    and type(obj._cache).__name__ != "NullCache"
                    and obj.targetoptions.get("inline", "never") != "always"):
                found[f"{mod.name}.{name}"] = obj
    return found


def test_the_warm_up_compiles_every_cached_kernel():
    kernels = _cached_kernels()
    assert "sparkv.cache.qattend._attend" in kernels and "sparkv.codec.huffman._decode_serial" \
        in kernels, sorted(kernels)
    seen: list[str] = []
    took = warm_kernels(report=lambda family, s: seen.append(family))
    assert seen == list(FAMILIES) == list(took)
    missing = sorted(name for name, k in kernels.items()
                     if not k.signatures and name not in CALLED_BY_KERNELS)
    assert set(CALLED_BY_KERNELS.values()) <= set(kernels) - set(missing)
    assert not missing, f"kernels no warm-up compiles (add a call to a warm_up()): {missing}"


def test_a_chosen_family_alone_and_an_unknown_one_refused():
    """A device service warms every family, an edge command the codec's alone
    (``sparkv.runtime.heap.settle``); a name that is no family is an error, not a no-op."""
    from sparkv.kernels import CODEC

    assert list(warm_kernels([CODEC])) == [CODEC]
    with pytest.raises(KeyError):
        warm_kernels(["no such family"])
