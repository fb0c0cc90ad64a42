"""Frames encoded on x86_64 decode bit for bit on any machine (aarch64 too): tests/data/x86_frames/
holds frames written by ``sparkv.codec.encode`` on x86_64 (every level, three dtypes, one and four
Huffman streams) and, in ``index.json``, the SHA-256 of each frame and of its decoded K and V
bytes. The decoder (numba's Huffman lanes, dequantization) must give those bytes exactly, serial
and parallel; the encoder, given the same inputs (built from integers, the same on every machine),
must write the same frames.

Regenerate (on x86_64 only; the point is that they were made there):
``PYTHONPATH=$PWD .venv/bin/python tests/test_codec_x86_frames.py --write``.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkv.codec import KVChunk, decode, decode_into, encode
from sparkv.layout import KVChunkId

HERE = Path(__file__).resolve().parent / "data" / "x86_frames"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
#: (name, level, dtype, heads, tokens, head_dim, layer, streams)
CASES = [
    ("raw-f32", "raw", "float32", 2, 16, 32, 0, None),
    ("raw-bf16", "raw", "bfloat16", 2, 16, 32, 3, None),
    ("q8-f16", "q8", "float16", 3, 48, 64, 1, None),
    ("q6-f32", "q6", "float32", 3, 48, 64, 5, 4),
    ("q5-f32", "q5", "float32", 3, 64, 64, 2, None),
    ("q5-f32-4streams", "q5", "float32", 3, 64, 64, 2, 4),
    ("q5-bf16-4streams", "q5", "bfloat16", 3, 64, 64, 7, 4),
    ("q4-f16", "q4", "float16", 3, 48, 64, 10, 2),
    ("q3-f32", "q3", "float32", 3, 48, 64, 20, 4),
    ("q2-bf16", "q2", "bfloat16", 3, 48, 64, 29, 3),
]
NUM_LAYERS = 30


def chunk_for(heads: int, tokens: int, dim: int, layer: int, dtype: str, t: int = 1) -> KVChunk:
    """A KV-like chunk built from integers only (the same bytes on every machine): values in
    [-10, 10] in steps of 1/1000, a few outlier channels x8 in K."""
    n = heads * tokens * dim
    i = np.arange(2 * n, dtype=np.uint64) + np.uint64(1000 * layer + 7)
    h = (i * np.uint64(2654435761)) % np.uint64(1 << 32)
    vals = ((h % np.uint64(20001)).astype(np.int64) - 10000).astype(np.float64) / 1000.0
    k = vals[:n].reshape(heads, tokens, dim)
    k[:, :, ::9] *= 8.0
    v = vals[n:].reshape(heads, tokens, dim)
    to = DTYPES[dtype]
    return KVChunk(KVChunkId(t, layer, 0), t * tokens,
                   torch.from_numpy(k.astype(np.float32)).to(to),
                   torch.from_numpy(v.astype(np.float32)).to(to), NUM_LAYERS)


def _frame_for(case: tuple) -> bytes:
    _, level, dtype, heads, tokens, dim, layer, streams = case
    return encode(chunk_for(heads, tokens, dim, layer, dtype), level, streams=streams)


def tensor_digest(x: torch.Tensor) -> str:
    x = x.contiguous()
    if x.dtype in (torch.bfloat16, torch.float16):
        x = x.view(torch.int16)
    return hashlib.sha256(x.numpy().tobytes()).hexdigest()


def _index() -> dict:
    return json.loads((HERE / "index.json").read_text())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_x86_frames_decode_bit_for_bit(case):
    meta = _index()["frames"][case[0]]
    frame = (HERE / f"{case[0]}.skvf").read_bytes()
    assert hashlib.sha256(frame).hexdigest() == meta["frame_sha256"]
    for parallel in (False, True):
        got = decode(frame, parallel=parallel)
        assert str(got.k.dtype).removeprefix("torch.") == case[2]
        assert tensor_digest(got.k) == meta["k_sha256"], (case[0], parallel)
        assert tensor_digest(got.v) == meta["v_sha256"], (case[0], parallel)
    k_out = torch.empty_like(got.k)
    v_out = torch.empty_like(got.v)
    decode_into(frame, k_out, v_out)
    assert (tensor_digest(k_out), tensor_digest(v_out)) == (meta["k_sha256"], meta["v_sha256"])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_this_machine_encodes_the_same_frames(case):
    assert _frame_for(case) == (HERE / f"{case[0]}.skvf").read_bytes(), case[0]


def write_fixtures() -> None:
    """Writes the frames and index.json (run on x86_64)."""
    if platform.machine() != "x86_64":
        raise SystemExit("the fixtures are x86_64's frames: write them on x86_64")
    HERE.mkdir(parents=True, exist_ok=True)
    frames = {}
    for case in CASES:
        frame = _frame_for(case)
        (HERE / f"{case[0]}.skvf").write_bytes(frame)
        out = decode(frame)
        frames[case[0]] = {"level": case[1], "dtype": case[2], "bytes": len(frame),
                           "frame_sha256": hashlib.sha256(frame).hexdigest(),
                           "k_sha256": tensor_digest(out.k), "v_sha256": tensor_digest(out.v)}
    doc = {"machine": platform.machine(), "torch": torch.__version__, "numpy": np.__version__,
           "frames": frames}
    (HERE / "index.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_fixtures()
    else:
        raise SystemExit(__doc__)
