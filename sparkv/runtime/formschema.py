"""Compiling a JSON Schema (the part OpenAI's structured outputs use) into a form's nodes
(:mod:`sparkv.runtime.formparts`). What a schema's text is: :mod:`sparkv.runtime.jsonform`."""

from __future__ import annotations

import json
import re
from typing import Any

from sparkv.runtime.formparts import (ANY, ArrayPart, FormError, LiteralPart, Node, NumberPart,
                                      ObjectPart, StringPart, UnionPart, json_text)
from sparkv.runtime.jsonregex import FORMATS, Pattern, PatternError

__all__ = ["schema_node", "MAX_SCHEMA_NODES", "MAX_SCHEMA_DEPTH"]

#: the most subschemas one schema holds, and how deep they nest
MAX_SCHEMA_NODES = 512
MAX_SCHEMA_DEPTH = 16

#: keywords that say nothing of the text
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default",
                          "examples", "deprecated", "readOnly", "writeOnly",
                          "$defs", "definitions"})      # subschemas a $ref names, not the text
#: what a ``$ref`` may name: a subschema of the root's ``$defs`` (or ``definitions``)
_REF = re.compile(r"^#/(\$defs|definitions)/([^/]+)$")
#: the keywords each type takes, besides the annotations
_KEYWORDS = {"object": {"properties", "required", "additionalProperties"},
             "array": {"items", "minItems", "maxItems"},
             "string": {"minLength", "maxLength", "pattern", "format"}, "number": set(),
             "integer": set(),
             "boolean": set(), "null": set()}


# ---- compiling a schema ---------------------------------------------------------------------------
class _Compiler:
    def __init__(self, root: Any) -> None:
        self.nodes = 0
        self.root = root if isinstance(root, dict) else {}
        self.named: dict[str, Node] = {}       # each $ref compiled once
        self.naming: set[str] = set()           # the $refs being compiled (a cycle: refused)

    def node(self, schema: Any, where: str, depth: int) -> Node:
        self.nodes += 1
        if self.nodes > MAX_SCHEMA_NODES or depth > MAX_SCHEMA_DEPTH:
            raise FormError(f"the schema is too large (at most {MAX_SCHEMA_NODES} subschemas, "
                            f"{MAX_SCHEMA_DEPTH} deep)")
        if isinstance(schema, dict) and "$ref" in schema:
            self._only(schema, {"$ref"}, where)
            return self._ref(schema["$ref"], where, depth)
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise FormError(f"{where}: a schema is an object, not {type(schema).__name__}")
        if "const" in schema or "enum" in schema:
            return self._literals(schema, where)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self._union(schema, key, where, depth)
        kind = schema.get("type")
        if isinstance(kind, list):
            return self._types(schema, kind, where, depth)
        if kind is None:
            self._only(schema, set(), where)
            return ANY
        return self._typed(schema, kind, where, depth)

    def _ref(self, ref: Any, where: str, depth: int) -> Node:
        """The subschema ``ref`` names in the root's ``$defs``, compiled once (a ref that comes
        back to itself is refused: its values could nest without end)."""
        m = _REF.match(ref) if isinstance(ref, str) else None
        if m is None:
            raise FormError(f"{where}: $ref {ref!r}: only '#/$defs/NAME' (or '#/definitions/"
                            "NAME') of the schema itself")
        if ref in self.named:
            return self.named[ref]
        defs = self.root.get(m.group(1))
        name = m.group(2).replace("~1", "/").replace("~0", "~")
        if not isinstance(defs, dict) or name not in defs:
            raise FormError(f"{where}: $ref {ref!r} names no subschema of the schema")
        if ref in self.naming:
            raise FormError(f"{where}: $ref {ref!r} refers back to itself (a recursive schema "
                            "is not supported)")
        self.naming.add(ref)
        node = self.node(defs[name], ref, depth + 1)
        self.naming.discard(ref)
        self.named[ref] = node
        return node

    def _typed(self, schema: dict, kind: Any, where: str, depth: int) -> Node:
        if not isinstance(kind, str) or kind not in _KEYWORDS:
            raise FormError(f"{where}: type {kind!r} is not a JSON Schema type")
        self._only(schema, _KEYWORDS[kind] | {"type"}, where)
        if kind == "object":
            return self._object(schema, where, depth)
        if kind == "array":
            items = self.node(schema.get("items", True), f"{where}.items", depth + 1)
            lo, hi = _bounds(schema, "minItems", "maxItems", where)
            return ArrayPart(items, lo, hi)
        if kind == "string":
            return _string_node(schema, where)
        if kind in ("number", "integer"):
            return NumberPart(integer=kind == "integer")
        return LiteralPart((b"true", b"false") if kind == "boolean" else (b"null",))

    def _types(self, schema: dict, kinds: list, where: str, depth: int) -> Node:
        """``type`` as a list: a branch per type, each with its own keywords."""
        bad = [k for k in kinds if not isinstance(k, str) or k not in _KEYWORDS]
        if bad or not kinds:
            raise FormError(f"{where}: type {bad[0] if bad else kinds!r} is not a JSON Schema "
                            "type")
        self._only(schema, set().union(*(_KEYWORDS[k] for k in kinds)) | {"type"}, where)
        return self._branches([self._typed({k: v for k, v in schema.items()
                                            if k in _KEYWORDS[t] or k in _ANNOTATIONS},
                                           t, where, depth) for t in kinds], where)

    def _object(self, schema: dict, where: str, depth: int) -> Node:
        props = schema.get("properties")
        if props is None:
            return ObjectPart(None)
        if not isinstance(props, dict):
            raise FormError(f"{where}.properties: an object of schemas")
        required = schema.get("required", [])
        if not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise FormError(f"{where}.required: a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise FormError(f"{where}.required names {missing[0]!r}, not among its properties")
        return ObjectPart(tuple((_key_text(k), self.node(v, f"{where}.{k}", depth + 1))
                             for k, v in props.items()))

    def _literals(self, schema: dict, where: str) -> Node:
        self._only(schema, {"const", "enum", "type"}, where)
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise FormError(f"{where}.enum: a non-empty list of values")
        if "const" in schema and "enum" in schema:      # both: the const, if the enum has it
            values = [v for v in values if json_text(v) == json_text(schema["const"])]
            if not values:
                raise FormError(f"{where}: its const is not among its enum: no value is both")
        if "type" in schema:
            kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            values = [v for v in values if any(_is_a(v, k) for k in kinds)]
            if not values:
                raise FormError(f"{where}: no value of its enum or const is of its type")
        texts = tuple(dict.fromkeys(json_text(v) for v in values))
        return LiteralPart(texts)

    def _union(self, schema: dict, key: str, where: str, depth: int) -> Node:
        self._only(schema, {key, "discriminator"}, where)
        options = schema[key]
        if not isinstance(options, list) or not options:
            raise FormError(f"{where}.{key}: a non-empty list of schemas")
        nodes = [self.node(s, f"{where}.{key}[{i}]", depth + 1) for i, s in enumerate(options)]
        if key == "oneOf":
            _exclusive(nodes, where)
        return self._branches(nodes, where)

    @staticmethod
    def _branches(nodes: list[Node], where: str) -> Node:
        return nodes[0] if len(nodes) == 1 else UnionPart(tuple(nodes))

    @staticmethod
    def _only(schema: dict, allowed: set[str], where: str) -> None:
        extra = sorted(set(schema) - allowed - _ANNOTATIONS)
        if extra:
            raise FormError(f"{where}: {extra[0]!r} is not supported here (a schema may use "
                            "type, properties, required, additionalProperties, items, "
                            "minItems, maxItems, minLength, maxLength, pattern, format, enum, "
                            "const, anyOf, oneOf, $ref to $defs)")


def _exclusive(nodes: list[Node], where: str) -> None:
    """``oneOf``: no text may be of two branches (:func:`_apart`, each pair)."""
    for i, a in enumerate(nodes):
        for j, b in enumerate(nodes[i + 1:], i + 1):
            if not _apart(a, b):
                raise FormError(f"{where}.oneOf: branches {i} and {j} may hold the same text "
                                "(oneOf needs them told apart: by their first byte, or as "
                                "objects whose properties differ or hold different consts); "
                                "anyOf takes them")


def _apart(a: Node, b: Node) -> bool:
    """Whether no text is of both ``a`` and ``b``: they begin differently, or they are objects
    with different property lists (each holds every property it lists), or with a property
    whose literals differ."""
    if not a.first & b.first:
        return True
    if not (isinstance(a, ObjectPart) and isinstance(b, ObjectPart)
            and a.props is not None and b.props is not None):
        return False
    if [k for k, _ in a.props] != [k for k, _ in b.props]:
        return True
    return any(isinstance(x, LiteralPart) and isinstance(y, LiteralPart)
               and not set(x.texts) & set(y.texts)
               for (_, x), (_, y) in zip(a.props, b.props))


def _is_a(value: Any, kind: Any) -> bool:
    """Whether a JSON value is of a JSON Schema type."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"null": value is None, "boolean": isinstance(value, bool), "number": number,
            "integer": number and float(value).is_integer(), "string": isinstance(value, str),
            "array": isinstance(value, list), "object": isinstance(value, dict)
            }.get(kind, False) if isinstance(kind, str) else False


def _count(schema: dict, key: str, where: str) -> int | None:
    v = schema.get(key)
    if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 31):
        raise FormError(f"{where}.{key}: a whole number >= 0, not {v!r}")
    return v


def _string_node(schema: dict, where: str) -> Node:
    """A string schema: its length bounds, or its ``pattern`` or ``format`` (not both, and not
    with a length bound: together they could leave a string no way to end)."""
    lo, hi = _bounds(schema, "minLength", "maxLength", where)
    spec = [k for k in ("pattern", "format") if k in schema]
    if not spec:
        return StringPart(lo, hi)
    if len(spec) > 1 or lo or hi is not None:
        raise FormError(f"{where}: {spec[0]!r} with {'format' if len(spec) > 1 else 'a length'}"
                        " bound is not supported")
    fmt = schema.get("format")
    text = schema["pattern"] if spec[0] == "pattern" else \
        FORMATS.get(fmt) if isinstance(fmt, str) else None
    if text is None:
        raise FormError(f"{where}: format {schema['format']!r} is not supported (date, time, "
                        "date-time, uuid)")
    try:
        return StringPart(pattern=Pattern.compile(text))
    except PatternError as e:
        raise FormError(f"{where}: pattern {text!r}: {e}") from None


def _bounds(schema: dict, low: str, high: str, where: str) -> tuple[int, int | None]:
    lo, hi = _count(schema, low, where) or 0, _count(schema, high, where)
    if hi is not None and lo > hi:
        raise FormError(f"{where}: {low} {lo} is above {high} {hi}: no value has both")
    return lo, hi


def _key_text(key: str) -> bytes:
    return json.dumps(key, ensure_ascii=False).encode()


def schema_node(schema: Any) -> Node:
    """``schema``'s root node (:class:`FormError` for what a form cannot enforce)."""
    return _Compiler(schema).node(schema, "schema", 0)
