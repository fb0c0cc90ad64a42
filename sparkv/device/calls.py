"""One call of the context service: its turn through the model and what it returns.

* :func:`run_turn`: the prompt run after a context's tokens in its working memory, the answer
  decoded, and the attention statistics of every key the new rows attend recorded
  (:mod:`sparkv.device.density`), which the context's chunks' levels come from;
* :class:`CallResult`: what the call returned and what it cost.

No state, no locks: the service runs one turn at a time (its run lock), over a working memory
its keeper switched in.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from sparkv.cache import ContextKV, SparkvCache
from sparkv.cache.fork import ForkCache
from sparkv.device.density import DensityRecorder, recording
from sparkv.device.tails import Rows, TailHit
from sparkv.generation import base_stats
from sparkv.runtime.hfcache import model_call
from sparkv.runtime.sampling import Sampling

if TYPE_CHECKING:
    from sparkv.device.counters import ServiceCounters
    from sparkv.device.keeper import SwitchIn
    from sparkv.device.loader import LoadStats
    from sparkv.device.planner import Split
    from sparkv.runtime.model import LoadedModel


@dataclass
class CallResult:
    """What one call returned and what it cost (seconds); a
    :class:`~sparkv.generation.Generation` (``text``, ``tokens``, ``stats``).

    ``load``: what loading the context did (``None`` when nothing was loaded: a whole-context
    keeper; a kept working memory's and a joiner's hold only ``sources``, where the working
    memory they read came from: for a joiner, the opener's load's); ``plan``: the IO/recompute
    split of that load (``None`` without one). :attr:`stats` gives both as dicts (empty for
    ``None``); :meth:`to_dict` is what ``POST /v1/contexts/{id}/call`` returns:
    ``context_id``, ``text``, ``tokens``, ``stats``."""

    context_id: str
    text: str
    tokens: list[int]
    switch_s: float               # switching latency: reclaim + load, until the context is ready
    reclaim_s: float = 0.0
    load_s: float = 0.0
    first_token_s: float = 0.0    # from the call to the first answer token
    total_s: float = 0.0
    aot_s: float = 0.0            # the ahead-of-time swap-out after the answer
    context_tokens: int = 0       # after the call
    bytes_evicted: int = 0
    bytes_written_at_reclaim: int = 0
    bytes_written_aot: int = 0
    turn_tokens_reused: int = 0   # the prompt's tokens whose KV a kept tail gave (not run)
    seed: int | None = None       # a sampled answer's seed (None: greedy)
    joined: bool = False          # it read the working memory another call switched in
    load: LoadStats | None = None
    plan: Split | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"context_id": self.context_id, "text": self.text, "tokens": self.tokens,
                "stats": self.stats}

    @property
    def stats(self) -> dict[str, Any]:
        """``ttft_s`` (= ``first_token_s``), ``new_tokens``, then every cost (``switch_s``,
        ``reclaim_s``, ``load_s``, ``first_token_s``, ``total_s``, ``aot_s``,
        ``context_tokens``, the bytes, ``turn_tokens_reused``, ``seed``, and the ``load`` and
        ``plan`` records as dicts)."""
        costs = {k: v for k, v in self.__dict__.items()
                 if k not in ("context_id", "text", "tokens")}
        costs.update(load={} if self.load is None else self.load.to_dict(),
                     plan={} if self.plan is None else asdict(self.plan))
        return {**base_stats(self.first_token_s, self.tokens), **costs}

    @classmethod
    def of(cls, lm: LoadedModel, ctx_id: str, tokens: list[int], sw: SwitchIn,
           context_tokens: int, counted: ServiceCounters, *, switch_s: float, first_token_s: float,
           total_s: float, aot_s: float, aot_bytes: int, stop: Sequence[str] = (),
           turn_tokens_reused: int = 0, seed: int | None = None, joined: bool = False
           ) -> "CallResult":
        """The result of a call that decoded ``tokens`` (its text: them decoded by ``lm``, end
        of sequence tokens left out, cut before a stop string of ``stop``), switched in by
        ``sw`` and counted ``counted`` (the service's counters during the call)."""
        from sparkv.runtime.generate import answer_text
        from sparkv.runtime.stops import StopStrings

        text = answer_text(lm, tokens, StopStrings(stop)) if tokens else ""
        return cls(ctx_id, text, tokens, switch_s, reclaim_s=sw.reclaim_s,
                   load_s=sw.stats.total_s if sw.stats else 0.0, first_token_s=first_token_s,
                   total_s=total_s, aot_s=aot_s, context_tokens=context_tokens,
                   bytes_evicted=counted.evicted_bytes,
                   bytes_written_at_reclaim=counted.reclaim_written_bytes,
                   bytes_written_aot=aot_bytes, turn_tokens_reused=turn_tokens_reused,
                   seed=seed, joined=joined, load=sw.stats, plan=sw.split)



@dataclass
class Turn:
    """What a turn decoded (``tokens``, the seconds to the first one: 0 when nothing was
    decoded), the densities it recorded, the rows it reused (``reused``: tokens of a kept tail
    appended, not run) and, when asked for, the KV of what it appended (``tail``: the prompt and
    the answer less its last token)."""

    tokens: list[int]
    first_token_s: float
    density: DensityRecorder
    reused: int = 0
    tail: Rows | None = None


def run_turn(lm: LoadedModel, W: ContextKV, n: int, ids: list[int], max_new: int, *, grow: bool,
             stop_at_eos: bool, stop: Sequence[str] = (), known: TailHit | None = None,
             keep_tail: bool = False, sampling: Sampling | None = None, reserve: int = 0,
             share: Callable[[Rows], None] | None = None) -> Turn:
    """Runs ``ids`` after the ``n`` tokens of working memory ``W`` and decodes up to
    ``max_new`` tokens, greedily unless ``sampling`` says otherwise (until a stop string of
    ``stop``).

    With ``grow`` the turn runs in ``W`` (which has room for ``ids`` and ``max_new`` more) and
    ``W`` keeps the new tokens. Without it the turn only reads ``W``: its tokens stay in a fork
    (:class:`~sparkv.cache.fork.ForkCache`), so turns of several calls may read one ``W`` at
    once; ``known`` (rows of a kept tail, ``ids`` beginning with its tokens) is appended to the
    fork first and only the rest of ``ids`` runs; ``keep_tail`` returns the KV of what the call
    appended (:attr:`Turn.tail`); ``reserve``: the tokens its fork makes room for at once (its
    bytes then known ahead); ``share`` is handed the KV of ``ids`` (copies, per layer) once
    they ran (:meth:`ReadTurns.share <sparkv.device.readturns.ReadTurns.share>`)."""
    if grow and (known is not None or keep_tail):
        raise ValueError("a turn that grows its context neither reuses nor returns a tail")
    rec = DensityRecorder(n + len(ids) + max_new + 1)
    if not grow:
        return _read_turn(lm, ForkCache(W, reserve), n, ids, max_new, rec, stop_at_eos, stop,
                          known, keep_tail, sampling, share)
    try:
        with recording(rec):
            tokens, first_s = _generate(lm, SparkvCache(W), n, ids, max_new, stop_at_eos, stop,
                                        sampling)
    except BaseException:
        W.truncate()
        raise
    return Turn(tokens, first_s, rec)


def _read_turn(lm: LoadedModel, fork: ForkCache, n: int, ids: list[int], max_new: int,
               rec: DensityRecorder, stop_at_eos: bool, stop: Sequence[str],
               known: TailHit | None, keep_tail: bool, sampling: Sampling | None,
               share: Callable[[Rows], None] | None = None) -> Turn:
    """A turn that only reads the memory ``fork`` forks (:func:`run_turn` without ``grow``)."""
    held = set(fork.memory.positions)
    if held != {n}:
        raise ValueError(f"the working memory holds {sorted(held)} tokens, not {n}")
    m = fork.append_rows(known.take()) if known is not None else 0
    after = None if share is None else (lambda: share(fork.rows()))
    with recording(rec):
        tokens, first_s = _generate(lm, fork, n + m, ids[m:], max_new, stop_at_eos, stop,
                                    sampling, after)
    tail = fork.rows() if keep_tail and tokens else None
    return Turn(tokens, first_s, rec, m, tail)


def _generate(lm: LoadedModel, cache: SparkvCache | ForkCache, n: int, ids: list[int],
              max_new: int, stop_at_eos: bool, stop: Sequence[str], sampling: Sampling | None,
              after_question: Callable[[], None] | None = None) -> tuple[list[int], float]:
    """The answer's tokens over ``cache`` and the seconds to the first; a :class:`SparkvCache`
    keeps what ran (committed to its memory), a fork keeps it itself."""
    from sparkv.runtime.generate import generate_over

    if max_new > 0:
        gen = generate_over(lm, cache, n, ids, max_new, stop_at_eos=stop_at_eos, stop=stop,
                            sampling=sampling, after_question=after_question)
        tokens, first_s = gen.tokens, gen.first_token_s
    else:
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=lm.device)
            pos = torch.arange(n, n + len(ids), device=lm.device)
            model_call(lm.model, input_ids=x, cache=cache, position_ids=pos[None],
                       cache_position=pos, use_cache=True, logits_to_keep=1)
        tokens, first_s = [], 0.0
    if isinstance(cache, SparkvCache):
        cache.commit()
    return tokens, first_s
