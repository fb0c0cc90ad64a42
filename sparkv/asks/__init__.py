"""Asks through the device service: many apps ask about server contexts, one model, one link and
one KV memory answer them (docs/device-service.md, "Asks").

    sparkv device serve --memory-budget-mb 512 --ask-slots 2 --ask-queue 16
    sparkv device ask --server http://127.0.0.1:8080 --context ID "What is it about?"

* :mod:`~sparkv.asks.service`: :class:`AskService` (submit, close, stats) and
  :class:`AskRequest`; :mod:`~sparkv.asks.tickets`: :class:`AskTicket` (events, cancel);
* :mod:`~sparkv.asks.admission`: slots and a bounded queue (429 ``queue_full`` past it);
* :mod:`~sparkv.asks.cores`: the compute worker every ask's compute goes through, in turn;
* :mod:`~sparkv.asks.forward`: an ask's forward passes on its lane, their tokens streamed;
* :mod:`~sparkv.asks.kept`: one app's view of the kept contexts;
* :mod:`~sparkv.asks.routes` (``/v1/asks``), :mod:`~sparkv.asks.chat`
  (``/v1/chat/completions``, OpenAI-compatible; :mod:`~sparkv.asks.completion` its answers),
  :mod:`~sparkv.asks.responses` (``/v1/responses``, OpenAI's Responses API;
  :mod:`~sparkv.asks.respschemas` its request), :mod:`~sparkv.asks.schemas`;
* :mod:`~sparkv.asks.commands`: what ``sparkv device serve`` gains.

Layering: above the edge (an ask is an :class:`~sparkv.edge.session.EdgeSession` ask) and the
device (its context service keeps what asks load); below the benchmarks and the CLI.
"""

from typing import TYPE_CHECKING

from sparkv.lazy import lazy_exports

if TYPE_CHECKING:
    from sparkv.asks.service import AskService
    from sparkv.asks.tickets import AskRequest, AskTicket

#: name -> the module that defines it (imported on first use: :mod:`sparkv.lazy`)
_EXPORTS: dict[str, str] = {
    "AskService": "sparkv.asks.service",
    "AskRequest": "sparkv.asks.tickets",
    "AskTicket": "sparkv.asks.tickets",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = ["AskRequest", "AskService", "AskTicket"]
