"""``truncation: "auto"`` of the Responses API (docs/asks.md, "Kept responses"): a
conversation that would run past the model's positions (the context, its turns and the longest
answer asked for) loses its oldest turns until it fits, as OpenAI's API drops items from the
beginning of the conversation. The instructions (the leading system turns, the tools' among
them) stay; what is left begins with a user's turn and ends with the question. A question that
does not fit alone is left whole: the ask refuses it (``413 prompt_too_long``) as without
truncation.

:func:`fitted` finds the most turns that fit by bisection over the user turns (a few
tokenizations of the conversation, not one per turn).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from sparkv.runtime.turns import Conversation

if TYPE_CHECKING:
    from sparkv.asks.service import AskService
    from sparkv.asks.tickets import AskRequest
    from sparkv.runtime.model import LoadedModel

__all__ = ["fitted", "truncated"]


def fitted(lm: "LoadedModel", conv: Conversation, room: int) -> tuple[Conversation, int]:
    """``conv`` without its oldest turns, the most of them that fit in ``room`` tokens after
    the context (with the answer's header); and how many turns were dropped."""
    from sparkv.edge.prompts import question_suffix

    turns = conv.turns
    lead = next((i for i, t in enumerate(turns) if t.role != "system"), len(turns))
    starts = [i for i in range(lead, len(turns)) if turns[i].role == "user"]

    def cut(i: int) -> Conversation:
        return Conversation(turns[:lead] + turns[i:])

    def fits(i: int) -> bool:
        return len(question_suffix(lm, cut(i))) <= room

    if fits(lead) or not starts:
        return conv, 0
    lo, hi = 0, len(starts) - 1          # starts[hi]: the question, kept whatever it holds
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return cut(starts[lo]), starts[lo] - lead


def truncated(asks: "AskService", app: str, ask: "AskRequest") -> tuple["AskRequest", int]:
    """``ask`` with its conversation fitted to the model's positions (:func:`fitted`) and how
    many turns it lost; unchanged when the model sets no positions, the question is one turn,
    or the context's length cannot be known (the ask then says what it finds)."""
    lm = asks.lm
    if not isinstance(ask.question, Conversation) or not lm.max_positions:
        return ask, 0
    held = asks.context_tokens(app, ask)
    if held is None:
        return ask, 0
    room = lm.max_positions - held - ask.options.max_new_tokens
    conv, dropped = fitted(lm, ask.question, room)
    return dataclasses.replace(ask, question=conv), dropped
