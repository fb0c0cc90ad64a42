"""Unit tests of the server's pieces that need no running server: HTTP conditionals and ranges,
configuration, content-derived ids, frame encryption, frame descriptions, the bench's stream
checker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkv.codec import KVChunk, decode, encode, peek_header
from sparkv.layout import KVChunkId
from sparkv.server.config import hash_api_key, load_settings, new_api_key
from sparkv.protocol.crypto import (DecryptionError, FrameCipher, key_from_text, key_to_text,
                                  new_key)
from sparkv.protocol.digests import checksum, etag_of
from sparkv.server.encoder import (ContextSpec, canonical_levels, derive_context_id,
                                   describe_frame)
from sparkv.server.errors import ApiError, ConfigError
from sparkv.server.http import if_range_allows, none_match, parse_range


# --- HTTP ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("header,expected", [
    (None, None), ("", None), ("bytes=0-9", (0, 10)), ("bytes=5-", (5, 100)),
    ("bytes=-10", (90, 100)), ("bytes=-1000", (0, 100)), ("bytes=90-200", (90, 100)),
    ("bytes=0-0", (0, 1)), ("bytes=99-99", (99, 100)), (" bytes = 1-2", (1, 3)),
    ("bytes=0-1,4-5", None), ("lines=0-1", None), ("bytes=5-2", None), ("bytes=a-b", None),
    ("bytes=", None), ("bytes=5", None), ("bytes=-", None), ("bytes=--1", None),
    ("bytes=1.5-2", None),
])
def test_parse_range(header, expected):
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=100-200", "bytes=-0"])
def test_unsatisfiable_range(header):
    with pytest.raises(ApiError) as e:
        parse_range(header, 100)
    assert e.value.status == 416 and e.value.headers["Content-Range"] == "bytes */100"


def test_etag_matching():
    tag = '"abc"'
    assert none_match('"abc"', tag) and none_match('W/"abc"', tag) and none_match("*", tag)
    assert none_match('"x", "abc"', tag) and not none_match('"x"', tag) and not none_match(None, tag)
    assert if_range_allows(None, tag) and if_range_allows('"abc"', tag)
    assert not if_range_allows('W/"abc"', tag) and not if_range_allows("Tue, 1 Jan 2030", tag)
    assert etag_of(checksum(b"hello")) == '"' + checksum(b"hello").split(":")[1] + '"'


# --- configuration -------------------------------------------------------------------------------
def test_config_rejects_plain_keys_unknown_fields_and_bad_names(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tenants:\n  a:\n    keys: [skv_plain_key]\n")
    with pytest.raises(ConfigError, match="hashes"):
        load_settings(cfg)
    cfg.write_text("tenantz: {}\n")
    with pytest.raises(ConfigError, match="tenantz"):
        load_settings(cfg)
    h = hash_api_key(new_api_key())
    cfg.write_text(f"tenants:\n  a:\n    keys: ['{h}']\n  b:\n    keys: ['{h}']\n")
    with pytest.raises(ConfigError, match="same key"):
        load_settings(cfg)
    cfg.write_text(f"tenants:\n  '../x':\n    keys: ['{h}']\n")
    with pytest.raises(ConfigError, match="tenant name"):
        load_settings(cfg)
    cfg.write_text("default_levels: [q9]\n")
    with pytest.raises(ConfigError, match="q9"):
        load_settings(cfg)
    cfg.write_text("default_model: other\n")
    with pytest.raises(ConfigError, match="default_model"):
        load_settings(cfg)
    cfg.write_text(": not yaml :\n  - [")
    with pytest.raises(ConfigError, match="YAML"):
        load_settings(cfg)
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml")


def test_config_overrides_and_key_index(tmp_path):
    key = new_api_key()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"store: file:///a\ntenants:\n  t1:\n    keys: ['{hash_api_key(key)}']\n")
    s = load_settings(cfg, store="redis://h:1/0", log_level=None)
    assert s.store == "redis://h:1/0" and s.log_level == "info"
    assert s.key_index() == {hash_api_key(key): "t1"}
    assert key.startswith("skv_") and len(key) > 40 and new_api_key() != key


# --- context ids ---------------------------------------------------------------------------------
def spec(**kw):
    base = dict(tenant="a", model="m", token_ids=(1, 2, 3), chunk_tokens=64,
                levels=("q8", "q5"), heads_per_group=0, encrypted=False)
    base.update(kw)
    return ContextSpec(**base)


def test_context_id_is_content_derived():
    cid = derive_context_id(spec(), "fp", "tok")
    assert len(cid) == 32 and int(cid, 16) >= 0
    assert derive_context_id(spec(), "fp", "tok") == cid
    for changed in (dict(tenant="b"), dict(token_ids=(1, 2, 4)), dict(token_ids=(1, 2)),
                    dict(chunk_tokens=32), dict(levels=("q8",)), dict(heads_per_group=1),
                    dict(encrypted=True)):
        assert derive_context_id(spec(**changed), "fp", "tok") != cid, changed
    assert derive_context_id(spec(), "fp2", "tok") != cid
    assert derive_context_id(spec(), "fp", "tok2") != cid
    assert ContextSpec.from_record(spec().to_record()) == spec()


def test_canonical_levels():
    assert canonical_levels(["q5", "raw", "q5", "q8"]) == ("raw", "q8", "q5")
    with pytest.raises(ValueError):
        canonical_levels(["q5", "nope"])
    with pytest.raises(ValueError):
        canonical_levels([])


# --- encryption ----------------------------------------------------------------------------------
def test_frame_cipher_roundtrip_and_binding():
    key = new_key()
    assert key_from_text(key_to_text(key)) == key and "=" not in key_to_text(key)
    c = FrameCipher(key, "ab" * 16)
    sealed = c.seal(b"frame bytes", 1, 2, 0, "q5")
    assert len(sealed) == len(b"frame bytes") + 28 and b"frame bytes" not in sealed
    assert c.open(sealed, 1, 2, 0, "q5") == b"frame bytes"
    assert c.seal(b"frame bytes", 1, 2, 0, "q5") != sealed  # fresh nonce
    for args in ((1, 2, 0, "q8"), (2, 2, 0, "q5"), (1, 2, 1, "q5")):
        with pytest.raises(DecryptionError):
            c.open(sealed, *args)
    with pytest.raises(DecryptionError):
        FrameCipher(key, "cd" * 16).open(sealed, 1, 2, 0, "q5")
    with pytest.raises(DecryptionError):
        FrameCipher(new_key(), "ab" * 16).open(sealed, 1, 2, 0, "q5")
    tampered = bytearray(sealed)
    tampered[20] ^= 1
    with pytest.raises(DecryptionError):
        c.open(bytes(tampered), 1, 2, 0, "q5")
    with pytest.raises(DecryptionError):
        c.open(b"short", 1, 2, 0, "q5")


# --- frame descriptions --------------------------------------------------------------------------
def _entropy(q: np.ndarray) -> float:
    p = np.bincount(q.reshape(-1)) / q.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


@pytest.mark.parametrize("level", ["q8", "q5", "q3"])
def test_describe_frame_recovers_the_quantized_symbols(level):
    from sparkv.codec import quant

    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 40, 16, generator=g)
    v = torch.randn(2, 40, 16, generator=g) * 0.1
    frame = encode(KVChunk(KVChunkId(1, 3, 0), 40, k, v, 8), level)
    d = describe_frame(frame)
    hdr = peek_header(frame)
    assert d["frame_bytes"] == len(frame)
    assert d["bits_per_value"] == pytest.approx(8 * len(frame) / hdr.num_values, abs=1e-3)
    for which, x, th in (("k", k, hdr.k), ("v", v, hdr.v)):
        info = d[which]
        assert info["bits"] == th.bits and info["exact_tokens"] == th.exact_tokens == 0
        # the entropy of the symbols the codec itself would produce from the original values
        xe = x.numpy()
        dec = decode(frame)
        xd = (dec.k if which == "k" else dec.v).numpy()
        m = th.mins[:, None, :] if th.axis == quant.AXIS_CHANNEL else th.mins[:, :, None]
        s = th.steps[:, None, :] if th.axis == quant.AXIS_CHANNEL else th.steps[:, :, None]
        q = np.rint((xd - m) / np.where(s > 0, s, 1)).astype(np.int64)
        assert np.all((q >= 0) & (q < 2 ** th.bits))
        # reconstruction from q is the decoded tensor (so q are the codec's symbols)
        assert np.allclose(m + q * s, xd, atol=1e-6)
        assert np.all(np.abs(xd - xe) <= s / 2 + 1e-5)  # and within half a step of the input
        assert info["entropy_bits_per_value"] == pytest.approx(_entropy(q), abs=1e-3)
    assert 0 < d["entropy_bits_per_value"] <= max(d["k"]["bits"], d["v"]["bits"])


def test_describe_raw_frame():
    k = torch.randn(1, 4, 8)
    frame = encode(KVChunk(KVChunkId(0, 0, 0), 0, k, k.clone(), 2), "raw")
    d = describe_frame(frame)
    assert d["entropy_bits_per_value"] is None and d["k"] == {"bits": 0, "coding": "plain"}
    assert d["dtype"] == "float32"


# --- the benchmark's stream checker --------------------------------------------------------------
def test_bench_frame_checker_across_chunk_boundaries():
    import struct

    from sparkv.bench.server import _FrameChecker

    sizes = [5, 1, 300, 7]
    body = b"".join(struct.pack("<I", n) + bytes([i]) * n for i, n in enumerate(sizes))
    for split in (1, 2, 3, 7, 64, len(body)):
        c = _FrameChecker(sizes)
        for i in range(0, len(body), split):
            c.feed(body[i:i + split])
        assert c.done(), split
    c = _FrameChecker([5, 2, 300, 7])  # a size out of order is caught
    c.feed(body)
    assert not c.done()
    c = _FrameChecker(sizes)
    c.feed(body[:-1])  # truncated
    assert not c.done()


# --- stream requests, stream slots, HTTP parse errors ---------------------------------------------
STREAM_DOCS = [
    {"chunks": [{"t": 0, "l": 1}]},
    {"chunks": [{"t": 0, "l": 1, "g": 2, "level": "raw"}, {"t": 3, "l": 0, "level": None}],
     "level": "q8"},
    {"chunks": [{"t": 2**31 - 1, "l": 0, "g": 0}]},
    {"chunks": [{"t": 1.0, "l": 2}]},          # JSON's integer 1.0: pydantic's path
    {"chunks": [{"t": 0, "l": 0}], "level": None},
    {"chunks": [{"t": -1, "l": 0}]}, {"chunks": [{"t": 2**31, "l": 0}]},
    {"chunks": [{"t": True, "l": 0}]}, {"chunks": [{"t": "1", "l": 0}]},
    {"chunks": [{"t": 1.5, "l": 0}]}, {"chunks": [{"l": 0}]}, {"chunks": [{"t": 0, "l": 0, "x": 1}]},
    {"chunks": [{"t": 0, "l": 0, "level": "q9"}]}, {"chunks": [{"t": 0, "l": 0, "level": 5}]},
    {"chunks": []}, {"chunks": "x"}, {"chunks": [[0, 0]]}, {"chunks": [{"t": 0, "l": 0}], "x": 1},
    {"chunks": [{"t": 0, "l": 0}], "level": ["raw"]}, {}, [], "x", None, 3,
]


@pytest.mark.parametrize("doc", STREAM_DOCS)
def test_stream_fast_path_agrees_with_the_schema(doc):
    from pydantic import ValidationError

    from sparkv.server.schemas import StreamRequest
    from sparkv.server.stream_request import _fast_items

    fast = _fast_items(doc)
    try:
        req = StreamRequest.model_validate(doc)
    except ValidationError:
        assert fast is None  # the fast path never accepts what the schema refuses
        return
    expected = [(it.t, it.l, it.g, it.level or req.level) for it in req.chunks]
    assert fast is None or fast == expected


def test_parse_stream_request_errors():
    import json

    from fastapi.exceptions import RequestValidationError

    from sparkv.server.stream_request import parse_stream_request

    ok = json.dumps({"chunks": [{"t": 1, "l": 2}], "level": "raw"}).encode()
    assert parse_stream_request(ok, "application/json; charset=utf-8", 10) == [(1, 2, 0, "raw")]
    assert parse_stream_request(ok, "application/vnd.x+json", 10) == [(1, 2, 0, "raw")]
    for body in (b"{nope", b'{"chunks": [', b"\xff\xfe\x00"):
        with pytest.raises(ApiError) as e:
            parse_stream_request(body, "application/json", 10)
        assert (e.value.status, e.value.code) == (400, "malformed_json")
    many = json.dumps({"chunks": [{"t": "not validated"}] * 11}).encode()
    with pytest.raises(ApiError) as e:
        parse_stream_request(many, "application/json", 10)
    assert (e.value.status, e.value.code, e.value.details["limit"]) == (400, "too_many_items", 10)
    for body, ctype in ((ok, "text/plain"), (ok, None), (b"", "application/json"),
                        (b'{"chunks": [{"t": -1, "l": 0}]}', "application/json")):
        with pytest.raises(RequestValidationError) as v:
            parse_stream_request(body, ctype, 10)
        assert v.value.errors()[0]["loc"][0] == "body"


def test_stream_batches_and_slots():
    from sparkv.server.metrics import ServerMetrics
    from sparkv.server.state import StreamSlots
    from sparkv.server.stores import ChunkKey
    from sparkv.server.stream_request import batches

    k = ChunkKey(0, 0, 0, "raw")
    assert [[s for _, s in b] for b in batches([(k, 3), (k, 3), (k, 5), (k, 1)], 6)] == \
        [[3, 3], [5, 1]]
    assert [[s for _, s in b] for b in batches([(k, 9), (k, 1)], 6)] == [[9], [1]]
    slots = StreamSlots(2, ServerMetrics())
    a, b = slots.acquire("alice"), slots.acquire("alice")
    other = slots.acquire("bob")
    with pytest.raises(ApiError) as e:
        slots.acquire("alice")
    assert (e.value.status, e.value.code) == (429, "too_many_streams")
    assert int(e.value.headers["Retry-After"]) >= 1
    a.release()
    a.release()  # idempotent
    assert slots.active("alice") == 1 and slots.active() == 2
    slots.acquire("alice")
    b.release()
    other.release()
    assert slots.active() == 1


@pytest.mark.parametrize("reason,code", [
    ("Invalid character in Content-Length", "bad_content_length"),
    ("Content-Length overflow", "bad_content_length"),
    ("Duplicate Content-Length", "bad_content_length"),
    ("Invalid character in chunk size", "malformed_http"), ("", "malformed_http"),
])
def test_http_parse_error_bodies(reason, code):
    import json

    from sparkv.rest.http_protocol import json_error_protocol, parse_error_body

    err = json.loads(parse_error_body(ValueError(reason) if reason else None))["error"]
    assert err["status"] == 400 and err["code"] == code and err["message"]
    assert json_error_protocol().__name__ in ("JsonErrorHttpToolsProtocol", "JsonErrorH11Protocol")


def test_path_indices_and_openapi_bounds_of_schemas():
    from pydantic import TypeAdapter, ValidationError

    from sparkv.server.schemas import CreateContext, PathIndex

    ta = TypeAdapter(PathIndex)
    assert ta.validate_python("0") == 0 and ta.validate_python("2147483647") == 2**31 - 1
    for bad in ("+1", "01", " 1", "1 ", "1.0", "-1", "\u0661", "2147483648", ""):
        with pytest.raises(ValidationError):
            ta.validate_python(bad)
    props = CreateContext.model_json_schema()["properties"]
    assert props["chunk_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 16,
                                                 "maximum": 65536}
    assert "'ge'" not in str(props) and "'le'" not in str(props)


@pytest.mark.parametrize("url,connect,public,prefix", [
    ("redis://h:6379/0", "redis://h:6379/0", "redis://h:6379/0", "sparkv"),
    ("redis://u:secret@h:6379/2?prefix=p1&socket_timeout=3",
     "redis://u:secret@h:6379/2?socket_timeout=3", "redis://h:6379/2", "p1"),
    ("rediss://:pw@h/1?prefix=", "rediss://:pw@h/1", "rediss://h/1", "sparkv"),
])
def test_a_redis_url_is_parsed_once_for_the_store_and_the_queue(url, connect, public, prefix):
    from sparkv.server.queue import RedisJobQueue
    from sparkv.server.stores.redis_store import RedisStore
    from sparkv.server.stores.redis_url import parse_redis_url

    assert parse_redis_url(url) == (connect, public, prefix)
    for kind in (RedisStore, RedisJobQueue):  # connects lazily: nothing is reached here
        made = kind(url)
        assert (made.url, made.prefix) == (public, prefix)
        assert "secret" not in repr(made) and "pw" not in made.url


def test_a_context_finishing_between_the_two_reads_is_never_reported_not_found():
    """``require_manifest`` reads the manifest, then the context's job: a job that finished in
    between (it publishes the manifest, then says ``done``) must give the manifest, not
    ``context_not_found`` (a watcher of a resumed encode saw one, session 64). A job that is
    done while its manifest is gone (deleted since) still reads as not found."""
    import asyncio
    from types import SimpleNamespace

    from sparkv.server.deps import require_manifest

    class State:
        def __init__(self, reads: list, job: dict | None) -> None:
            self.reads, self.jobs = reads, SimpleNamespace(for_context=lambda t, c: job)

        async def manifest(self, tenant: str, context_id: str):
            return self.reads.pop(0)

    done = {"job_id": "j" * 32, "state": "done"}
    assert asyncio.run(require_manifest(State([None, "published"], done), "t", "c")) == "published"
    with pytest.raises(ApiError) as gone:
        asyncio.run(require_manifest(State([None, None], done), "t", "c"))
    assert gone.value.code == "context_not_found"
    running = {"job_id": "j" * 32, "state": "running", "done": 3, "total": 9}
    with pytest.raises(ApiError) as pending:
        asyncio.run(require_manifest(State([None], running), "t", "c"))
    assert pending.value.code == "context_pending"


def test_an_expired_manifest_entry_is_parsed_again_only_if_its_bytes_changed(monkeypatch):
    """The server's parsed-manifest cache: past ``manifest_cache_s`` the stored bytes are read
    again (a DELETE shows), but the same bytes are not validated again (20-30 ms of CPU for a
    2K-token context's manifest); other bytes are, and a deleted manifest is gone."""
    import asyncio
    from types import SimpleNamespace

    from test_quality_recent_floor import _manifest

    from sparkv.server import state as st
    from sparkv.server.config import Settings

    stored = {"raw": _manifest(["q8", "q5"]).to_json()}
    parses = []
    real_parse = st.ParsedManifest.parse

    def counting(raw):
        parses.append(raw)
        return real_parse(raw)

    monkeypatch.setattr(st.ParsedManifest, "parse", staticmethod(counting))
    store = SimpleNamespace(manifests=SimpleNamespace(get=lambda tenant, cid: stored["raw"]))
    state = st.ServerState(Settings(manifest_cache_s=0.001), store, None, None, None, None)
    clock = {"now": 100.0}
    monkeypatch.setattr(st.time, "monotonic", lambda: clock["now"])

    async def ask():
        return await state.manifest("t", "c")

    first = asyncio.run(ask())
    clock["now"] += 1.0                                   # long past the entry's expiry
    assert asyncio.run(ask()) is first and len(parses) == 1
    stored["raw"] = _manifest(["q8"]).to_json()
    clock["now"] += 1.0
    changed = asyncio.run(ask())
    assert len(parses) == 2 and changed is not first and changed.levels == ("q8",)
    stored["raw"] = None
    clock["now"] += 1.0
    assert asyncio.run(ask()) is None
