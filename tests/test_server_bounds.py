"""The server's byte bounds as units (no server process): the frame cap's size formula against
real frames, the stream response cap, the pieces a stream is sent in, strict ``Bearer`` parsing."""

from __future__ import annotations

import pytest
import torch

from sparkv.codec import KVChunk, encode
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.protocol import split_records
from sparkv.protocol.crypto import FrameCipher, new_key
from sparkv.protocol.errors import ApiError
from sparkv.server.encoder import frame_cap_error, largest_frame_bytes
from sparkv.server.middleware import bearer_key
from sparkv.server.stores import ChunkKey
from sparkv.server.stream_request import ResponseCap
from sparkv.server.streaming import SEND_PIECE_BYTES, record_pieces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("level", ["raw", "q8", "q4", "q2"])
def test_the_largest_frame_bounds_every_level(dtype, level):
    geo = ChunkGeometry(num_tokens=100, chunk_tokens=64, num_layers=2, num_kv_heads=2,
                        head_dim=16)
    torch.manual_seed(0)
    k, v = (torch.randn(2, 64, 16).to(dtype) for _ in range(2))
    frame = encode(KVChunk(KVChunkId(0, 1, 0), 0, k, v, 2), level)
    bound = largest_frame_bytes(geo, dtype.itemsize, encrypted=False)
    assert len(frame) <= bound
    if level == "raw":
        assert len(frame) == bound  # exact for the raw frame of the longest chunk
        sealed = FrameCipher(new_key(), "a" * 32).seal(frame, 0, 1, 0, "raw")
        assert len(sealed) == largest_frame_bytes(geo, dtype.itemsize, encrypted=True)
    assert frame_cap_error(geo, dtype.itemsize, False, bound) is None
    message, size = frame_cap_error(geo, dtype.itemsize, False, bound - 1)
    assert size == bound and "chunk_tokens" in message


def test_the_response_cap_is_absolute_and_proportionate():
    cap = ResponseCap(max_bytes=10_000, amplification=10)
    cap.check(total=500, body_bytes=50, largest=100)  # 10 bytes per body byte
    with pytest.raises(ApiError) as e:
        cap.check(total=501, body_bytes=50, largest=100)
    assert (e.value.status, e.value.code, e.value.details["limit"]) == (413, "response_too_large",
                                                                      500)
    cap.check(total=900, body_bytes=20, largest=900)  # one frame is always allowed
    with pytest.raises(ApiError) as e:
        cap.check(total=10_001, body_bytes=5_000, largest=100)
    assert e.value.details["limit"] == 10_000


@pytest.mark.parametrize("sizes", [[10, 20, 30], [SEND_PIECE_BYTES - 4], [SEND_PIECE_BYTES],
                                   [3 * SEND_PIECE_BYTES + 7, 5, SEND_PIECE_BYTES * 2], [0, 1]])
def test_a_batch_is_sent_in_bounded_pieces(sizes):
    frames = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    batch = [(ChunkKey(i, 0, 0, "raw"), n) for i, n in enumerate(sizes)]
    pieces = list(record_pieces(batch, frames))
    assert all(0 < len(p) <= SEND_PIECE_BYTES for p in pieces)
    assert split_records(b"".join(pieces), sizes) == frames


def test_bearer_is_one_space_and_a_key():
    assert bearer_key("Bearer skv_abc") == "skv_abc"
    assert bearer_key("bearer skv_abc") == "skv_abc"
    for value in ("Bearer  skv_abc", "Bearer\tskv_abc", "Bearer skv_abc x", "Bearer ", "Bearer",
                  "Bearerskv_abc", "Basic skv_abc", "Bearer skv_\x01abc", "Bearer skv_\u00e9"):
        assert bearer_key(value) is None, value
