"""The device side of sparkv: the REST client, the overlap engine, link emulation, ``ask``.

    from sparkv.edge import EdgeClient
    with EdgeClient("http://127.0.0.1:8080", api_key=KEY) as client:
        result = client.ask(context_id, "What does it say about warranty?", strategy="sparkv")
        print(result.answer)
        print(result.breakdown.table())

See docs/edge.md.
"""

from sparkv.edge.ask import (STRATEGIES, AskError, AskResult, Breakdown, ask, build_instance,
                             chat_context, question_suffix)
from sparkv.edge.client import EdgeClient, ServerError, ServerUnavailable
from sparkv.edge.engine import Engine, EngineConfig, EngineError, LoadResult, TransferLog
from sparkv.edge.manifest import Manifest, ManifestError, tokens_digest
from sparkv.edge.shaper import LinkShaper

__all__ = [
    "STRATEGIES", "AskError", "AskResult", "Breakdown", "EdgeClient", "Engine", "EngineConfig",
    "EngineError", "LinkShaper", "LoadResult", "Manifest", "ManifestError", "ServerError",
    "ServerUnavailable", "TransferLog", "ask", "build_instance", "chat_context",
    "question_suffix", "tokens_digest",
]
