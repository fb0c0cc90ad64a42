"""A served context for the paired A/B scripts under ``bench/`` (``early_link_ab.py``,
``receive_path.py``): a real ``sparkv serve`` process on loopback (or, root only, in a network
namespace behind a tc-shaped veth: :func:`netns_served_context`) holding the bundled sample text,
an edge session on it, and an ask with nothing learned of the link (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import gc
import tempfile
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:
    from sparkv.edge.answer import AskResult
    from sparkv.edge.netns import ShapedLink
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
    from sparkv.server.process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp, ServerProcess(
            None, f"file://{tmp}/store", log_path=f"{tmp}/s.log", torch_threads=2) as srv:
        with _session_on(srv.url, lm, tokens, chunk_tokens, levels, warm) as served:
            yield served


@contextlib.contextmanager
def netns_served_context(lm: LoadedModel, tokens: int = 2048, chunk_tokens: int = 512,
                         levels: Sequence[str] = ("raw", "q8", "q5"),
                         warm: Sequence[str] = ("local", "sparkv", "hybrid")
                         ) -> Iterator[tuple[EdgeSession, str, ShapedLink]]:
    """:func:`served_context` with the server in a network namespace behind a veth pair that tc
    shapes (root only, docs/netns.md): ``(session, context id, link)``; pass ``link`` to
    :func:`fresh_ask`. The server runs one torch thread (``sparkv bench ttft --link netns``)."""
    from sparkv.bench.common import NetnsServer

    with tempfile.TemporaryDirectory() as tmp:
        server = NetnsServer(tmp)
        try:
            with _session_on(server.url, lm, tokens, chunk_tokens, levels, warm) as (s, cid):
                yield s, cid, server.link
        finally:
            server.close()


@contextlib.contextmanager
def _session_on(url: str, lm: LoadedModel, tokens: int, chunk_tokens: int,
                levels: Sequence[str], warm: Sequence[str]
                ) -> Iterator[tuple[EdgeSession, str]]:
    """An edge session on the server at ``url`` with the sample context stored and the
    strategies of ``warm`` asked once unshaped."""
    from sparkv.edge.options import AskOptions
    from sparkv.edge.prompts import chat_context
    from sparkv.edge.session import EdgeSession
    from sparkv.edge.shaper import LinkShaper
    from sparkv.runtime import sample_context_ids

    ctx = chat_context(lm, sample_context_ids(lm, tokens))
    s = EdgeSession.connect(url, model=lm, timeout_s=120.0)
    try:
        cid = s.client.create_context(token_ids=ctx, levels=list(levels),
                                      chunk_tokens=chunk_tokens)
        s.client.shaper = LinkShaper.unlimited()
        for strat in warm:
            s.ask(cid, QUESTION, AskOptions(strategy=strat, max_new_tokens=2, use_cache=False))
        yield s, cid
    finally:
        s.close()


def fresh_ask(s: EdgeSession, cid: str, strategy: str, trace: Trace, *,
              link: ShapedLink | None = None, **options: Any) -> AskResult:
    """One ask over ``trace`` with no link rate learned and no manifest cached, the garbage
    collector off during it (a full collection before). The in-process shaper follows the
    trace with a 20 ms round trip; with ``link`` (:func:`netns_served_context`) tc does, on
    the veth, and the client does not shape."""
    from sparkv.edge.options import AskOptions
    from sparkv.edge.shaper import LinkShaper

    if link is None:
        s.client.shaper = LinkShaper(trace, rtt_s=0.02)
    else:
        s.client.shaper = LinkShaper.unlimited()
        link.start_trace(trace, interval_s=0.05)
    s.priors.bandwidth_Bps, s.client.last_download = None, None
    gc.collect()
    gc.disable()
    try:
        return s.ask(cid, QUESTION, AskOptions(strategy=strategy, max_new_tokens=4,
                                               use_cache=False, stop_at_eos=False), **options)
    finally:
        gc.enable()
        if link is not None:
            link.stop_trace()
            link.set_rate(1000.0)
