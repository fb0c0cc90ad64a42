"""What an app's routes say about a path: every route (:func:`flat_routes`) and the methods a
path allows (:func:`allowed_methods`, the ``Allow`` header of a 405)."""

from __future__ import annotations

from typing import Iterable, Iterator

from sparkv.extras import require_all

require_all(("fastapi",), feature="the HTTP apps (sparkv.rest.routing)")

from starlette.routing import BaseRoute, Match  # noqa: E402 - after the check that names the extra
from starlette.types import Scope


def flat_routes(routes: Iterable[BaseRoute]) -> Iterator[BaseRoute]:
    """Every route, with those of included routers in place of their inclusion (FastAPI wraps
    an ``include_router`` in an object that keeps the router as ``original_router``; the
    apps' routers are included without a prefix)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from flat_routes(inner.routes)
        else:
            yield route


def allowed_methods(routes: Iterable[BaseRoute], scope: Scope) -> list[str]:
    """The methods of every route whose path matches the request's, sorted: a path served by
    several routes (``GET`` and ``DELETE`` of a context) allows all of theirs, where Starlette
    names only the first route's."""
    methods: set[str] = set()
    for route in flat_routes(routes):
        route_methods = getattr(route, "methods", None)
        if not route_methods:
            continue
        probe = {**scope, "method": next(iter(route_methods))}
        if route.matches(probe)[0] == Match.FULL:
            methods.update(route_methods)
    return sorted(methods)
