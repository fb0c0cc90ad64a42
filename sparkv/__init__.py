"""sparkv: cloud-edge KV-cache streaming for on-device LLMs.

The names a user needs, importable from the top (docs/python-api.md)::

    from sparkv import EdgeSession, AskOptions, ContextService, ServiceConfig, load_model

They load lazily (PEP 562): ``import sparkv`` imports neither torch nor the server, and changes
no environment variable (the ``sparkv`` command sets ``OMP_WAIT_POLICY``: docs/edge.md, "Threads
and OpenMP"); each name imports its own part on first use. A part of another install profile
(docs/python-api.md, "Install profiles") says which extra to install
(:class:`~sparkv.extras.MissingExtra`).
"""

import importlib as _importlib
from typing import Any as _Any

__version__ = "0.1.0"

#: top-level name -> the module that defines it under the same name
_EXPORTS: dict[str, str] = {
    # errors and the result shape
    "SparkvError": "sparkv.errors",
    "MissingExtra": "sparkv.extras",
    "Generation": "sparkv.generation",
    # the model and generation over a cache
    "load_model": "sparkv.runtime.model",
    "LoadedModel": "sparkv.runtime.model",
    "greedy_generate": "sparkv.runtime.generate",
    "GenerationResult": "sparkv.runtime.generate",
    # the device's KV memory
    "ContextKV": "sparkv.cache",
    "SparkvCache": "sparkv.cache",
    # the edge: ask a server's context
    "EdgeSession": "sparkv.edge.session",
    "AskOptions": "sparkv.edge.options",
    "AskResult": "sparkv.edge.answer",
    "EdgeClient": "sparkv.edge.client",
    "LinkShaper": "sparkv.edge.shaper",
    "Conversation": "sparkv.runtime.turns",
    "ChatTurn": "sparkv.runtime.turns",
    # the on-device context service
    "ContextService": "sparkv.device.service",
    "ServiceConfig": "sparkv.device.config",
    "CallResult": "sparkv.device.calls",
    "DeviceClient": "sparkv.device.client",
    # DynaKV: long decoding with clustered KV on flash
    "generate": "sparkv.decode.session",
    "DecodeSession": "sparkv.decode.session",
    "DecodeResult": "sparkv.decode.session",
    "DecodeConfig": "sparkv.decode.config",
    "DynaKVCache": "sparkv.decode.hf",
    # presses (KV compression), under kvpress's class names
    "Press": "sparkv.presses",
    "PressError": "sparkv.presses",
    "SnapKVPress": "sparkv.presses",
    "PyramidKVPress": "sparkv.presses",
    "DynamicKVPress": "sparkv.presses",
    "AdaKVPress": "sparkv.presses",
    "AdaPyramidPress": "sparkv.presses",
    "KnormPress": "sparkv.presses",
    "RandomPress": "sparkv.presses",
    "StreamingLLMPress": "sparkv.presses",
    "parse_press": "sparkv.presses",
    "make_press": "sparkv.presses",
    "compress": "sparkv.presses",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> _Any:
    """PEP 562: imports the part that defines ``name`` on first use and caches the name here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sparkv' has no attribute {name!r}")
    try:
        value = getattr(_importlib.import_module(module), name)
    except AttributeError:
        raise AttributeError(f"module 'sparkv' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
