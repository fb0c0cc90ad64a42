"""The wire contract between the server and the edge, defined once (docs/wire-format.md,
docs/rest-api.md).

* :mod:`~sparkv.protocol.manifest`: :class:`Manifest`, the typed description of a stored context
  that the encoder builds, the server validates and serves, the edge parses and OpenAPI shows;
* :mod:`~sparkv.protocol.stream`: the ``u32 | frame`` stream record, written by the server and read
  incrementally by the edge (:class:`RecordReader`);
* :mod:`~sparkv.protocol.crypto`: AES-256-GCM frame encryption (:class:`FrameCipher`);
* :mod:`~sparkv.protocol.digests`: frame checksums (the ETags) and the token-id digest;
* :mod:`~sparkv.protocol.errors`: the shared errors and the one JSON error shape.

The codec frame itself (the bytes inside a record) is :mod:`sparkv.codec`'s.
"""

from sparkv.protocol.crypto import FrameCipher, key_from_text, key_to_text, new_key
from sparkv.protocol.digests import (checksum, etag_of, tokens_bytes, tokens_digest,
                                     tokens_from_bytes, verify)
from sparkv.protocol.errors import (ApiError, DecryptionError, ErrorResponse, ManifestError,
                                    ProtocolError, RecordError, ServerUnavailable, error_body)
from sparkv.protocol.manifest import (MANIFEST_FORMAT, ChunkEntry, EncryptionInfo, GeometryInfo,
                                      KeptInfo, LevelEntry, Manifest, ModelInfo, PressInfo,
                                      TensorQuant, kept_entry)
from sparkv.protocol.stream import (FRAME_MEDIA_TYPE, STREAM_MEDIA_TYPE, RecordPiece,
                                    RecordReader, encode_records, record_header, split_records,
                                    stream_length)

__all__ = [
    "FrameCipher", "key_from_text", "key_to_text", "new_key", "checksum", "etag_of",
    "tokens_bytes", "tokens_digest", "tokens_from_bytes", "verify", "ApiError",
    "DecryptionError", "ErrorResponse", "ManifestError", "ProtocolError", "RecordError",
    "ServerUnavailable", "error_body", "MANIFEST_FORMAT", "ChunkEntry", "EncryptionInfo",
    "GeometryInfo", "KeptInfo", "LevelEntry", "Manifest", "PressInfo", "kept_entry", "ModelInfo", "TensorQuant", "FRAME_MEDIA_TYPE",
    "STREAM_MEDIA_TYPE", "RecordPiece", "RecordReader", "encode_records", "record_header",
    "split_records", "stream_length",
]
