"""Exception types shared across sparkv. Every user-facing error derives from ``SparkvError``."""

from __future__ import annotations


class SparkvError(Exception):
    """Base class for every error sparkv raises on purpose, with a message meant for people."""
