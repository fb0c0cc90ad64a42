"""A served context for the paired A/B scripts under ``bench/`` (``early_link_ab.py``,
``receive_path.py``): a real ``sparkv serve`` process on loopback holding the bundled sample
text, an edge session on it, and an ask with nothing learned of the link (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    from sparkv.edge.answer import AskResult
    from sparkv.edge.session import EdgeSession
    from sparkv.runtime.model import LoadedModel
    from sparkv.scheduler.trace import Trace

QUESTION = "What does this text say about warranty? Answer in one sentence."


@contextlib.contextmanager
def served_context(lm: LoadedModel, tokens: int = 2048, chunk_tokens: int = 512,
                   levels: Sequence[str] = ("raw", "q8", "q5"),
                   warm: Sequence[str] = ("local", "sparkv", "hybrid")
                   ) -> Iterator[tuple[EdgeSession, str]]:
    """``(session, context id)``: a server process (2 threads) with the sample text's first
    ``tokens`` tokens as a chat context, each strategy of ``warm`` asked once unshaped (kernels,
    codec tables, the HTTP stack and the planners loaded before anything is measured)."""
    from sparkv.edge.options import AskOptions
    from sparkv.edge.prompts import chat_context
    from sparkv.edge.session import EdgeSession
    from sparkv.edge.shaper import LinkShaper
    from sparkv.runtime import sample_context_ids
    from sparkv.server.process import ServerProcess

    ctx = chat_context(lm, sample_context_ids(lm, tokens))
    with tempfile.TemporaryDirectory() as tmp, ServerProcess(
            None, f"file://{tmp}/store", log_path=f"{tmp}/s.log", torch_threads=2) as srv:
        s = EdgeSession.connect(srv.url, model=lm, timeout_s=120.0)
        try:
            cid = s.client.create_context(token_ids=ctx, levels=list(levels),
                                          chunk_tokens=chunk_tokens)
            s.client.shaper = LinkShaper.unlimited()
            for strat in warm:
                s.ask(cid, QUESTION, AskOptions(strategy=strat, max_new_tokens=2,
                                                use_cache=False))
            yield s, cid
        finally:
            s.close()


def fresh_ask(s: EdgeSession, cid: str, strategy: str, trace: Trace, **options: Any
              ) -> AskResult:
    """One ask over ``trace`` (20 ms round trip) with no link rate learned and no manifest
    cached, the garbage collector off during it (a full collection before)."""
    from sparkv.edge.options import AskOptions
    from sparkv.edge.shaper import LinkShaper

    s.client.shaper = LinkShaper(trace, rtt_s=0.02)
    s.priors.bandwidth_Bps, s.client.last_download = None, None
    gc.collect()
    gc.disable()
    try:
        return s.ask(cid, QUESTION, AskOptions(strategy=strategy, max_new_tokens=4,
                                               use_cache=False, stop_at_eos=False), **options)
    finally:
        gc.enable()
