"""Lazy package exports (PEP 562): a package's ``__init__`` names what it offers without
importing it, so that importing one small module of the package (a command's parser, under
``sparkv --help``) loads neither torch nor the server.

    from sparkv.lazy import lazy_exports
    _EXPORTS = {"EdgeSession": "sparkv.edge.session", ...}
    __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

Each name is imported from its module on first use and then cached in the package. The package
keeps the same imports under ``if TYPE_CHECKING:`` for the type checker.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str], namespace: dict[str, Any]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, whose ``exports`` map a name to the module
    that defines it under that name; ``namespace`` is the package's ``globals()``."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
