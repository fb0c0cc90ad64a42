"""The version the server reports (``/healthz``, OpenAPI)."""

from __future__ import annotations


def server_version() -> str:
    """sparkv's version, also from a stale editable install that exposes sparkv as a namespace
    package (then from the installed distribution's metadata), else ``"unknown"``."""
    try:
        from sparkv import __version__

        return str(__version__)
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("sparkv")
        except PackageNotFoundError:
            return "unknown"


__version__ = server_version()
