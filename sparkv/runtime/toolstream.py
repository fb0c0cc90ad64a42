"""Tool calls read as an answer's text comes (:mod:`sparkv.runtime.toolform`): a stream shows a
call's name as soon as its arguments begin, then its arguments as the model writes them (OpenAI's
streamed tool calls), and never shows what it would have to take back.

The answer is the form's (guided): calls in the Hermes format,
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one after another. A
:class:`CallReader` is fed the answer's text in pieces and gives :class:`CallPiece`\\ s: a
call's first piece names it (and gives its id), the next ones its arguments' text as it was
written, its last says it closed. The arguments are the model's own JSON text, not normalised:
a call's pieces add up to its final ``arguments``.

What is shown is decided as the text comes, never after:

* **A repeat is never shown.** Small models repeat their calls until their token cap: a call is
  held back while its arguments so far begin those of a call of its tool made before in the
  answer, shown as soon as they differ, and dropped when they end the same (compared without
  the whitespace between JSON tokens: a repeat spaced otherwise is a repeat).
* **A call cut off** (the answer ended inside it: its token cap) stays as far as it was shown,
  not complete (:attr:`ToolCall.complete` false; the answer's finish is ``length``). One cut
  off before its arguments began, or while held back, is dropped.
* Text that is no call (prose, a tool name not among those given, arguments that are no JSON
  object) ends the reading: the calls before it stand; with none, the answer is text.

State: one answer's text not yet read, and its calls; one reader per answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Collection, NamedTuple

__all__ = ["ToolCall", "CallPiece", "CallReader", "OPEN", "CLOSE"]

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
#: a call's head, up to its arguments' first byte
_HEAD = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*'
                   r'(?=\{)')
#: what closes a call after its arguments
_TAIL = re.compile(r"\s*\}\s*</tool_call>")
#: JSON's whitespace between tokens
_SPACE = frozenset(" \t\n\r")
#: the most text a head or tail may take before it is no call (whitespace runs are bounded)
_MOST_FRAME = 512


@dataclass(frozen=True)
class ToolCall:
    """A call read from an answer: its id, the tool's name, the arguments' JSON text, and
    whether it is whole (``False``: the answer was cut off inside its arguments)."""

    id: str
    name: str
    arguments: str
    complete: bool = True


class CallPiece(NamedTuple):
    """What a call shows next: its place among the calls shown, its id, its name (on its first
    piece only), its arguments' text added, and whether it closed."""

    place: int
    id: str
    name: str | None
    arguments: str
    done: bool


@dataclass
class _Call:
    name: str
    args: str = ""
    complete: bool = False
    place: int = -1                 # its place among the calls shown (-1: not shown yet)
    id: str = ""
    shown: int = 0                  # how much of ``args`` is shown
    bare: str = ""                  # ``args`` without the whitespace between JSON tokens


class CallReader:
    """Reads one answer's calls as its text comes (module docstring); ``names``: the tools it
    may call."""

    def __init__(self, names: Collection[str]) -> None:
        self._names = frozenset(names)
        self._text = ""                 # read, not yet taken
        self._call: _Call | None = None
        self._shown: list[_Call] = []
        self._depth, self._in_string, self._escaped = 0, False, False
        self.ended = False              # text that is no call came
        self.repeats = 0                # the calls dropped as repeats

    def feed(self, text: str) -> list[CallPiece]:
        """The pieces ``text`` (the answer's next text) shows."""
        self._text += text
        out: list[CallPiece] = []
        while not self.ended and self._step(out):
            pass
        if self._call is not None and not self._call.complete:
            self._show(self._call, out)
        return out

    def calls(self) -> list[ToolCall]:
        """The calls shown, in order (the last may be cut off)."""
        return [ToolCall(c.id, c.name, c.args[:c.shown], c.complete) for c in self._shown]

    def _step(self, out: list[CallPiece]) -> bool:
        """Takes what it can of the text; ``False`` when it must wait for more."""
        call = self._call
        if call is None:
            return self._head()
        if not call.complete:
            return self._arguments(call, out)
        m = _TAIL.match(self._text)
        if m is None:
            return self._waits()
        self._text, self._call = self._text[m.end():], None
        return True

    def _head(self) -> bool:
        m = _HEAD.match(self._text)
        if m is None:
            head = self._text.lstrip()
            if not (head.startswith(OPEN.strip()) or OPEN.strip().startswith(head)):
                self.ended = True
                return False
            return self._waits()
        if m.group(1) not in self._names:
            self.ended = True
            return False
        self._call, self._text = _Call(m.group(1)), self._text[m.end():]
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _waits(self) -> bool:
        if len(self._text) > _MOST_FRAME:
            self.ended = True
        return False

    def _arguments(self, call: _Call, out: list[CallPiece]) -> bool:
        """Takes the arguments' text up to their end (then closes the call)."""
        bare: list[str] = []                    # whitespace between tokens says nothing
        for k, ch in enumerate(self._text):
            if self._in_string or ch not in _SPACE:
                bare.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    call.bare += "".join(bare)
                    call.args += self._text[:k + 1]
                    self._text = self._text[k + 1:]
                    self._close(call, out)
                    return not self.ended
        call.bare += "".join(bare)
        call.args += self._text
        self._text = ""
        return False

    def _close(self, call: _Call, out: list[CallPiece]) -> None:
        try:
            whole = isinstance(json.loads(call.args), dict)
        except ValueError:
            whole = False
        if not whole:
            self.ended = True
            return
        call.complete = True
        if call.place < 0 and self._repeats(call):
            self.repeats += 1                       # a repeat: never shown
            return
        self._show(call, out)

    def _repeats(self, call: _Call) -> bool:
        """Whether ``call`` so far may still be a repeat of one made before (their arguments
        compared without the whitespace between JSON tokens)."""
        return any(c.complete and c.name == call.name and (
            c.bare == call.bare if call.complete else c.bare.startswith(call.bare))
            for c in self._shown)

    def _show(self, call: _Call, out: list[CallPiece]) -> None:
        first = call.place < 0
        if first:
            if self._repeats(call):
                return                              # held back while it may be a repeat
            call.place, call.id = len(self._shown), f"call_{uuid.uuid4().hex[:24]}"
            self._shown.append(call)
        added = call.args[call.shown:]
        if first or added or call.complete:
            out.append(CallPiece(call.place, call.id, call.name if first else None, added,
                                 call.complete))
        call.shown = len(call.args)
