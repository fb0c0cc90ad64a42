"""Chat formatting of the context service's turns: a context's system turn and each call's user
turn, in ChatML for chat models (a tokenizer with ``<|im_start|>``), as plain text otherwise.

Functions only, no state: the service passes in whether its model speaks ChatML
(:attr:`LoadedModel.chatml <sparkv.runtime.model.LoadedModel.chatml>`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection, Sequence

from sparkv.device.errors import DeviceError
from sparkv.device.inputs import check_text, check_token_ids

if TYPE_CHECKING:
    from sparkv.runtime.model import LoadedModel

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def system_text(system_prompt: str | None, chatml: bool) -> str:
    """A context's first text: its system turn (the default prompt when ``None``)."""
    sp = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    return f"<|im_start|>system\n{sp}<|im_end|>\n" if chatml else sp


def system_turn_ids(lm: LoadedModel, system_prompt: str | None, ids: Sequence[int] | None, *,
                    vocab: int, chatml: bool) -> list[int]:
    """A new context's first ids: ``ids`` as they are (checked against the vocabulary), else the
    system turn of ``system_prompt``; :class:`DeviceError` if that makes no token."""
    check_text(system_prompt, "the system prompt")
    if ids is not None:
        out = check_token_ids(ids, vocab, "system_ids")
    elif lm.tokenizer is None:
        raise DeviceError("this model has no tokenizer: pass system_ids")
    else:
        out = lm.encode_text(system_text(system_prompt, chatml))
    if not out:
        raise DeviceError("a context needs at least one token (give a system prompt)")
    return out


def turn_ids(lm: LoadedModel, pending: Sequence[int], prompt: str | None,
             prompt_ids: Sequence[int] | None, *, chatml: bool,
             eos: Collection[int]) -> list[int]:
    """The ids a call appends to a context: its ``pending`` ids (the last answer token, not yet run
    through the model), the previous turn closed (ChatML), then ``prompt_ids`` as they are or
    ``prompt`` as a user turn opening the assistant's answer."""
    pending = list(pending)
    if prompt_ids is not None:
        return pending + [int(x) for x in prompt_ids]
    if prompt is None:
        raise DeviceError("give a prompt or prompt_ids")
    if lm.tokenizer is None:
        raise DeviceError("this model has no tokenizer: pass prompt_ids")
    if not chatml:
        return pending + lm.encode_text(prompt)
    pre: list[int] = []
    if pending:
        closed = pending[-1] in eos
        pre = pending + lm.encode_text("\n" if closed else "<|im_end|>\n")
    return pre + lm.encode_text(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
