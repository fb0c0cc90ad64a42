"""The parts a form is made of: one node per piece of an answer's text (a JSON value of a
kind, a literal, a union of parts), and :class:`FormError` for what no form can be.

:mod:`sparkv.runtime.formschema` compiles a JSON Schema into these nodes;
:mod:`sparkv.runtime.jsonform` reads an answer's bytes against them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sparkv.runtime.jsonregex import Pattern

__all__ = ["FormError", "Node", "AnyValue", "ObjectPart", "ArrayPart", "StringPart", "NumberPart",
           "LiteralPart", "UnionPart", "ANY", "ANY_OBJECT", "ANY_ARRAY", "ANY_STRING",
           "ANY_NUMBER", "TRUE_FALSE_NULL", "BY_FIRST"]


class FormError(ValueError):
    """A schema this automaton cannot enforce (or no schema at all)."""


class Node:
    """A subschema; ``first``: the bytes its value's text may begin with."""

    first: frozenset[int] = frozenset()


@dataclass(eq=False)
class AnyValue(Node):
    first = frozenset(b'{["-0123456789tfn')


@dataclass(eq=False)
class ObjectPart(Node):
    props: tuple[tuple[bytes, Node], ...] | None   # None: any keys and values
    first = frozenset(b"{")


@dataclass(eq=False)
class ArrayPart(Node):
    items: Node
    min_items: int = 0
    max_items: Optional[int] = None
    first = frozenset(b"[")


@dataclass(eq=False)
class StringPart(Node):
    min_len: int = 0
    max_len: Optional[int] = None
    pattern: Optional[Pattern] = None           # its text matches it (printable ASCII only)
    first = frozenset(b'"')


@dataclass(eq=False)
class NumberPart(Node):
    integer: bool = False
    first = frozenset(b"-0123456789")


@dataclass(eq=False)
class LiteralPart(Node):
    texts: tuple[bytes, ...]

    def __post_init__(self) -> None:
        self.first = frozenset(t[0] for t in self.texts)


@dataclass(eq=False)
class UnionPart(Node):
    branches: tuple[Node, ...]

    def __post_init__(self) -> None:
        self.first = frozenset().union(*(b.first for b in self.branches))

    def branch(self, byte: int) -> Node | None:
        return next((b for b in self.branches if byte in b.first), None)


ANY = AnyValue()
ANY_STRING = StringPart()
ANY_OBJECT = ObjectPart(None)
ANY_ARRAY = ArrayPart(ANY)
ANY_NUMBER = NumberPart()
TRUE_FALSE_NULL = LiteralPart((b"true", b"false", b"null"))
#: what a value of any kind is, by its first byte
BY_FIRST = {ord("{"): ANY_OBJECT, ord("["): ANY_ARRAY, ord('"'): ANY_STRING,
             ord("t"): TRUE_FALSE_NULL, ord("f"): TRUE_FALSE_NULL, ord("n"): TRUE_FALSE_NULL}

