"""Stop strings: an answer ends where one of them first appears in its text, and its text ends
before it (OpenAI's ``stop``).

Generation looks after every token (:meth:`StopStrings.hit`: the last tokens decoded, enough of
them to hold the longest stop string), so it stops at the token that completes one. The answer's
text is the decoded tokens cut before the first stop string (:meth:`StopStrings.cut`); its tokens
keep the ones that spelled it. A stream that shows the answer as it grows holds back a tail that
may still become a stop string (:meth:`StopStrings.shown`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

__all__ = ["StopStrings", "MAX_STOPS", "MAX_STOP_CHARS"]

#: the most stop strings an answer may have (OpenAI's limit)
MAX_STOPS = 4
#: the longest stop string (characters)
MAX_STOP_CHARS = 64


class StopStrings:
    """An answer's stop strings (empty ones are ignored; none: nothing stops the answer)."""

    def __init__(self, strings: Sequence[str] = ()) -> None:
        if isinstance(strings, str):
            strings = (strings,)
        self.strings = tuple(dict.fromkeys(s for s in strings if s))
        self.longest = max(map(len, self.strings), default=0)
        #: tokens decoded to look for one: a character may take four byte-level tokens
        self.window = 4 * self.longest + 4

    def __bool__(self) -> bool:
        return bool(self.strings)

    def hit(self, lm: "LoadedModel", tokens: Sequence[int]) -> bool:
        """Whether the answer's last tokens spell a stop string."""
        if not self.strings or not tokens:
            return False
        tail = lm.decode_tokens(list(tokens[-self.window:]))
        return any(s in tail for s in self.strings)

    def cut(self, text: str) -> str:
        """``text`` up to its first stop string."""
        ends = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[:min(ends)] if ends else text

    def shown(self, text: str) -> str:
        """What of a growing answer may be shown: :meth:`cut`, less a tail that begins a stop
        string (it may complete it)."""
        text = self.cut(text)
        for k in range(min(len(text), self.longest), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.strings):
                return text[:-k]
        return text
