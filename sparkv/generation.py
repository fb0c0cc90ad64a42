"""The one shape of a generation result: ``text``, ``tokens``, ``stats``.

Every API that generates an answer returns a record with this shape (docs/python-api.md):

==============================================  =================================================
call                                            result
==============================================  =================================================
``EdgeSession.ask(...)``                        :class:`~sparkv.edge.answer.AskResult`
``ContextService.call(...)``                    :class:`~sparkv.device.calls.CallResult`
``DeviceClient.call(...)`` (HTTP)               :class:`~sparkv.device.schemas.CallReply`
``DeviceClient.ask(...)`` (HTTP)                :class:`~sparkv.device.schemas.DoneEvent`
``sparkv.decode.generate(...)``                 :class:`~sparkv.decode.session.DecodeResult`
                                                (still unpacks as ``result, stats``)
``greedy_generate(...)``                        :class:`~sparkv.runtime.generate.GenerationResult`
==============================================  =================================================

``sparkv ask --json`` and the JSON of ``POST /v1/contexts/{id}/call`` and of an ask's ``done``
event carry the same three keys.

``stats`` is a JSON-able ``dict``: always ``ttft_s`` (seconds from the call to the first generated
token) and ``new_tokens`` (``len(tokens)``), then what that API measures (the edge's TTFT
breakdown, the context service's switch and load times, DynaKV's decode statistics under
``"decode"``). Each record keeps its own richer attributes beside the shape.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

#: the keys every ``stats`` dict holds
COMMON_STATS = ("ttft_s", "new_tokens")


@runtime_checkable
class Generation(Protocol):
    """What a generation returned: the decoded ``text``, the generated token ids ``tokens`` (end
    of sequence excluded from ``text``), and ``stats`` (module docstring)."""

    @property
    def text(self) -> str: ...

    @property
    def tokens(self) -> list[int]: ...

    @property
    def stats(self) -> dict[str, Any]: ...


def base_stats(ttft_s: float, tokens: list[int]) -> dict[str, Any]:
    """The keys every ``stats`` starts with (:data:`COMMON_STATS`)."""
    return {"ttft_s": float(ttft_s), "new_tokens": len(tokens)}
