"""The model's forward passes on an ask's thread: each one a unit of compute on the ask's lane, and
the answer's tokens reported as they are chosen.

An ask answers on its own thread: the question's forward pass, then one per answer token
(:func:`sparkv.runtime.generate.greedy_generate`, and the context service's call for a kept
context). :func:`install` puts one pair of hooks on the shared model; :func:`bound` binds the
calling thread to an ask's lane and token callback for a block. A forward pass on a bound
thread then

* waits for the ask's turn on the cores (:meth:`AskLane.acquire
  <sparkv.asks.cores.AskLane.acquire>`; a cancelled ask raises there, between two tokens), runs,
  and gives the cores back (also when it fails); after the first, the lane is answering
  (:meth:`AskLane.answered <sparkv.asks.cores.AskLane.answered>`).

Each token the thread's generation chooses, greedy or sampled, goes to ``on_token``
(:func:`sparkv.runtime.sampling.reporting_to`): the token the answer takes, whichever path
(the edge's, the context service's, a decode policy's) chose it.

The answer's later tokens do not come here one pass each: a bound thread's greedy decoding is
routed (:func:`sparkv.runtime.batchdecode.decoding_through`) to :meth:`AskLane.run_decode
<sparkv.asks.cores.AskLane.run_decode>`, which runs the answer tokens of the asks waiting for
the cores at once as one forward pass of one row each, and the thread reports its own token.
That pass runs on the holding lane's thread while it holds the cores: the hooks leave it be.

A forward pass on any other thread (the layer steps of a load run on the engine's threads, and
go through the lane themselves: :class:`sparkv.edge.lane.LaneStepper`) is untouched.

State: the binding, per thread (``threading.local``); the hooks are installed once per model
(an attribute on it marks them).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Iterator

from sparkv.asks.cores import AskLane

if TYPE_CHECKING:
    from sparkv.runtime.sampling import Reporter

__all__ = ["install", "bound"]

_MARK = "_sparkv_ask_hooks"
_local = threading.local()


def install(model: Any) -> None:
    """Puts the hooks on ``model`` (a transformers causal LM; once)."""
    if getattr(model, _MARK, False):
        return
    model.register_forward_pre_hook(_before, with_kwargs=True)
    model.register_forward_hook(_after, with_kwargs=True, always_call=True)
    setattr(model, _MARK, True)


@contextlib.contextmanager
def bound(lane: AskLane, on_token: Reporter | None = None,
          logprobs: int | None = None) -> Iterator[None]:
    """Binds this thread's forward passes to ``lane`` (and the tokens its generation chooses
    to ``on_token``, with their log-probabilities and ``logprobs`` alternatives when it is not
    ``None``) for the block."""
    from sparkv.runtime.batchdecode import decoding_through
    from sparkv.runtime.sampling import reporting_to

    _local.lane, _local.held = lane, False
    try:
        with decoding_through(lane.run_decode), reporting_to(on_token, logprobs):
            yield
    finally:
        _local.lane = None


def _before(module: Any, args: Any, kwargs: Any) -> None:
    lane = getattr(_local, "lane", None)
    if lane is not None and not lane.holding:   # holding: the pass is the lane's own unit
        lane.acquire()                          # (answer tokens run together, below)
        _local.held = True


def _after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
    lane = getattr(_local, "lane", None)
    if lane is None or not getattr(_local, "held", False):
        return
    _local.held = False
    if not lane.answering:     # the question's pass: the ask's first token (answering before
        lane.answered()        # the cores go: an answer token waiting may gather its next)
    lane.release()
