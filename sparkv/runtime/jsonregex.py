"""A JSON Schema ``pattern`` (and the ``format``s it spells: ``date``, ``time``, ``date-time``,
``uuid``) as an automaton over a string's bytes, for :mod:`sparkv.runtime.jsonform`.

The part of the regular-expression syntax schemas use, over printable ASCII: literals and
escaped metacharacters, ``.``, classes (``[a-z_]``, ``[^...]``, ``\\d``, ``\\w``, ``\\s`` and their
negations), groups (``(...)``, ``(?:...)``) with alternation, and the quantifiers ``?``, ``*``,
``+``, ``{n}``, ``{n,}``, ``{n,m}`` (``m`` at most :data:`MAX_REPEAT`). ``^`` may open the
pattern and ``$`` close it; without them the pattern may match anywhere in the string, as JSON
Schema says. Anything else (lookarounds, backreferences, anchors inside, a non-ASCII character)
is a :class:`PatternError`. The string a pattern constrains holds printable ASCII only and no
escapes (no ``"`` or ``\\``), so its bytes are its characters.

The automaton is a Thompson NFA; a state is the frozenset of the NFA's states after the bytes
so far (:meth:`Pattern.start`, :meth:`Pattern.step`, :meth:`Pattern.accepts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Pattern", "PatternError", "FORMATS", "MAX_REPEAT", "MAX_STATES"]

#: the largest repeat count a quantifier may give, and the most NFA states a pattern makes
MAX_REPEAT = 64
MAX_STATES = 20000
#: the characters a constrained string may hold: printable ASCII but ``"`` and ``\``
_PRINTABLE = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("\\")}
_DIGIT = frozenset(b"0123456789")
_WORD = _DIGIT | frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_SPACE = frozenset(b" ")
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE, "D": _PRINTABLE - _DIGIT,
            "W": _PRINTABLE - _WORD, "S": _PRINTABLE - _SPACE}
_META = set("\\^$.|?*+()[]{}")
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d{1,9})?(Z|[+-]([01]\d|2[0-3]):[0-5]\d)"
#: the formats taken, as the patterns they are (RFC 3339's; a date's day is 01-31 whatever its
#: month)
FORMATS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$",
           "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"}


class PatternError(ValueError):
    """A pattern outside the syntax taken here."""


@dataclass
class _Nfa:
    """Edges ``state -> [(bytes, next)]`` and ``state -> [next]`` (empty moves)."""

    edges: list[list[tuple[frozenset[int], int]]] = field(default_factory=list)
    empty: list[list[int]] = field(default_factory=list)

    def new(self) -> int:
        if len(self.edges) >= MAX_STATES:
            raise PatternError(f"the pattern is too large (more than {MAX_STATES} states)")
        self.edges.append([])
        self.empty.append([])
        return len(self.edges) - 1


class _Parser:
    """Recursive descent over the pattern, building the NFA (each piece a ``(start, end)``)."""

    def __init__(self, text: str, nfa: _Nfa) -> None:
        self.text, self.i, self.nfa = text, 0, nfa

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def take(self) -> str:
        c = self.text[self.i]
        self.i += 1
        return c

    def alternation(self) -> tuple[int, int]:
        pieces = [self.sequence()]
        while self.peek() == "|":
            self.take()
            pieces.append(self.sequence())
        if len(pieces) == 1:
            return pieces[0]
        s, e = self.nfa.new(), self.nfa.new()
        for a, b in pieces:
            self.nfa.empty[s].append(a)
            self.nfa.empty[b].append(e)
        return s, e

    def sequence(self) -> tuple[int, int]:
        s = e = self.nfa.new()
        while self.peek() not in (None, "|", ")"):
            a, b = self.quantified()
            self.nfa.empty[e].append(a)
            e = b
        return s, e

    def quantified(self) -> tuple[int, int]:
        start = self.i
        piece = self.atom()
        text = self.text[start:self.i]
        lo, hi = self.quantifier()
        if (lo, hi) == (1, 1):
            return piece
        return _repeat(self.nfa, piece, lo, hi, lambda: _Parser(text, self.nfa).atom())

    def quantifier(self) -> tuple[int, int | None]:
        c = self.peek()
        if c in ("?", "*", "+"):
            self.take()
            return {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
        if c != "{":
            return 1, 1
        close = self.text.find("}", self.i)
        body = self.text[self.i + 1:close] if close > 0 else ""
        lo_s, comma, hi_s = body.partition(",")
        if not lo_s.isdigit() or not (hi_s.isdigit() or hi_s == "") or \
                (not comma and hi_s):
            raise PatternError(f"a quantifier {{{body}}} is not {{n}}, {{n,}} or {{n,m}}")
        self.i = close + 1
        lo, hi = int(lo_s), (int(hi_s) if hi_s else None) if comma else int(lo_s)
        if lo > MAX_REPEAT or (hi is not None and (hi > MAX_REPEAT or hi < lo)):
            raise PatternError(f"a quantifier {{{body}}}: counts at most {MAX_REPEAT}, n <= m")
        return lo, hi

    def atom(self) -> tuple[int, int]:
        c = self.take()
        if c == "(":
            if self.text.startswith("?:", self.i):
                self.i += 2
            elif self.peek() == "?":
                raise PatternError("lookarounds and named groups are not supported")
            piece = self.alternation()
            if self.peek() != ")":
                raise PatternError("a group is not closed")
            self.take()
            return piece
        if c in "^$":
            raise PatternError(f"{c!r} is taken only at the pattern's start (^) or end ($)")
        if c in _META - {"\\", "[", "."}:
            raise PatternError(f"{c!r} stands where a character or group belongs")
        return self._edge(self.charset(c))

    def charset(self, c: str) -> frozenset[int]:
        if c == ".":
            return _PRINTABLE
        if c == "\\":
            return self.escaped()
        if c == "[":
            return self.bracket()
        return _ascii(c)

    def escaped(self) -> frozenset[int]:
        if self.peek() is None:
            raise PatternError("the pattern ends with a backslash")
        c = self.take()
        if c in _CLASSES:
            return _CLASSES[c]
        if c in _META or c in "-/ ":
            return _ascii(c)
        raise PatternError(f"\\{c} is not supported (classes \\d \\w \\s, escaped metacharacters)")

    def bracket(self) -> frozenset[int]:
        negate = self.peek() == "^"
        if negate:
            self.take()
        out: set[int] = set()
        first = True
        while self.peek() is not None and (self.peek() != "]" or first):
            first = False
            c = self.take()
            lo = self.escaped() if c == "\\" else _ascii(c)
            if self.peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", ""):
                self.take()
                d = self.take()
                hi = self.escaped() if d == "\\" else _ascii(d)
                if len(lo) != 1 or len(hi) != 1 or min(lo) > min(hi):
                    raise PatternError(f"a range {c}-{d} is not a range of characters")
                out |= set(range(min(lo), min(hi) + 1))
            else:
                out |= lo
        if self.peek() != "]":
            raise PatternError("a class [...] is not closed")
        self.take()
        chars = (_PRINTABLE - out) if negate else (frozenset(out) & _PRINTABLE)
        if not chars:
            raise PatternError("a class matches no character a string may hold here")
        return frozenset(chars)

    def _edge(self, chars: frozenset[int]) -> tuple[int, int]:
        s, e = self.nfa.new(), self.nfa.new()
        self.nfa.edges[s].append((chars, e))
        return s, e


def _ascii(c: str) -> frozenset[int]:
    b = ord(c)
    if b not in _PRINTABLE:
        raise PatternError(f"{c!r}: a pattern here holds printable ASCII but '\"' and '\\'")
    return frozenset({b})


def _repeat(nfa: _Nfa, first: tuple[int, int], lo: int, hi: int | None,
            again: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    """``lo`` to ``hi`` copies (``None``: any number) of a piece, chained."""
    s = e = nfa.new()
    if hi == 0:                               # {0}: nothing
        return s, e
    pieces = [first] + [again() for _ in range(max(lo, hi or 1) - 1)]
    for k, (a, b) in enumerate(pieces):
        nfa.empty[e].append(a)
        if k >= lo:                           # the copies past lo may be left out
            nfa.empty[e].append(b)
        e = b
    if hi is None:                            # the last copy loops
        a, b = pieces[-1]
        nfa.empty[b].append(a)
        if lo == 0:
            nfa.empty[s].append(e)
    return s, e


@dataclass(frozen=True, eq=False)
class Pattern:
    """A compiled pattern: its NFA, and where it starts and accepts."""

    text: str
    nfa: _Nfa
    first: int
    accept: int

    @classmethod
    def compile(cls, text: str) -> "Pattern":
        if not isinstance(text, str) or len(text) > 1024:
            raise PatternError("a pattern is a string of at most 1024 characters")
        head, tail = text.startswith("^"), text.endswith("$") and not text.endswith("\\$")
        core = text[1 if head else 0:len(text) - (1 if tail else 0)]
        body = ("" if head else ".*") + f"(?:{core})" + ("" if tail else ".*")
        nfa = _Nfa()
        parser = _Parser(body, nfa)
        s, e = parser.alternation()
        if parser.i != len(body):
            raise PatternError(f"{body[parser.i]!r} is not where it may be")
        return cls(text, nfa, s, e)

    def start(self) -> frozenset[int]:
        return self._closure({self.first})

    def step(self, states: frozenset[int], byte: int) -> frozenset[int]:
        """The states after ``byte`` (empty: the string cannot match)."""
        nxt = {n for s in states for chars, n in self.nfa.edges[s] if byte in chars}
        return self._closure(nxt) if nxt else frozenset()

    def accepts(self, states: frozenset[int]) -> bool:
        return self.accept in states

    def _closure(self, states: set[int]) -> frozenset[int]:
        out, todo = set(states), list(states)
        while todo:
            for n in self.nfa.empty[todo.pop()]:
                if n not in out:
                    out.add(n)
                    todo.append(n)
        return frozenset(out)
