"""Prompt layout on the device: the reusable context (ChatML system turn + document) and a
question's suffix after it (:func:`sparkv.runtime.generate.prompt_parts`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel


def question_suffix(lm: LoadedModel, question: str, chat: bool = True) -> list[int]:
    """The question's tokens after a context made by :func:`chat_context` (plain text tokens
    when ``chat`` is false)."""
    from sparkv.runtime.generate import prompt_parts

    if not chat:
        return lm.encode_text(question)
    return prompt_parts(lm, [], question)[1]


def chat_context(lm: LoadedModel, document_ids: Sequence[int]) -> list[int]:
    """The reusable context for a document (ChatML system turn + the document)."""
    from sparkv.runtime.generate import prompt_parts

    return prompt_parts(lm, document_ids, "")[0]
