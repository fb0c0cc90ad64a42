"""The device side of sparkv, one direction from the wire to the answer:

    protocol (manifest, records)  ->  client (REST)  ->  transport (ChunkSource; HTTP)
        ->  engine (stream + compute + decode under the controller)  ->  session (ask)

    from sparkv.edge import AskOptions, EdgeSession
    with EdgeSession.connect("http://127.0.0.1:8080", api_key=KEY) as session:
        result = session.ask(context_id, "What does it say about warranty?",
                             AskOptions(strategy="sparkv"))
        print(result.text)
        print(result.breakdown.table())

See docs/edge.md.
"""

from typing import TYPE_CHECKING

from sparkv.lazy import lazy_exports

if TYPE_CHECKING:
    from sparkv.edge.answer import AskResult, Breakdown
    from sparkv.edge.client import EdgeClient
    from sparkv.edge.engine import Engine, EngineConfig, EngineError
    from sparkv.edge.http_source import HttpChunkSource
    from sparkv.edge.options import AskOptions
    from sparkv.edge.planning import STRATEGIES, AskError, build_instance
    from sparkv.edge.prompts import chat_context, question_suffix
    from sparkv.edge.results import LoadResult, TransferLog, TransferStatus
    from sparkv.edge.session import EdgeSession, Priors
    from sparkv.edge.shaper import LinkShaper
    from sparkv.edge.transport import ChunkSource, ChunkStream, FetchItem, SourceError
    from sparkv.protocol import ApiError, Manifest, ManifestError, ServerUnavailable

#: name -> the module that defines it (imported on first use: :mod:`sparkv.lazy`)
_EXPORTS: dict[str, str] = {
    "AskResult": "sparkv.edge.answer",
    "Breakdown": "sparkv.edge.answer",
    "EdgeClient": "sparkv.edge.client",
    "Engine": "sparkv.edge.engine",
    "EngineConfig": "sparkv.edge.engine",
    "EngineError": "sparkv.edge.engine",
    "HttpChunkSource": "sparkv.edge.http_source",
    "AskOptions": "sparkv.edge.options",
    "STRATEGIES": "sparkv.edge.planning",
    "AskError": "sparkv.edge.planning",
    "build_instance": "sparkv.edge.planning",
    "chat_context": "sparkv.edge.prompts",
    "question_suffix": "sparkv.edge.prompts",
    "LoadResult": "sparkv.edge.results",
    "TransferLog": "sparkv.edge.results",
    "TransferStatus": "sparkv.edge.results",
    "EdgeSession": "sparkv.edge.session",
    "Priors": "sparkv.edge.session",
    "LinkShaper": "sparkv.edge.shaper",
    "ChunkSource": "sparkv.edge.transport",
    "ChunkStream": "sparkv.edge.transport",
    "FetchItem": "sparkv.edge.transport",
    "SourceError": "sparkv.edge.transport",
    "ApiError": "sparkv.protocol",
    "Manifest": "sparkv.protocol",
    "ManifestError": "sparkv.protocol",
    "ServerUnavailable": "sparkv.protocol",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = [
    "STRATEGIES", "ApiError", "AskError", "AskOptions", "AskResult", "Breakdown", "ChunkSource",
    "ChunkStream", "EdgeClient", "EdgeSession", "Engine", "EngineConfig", "EngineError",
    "FetchItem", "HttpChunkSource", "LinkShaper", "LoadResult", "Manifest", "ManifestError",
    "Priors", "ServerUnavailable", "SourceError", "TransferLog", "TransferStatus",
    "build_instance", "chat_context", "question_suffix",
]
