"""``GET /v1/models``: the contexts an app may ask about from the service's memory, as OpenAI's
model list (what a stock client's ``models.list()`` reads, and a chat app's model picker).

A chat completion's ``model`` is a server context's id (:mod:`sparkv.asks.chat`). The service
knows the ones it keeps: an ask that keeps its context labels it ``SERVER#CONTEXT_ID``
(:meth:`~sparkv.edge.kept.KeptAsks.label`). The list holds those the calling app may see, as
``GET /v1/contexts`` does (its own and those shared with it), newest first, one entry per
server context id. It does not list the server's contexts: a server context's id is what lets
an app ask about it with the service's key, which may reach other apps' documents.
"""

from __future__ import annotations

import re

from sparkv.extras import require_all

require_all(("fastapi",), feature="the OpenAI-compatible routes of the device service "
                                   "(sparkv.asks.models)")

from fastapi import APIRouter  # noqa: E402 - after the check

from sparkv.asks.chat import UnknownModel
from sparkv.asks.schemas import ContextModel, ContextModelList, KeptCopy
from sparkv.device.app import CallerDep, OwnersDep, ServiceDep, error_responses
from sparkv.device.owners import ContextOwners
from sparkv.device.service import ContextService

__all__ = ["models_router", "kept_models"]

#: a kept context's label: the server's URL, ``#``, the server context's id
KEPT_LABEL = re.compile(r"^(?P<server>.+)#(?P<cid>[0-9a-f]{32})$")

models_router = APIRouter(tags=["openai"])


def kept_models(service: ContextService, owners: ContextOwners, caller: str
                ) -> list[ContextModel]:
    """The kept contexts ``caller`` may see, as model objects (newest first; one per server
    context id)."""
    cards: dict[str, ContextModel] = {}
    for c in sorted(service.list(), key=lambda c: -c.created_unix):
        m = KEPT_LABEL.match(c.label or "")
        if m is None or m["cid"] in cards or not owners.visible(c.id, caller):
            continue
        cards[m["cid"]] = ContextModel(
            id=m["cid"], created=int(c.created_unix), owned_by=owners.describe(c.id)["owner"],
            sparkv=KeptCopy(kept_id=c.id, server=m["server"], tokens=c.tokens))
    return list(cards.values())


@models_router.get("/v1/models", response_model=ContextModelList)
def list_models(service: ServiceDep, caller: CallerDep,
                owners: OwnersDep) -> ContextModelList:
    """The server contexts the caller may ask about from the service's memory."""
    return ContextModelList(data=kept_models(service, owners, caller))


@models_router.get("/v1/models/{model}", response_model=ContextModel,
                   responses=error_responses(404))
def get_model(model: str, service: ServiceDep, caller: CallerDep,
              owners: OwnersDep) -> ContextModel:
    """One of :func:`list_models`' (404 ``unknown_model`` for any other name)."""
    for card in kept_models(service, owners, caller):
        if card.id == model:
            return card
    raise UnknownModel(f"the service keeps no context {model!r} this app may see (a chat "
                       "completion asks about any server context by its id)")
