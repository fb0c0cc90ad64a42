"""Tool calls (OpenAI's ``tools``): what the model is told of the tools, the form its answer
takes, and the calls read back from it.

The model is told the tools in the Hermes format most open chat models are tuned on (SmolLM2,
Qwen, Hermes): their JSON Schemas inside ``<tools></tools>``, and a call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A tool's result goes back
to it inside ``<tool_response></tool_response>``.

A :class:`ToolSet` is the request's tools and its ``tool_choice``:

* ``none``: the answer is as without tools (text, or the ``response_format``'s JSON);
* ``auto``: the answer is either that, or calls: the form (:mod:`sparkv.runtime.jsonform`)
  is a union of prose that does not begin with ``<tool_call>`` (or the ``response_format``'s
  JSON) and calls, so an answer that begins a call makes a whole one;
* ``required``: one call or more (up to :data:`MAX_CALLS`; one without ``parallel``);
* a tool's name: exactly one call of it.

Each call's ``name`` is one of the tools' and its ``arguments`` a value of the tool's
``parameters`` (any JSON object where a schema cannot be enforced and the tool is not
``strict``; a strict tool's is a :class:`ToolError`). :meth:`ToolSet.read` reads the calls back
from an answer's text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from sparkv.runtime.formparts import (ANY_OBJECT, MAX_ALTERNATIVES, FormError, Node,
                                      ObjectPart, const_part, form_width, object_part, one_of,
                                      raw_part, repeated, sequence, text_part)
from sparkv.runtime.formschema import schema_node
from sparkv.runtime.jsonform import JsonForm
from sparkv.runtime.toolstream import CLOSE, OPEN, CallReader, ToolCall

__all__ = ["Tool", "ToolCall", "ToolSet", "ToolError", "TOOL_NAME", "MAX_TOOLS", "MAX_CALLS",
           "CHOICES", "call_text", "response_text"]

#: a tool's name (OpenAI's rule)
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: the most tools one request may give, and calls one answer may make
MAX_TOOLS = 128
MAX_CALLS = 8
#: ``tool_choice``'s words (else a tool's name)
CHOICES = ("none", "auto", "required")



class ToolError(ValueError):
    """Tools or a tool choice that cannot be: a bad name, a name twice, a strict tool whose
    parameters cannot be enforced, a choice naming no tool."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, its arguments' JSON Schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool = False

    def arguments_part(self) -> Node:
        """The form of its call's ``arguments``: a value of :attr:`parameters` (any JSON
        object without them, or where they cannot be enforced and the tool is not strict)."""
        if not self.parameters:
            return ANY_OBJECT
        try:
            node = schema_node(self.parameters)
            if not isinstance(node, ObjectPart):
                raise FormError("the top level must be an object schema")
            if form_width(node) > MAX_ALTERNATIVES:
                raise FormError(f"too ambiguous: more than {MAX_ALTERNATIVES} readings at once")
        except FormError as e:
            if self.strict:
                raise ToolError(f"tool {self.name!r}: its parameters cannot be enforced: {e}"
                                ) from None
            return ANY_OBJECT
        return node

    def listing(self) -> str:
        """The tool as the model is told of it (one line of JSON)."""
        return json.dumps({"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": self.parameters or {"type": "object"}}}, ensure_ascii=False)


def call_text(name: str, arguments: str) -> str:
    """A call as the model writes it (``arguments``: JSON text; kept as text if not JSON)."""
    try:
        args: Any = json.loads(arguments)
    except ValueError:
        args = arguments
    return OPEN + json.dumps({"name": name, "arguments": args}, ensure_ascii=False) + CLOSE


def response_text(content: str) -> str:
    """A tool's result as the model is given it."""
    return f"<tool_response>\n{content}\n</tool_response>"


class ToolSet:
    """The request's tools and how the answer may use them (:class:`ToolError` for what
    cannot be)."""

    def __init__(self, tools: Sequence[Tool], choice: str = "auto",
                 parallel: bool = True) -> None:
        names = [t.name for t in tools]
        bad = [n for n in names if not TOOL_NAME.match(n)]
        if bad:
            raise ToolError(f"tool name {bad[0]!r}: 1-64 letters, digits, _ or -")
        if len(set(names)) != len(names):
            raise ToolError("two tools have one name")
        if len(tools) > MAX_TOOLS:
            raise ToolError(f"at most {MAX_TOOLS} tools")
        if choice not in CHOICES and choice not in names:
            raise ToolError(f"tool_choice names {choice!r}, not one of the tools")
        if choice != "none" and not tools:
            raise ToolError(f"tool_choice {choice!r} needs tools")
        self.tools, self.choice, self.parallel = tuple(tools), choice, parallel
        self._callable = [t for t in self.tools if choice in ("auto", "required", t.name)]
        self._calls = self._calls_part() if choice != "none" else None
        try:
            self.form()                          # too ambiguous: refused with the tools
        except FormError as e:
            raise ToolError(str(e)) from None

    def _calls_part(self) -> Node:
        call = sequence(raw_part(OPEN), one_of(*(object_part([
            ("name", const_part(t.name)), ("arguments", t.arguments_part())])
            for t in self._callable)), raw_part(CLOSE))
        if not self.parallel or self.choice not in ("auto", "required"):
            return call
        return sequence(call, repeated(sequence(raw_part("\n"), call), 0, MAX_CALLS - 1))

    def instructions(self) -> str:
        """What the model is told of the tools (a system turn)."""
        shown = [t for t in self.tools if self.choice == "none" or t in self._callable]
        lines = ["You may call one or more functions to answer the question. The functions, "
                 "as JSON Schemas, are within <tools></tools>:", "<tools>",
                 *(t.listing() for t in shown), "</tools>",
                 "To call a function, answer with its name and arguments as a JSON object "
                 "within <tool_call></tool_call> tags:",
                 '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}'
                 "\n</tool_call>"]
        if self.choice == "none":
            lines.append("Do not call a function now: answer in text.")
        elif self.choice == "required":
            lines.append("Call one of the functions now.")
        elif self.choice != "auto":
            lines.append(f"Call the function {self.choice} now.")
        return "\n".join(lines)

    def form(self, answer: JsonForm | None = None) -> JsonForm | None:
        """The answer's form: ``answer`` (the ``response_format``'s; ``None``: text) with
        ``none``; with ``auto``, that or calls; else calls only (:class:`FormError` if too
        ambiguous)."""
        if self._calls is None:
            return answer
        ends = self._repeats if self.parallel and self.choice in ("auto", "required") else None
        if self.choice != "auto":
            return JsonForm.of(self._calls, "tool_calls", ends)
        other = answer.root if answer is not None else text_part(refused=(OPEN.strip(),))
        return JsonForm.of(one_of(other, self._calls), "text_or_tool_calls", ends)

    def _repeats(self, text: bytes) -> bool:
        """Whether the answer so far ends with a call that repeats one it made (the reader
        drops it: :mod:`sparkv.runtime.toolstream`): a model that repeats its calls is done
        calling (small ones otherwise repeat them until their token cap)."""
        if not text.endswith(CLOSE.strip().encode()):
            return False
        reader = self.reader()
        reader.feed(text.decode(errors="replace"))
        return reader.repeats > 0

    def reader(self) -> CallReader:
        """A reader of an answer's calls as its text comes (:mod:`sparkv.runtime.toolstream`)."""
        return CallReader([t.name for t in self._callable])

    def read(self, text: str) -> list[ToolCall]:
        """The calls a whole answer's text makes, as a stream of it shows them (none: it is
        text): a repeat of a call made before is dropped, a call cut off by the end of the
        text is not complete (:mod:`sparkv.runtime.toolstream`)."""
        if self._calls is None:
            return []
        reader = self.reader()
        reader.feed(text)
        return reader.calls()

    def begins_calls(self, text: str) -> bool:
        """Whether an answer that begins with ``text`` is calls (the form makes one that
        begins a call whole calls)."""
        return self._calls is not None and text.lstrip().startswith(OPEN.strip())

    def may_call(self, shown: str) -> bool:
        """Whether an answer that begins with ``shown`` may be calls (streamed text is held
        back while it may)."""
        if self._calls is None:
            return False
        head, opener = shown.lstrip(), OPEN.strip()
        return head.startswith(opener) or opener.startswith(head)
