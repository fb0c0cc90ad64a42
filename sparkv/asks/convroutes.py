"""OpenAI's Conversations API on the device service (docs/asks.md, "Conversations"), over the
service's :class:`~sparkv.asks.convstore.ConversationStore`:

======  =============================================  ==========================================
method  path                                           answer
======  =============================================  ==========================================
POST    ``/v1/conversations``                          a new ``conversation`` (``items``: its
                                                       first, at most 20; ``metadata``)
GET     ``/v1/conversations/{id}``                     the ``conversation``
POST    ``/v1/conversations/{id}``                     it, its ``metadata`` set
DELETE  ``/v1/conversations/{id}``                     ``{"id", "object": "conversation.deleted",
                                                       "deleted": true}``
GET     ``/v1/conversations/{id}/items``               its items (a ``list``: ``limit``,
                                                       ``order``, ``after``)
POST    ``/v1/conversations/{id}/items``               the items added (a ``list``; at most 20)
GET     ``/v1/conversations/{id}/items/{item_id}``     the item
DELETE  ``/v1/conversations/{id}/items/{item_id}``     the ``conversation``, the item gone
======  =============================================  ==========================================

A response names its conversation (``conversation``: its id, or ``{"id": ...}``): it comes
after the conversation's items, and once answered (completed or incomplete) its input items and
output items are added to it (:class:`ConversationTurn`). An id the app did not make (another
app's, one deleted or evicted, or one never made) is a 404 ``conversation_not_found``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any, Literal, Sequence

from sparkv.extras import require_all

require_all(("fastapi",), feature="the conversations' routes of the device service "
                                   "(sparkv.asks.convroutes)")

from fastapi import APIRouter, Depends, Path, Query, Request  # noqa: E402 - after the check
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sparkv.asks.convstore import MAX_ITEMS_ADDED, ConversationStore, Snapshot
from sparkv.asks.respkept import page_of
from sparkv.asks.respschemas import InputItem, as_input, identified, listed
from sparkv.device.app import CallerDep, error_responses
from sparkv.device.errors import DeviceError

log = logging.getLogger("sparkv.asks")

__all__ = ["conversations_router", "ConversationTurn", "conversation_of", "get_conversations",
           "ConversationsDep", "UnknownConversation", "UnknownItem", "NoConversationsKept",
           "Metadata"]

ConversationId = Annotated[str, Path(min_length=1, max_length=256)]
ItemId = Annotated[str, Path(min_length=1, max_length=256)]
#: OpenAI's metadata: at most 16 keys of 64 characters, values of 512
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)],
                          Annotated[str, Field(max_length=512)]], Field(max_length=16)]
Items = Annotated[list[InputItem], Field(max_length=MAX_ITEMS_ADDED)]
Include = Annotated[list[str] | None, Query(max_length=16)]


class UnknownConversation(DeviceError, status=404, code="conversation_not_found"):
    """No conversation of this app with this id (never made, deleted or evicted)."""


class UnknownItem(DeviceError, status=404, code="item_not_found"):
    """No item with this id in the conversation."""


class NoConversationsKept(DeviceError, status=400, code="conversations_not_kept"):
    """The service keeps no conversations (``--conversations-kept 0``)."""


class NewConversation(BaseModel):
    """``POST /v1/conversations``: its first ``items`` and its ``metadata``."""

    model_config = ConfigDict(extra="forbid")

    items: Items | None = None
    metadata: Metadata | None = None


class ConversationUpdate(BaseModel):
    """``POST /v1/conversations/{id}``: its new ``metadata``."""

    model_config = ConfigDict(extra="forbid")

    metadata: Metadata


class NewItems(BaseModel):
    """``POST /v1/conversations/{id}/items``: the items to add."""

    model_config = ConfigDict(extra="forbid")

    items: Annotated[list[InputItem], Field(min_length=1, max_length=MAX_ITEMS_ADDED)]


def get_conversations(request: Request) -> ConversationStore:
    """The app's conversations (``app.state.conversations``)."""
    return request.app.state.conversations


ConversationsDep = Annotated[ConversationStore, Depends(get_conversations)]


def _kept_here(store: ConversationStore) -> None:
    """:class:`NoConversationsKept` when the service keeps none."""
    if not store.enabled:
        raise NoConversationsKept("conversations are not kept by this service "
                                  "(--conversations-kept 0): send the conversation as input")


def conversation_of(store: ConversationStore, caller: str, cid: str) -> Snapshot:
    """``caller``'s conversation ``cid`` as it stands (:class:`UnknownConversation` when it
    has none such)."""
    _kept_here(store)
    snap = store.get(caller, cid)
    if snap is None:
        raise UnknownConversation(f"Conversation with id {cid!r} not found.")
    return snap


class ConversationTurn:
    """Adds a response's input ``items`` and its output items to ``caller``'s conversation
    ``cid`` once it is answered (completed or incomplete)."""

    def __init__(self, store: ConversationStore, caller: str, cid: str,
                 items: Sequence[InputItem]) -> None:
        self.store, self.caller, self.cid = store, caller, cid
        self.items = [identified(i) for i in items]

    async def __call__(self, response: dict[str, Any]) -> None:
        if response.get("status") not in ("completed", "incomplete"):
            return
        try:
            output = as_input(response["output"])
        except ValidationError as e:
            log.warning("response %s: its output is no input, the conversation %s has its "
                        "input only (%s)", response["id"], self.cid, e)
            output = []
        added = await asyncio.to_thread(self.store.add, self.caller, self.cid,
                                        [*self.items, *output])
        if added is None:
            log.warning("response %s: its conversation %s went while it was answered",
                        response["id"], self.cid)


conversations_router = APIRouter(tags=["openai"])


def _item(snap: Snapshot, item_id: str) -> InputItem:
    for item in snap.items:
        if item.id == item_id:
            return item
    raise UnknownItem(f"Item with id {item_id!r} not found in conversation "
                      f"{snap.info['id']!r}.")


@conversations_router.post("/v1/conversations", responses=error_responses(400))
def create_conversation(body: NewConversation, store: ConversationsDep,
                        caller: CallerDep) -> dict[str, Any]:
    """A new conversation of this app, with its first items."""
    _kept_here(store)
    items = [identified(i) for i in body.items or []]
    return store.create(caller, items, body.metadata).info


@conversations_router.get("/v1/conversations/{conversation_id}",
                          responses=error_responses(400, 404))
def get_conversation(conversation_id: ConversationId, store: ConversationsDep,
                     caller: CallerDep) -> dict[str, Any]:
    """A conversation of this app."""
    return conversation_of(store, caller, conversation_id).info


@conversations_router.post("/v1/conversations/{conversation_id}",
                           responses=error_responses(400, 404))
def update_conversation(conversation_id: ConversationId, body: ConversationUpdate,
                        store: ConversationsDep, caller: CallerDep) -> dict[str, Any]:
    """Sets a conversation's metadata."""
    conversation_of(store, caller, conversation_id)
    snap = store.update(caller, conversation_id, body.metadata)
    return (snap or conversation_of(store, caller, conversation_id)).info


@conversations_router.delete("/v1/conversations/{conversation_id}",
                             responses=error_responses(400, 404))
def delete_conversation(conversation_id: ConversationId, store: ConversationsDep,
                        caller: CallerDep) -> dict[str, Any]:
    """Forgets a conversation of this app (its file too)."""
    conversation_of(store, caller, conversation_id)
    if not store.delete(caller, conversation_id):
        raise UnknownConversation(f"Conversation with id {conversation_id!r} not found.")
    return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}


@conversations_router.get("/v1/conversations/{conversation_id}/items",
                          responses=error_responses(400, 404))
def list_items(conversation_id: ConversationId, store: ConversationsDep, caller: CallerDep,
               limit: Annotated[int, Query(ge=1, le=100)] = 20,
               order: Literal["asc", "desc"] = "desc",
               after: Annotated[str | None, Query(max_length=256)] = None,
               include: Include = None) -> dict[str, Any]:
    """A conversation's items, newest first unless ``order`` is ``asc``, ``limit`` of them
    after the item ``after`` (``include``: taken)."""
    snap = conversation_of(store, caller, conversation_id)
    return page_of([listed(i) for i in snap.items], limit, order, after)


@conversations_router.post("/v1/conversations/{conversation_id}/items",
                           responses=error_responses(400, 404))
def add_items(conversation_id: ConversationId, body: NewItems, store: ConversationsDep,
              caller: CallerDep, include: Include = None) -> dict[str, Any]:
    """Adds items to a conversation: the items added, as a ``list``."""
    conversation_of(store, caller, conversation_id)
    items = [identified(i) for i in body.items]
    if store.add(caller, conversation_id, items) is None:
        raise UnknownConversation(f"Conversation with id {conversation_id!r} not found.")
    return page_of([listed(i) for i in items], len(items), "asc")


@conversations_router.get("/v1/conversations/{conversation_id}/items/{item_id}",
                          responses=error_responses(400, 404))
def get_item(conversation_id: ConversationId, item_id: ItemId, store: ConversationsDep,
             caller: CallerDep, include: Include = None) -> dict[str, Any]:
    """One item of a conversation."""
    return listed(_item(conversation_of(store, caller, conversation_id), item_id))


@conversations_router.delete("/v1/conversations/{conversation_id}/items/{item_id}",
                             responses=error_responses(400, 404))
def delete_item(conversation_id: ConversationId, item_id: ItemId, store: ConversationsDep,
                caller: CallerDep) -> dict[str, Any]:
    """Removes an item from a conversation: the conversation."""
    conversation_of(store, caller, conversation_id)
    snap, found = store.remove_item(caller, conversation_id, item_id)
    if snap is None:
        raise UnknownConversation(f"Conversation with id {conversation_id!r} not found.")
    if not found:
        raise UnknownItem(f"Item with id {item_id!r} not found in conversation "
                          f"{conversation_id!r}.")
    return snap.info
