"""One streamed answer's text as its tokens come, for the chat and the Responses streams
(:mod:`sparkv.asks.completion`, :mod:`sparkv.asks.responses`): shown as it comes, held back
while it may still begin a tool call, and read as calls once it does begin one (the form then
makes it calls: :mod:`sparkv.runtime.toolform`), each call shown as the model writes it
(:mod:`sparkv.runtime.toolstream`: named when its arguments begin, its arguments as written, a
repeat never shown).

At the answer's end, :meth:`AnswerText.finish` reads the rest of its whole text and sets its
calls on the ask's ``done`` event, so the stream's last events and the kept response name the
calls with the ids the stream showed. An answer that began a call but was cut off before one was
named is text after all: what was held back is shown then, as before.

State: the text shown, the token events held back, the calls' reader; one per answer.
"""

from __future__ import annotations

from typing import Any, Protocol

from sparkv.runtime.toolstream import CallPiece, CallReader

__all__ = ["AnswerText"]


class _Completion(Protocol):
    """What of a completion the text needs (:class:`~sparkv.asks.completion.Completion`)."""

    logprobs: bool

    def may_call(self, shown: str) -> bool: ...

    def begins_calls(self, text: str) -> bool: ...

    def call_reader(self) -> CallReader: ...


class AnswerText:
    """One answer's text as its tokens come (module docstring)."""

    def __init__(self, c: _Completion) -> None:
        self.c = c
        self.shown = ""                          # the text shown
        self.held: list[dict[str, Any]] = []     # token events not shown as text (yet)
        self._held_text = ""                     # and their text
        self.reader: CallReader | None = None    # once the answer begins a call
        self._fed = ""                           # the text the reader was given

    def token(self, event: dict[str, Any]) -> tuple[list[dict[str, Any]], list[CallPiece]]:
        """The token events to show as text now (none while held back) and the calls'
        pieces shown now, after the token ``event``."""
        self.held.append(event)
        self._held_text += event["text"]
        text = self._held_text
        if self.reader is not None or self.c.may_call(self.shown + text):
            return [], self._calls(text)
        events, self.held, self._held_text = self.held, [], ""
        if not (text or self.c.logprobs):
            return [], []
        self.shown += text
        return events, []

    def finish(self, done: dict[str, Any]) -> list[CallPiece]:
        """The calls' pieces the answer's whole text (``done``'s) still shows; its calls set
        on ``done`` (:meth:`Completion.calls <sparkv.asks.completion.Completion.calls>` gives
        them)."""
        text = done["text"]
        pieces = self._calls(text) if not self.shown and text.startswith(self._fed) else []
        if self.reader is not None:
            done["_tool_calls"] = self.reader.calls()
        return pieces

    def _calls(self, text: str) -> list[CallPiece]:
        """The pieces of the held ``text`` (the answer so far) not given to the reader yet."""
        if self.reader is None:
            if not self.c.begins_calls(text):
                return []
            self.reader = self.c.call_reader()
        new, self._fed = text[len(self._fed):], text
        return self.reader.feed(new)
