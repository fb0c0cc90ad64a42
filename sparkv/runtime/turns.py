"""An app's chat after a reusable context: its turns, rendered as the prompt's suffix.

A context a server holds ends inside a user turn: with ChatML (SmolLM2, Qwen) its system turn,
then the user's turn opened with the document (:func:`sparkv.runtime.generate.prompt_parts`).
One question closes that turn and opens the assistant's. A :class:`Conversation` (OpenAI's
``messages``) is rendered the same way, turn by turn:

* leading ``system`` turns (an app's instructions) go into the document's user turn, after the
  document and before the first question (the context's own system turn is the server's: the
  KV of a prefix cannot change);
* the first ``user`` turn continues the document's turn, as a lone question does; every later
  turn is a ChatML turn of its own (``assistant``, ``user``, or a ``system`` turn in the middle);
* the last turn is the user's question, and the suffix ends by opening the assistant's turn.

A message's text is plain text: ``<|im_end|>`` written in one is those characters, never the
special token (``split_special_tokens``), so no message opens or closes a turn. The text between
the template's special tokens is encoded as one piece, as a tokenizer encodes a whole prompt, so
a lone question gives exactly the tokens it always gave.

Models without ChatML get ``\\n\\nQuestion: ...\\nAnswer:`` per user turn and the assistant's text
after its ``Answer:``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from sparkv.errors import SparkvError

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

__all__ = ["ROLES", "ChatTurn", "Conversation", "ConversationError", "TokenPrompt", "suffix_ids"]

#: the roles a turn may have
ROLES = ("system", "user", "assistant")
_START, _END = "<|im_start|>", "<|im_end|>"


class ConversationError(SparkvError, ValueError):
    """Turns that cannot be asked: none, an unknown role, a user's or system turn with no text,
    or a last turn that is not the user's question."""


@dataclass(frozen=True)
class ChatTurn:
    """One message: ``role`` (:data:`ROLES`) and its text (stripped when rendered)."""

    role: str
    text: str


@dataclass(frozen=True)
class Conversation:
    """The turns after a context, the last one the user's question (checked when made:
    :class:`ConversationError`)."""

    turns: tuple[ChatTurn, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise ConversationError("a conversation needs at least the user's question")
        for i, t in enumerate(self.turns):
            if t.role not in ROLES:
                raise ConversationError(f"message {i}: role {t.role!r} is not one of "
                                        f"{', '.join(ROLES)}")
            if not t.text.strip() and t.role != "assistant":   # a model may answer nothing
                raise ConversationError(f"message {i} ({t.role}) has no text")
        if self.turns[-1].role != "user":
            raise ConversationError("the last message must be the user's question (got "
                                    f"{self.turns[-1].role!r})")

    @classmethod
    def of(cls, question: str, history: Sequence[ChatTurn] = ()) -> "Conversation":
        """``history`` (earlier turns, instructions first), then ``question``."""
        return cls((*history, ChatTurn("user", question)))

    @property
    def question(self) -> str:
        """The last turn's text."""
        return self.turns[-1].text


@dataclass(frozen=True)
class TokenPrompt:
    """A question given as the model's token ids (a text completion's token prompt), run as
    they are after the context: no chat template, no tokenizing."""

    ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.ids:
            raise ConversationError("a token prompt needs at least one token")


#: a rendered piece: (is a special token of the template, text)
_Piece = tuple[bool, str]


def _chatml(conv: Conversation) -> list[_Piece]:
    turns = list(conv.turns)
    lead: list[str] = []
    while turns[0].role == "system":
        lead.append(turns.pop(0).text.strip())
    out: list[_Piece] = []
    if turns[0].role == "user":                  # the document's turn goes on with it
        out += [(False, "\n\n" + "\n\n".join([*lead, turns.pop(0).text.strip()])),
                (True, _END), (False, "\n")]
    else:
        out += ([(False, "\n\n" + "\n\n".join(lead))] if lead else []) + [(True, _END),
                                                                          (False, "\n")]
    for t in turns:
        out += [(True, _START), (False, f"{t.role}\n{t.text.strip()}"), (True, _END),
                (False, "\n")]
    return out + [(True, _START), (False, "assistant\n")]


def _plain(conv: Conversation) -> list[_Piece]:
    out: list[_Piece] = []
    for t in conv.turns:
        text = t.text.strip()
        out.append((False, {"user": f"\n\nQuestion: {text}\nAnswer:", "assistant": f" {text}",
                            "system": f"\n\n{text}"}[t.role]))
    return out


def suffix_ids(lm: "LoadedModel", conv: Conversation) -> list[int]:
    """The conversation's tokens after a context of :func:`~sparkv.runtime.generate.
    prompt_parts` (module docstring)."""
    tok = lm.tokenizer
    if tok is None:
        raise ConversationError(f"model {lm.name} has no tokenizer")
    pieces = _chatml(conv) if lm.chatml else _plain(conv)
    ids: list[int] = []
    text = ""
    for special, s in pieces + [(True, "")]:
        if not special:
            text += s
            continue
        if text:
            ids += tok.encode(text, add_special_tokens=False, split_special_tokens=True)
            text = ""
        if s:
            ids.append(int(tok.convert_tokens_to_ids(s)))
    return ids
