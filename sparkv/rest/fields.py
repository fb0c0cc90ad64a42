"""JSON body fields both apps read the same way (pydantic only: importable without the HTTP
extra), so the same value gets the same answer from the server and the device service.

* :data:`JsonInt`, :data:`JSON_INT`: JSON Schema's integer, an int or a float with no fraction
  (``3.0``), never a bool or a string (``true`` and ``"3"`` are 422, not coerced);
* :data:`JSON_NUMBER`: JSON Schema's number, an int or a float, never a bool or a string
  (pydantic's lax mode would read ``true`` as 1.0 and ``"0.5"`` as 0.5);
* :func:`one_of`, :func:`at_most_one_of`: the JSON Schema of "exactly one of these fields" and
  "not both", stated in the schema as the route enforces it (a field that is ``null`` counts as
  absent, as the routes read it).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Strict


def _json_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError("must be an integer")
        return int(value)
    return value


JSON_INT = BeforeValidator(_json_int)
"""The validator of JSON Schema's integer (module docstring). A bounded one is
``Annotated[int, Field(ge=minimum, le=maximum), JSON_INT]``: the bounds sit on the inner ``int``
so that JSON Schema (and OpenAPI) shows them as ``minimum``/``maximum``; put on the outer,
validator-wrapped type (or on an ``Optional``) pydantic would emit non-standard ``ge``/``le``
keywords."""

JsonInt = Annotated[int, JSON_INT]
"""JSON Schema's integer (module docstring)."""

JSON_NUMBER = Strict()
"""The marker of JSON Schema's number on a float: ``Annotated[float, JSON_NUMBER, Field(...)]``
(module docstring; strict pydantic still takes an int for a float)."""


def _given(fields: dict[str, str]) -> dict[str, Any]:
    """The schema of "every one of ``fields`` is present and not null" (name -> JSON type)."""
    return {"required": sorted(fields),
            "properties": {name: {"type": kind} for name, kind in fields.items()}}


def one_of(fields: dict[str, str]) -> dict[str, Any]:
    """``json_schema_extra`` of a body that must give exactly one of ``fields`` (name -> JSON
    type), not null."""
    return {"oneOf": [_given({name: kind}) for name, kind in fields.items()]}


def at_most_one_of(fields: dict[str, str]) -> dict[str, Any]:
    """``json_schema_extra`` of a body that may give at most one of ``fields`` (not null)."""
    return {"not": _given(fields)}
