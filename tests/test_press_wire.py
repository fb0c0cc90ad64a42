"""Compressed contexts on the wire (issue 14, Deliver 3): ``POST /v1/contexts`` with a press, the
manifest's kept positions, the edge assembling one cache shape whichever path made each chunk.

A real ``sparkv serve`` process on loopback with the bundled SmolLM2, a 1K-token context
(T = 256), encoded uncompressed and with ``adakv:0.5`` (question-agnostic, window 32).
"""

from __future__ import annotations

import base64
import io
import json
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch

from helpers import FLOAT32_SERVER
from sparkv.edge import EdgeSession, LinkShaper, chat_context
from sparkv.edge.session import apply_kept
from sparkv.layout import KVChunkId
from sparkv.protocol import Manifest, ManifestError
from sparkv.protocol.kept import decode_kept, encode_kept
from sparkv.runtime.generate import sample_context_ids
from sparkv.server.process import ServerProcess

PRESS = "adakv:0.5"
T = 256
# these tests test the wire, not the press's quality: SmolLM2's shipped table fails every press,
# so each request with one carries the quality warning (tests/test_quality_defaults.py tests it)
pytestmark = pytest.mark.filterwarnings("ignore::sparkv.edge.client.QualityWarning")


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory):
    d = tmp_path_factory.mktemp("press-wire")
    lm = smollm2
    ids = chat_context(lm, sample_context_ids(lm, 1000))
    srv = ServerProcess(None, f"file://{d}/store", log_path=d / "server.log",
                        env=FLOAT32_SERVER).start()
    try:
        session = EdgeSession.connect(srv.url, model=lm)
        full = session.client.create_context(token_ids=ids, levels=["raw", "q8"], chunk_tokens=T)
        pressed = session.client.pressed_context(full, PRESS)
        mf, mp = session.client.manifest(full), session.client.manifest(pressed)
        session.close()
        yield {"server": srv, "lm": lm, "ids": ids, "full": full, "pressed": pressed,
               "mf": mf, "mp": mp}
    finally:
        srv.stop()
        assert "Traceback" not in srv.log(), srv.log()


def _ask(served, cid, strategy, level="raw", mbps=None, **kw):
    shaper = LinkShaper.constant(mbps, 2.0) if mbps else LinkShaper.unlimited()
    with EdgeSession.connect(served["server"].url, model=served["lm"], shaper=shaper) as s:
        return s.ask(cid, "What is this about?", strategy=strategy, level=level, backend="dense",
                     max_new_tokens=2, **kw)


def _positions(kv, layer):
    store = kv.layers[layer]
    return [store.head(h).pos.cpu().numpy() for h in range(kv.geometry.num_kv_heads)]


def _assert_kept(kv, manifest):
    keep = manifest.keep_lists()
    for layer in range(kv.geometry.num_layers):
        assert kv.layers[layer] is not None and kv.layers[layer].ragged
        got = _positions(kv, layer)
        for h, want in enumerate(keep[layer]):
            assert np.array_equal(got[h], want), (layer, h)


# ---- the manifest -------------------------------------------------------------------------------
def test_pressed_manifest_describes_the_press(served):
    mp, mf = served["mp"], served["mf"]
    assert served["pressed"] != served["full"]
    assert mp.press is not None and mp.press.spec == PRESS and mp.press.window == 32
    n, g = mp.num_tokens, mp.chunk_geometry
    per_head = round(0.5 * n)
    assert mp.press.kept_entries == per_head * g.num_layers * g.num_kv_heads
    keep = mp.keep_lists()
    assert sum(x.size for row in keep for x in row) == mp.press.kept_entries
    for row in keep:
        for x in row:   # the window (last 32 tokens) is kept by every head
            assert np.all(np.isin(np.arange(n - 32, n), x))
            assert np.all(np.diff(x) > 0)
    # (e) the uncompressed context is unaffected: no press, no kept lists, same document shape
    assert mf.press is None and not mf.kept_positions
    doc = json.loads(mf.to_json())
    assert "press" not in doc and all("kept" not in c for c in doc["chunks"])


def test_bytes_shrink_by_the_kept_fraction(served):
    """(a) Must show: a stream-only load of the compressed context fetches the kept fraction of
    the uncompressed one's bytes within 5% (position lists included), at raw and at q8."""
    mp, mf = served["mp"], served["mf"]
    frac = mp.press.kept_fraction
    for level in ("raw", "q8"):
        rf = _ask(served, served["full"], "stream", level)
        rp = _ask(served, served["pressed"], "stream", level)
        assert rf.breakdown.chunks_computed == 0 and rp.breakdown.chunks_computed == 0
        assert rf.load.bytes_streamed == mf.level_bytes(level)
        assert rp.load.bytes_streamed == mp.level_bytes(level)
        ratio = (rp.load.bytes_streamed + mp.kept_bytes()) / rf.load.bytes_streamed
        print(f"{level}: compressed/full bytes {ratio:.4f}, kept fraction {frac:.4f}")
        assert abs(ratio / frac - 1) <= 0.05, (level, ratio, frac)
        # the assembled cache keeps exactly the manifest's positions; the full one stays dense
        _assert_kept(rp.load.kv, mp)
        assert all(rf.load.kv.is_dense(layer) for layer in range(mf.chunk_geometry.num_layers))
        assert abs(rp.load.kv.nbytes / rf.load.kv.nbytes - frac) < 0.05


def test_streamed_cache_equals_server_side_compression(served):
    """(c) stream-only at raw: the assembled cache is the server-side compressed memory."""
    from sparkv.presses import compress, parse_press, prefill, to_memory

    lm, ids = served["lm"], served["ids"]
    res = _ask(served, served["pressed"], "stream", "raw")
    press, budget = parse_press(PRESS)
    layers, window, _ = prefill(lm, ids, window=32)
    ref = to_memory(lm, layers, chunk_tokens=T)
    compress(ref, press, budget, window)
    kv = res.load.kv
    for layer in range(kv.geometry.num_layers):
        for h in range(kv.geometry.num_kv_heads):
            a, b = kv.layers[layer].head(h), ref.layers[layer].head(h)
            assert torch.equal(a.pos, b.pos), (layer, h)
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v), (layer, h)


def test_local_stream_and_mixed_paths_keep_the_same_positions(served):
    """(b) every chunk computed locally, every chunk streamed, and a mix: one cache shape."""
    from sparkv.runtime.stepper import LayerStepper

    lm, ids, mp = served["lm"], served["ids"], served["mp"]
    local = _ask(served, served["pressed"], "local")
    assert local.breakdown.chunks_streamed == 0
    _assert_kept(local.load.kv, mp)
    stream = _ask(served, served["pressed"], "stream")
    _assert_kept(stream.load.kv, mp)
    # a deterministic mix: token chunks 0-1 streamed (pruned payloads), 2-3 computed locally,
    # whose steps attend over the streamed, pruned entries (explicit-position views)
    g = mp.chunk_geometry
    stepper = LayerStepper(lm, ids, T, heads_per_group=g.heads_per_group)
    with EdgeSession.connect(served["server"].url, model=lm) as s:
        for cid in g.chunk_ids():
            if cid.t < 2:
                from sparkv.codec import decode
                from sparkv.edge.frames import put_kept

                chunk = decode(s.client.frame(served["pressed"], cid.t, cid.l, cid.g, "raw"))
                put_kept(stepper.kv, cid, mp.kept_positions[cid], chunk.k, chunk.v)
    assert not stepper.kv.is_dense(0)
    stepper.complete()
    srcs = set(stepper.kv.sources().values())
    assert srcs == {"streamed", "computed"}, srcs
    apply_kept(stepper.kv, mp)
    _assert_kept(stepper.kv, mp)
    # streamed chunks hold the server's values, locally computed ones the device's
    for layer in (0, g.num_layers - 1):
        for h in range(g.num_kv_heads):
            a, b = stepper.kv.layers[layer].head(h), stream.load.kv.layers[layer].head(h)
            early = a.pos < 2 * T
            assert torch.equal(a.k[early], b.k[early])
    # the answer comes out of the pruned cache
    assert local.tokens and stream.tokens


def test_hybrid_and_sparkv_assemble_the_manifest_shape(served):
    for strategy in ("hybrid", "sparkv"):
        res = _ask(served, served["pressed"], strategy, "q8", mbps=20.0)
        bd = res.breakdown
        print(strategy, "streamed", bd.chunks_streamed, "computed", bd.chunks_computed)
        assert not bd.fallback, bd.fallback
        _assert_kept(res.load.kv, served["mp"])


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["nope:0.5", "adakv:1.5", "adakv", "adakv:0t", "adakv:x%",
                                  "adakv:0.5@nowhere"])
def test_bad_press_spec_is_422(served, spec):
    import httpx

    r = httpx.post(f"{served['server'].url}/v1/contexts",
                   json={"token_ids": served["ids"][:64], "press": spec}, timeout=30)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and "press" in json.dumps(err), err


def _tampered(manifest: Manifest, fn) -> dict:
    doc = json.loads(manifest.to_json())
    fn(doc)
    return doc


def test_tampered_position_lists_are_refused(served):
    mp = served["mp"]
    Manifest.parse(mp.to_json())  # intact: fine

    def count_off(doc):
        doc["chunks"][0]["kept"]["counts"][0] += 1

    def drop_kept(doc):
        del doc["chunks"][3]["kept"]

    def bad_base64(doc):
        doc["chunks"][1]["kept"]["positions"] = "!!notbase64"

    def flip_padding(doc):  # a position past the chunk (bitmap) or past its end (delta)
        c = doc["chunks"][-1]
        counts, coding = c["kept"]["counts"], c["kept"]["coding"]
        rel = decode_kept(counts, coding, c["kept"]["positions"], c["num_tokens"])
        raw = bytearray(base64.b64decode(c["kept"]["positions"]))
        if coding == "bitmap":
            raw[-1] ^= 0x80 if c["num_tokens"] % 8 else 0
            raw += b"\x00"  # one byte too many either way
        else:
            raw += b"\x05"
        c["kept"]["positions"] = base64.b64encode(bytes(raw)).decode()
        assert rel

    def total_off(doc):
        doc["press"]["kept_entries"] -= 1

    def kept_without_press(doc):
        del doc["press"]

    for fn in (count_off, drop_kept, bad_base64, flip_padding, total_off, kept_without_press):
        with pytest.raises(ManifestError):
            Manifest.parse(json.dumps(_tampered(mp, fn)))


def test_position_codings_round_trip_and_refuse_damage():
    rng = np.random.default_rng(0)
    for n in (1, 7, 8, 256, 300):
        for density in (0.0, 0.05, 0.5, 1.0):
            pos = [np.sort(rng.choice(n, int(density * n), replace=False)) + 1000
                   for _ in range(3)]
            counts, coding, text = encode_kept(pos, 1000, n)
            back = decode_kept(counts, coding, text, n)
            assert all(np.array_equal(a + 1000, b) for a, b in zip(back, pos))
            if density == 0.05 and n >= 256:
                assert coding == "delta"
            if density == 0.5 and n >= 256:
                assert coding == "bitmap"
    # a delta list that walks past the chunk
    text = base64.b64encode(bytes([3, 200, 1])).decode()
    with pytest.raises(ValueError):
        decode_kept([3], "delta", text, 100)
    with pytest.raises(ValueError):
        decode_kept([2], "delta", base64.b64encode(bytes([1])).decode(), 100)
    with pytest.raises(ValueError):
        encode_kept([np.array([5, 5])], 0, 10)


def test_cli_ask_with_press(served):
    from sparkv.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["ask", "What is this about?", "--server", served["server"].url,
                   "--context", served["full"], "--press", PRESS, "--strategy", "stream",
                   "--level", "q8", "--max-new-tokens", "2", "--no-cache", "--json"])
    assert rc == 0
    doc = json.loads(out.getvalue())
    assert doc["context_id"] == served["pressed"]   # found by id, not encoded again
    assert doc["stats"]["bytes_streamed"] == served["mp"].level_bytes("q8")
    # a bad press is a one-line error (exit 2) before the model loads
    assert main(["ask", "q", "--server", served["server"].url, "--context", served["full"],
                 "--press", "nope:0.5", "--no-cache"]) == 2


def test_repeat_probe_window(served):
    """``NAME:BUDGET@repeat``: a fixed probe question is the window (nothing forced); its own
    context id; the edge assembles its positions like any other."""
    with EdgeSession.connect(served["server"].url, model=served["lm"]) as s:
        cid = s.client.create_context(token_ids=served["ids"], levels=["q8"], chunk_tokens=T,
                                      press="AdaKV:50%@Repeat")
        m = s.client.manifest(cid)
    assert cid not in (served["pressed"], served["full"])
    assert m.press.spec == "adakv:0.5@repeat" and m.press.window == 0
    assert m.press.probe == "Repeat the text above." and m.press.kept_fraction == 0.5
    assert any(not np.array_equal(a, b) for ra, rb in zip(m.keep_lists(), served["mp"].keep_lists())
               for a, b in zip(ra, rb))
    res = _ask(served, cid, "stream", "q8")
    _assert_kept(res.load.kv, m)


def test_kept_chunk_ids_cover_the_geometry(served):
    mp = served["mp"]
    assert set(mp.kept_positions) == set(mp.chunk_geometry.chunk_ids())
    assert KVChunkId(0, 0, 0) in mp.kept_positions


def test_offline_encoder_takes_a_press(tmp_path, smollm2, capsys):
    """``sparkv encode --press`` runs the same encoder: a compressed manifest, its own id."""
    from sparkv.cli import main
    from sparkv.server.stores import open_store

    ids = sample_context_ids(smollm2, 200)
    src = tmp_path / "ids.json"
    src.write_text(json.dumps(ids))
    store = f"file://{tmp_path}/store"
    out = {}
    for press in (None, "SnapKV:25%"):
        argv = ["encode", str(src), "--store", store, "--token-ids", "--levels", "q8",
                "--chunk-tokens", "64", "--json"] + (["--press", press] if press else [])
        assert main(argv) == 0
        out[press] = json.loads(capsys.readouterr().out)
    assert out[None]["context_id"] != out["SnapKV:25%"]["context_id"]
    st = open_store(store)
    tenant = out[None]["tenant"]
    m = Manifest.parse(st.manifests.get(tenant, out["SnapKV:25%"]["context_id"]))
    assert m.press.spec == "snapkv:0.25" and m.press.kept_fraction == 0.25
    assert Manifest.parse(st.manifests.get(tenant, out[None]["context_id"])).press is None
    assert main(["encode", str(src), "--store", store, "--token-ids", "--press", "x:1"]) == 2
    assert "--press" in capsys.readouterr().err
