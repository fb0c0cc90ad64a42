"""Answer tokens of several contexts in one forward pass: :func:`decode_together`, and the
route a thread's greedy decoding takes (:func:`decoding_through`, :func:`decode_step`).

On a CPU one decode pass is bound by reading the model's weights (SmolLM2-135M in float32: 540
MB, about 80-100 ms a token on this 2-core machine, whatever the rows), so K asks' next tokens
as one pass of K rows cost about one token's time. Each row attends over its own KV memory
(:class:`~sparkv.cache.batch.BatchCache`); its logits are those its own pass gives, within
float32 rounding (the GEMMs see more rows).

:func:`sparkv.runtime.generate.greedy_generate` takes every answer token after the first through
:func:`decode_step`: one pass of its own, unless the thread was routed elsewhere (a device
service answering several asks routes it to its compute worker, which runs the answer tokens
waiting together as one pass: :mod:`sparkv.asks.cores`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from sparkv.cache import SparkvCache
from sparkv.cache.batch import BatchCache
from sparkv.cache.fork import ForkCache
from sparkv.runtime.hfcache import model_call
from sparkv.runtime.linears import answer_tokens
from sparkv.runtime.model import LoadedModel

__all__ = ["DecodeItem", "decode_together", "decode_step", "decoding_through", "Decoder"]


class DecodeItem(NamedTuple):
    """One context's next answer token to run: its cache (the context's memory, or a fork of
    it), the token and its position."""

    cache: SparkvCache | ForkCache
    token: int
    position: int


#: a route for a thread's answer tokens: ``(lm, item) -> logits [vocab]``
Decoder = Callable[[LoadedModel, DecodeItem], torch.Tensor]

_route = threading.local()


@torch.inference_mode()
def decode_together(lm: LoadedModel, items: Sequence[DecodeItem]) -> torch.Tensor:
    """One forward pass of ``len(items)`` rows, row ``i`` item ``i``'s token over its own cache
    (which takes the token's K/V); returns the logits ``[K, vocab]``. One item: the plain pass
    over its cache."""
    if not items:
        raise ValueError("nothing to decode")
    device = lm.device
    ids = torch.tensor([[it.token] for it in items], dtype=torch.long, device=device)
    pos = torch.tensor([[it.position] for it in items], dtype=torch.long, device=device)
    if len(items) == 1:
        cache: object = items[0].cache
        cache_pos = pos[0]
    else:
        cache = BatchCache([it.cache for it in items])
        cache_pos = pos.max().view(1)     # the mask's length only: each row has its own
    with answer_tokens():
        out = model_call(lm.model, input_ids=ids, cache=cache, position_ids=pos,
                         cache_position=cache_pos, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def decode_step(lm: LoadedModel, item: DecodeItem) -> torch.Tensor:
    """The logits ``[vocab]`` of ``item``'s token: through the thread's route
    (:func:`decoding_through`), else a pass of its own."""
    route: Decoder | None = getattr(_route, "fn", None)
    if route is not None:
        return route(lm, item)
    return decode_together(lm, [item])[0]


@contextlib.contextmanager
def decoding_through(route: Decoder) -> Iterator[None]:
    """Routes this thread's answer tokens (:func:`decode_step`) through ``route`` for the
    block."""
    before = getattr(_route, "fn", None)
    _route.fn = route
    try:
        yield
    finally:
        _route.fn = before
