"""The decisions docs/wire-format.md and docs/rest-api.md state for the points an independent
decoder found open (issue 26): the exact row of a compressed frame, the placeholder frame, the
frame's H and N against the manifest's names, ``heads_per_group`` in a manifest, the xxh3_128
digest, delta varints, canonical base64, ``const_symbol`` with Huffman coding, the order of the
manifest's chunks, ``bits_per_value``, the manifest's ``frame_version`` and the order in which the
decoder applies its checks. (Float16 NaN payloads: tests/test_codec_vectors.py.)"""

from __future__ import annotations

import base64
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from sparkv.codec import (AXIS_TOKEN, CODING_CONSTANT, CodecError, KVChunk, decode, encode,
                          peek_header)
from sparkv.codec.frame import VERSION
from sparkv.layout import ChunkGeometry, KVChunkId
from sparkv.protocol import Manifest, ManifestError, checksum, etag_of
from sparkv.protocol.kept import MAX_VARINT_BYTES, decode_kept, encode_kept
from sparkv.protocol.manifest import KeptInfo
from sparkv.server.encoder import PressedContext, kept_rows

ROOT = Path(__file__).resolve().parents[1]
WIRE_DOC = (ROOT / "docs" / "wire-format.md").read_text()
REST_DOC = (ROOT / "docs" / "rest-api.md").read_text()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


# ---- base64 and varints of the kept positions ---------------------------------------------------
def test_positions_must_be_canonical_base64():
    """``BR==`` and ``BQ==`` both decode to ``05`` with a lenient decoder: only ``BQ==`` (zero
    trailing bits) is accepted. (Before issue 26 the decoder took ``BR==`` as ``BQ==``.)"""
    assert [p.tolist() for p in decode_kept([2], "bitmap", "BQ==", 8)] == [[0, 2]]
    for text in ("BR==", "BX==", "AAF=", "AAH="):  # 05, 05, 00 01, 00 01 with stray low bits
        with pytest.raises(ValueError, match="canonical base64"):
            decode_kept([0], "bitmap", text, 16)
    for text in ("BQ", "BQ=", "B Q==", "BQ==\n", "-_=="):  # unpadded, whitespace, url alphabet
        with pytest.raises(ValueError, match="base64"):
            decode_kept([2], "bitmap", text, 8)


def test_delta_varints_are_short_and_shortest():
    # canonical: 128 (80 01), then a gap of 0
    assert [p.tolist() for p in decode_kept([2], "delta", b64(bytes([0x80, 0x01, 0x00])),
                                            200)] == [[128, 129]]
    # overlong: 0 as 80 00, 5 as 85 00 or 85 80 00 (accepted before issue 26)
    for raw in (bytes([0x80, 0x00]), bytes([0x85, 0x00]), bytes([0x85, 0x80, 0x00])):
        with pytest.raises(ValueError, match="overlong"):
            decode_kept([1], "delta", b64(raw), 100)
    # longer than MAX_VARINT_BYTES: refused whatever it encodes (6 were read before)
    six = bytes([0x85] + [0x80] * (MAX_VARINT_BYTES - 1) + [0x01])
    with pytest.raises(ValueError, match=f"longer than {MAX_VARINT_BYTES} bytes"):
        decode_kept([1], "delta", b64(six), 100)
    endless = bytes([0xFF] * 64)
    with pytest.raises(ValueError, match="longer than"):
        decode_kept([1], "delta", b64(endless), 100)
    # five bytes are allowed by length; the value then has to fit the chunk
    five = bytes([0xFF] * (MAX_VARINT_BYTES - 1) + [0x0F])
    with pytest.raises(ValueError, match="past the chunk"):
        decode_kept([1], "delta", b64(five), 100)
    # the encoder writes shortest varints of at most the limit's bytes
    counts, coding, text = encode_kept([np.array([0, 300, 60000])], 0, 65536)
    assert coding == "delta" and base64.b64decode(text) == bytes([0, 0xAB, 0x02, 0xB3, 0xD2,
                                                                  0x03])


# ---- digests ------------------------------------------------------------------------------------
def test_xxh3_128_seed_and_hex_order():
    """Seed 0; the hex is the 128-bit digest most significant digit first (the canonical XXH128
    form: high 64 bits, then low 64). The empty input's digest is xxHash's own test vector."""
    assert checksum(b"") == "xxh3_128:99aa06d3014798d86001c324468d497f"
    data = b"SPKV"
    want = xxhash.xxh3_128_intdigest(data, seed=0)
    assert checksum(data) == f"xxh3_128:{want:032x}"
    high, low = want >> 64, want & (2**64 - 1)
    assert checksum(data).endswith(f"{high:016x}{low:016x}")
    assert etag_of(checksum(data)) == f'"{want:032x}"'


# ---- compressed frames: the exact row and the placeholder ----------------------------------------
def _pressed(keep: list[list[int]], n: int = 16, d: int = 4, dtype=torch.float32):
    """One layer, ``len(keep)`` KV heads in one group, one token chunk of ``n`` tokens."""
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(1, len(keep), n, d, generator=gen).to(dtype)
    v = torch.randn(1, len(keep), n, d, generator=gen).to(dtype)
    geo = ChunkGeometry(n, n, 1, len(keep), d)
    pressed = PressedContext([(k, v)], [[torch.tensor(p, dtype=torch.long) for p in keep]], {})
    return pressed, geo, k, v


def _frame(pressed, geo, level: str) -> bytes:
    cid = KVChunkId(0, 0, 0)
    _, k, v = kept_rows(pressed, geo, cid)
    return encode(KVChunk(cid, 0, k, v, 1), level)


def test_compressed_frame_exact_row_is_the_first_row_not_the_sink():
    """In chunk 0 the frame's first ``E`` rows are exact, whatever positions they hold: head 0
    does not keep the sink (position 0), so its first kept row (position 3) is exact, and head 1's
    sink row (frame row 2) is quantized like any other."""
    pressed, geo, k, v = _pressed([[3, 5], [0, 4]])
    frame = _frame(pressed, geo, "q4")
    hdr = peek_header(frame)
    assert hdr.shape == (1, 4, 4) and hdr.token_start == 0
    assert hdr.k.exact_tokens == hdr.v.exact_tokens == 1
    out = decode(frame)
    assert torch.equal(out.k[0, 0], k[0, 0, 3]) and torch.equal(out.v[0, 0], v[0, 0, 3])
    assert not torch.equal(out.k[0, 2], k[0, 1, 0])  # head 1's sink: quantized (4 bits)


@pytest.mark.parametrize("level", ["raw", "q8", "q5", "q2"])
@pytest.mark.parametrize("t", [0, 1])
def test_placeholder_frame_of_a_chunk_that_keeps_nothing(level, t):
    """``sum(counts) = 0``: the frame is ``[1, 1, D]`` zeros (H = 1, N = 1) at the chunk's
    ``token_start``; in chunk 0 a fully exact tensor, elsewhere a constant one (min 0, step 0,
    const_symbol 0). A decoder ignores its values; ``kept.frame_rows`` is 1."""
    n, d = 16, 4
    k = torch.randn(1, 2, 2 * n, d, generator=torch.Generator().manual_seed(2))
    geo = ChunkGeometry(2 * n, n, 1, 2, d)
    keep = [[20], [21]] if t == 0 else [[3], [4]]  # the other chunk keeps everything
    pressed = PressedContext([(k, k.clone())], [[torch.tensor(p) for p in keep]], {})
    cid = KVChunkId(t, 0, 0)
    pos, kk, vv = kept_rows(pressed, geo, cid)
    counts = [len(p) for p in pos]
    assert counts == [0, 0]
    frame = encode(KVChunk(cid, geo.token_range(t)[0], kk, vv, 1), level)
    hdr = peek_header(frame)
    assert (hdr.num_heads, hdr.num_tokens, hdr.head_dim) == (1, 1, d)
    assert hdr.token_start == n * t
    out = decode(frame)
    assert not out.k.any() and not out.v.any()
    if level == "raw":  # header, two zero tensors of 16 bytes, checksum
        assert len(frame) == 64 + 2 * 16 + 8 and not any(frame[64:96])
    elif t == 0:  # the sink row: a fully exact tensor
        assert hdr.k.exact_tokens == 1 and hdr.k.coding == CODING_CONSTANT
        assert hdr.k.mins is None and hdr.header_len == 64
    else:
        assert hdr.k.exact_tokens == 0 and hdr.k.coding == CODING_CONSTANT
        assert hdr.k.const_symbol == 0 and not hdr.k.mins.any() and not hdr.k.steps.any()
    _, coding, text = encode_kept(pos, n * t, n)
    assert KeptInfo(counts=counts, coding=coding, positions=text).frame_rows == 1


# ---- const_symbol with Huffman coding -----------------------------------------------------------
def _resum(frame: bytes | bytearray) -> bytes:
    body = bytes(frame[:-8])
    return body + struct.pack("<Q", xxhash.xxh64_intdigest(body))


def _q5_frame() -> bytes:
    """Example 2 of docs/wire-format.md (4 bytes of header padding at 0x124-0x127)."""
    n, d = torch.meshgrid(torch.arange(20), torch.arange(8), indexing="ij")
    k = (((5 * n + 2 * d) % 23 - 11) / 8).float()[None]
    v = (((3 * n * d + n + 7 * d) % 19 - 9) / 16).float()[None]
    frame = encode(KVChunk(KVChunkId(0, 10, 2), 0, k, v, 30), "q5", v_axis=AXIS_TOKEN)
    assert len(frame) == 500 and peek_header(frame).header_len == 0x128
    return frame


def test_const_symbol_must_be_zero_with_huffman_coding():
    frame = bytearray(_q5_frame())
    assert frame[40 + 3] == 1  # K coding: Huffman
    frame[40 + 6] = 1
    with pytest.raises(CodecError, match="const_symbol must be 0 with Huffman"):
        decode(_resum(frame))


# ---- the order of checks ------------------------------------------------------------------------
def _raw_frame() -> bytes:
    """Example 1 of docs/wire-format.md."""
    k = torch.tensor([[[1.0, 2.0]]])
    v = torch.tensor([[[-1.0, 0.5]]])
    return encode(KVChunk(KVChunkId(0, 0, 0), 0, k, v, 0), "raw")


def _set(frame: bytes, edits: dict[int, int], resum: bool = True, extra: bytes = b"") -> bytes:
    out = bytearray(frame)
    for at, value in edits.items():
        out[at] = value
    out = bytes(_resum(out) if resum else out)
    return out + extra


def _twice_broken():
    raw, q5 = _raw_frame(), _q5_frame()
    hl = peek_header(q5).header_len
    return [  # (frame failing two checks, the first one's message), in the documented order
        ("short+magic", b"XXXX" + raw[4:40], "frame truncated"),
        ("magic+version", _set(raw, {0: 0x58, 4: 1}), "bad magic"),
        ("version+dtype", _set(raw, {4: 1, 5: 9}), "unsupported frame version 1"),
        ("dtype+level", _set(raw, {5: 9, 6: 7}), "unknown dtype code 9"),
        ("level+flags", _set(raw, {6: 7, 7: 1}), "unknown level code 7"),
        ("flags+header_len", _set(raw, {7: 1, 8: 65}), "reserved header fields"),
        ("header_len+shape", _set(raw, {8: 65, 28: 0}), "bad header length 65"),
        ("shape+layer", _set(q5, {28: 0, 20: 40}), "empty chunk shape"),
        ("layer+K", _set(q5, {20: 40, 47: 1}), "layer 40 out of range"),
        ("K+V", _set(q5, {47: 1, 59: 1}), "K: reserved descriptor byte"),
        ("K coding+K predictor", _set(q5, {43: 3, 44: 2}), "K: unknown coding 3"),
        ("V+padding", _set(q5, {59: 1, hl - 1: 1}), "V: reserved descriptor byte"),
        ("padding+payload_len", _set(q5, {hl - 1: 1, 12: 0}), "header padding is not zero"),
        ("payload_len+checksum", _set(raw, {12: 8}, resum=False), "payload length 8"),
        ("length+checksum", _set(raw, {70: 0xAA}, resum=False, extra=b"\0"),
         "frame is 89 bytes"),
        ("checksum+stream", _set(q5, {hl + 40: q5[hl + 40] ^ 0xFF}, resum=False),
         "checksum mismatch"),
    ]


@pytest.mark.parametrize("name,frame,first", _twice_broken(), ids=[c[0] for c in _twice_broken()])
def test_a_frame_failing_two_checks_reports_the_first(name, frame, first):
    with pytest.raises(CodecError, match=re.escape(first)):
        decode(frame)


def test_the_documented_order_lists_every_check_once():
    m = re.search(r"<!-- check-order:begin -->\n(.*?)<!-- check-order:end -->", WIRE_DOC, re.S)
    assert m, "docs/wire-format.md lost its check-order list"
    steps = [int(x) for x in re.findall(r"^(\d+)\. ", m.group(1), re.M)]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 15
    order = m.group(1)
    fragments = ["truncated", "magic", "version", "dtype", "level", "flags", "header_len",
                 "H, N, D", "layer", "K tensor", "V tensor", "header padding", "payload_len",
                 "frame length", "checksum", "Huffman streams"]
    at = [order.find(f) for f in fragments]
    assert all(x >= 0 for x in at) and at == sorted(at), list(zip(fragments, at))


# ---- the manifest -------------------------------------------------------------------------------
def _manifest_doc() -> dict:
    g = ChunkGeometry(40, 16, 2, 3, 8)
    tq = {"bits": 5, "coding": "huffman"}
    chunks = []
    for c in g.chunk_ids():
        start, end = g.token_range(c.t)
        e = {"bytes": 100, "checksum": checksum(bytes(c)), "frame_bytes": 100,
             "bits_per_value": 1.0, "k": tq, "v": tq}
        chunks.append({"t": c.t, "l": c.l, "g": c.g, "token_start": start,
                       "num_tokens": end - start, "levels": {"q5": e}})
    m = Manifest.build(context_id="b" * 32, model={"name": "m", "fingerprint": "f"},
                       token_ids=list(range(40)), geometry=g, levels=["q5"],
                       frame_version=VERSION, chunks=chunks, created_unix=1.0)
    return json.loads(m.to_json())


def test_manifest_heads_per_group_is_resolved_never_zero():
    doc = _manifest_doc()
    assert doc["geometry"]["heads_per_group"] == 3  # built from heads_per_group=0: all heads
    doc["geometry"]["heads_per_group"] = 0
    with pytest.raises(ManifestError, match="heads_per_group"):
        Manifest.parse(json.dumps(doc))


def test_manifest_chunk_order_is_not_a_promise():
    """sparkv writes chunks token-major, (t, l, g) ascending; a reader looks them up by
    (t, l, g): any order parses to the same index."""
    doc = _manifest_doc()
    ids = [(c["t"], c["l"], c["g"]) for c in doc["chunks"]]
    assert ids == sorted(ids)
    m = Manifest.parse(json.dumps(doc))
    doc["chunks"].reverse()
    back = Manifest.parse(json.dumps(doc))
    assert back.index == m.index and back.sizes == m.sizes


def test_rest_doc_manifest_example_has_the_current_frame_version():
    versions = re.findall(r'"frame_version": (\d+)', REST_DOC)
    assert versions and all(int(v) == VERSION for v in versions)


@pytest.fixture(scope="module")
def compressed_manifest(tiny_llama, tmp_path_factory):
    """A real compressed context of the tiny Llama (encode_context, a file store)."""
    from sparkv.presses import canonical_spec
    from sparkv.server.encoder import ContextSpec, derive_context_id, encode_context
    from sparkv.server.models import ModelEntry
    from sparkv.server.stores import open_store

    store = open_store(f"file://{tmp_path_factory.mktemp('wire-spec')}/store")
    entry = ModelEntry.from_loaded("tiny", tiny_llama, 4096)
    ids = tuple(int(x) for x in torch.randint(1, 128, (100,), generator=torch.Generator()
                                               .manual_seed(3)))
    spec = ContextSpec("t", "tiny", ids, 32, ("raw", "q8", "q4"), 0, False,
                       canonical_spec("snapkv:0.25"))
    cid = derive_context_id(spec, entry.fingerprint, entry.tokenizer_id)
    data, _ = encode_context(entry, spec, cid, store.chunks)
    return Manifest.parse(data), store, spec


def test_bits_per_value_of_a_compressed_manifest(compressed_manifest):
    """``bits_per_value = 8 * frame_bytes / (2 * H * N * D)`` with the frame's own H and N:
    in a compressed context H = 1 and N = kept.frame_rows, not the chunk's heads and tokens."""
    m, store, spec = compressed_manifest
    g = m.geometry
    assert m.compressed and g.heads_per_group == 2
    differs = 0
    from sparkv.server.stores import ChunkKey

    for c in m.chunks:
        for lv, e in c.levels.items():
            hdr = peek_header(store.chunks.get(spec.tenant, m.context_id,
                                              ChunkKey(c.t, c.l, c.g, lv)))
            assert (hdr.num_heads, hdr.num_tokens, hdr.head_dim) == (1, c.kept.frame_rows,
                                                                       g.head_dim)
            assert hdr.token_start == c.token_start
            want = round(8 * e.frame_bytes / (2 * 1 * c.kept.frame_rows * g.head_dim), 4)
            assert e.bits_per_value == want, (c.id, lv)
            full = 8 * e.frame_bytes / (2 * g.heads_per_group * c.num_tokens * g.head_dim)
            differs += abs(full - e.bits_per_value) > 1e-3
    assert differs  # the chunk-shape formula would be wrong here


def test_compressed_manifest_is_token_major_and_canonical(compressed_manifest):
    m, _, _ = compressed_manifest
    ids = [(c.t, c.l, c.g) for c in m.chunks]
    assert ids == sorted(ids)
    for c in m.chunks:
        assert b64(base64.b64decode(c.kept.positions)) == c.kept.positions
    doc = json.loads(m.to_json())
    c = next(c for c in doc["chunks"] if c["kept"]["positions"].endswith("="))
    text = c["kept"]["positions"]
    i = len(text.rstrip("=")) - 1
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    c["kept"]["positions"] = text[:i] + alphabet[alphabet.index(text[i]) + 1] + text[i + 1:]
    with pytest.raises(ManifestError, match="canonical base64"):
        Manifest.parse(json.dumps(doc))
