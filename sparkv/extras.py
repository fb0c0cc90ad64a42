"""Install profiles: which optional dependency belongs to which extra, and the one check that
names the extra when a dependency is missing.

``pip install sparkv`` (or ``sparkv[edge]``) is the device side: ``sparkv ask``, the context
service, presses, DynaKV, the codec and the runtime. The rest is optional (docs/python-api.md,
"Install profiles"):

========  ==============================================================================
extra     what needs it
========  ==============================================================================
server    the REST server and its workers (fastapi, uvicorn, redis, prometheus-client,
          pyyaml), and the device service's HTTP app (``sparkv device serve``)
bench     benchmarks, the MILP oracle (pulp), training the latency model (scikit-learn),
          plots (matplotlib), the serving load generator (aiohttp)
all       server + bench
========  ==============================================================================

A module that needs an optional dependency imports it through :func:`require` (inside the
function that needs it, so that the module itself stays importable), which raises
:class:`MissingExtra`, a :class:`~sparkv.errors.SparkvError`: the CLI prints its one line and
exits 2.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from sparkv.errors import SparkvError

#: import name -> the extra that installs it
EXTRA_OF: dict[str, str] = {
    "fastapi": "server", "starlette": "server", "uvicorn": "server", "redis": "server",
    "prometheus_client": "server", "yaml": "server",
    "pulp": "bench", "sklearn": "bench", "matplotlib": "bench", "aiohttp": "bench",
}


class MissingExtra(SparkvError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it.

    Also an ``ImportError``, so that code that tolerates a missing optional import keeps
    doing so."""

    def __init__(self, module: str, extra: str, feature: str | None = None) -> None:
        self.module, self.extra = module, extra
        what = f"{feature} needs" if feature else "needs"
        super().__init__(f"{what} {module!r}, which is not installed: "
                         f"pip install 'sparkv[{extra}]'")


def require(module: str, extra: str | None = None, feature: str | None = None) -> ModuleType:
    """Imports ``module`` (e.g. ``"fastapi"``, ``"sklearn.neural_network"``) and returns it.

    Raises :class:`MissingExtra` naming ``extra`` (default: the extra of the module's top-level
    package in :data:`EXTRA_OF`) when the module, or a dependency of it, is not installed.
    ``feature`` says what needs it (``"sparkv serve"``) in the message."""
    top = module.split(".")[0]
    extra = extra or EXTRA_OF.get(top)
    if extra is None:
        raise ValueError(f"no extra is known for {module!r}: name it (extra=...)")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise MissingExtra(exc.name or top, extra, feature) from exc


def require_all(modules: tuple[str, ...], feature: str | None = None) -> None:
    """:func:`require` for each of ``modules``: fails on the first one missing."""
    for module in modules:
        require(module, feature=feature)


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the ``Agg`` backend (plots are written to files), or
    :class:`MissingExtra` naming the bench extra."""
    matplotlib = require("matplotlib", feature="plotting")
    matplotlib.use("Agg")
    return require("matplotlib.pyplot", feature="plotting")


def as_missing_extra(exc: BaseException) -> MissingExtra | None:
    """The :class:`MissingExtra` of a ``ModuleNotFoundError`` for an optional dependency that was
    imported without :func:`require` (the CLI's safety net), else ``None``."""
    if isinstance(exc, MissingExtra):
        return exc
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    top = exc.name.split(".")[0]
    return MissingExtra(top, EXTRA_OF[top]) if top in EXTRA_OF else None


#: what the REST server and the device service's HTTP app import (``sparkv serve``, ``worker``)
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client", "yaml")
