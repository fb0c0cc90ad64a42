"""Prompt layout on the device: the reusable context (ChatML system turn + document) and a
question's suffix after it (:func:`sparkv.runtime.generate.prompt_parts`), or a conversation's
(:mod:`sparkv.runtime.turns`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel
    from sparkv.runtime.turns import Conversation, TokenPrompt


def question_suffix(lm: LoadedModel, question: str | Conversation | TokenPrompt,
                    chat: bool = True) -> list[int]:
    """The question's tokens after a context made by :func:`chat_context`: a lone question, or
    an app's conversation whose last turn is the question (:mod:`sparkv.runtime.turns`); plain
    text tokens of a lone question when ``chat`` is false, a token prompt's ids as they are.

    Raises:
        AskError: what :func:`check_question` refuses.
    """
    from sparkv.runtime.turns import TokenPrompt, suffix_ids

    conv = check_question(question, chat)
    if isinstance(question, TokenPrompt):
        return list(question.ids)
    return lm.encode_text(str(question)) if conv is None else suffix_ids(lm, conv)


def check_question(question: str | Conversation | TokenPrompt, chat: bool = True
                   ) -> Conversation | None:
    """The question as a conversation (``None`` for a lone question or a token prompt with
    ``chat`` off), checked without tokenizing it.

    Raises:
        AskError: a question with no text (chat on), a conversation or a token prompt with
            ``chat`` on the other way, or turns that are no conversation
            (:class:`~sparkv.runtime.turns.ConversationError`).
    """
    from sparkv.edge.planning import AskError
    from sparkv.runtime.turns import Conversation, ConversationError, TokenPrompt

    if isinstance(question, TokenPrompt):
        if chat:
            raise AskError("a token prompt runs as it is: it is asked with 'chat' off")
        return None
    if isinstance(question, str) and not chat:
        return None
    if not chat:
        raise AskError("a conversation is asked as chat turns: 'chat' off takes one question")
    try:
        return Conversation.of(question) if isinstance(question, str) else question
    except ConversationError as e:
        raise AskError(str(e)) from None


def chat_context(lm: LoadedModel, document_ids: Sequence[int]) -> list[int]:
    """The reusable context for a document (ChatML system turn + the document)."""
    from sparkv.runtime.generate import prompt_parts

    return prompt_parts(lm, document_ids, "")[0]
