"""The KV of recent turns after a context, reused by the next ask of the same conversation:
:class:`TurnTails` (docs/device-service.md, "A conversation's turns, kept").

A chat app sends its whole conversation with every request (OpenAI's API has no server-side
history), and a call that answers over a context without growing it (``grow=False``, what every
ask makes) forgets the turns' KV when it returns. So the tenth question of a chat would prefill
all nine earlier turns again. The service keeps, per context and app, the KV of what its recent
calls appended (the turns and the answer, less its last token, whose KV was never computed) in a
bounded, least-recently-used store. A call whose ids begin with a kept tail's tokens appends
those rows to the working memory and runs only the rest, at the same positions: the KV of a
position depends only on the tokens up to it, so any common prefix is reusable, not only a whole
tail.

Tails live in host RAM (on a GPU they are copied back to the device when reused: the device's
memory holds only contexts and working memories, under the budget). A tail is computed over the
context as it was held then; it stays valid while the context holds the same tokens (a tail is
keyed by the context's token count, and a context that grows or is deleted forgets its tails).
Chunks re-levelled or swapped later do not drop it, as a chat that grows its context keeps its
turns' KV computed once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import torch

#: the fewest tokens of a tail worth reusing (one chunk): two questions about a document often
#: begin with the same few tokens, and reusing those would save nothing
MIN_REUSE = 16
#: the default capacity holds this many tokens of the model's KV ...
DEFAULT_TOKENS = 2048
#: ... and at least this many bytes
DEFAULT_FLOOR_BYTES = 64 << 20


def default_capacity(token_bytes: int) -> int:
    """The turn cache's default bytes for a model whose KV takes ``token_bytes`` a token (every
    layer, K and V, at the dtype tails are kept in): :data:`DEFAULT_TOKENS` tokens, at least
    :data:`DEFAULT_FLOOR_BYTES` (a fixed 64 MB held 560 tokens of a 3B model at fp16, less than
    one long chat)."""
    return max(DEFAULT_FLOOR_BYTES, DEFAULT_TOKENS * token_bytes)

#: per layer ``(K, V)`` ``[kv_heads, m, head_dim]``: the rows of ``m`` tokens after a context
Rows = list[tuple[torch.Tensor, torch.Tensor]]


class TailKey(NamedTuple):
    """Whose tails: context ``ctx_id`` holding ``base`` tokens, asked by ``scope`` (an app: one
    app's turns are never reused by another's, whose faster answer would tell it what the first
    asked)."""

    ctx_id: str
    base: int
    scope: str = ""


@dataclass(frozen=True)
class TailHit:
    """Rows to append before a call: the first ``count`` rows of a kept tail."""

    rows: Rows
    count: int

    def take(self) -> Rows:
        """The ``count`` rows per layer (views)."""
        return [(k[:, :self.count], v[:, :self.count]) for k, v in self.rows]


@dataclass
class _Tail:
    tokens: tuple[int, ...]
    rows: Rows
    nbytes: int


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many first ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _nbytes(rows: Rows) -> int:
    return sum(t.numel() * t.element_size() for kv in rows for t in kv)


class TurnTails:
    """Recent tails per :class:`TailKey`, least recently used first out, at most ``capacity``
    bytes in all (0: nothing is kept) and :data:`PER_CONTEXT` per key."""

    #: tails kept per context (one per conversation going on about it)
    PER_CONTEXT = 8

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("the turn cache's capacity must be >= 0")
        self.capacity = capacity
        self._tails: OrderedDict[tuple[TailKey, int], _Tail] = OrderedDict()
        self._lock = threading.Lock()
        self._serial = 0
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0
        self.evictions = 0

    def match(self, where: TailKey, ids: Sequence[int], least: int = 1) -> TailHit | None:
        """The longest kept prefix of ``ids`` of ``where``'s tails, short of the last id (a call
        runs at least one); ``None`` when it is shorter than ``least`` tokens."""
        with self._lock:
            best, key_of = max(least, 1) - 1, None
            for key, tail in self._tails.items():
                if key[0] == where:
                    m = min(common_prefix(tail.tokens, ids), len(ids) - 1)
                    if m > best:
                        best, key_of = m, key
            if key_of is None:
                self.misses += 1
                return None
            self._tails.move_to_end(key_of)
            self.hits += 1
            self.reused_tokens += best
            return TailHit(self._tails[key_of].rows, best)

    def put(self, where: TailKey, tokens: Sequence[int], rows: Rows) -> bool:
        """Keeps ``rows``, the KV of ``tokens`` after ``where``'s context; a tail of ``where``
        that ``tokens`` begin with is replaced. Returns whether it is kept (not when larger than
        the capacity). :class:`ValueError` when ``rows`` do not hold one row per token."""
        if any(int(t.shape[1]) != len(tokens) for kv in rows for t in kv):
            raise ValueError(f"a tail of {len(tokens)} tokens needs as many rows a layer")
        nbytes = _nbytes(rows)
        if not tokens or nbytes > self.capacity:
            return False
        tail = _Tail(tuple(tokens), rows, nbytes)
        with self._lock:
            for key in [k for k, t in self._tails.items() if k[0] == where
                        and common_prefix(t.tokens, tail.tokens) == len(t.tokens)]:
                self._drop(key)
            self._serial += 1
            self._tails[(where, self._serial)] = tail
            self.nbytes += nbytes
            self._bound(where)
        return True

    def _bound(self, where: TailKey) -> None:
        mine = [k for k in self._tails if k[0] == where]
        for key in mine[:max(0, len(mine) - self.PER_CONTEXT)]:
            self._drop(key, evicted=True)
        while self.nbytes > self.capacity:
            self._drop(next(iter(self._tails)), evicted=True)

    def _drop(self, key: tuple[TailKey, int], evicted: bool = False) -> None:
        self.nbytes -= self._tails.pop(key).nbytes
        self.evictions += int(evicted)

    def forget(self, ctx_id: str) -> None:
        """Drops every tail of context ``ctx_id`` (it grew, or is gone)."""
        with self._lock:
            for key in [k for k in self._tails if k[0].ctx_id == ctx_id]:
                self._drop(key)

    def to_dict(self) -> dict[str, Any]:
        """``capacity``, ``bytes``, ``tails``, ``hits``, ``misses``, ``reused_tokens``,
        ``evictions``: what ``GET /v1/stats`` reports as ``turn_cache``."""
        with self._lock:
            return {"capacity": self.capacity, "bytes": self.nbytes, "tails": len(self._tails),
                    "hits": self.hits, "misses": self.misses,
                    "reused_tokens": self.reused_tokens, "evictions": self.evictions}
