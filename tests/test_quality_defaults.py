"""The quality table v2 (verdicts, sections for every group) and the defaults that read it: the
level floor, the backend, the dtype API, the device service's ratio, the server's warning on a
press that fails (through a real server), the demo's press choice, and the bench's wiring of the
decision rule (aggregate, verdicts, --check, quality_table from any group)."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest

from sparkv.bench.quality import (Config, _check, aggregate, group_verdicts, quality_table,
                                  verdicts)
from sparkv.predictor.quality import (QualityEntry, QualityTable, RetrievalScore,
                                      allowed_levels, describe_table, device_ratio_for,
                                      press_warning, table_cpu_dtype, table_dtype_passes,
                                      verdict_for)


def _v(verdict: str) -> dict:
    summary = {"pass": "pass", "fail": "FAIL (teacher_forced_drop)",
               "undecided": "undecided: need 12 more QA questions"}[verdict]
    return {"verdict": verdict, "summary": summary, "metrics": {}}


def _e(name: str, verdict: str | None = None, **params) -> QualityEntry:
    return QualityEntry(name, {"passkey": RetrievalScore(10, 10, 10, 10)}, 20, 0.9, 0.995, 1e-4,
                        1000.0, _v(verdict) if verdict else None, dict(params))


def _table(**sections) -> QualityTable:
    return QualityTable("fp123", "tiny", 1.0, sections.pop("levels", []),
                        sections.pop("backends", []), {}, sections=sections)


def test_v2_roundtrip_and_v1_still_reads(tmp_path):
    t = _table(levels=[_e("raw"), _e("q8", "pass")], dtypes=[_e("bfloat16", "pass",
                                                                 dtype="bfloat16")],
               presses=[_e("adakv:0.5", "fail", press="adakv:0.5", ratio=0.5)])
    path = t.save(tmp_path / "t.json")
    doc = json.loads(path.read_text())
    assert doc["version"] == 2 and set(doc["sections"]) == {"dtypes", "presses"}
    back = QualityTable.load(path)
    assert back.to_dict() == t.to_dict() and back.has_verdicts()
    assert back.entry("presses", "adakv:0.5").params == {"press": "adakv:0.5", "ratio": 0.5}
    assert back.section_names() == ["levels", "dtypes", "presses"]
    assert "presses: adakv:0.5 FAIL (teacher_forced_drop)" in describe_table(back)
    # a version 1 file (no verdicts, no sections) loads and is judged by the thresholds
    v1 = {k: v for k, v in doc.items() if k != "sections"}
    v1["version"] = 1
    for e in v1["levels"]:
        e.pop("verdict"), e.pop("params")
    (tmp_path / "v1.json").write_text(json.dumps(v1))
    old = QualityTable.load(tmp_path / "v1.json")
    assert not old.has_verdicts() and old.section("dtypes") == []
    assert allowed_levels(old) == ["raw", "q8"]
    assert "(no verdict" in describe_table(old)[0]


def test_levels_follow_the_verdicts_down_to_the_first_that_does_not_pass(tmp_path):
    from sparkv.edge.planning import default_quality_floor

    t = _table(levels=[_e("raw"), _e("q8", "pass"), _e("q6", "pass"), _e("q5", "undecided"),
                       _e("q4", "pass")])
    assert allowed_levels(t) == ["raw", "q8", "q6"]            # q4 passing below q5: not trusted
    assert allowed_levels(t, use_verdicts=False) == ["raw", "q8", "q6", "q5", "q4"]
    t.save(tmp_path / "t.json")
    assert default_quality_floor("fp123", path=tmp_path / "t.json") == "q6"
    t.levels = [_e("raw"), _e("q8", "fail")]
    t.save(tmp_path / "t.json")
    assert default_quality_floor("fp123", path=tmp_path / "t.json") == "raw"


def test_the_backend_follows_its_verdict(tmp_path):
    from sparkv.edge.planning import default_backend
    from sparkv.runtime.attention import get_backend

    auto = get_backend("auto").name
    path = tmp_path / "t.json"
    # dense itself undecided (few tasks): the auto backend's own verdict decides
    _table(levels=[_e("raw")], backends=[_e("dense", "undecided"), _e(auto, "fail")]).save(path)
    assert default_backend("fp123", path=path) == ("dense" if auto != "dense" else "auto")
    _table(levels=[_e("raw")], backends=[_e("dense", "pass"), _e(auto, "undecided")]).save(path)
    assert default_backend("fp123", path=path) == ("dense" if auto != "dense" else "auto")
    _table(levels=[_e("raw")], backends=[_e(auto, "pass")]).save(path)
    assert default_backend("fp123", path=path) == "auto"
    assert verdict_for("fp123", "backends", auto, path) == "pass"
    assert verdict_for("fp123", "backends", "nope", path) is None
    # a configuration attending in bf16 takes dense where auto is block-sparse (docs/dtypes.md)
    from sparkv.runtime.compute import get_compute

    want = "dense" if auto == "block_sparse" else "auto"
    assert default_backend("fp123", path=path, compute=get_compute("mixed-attn")) == want
    assert default_backend("fp123", path=path, compute=get_compute("mixed")) == "auto"


def test_dtype_api_and_bf16_detection(tmp_path):
    from sparkv.runtime.device import cpu_has_bf16

    path = tmp_path / "t.json"
    with_bf16 = tmp_path / "cpuinfo"
    with_bf16.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\n")
    without = tmp_path / "cpuinfo2"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n")
    assert cpu_has_bf16(with_bf16) and not cpu_has_bf16(without)
    assert not cpu_has_bf16(tmp_path / "missing")
    assert table_dtype_passes("fp123", "bfloat16", path) is None      # no table: as today
    assert table_cpu_dtype("fp123", path, with_bf16) == "float32"
    _table(levels=[_e("raw")], dtypes=[_e("bfloat16", "pass")]).save(path)
    assert table_dtype_passes("fp123", "bfloat16", path) is True
    assert table_cpu_dtype("fp123", path, with_bf16) == "bfloat16"
    assert table_cpu_dtype("fp123", path, without) == "float32"       # no bf16 hardware
    _table(levels=[_e("raw")], dtypes=[_e("bfloat16", "undecided")]).save(path)
    assert table_dtype_passes("fp123", "bfloat16", path) is False
    assert table_cpu_dtype("fp123", path, with_bf16) == "float32"


def test_device_ratio_is_the_smallest_passing_ratio(tmp_path):
    from sparkv.device.commands import default_ratio
    from sparkv.device.config import ServiceConfig

    path = tmp_path / "t.json"
    assert device_ratio_for("fp123", path=path) == 1.0                 # no table
    dev = [_e("device@1", "pass", ratio=1.0), _e("device@0.75", "pass", ratio=0.75),
           _e("device@0.5", "undecided", ratio=0.5), _e("device@0.25", "pass", ratio=0.25)]
    _table(levels=[_e("raw")], device=dev).save(path)
    assert device_ratio_for("fp123", path=path) == 0.75
    _table(levels=[_e("raw")], device=[_e("device@0.5", "fail", ratio=0.5)]).save(path)
    assert device_ratio_for("fp123", path=path) == 1.0
    # the service's default (docs/device-service.md): only the tolerance compression has a ratio
    assert default_ratio("nobody", ServiceConfig.preset("llms")) == 1.0
    assert default_ratio("nobody", ServiceConfig.preset("vllm-s")) == 1.0


def test_press_warning_only_on_fail(tmp_path):
    path = tmp_path / "t.json"
    assert press_warning("fp123", "adakv:0.5", path) is None
    _table(levels=[_e("raw")], presses=[_e("adakv:0.5", "fail"), _e("snapkv:0.2", "pass"),
                                        _e("knorm:0.5", "undecided")]).save(path)
    w = press_warning("fp123", "adakv:0.5", path)
    assert w is not None and "adakv:0.5 fails" in w and w.isascii()
    assert press_warning("fp123", "snapkv:0.2", path) is None
    assert press_warning("fp123", "knorm:0.5", path) is None
    assert press_warning("fp123", "expected:0.5", path) is None       # no row: as before


def test_demo_press_choice(tmp_path, monkeypatch):
    import sparkv.predictor.quality as pq
    from sparkv.demo import choose_press, passing_level

    path = tmp_path / "t.json"
    monkeypatch.setattr(pq, "quality_table_path", lambda fp: path)
    monkeypatch.setattr(pq, "bundled_quality_table_path", lambda fp: tmp_path / "none.json")
    spec, why = choose_press("fp123", "auto")
    assert spec is None and "no quality table" in why          # no press is shown unjudged
    assert passing_level("fp123", ["raw", "q8"]) is None
    big, small = _e("snapkv:0.2", "pass"), _e("adakv:0.5", "pass")
    small.bytes_per_token = 400.0
    _table(levels=[_e("raw")], presses=[big, small,
                                        _e("adakv:0.5@repeat", "fail")]).save(path)
    assert choose_press("fp123", "auto") == ("adakv:0.5", "pass")
    spec, note = choose_press("fp123", "AdaKV:50%@repeat")      # an explicit press: as given
    assert spec == "AdaKV:50%@repeat" and note.startswith("FAIL")
    # no press passes: none is chosen, and the line says which failed
    _table(levels=[_e("raw")], presses=[_e("adakv:0.5", "fail"),
                                        _e("knorm:0.5", "undecided")]).save(path)
    spec, why = choose_press("fp123", "auto")
    assert spec is None
    assert why == ("no KV press passes this model's quality table (adakv:0.5 FAIL "
                   "(teacher_forced_drop), knorm:0.5 undecided: need 12 more QA questions)")


def test_demo_shows_the_most_compressing_passing_level_of_the_shipped_table():
    """The bundled SmolLM2's stored verdicts: every press fails, so ``--press auto`` shows no
    press; the level variant is the passing level with the fewest bytes among those encoded
    (q8 and q6 pass, q5 is undecided, q4 fails)."""
    from sparkv.demo import choose_press, passing_level

    fp = "6fac3bd521445dbb"
    spec, why = choose_press(fp, "auto")
    assert spec is None and why.startswith("no KV press passes this model's quality table")
    assert "adakv:0.5@repeat FAIL" in why
    level = passing_level(fp, ["raw", "q8", "q5"])              # the demo's default levels
    assert level is not None and level[0] == "q8" and level[1].verdict_name == "pass"
    assert passing_level(fp, ["raw", "q8", "q6", "q5", "q4"])[0] == "q6"
    assert passing_level(fp, ["raw", "q5", "q4"]) is None        # none passes: left out


# ---- the bench's wiring ---------------------------------------------------------------------------
def _rows(config: str, group: str, n_qa: int, tf: float, n_pk: int = 0, kept: int = 0,
          **keys) -> list[dict]:
    rows = []
    for i in range(n_qa):
        for c, g, t in (("dense", "dense", 1.0), (config, group, tf)):
            rows.append({"family": "qa", "size": None, "tokens": 2000, "probe": f"qa/{i}",
                         "config": c, "group": g, "strategy": None, "level": None,
                         "backend": None, "link": None, "error": None, "correct": False,
                         "score": 0.0, "greedy_agreement": t, "teacher_forced": t,
                         "first_token_kl": 1.0 - t, "mb": 1.0, "ttft_s": None,
                         "fallback": {}, **(keys if c == config else {})})
    for i in range(n_pk):
        for c, g, ok in (("dense", "dense", True), (config, group, i < kept)):
            rows.append({"family": "passkey", "size": 2048, "tokens": 2000,
                         "probe": f"passkey-2048-{i}", "config": c, "group": g,
                         "strategy": None, "level": None, "backend": None, "link": None,
                         "error": None, "correct": ok, "score": float(ok),
                         "greedy_agreement": 1.0, "teacher_forced": 1.0, "first_token_kl": 0.0,
                         "mb": 1.0, "ttft_s": None, "fallback": {},
                         **(keys if c == config else {})})
    return rows


def _dedup(rows: list[dict]) -> list[dict]:
    return list({(r["probe"], r["config"]): r for r in rows}.values())


def test_aggregate_and_verdicts_carry_the_rule():
    rows = _dedup(_rows("stream@q8", "level", 30, 1.0, 60, 60, level="q8")
                  + _rows("default@20mbps", "strategy", 30, 0.5, 10, 2))
    res = aggregate(rows, seed=3)
    q8 = next(r for r in res if r["config"] == "stream@q8" and r["family"] == "passkey")
    m = q8["verdict"]["metrics"]["retrieval_relative"]
    assert m["margin"] == 0.95 and m["interval"][0] >= 0.95 and m["verdict"] == "pass"
    assert "verdict" not in next(r for r in res if r["config"] == "dense")
    v = verdicts(res, rows, seed=3)
    assert v["stream@q8"]["verdict"]["verdict"] == "pass"
    assert v["default@20mbps"]["verdict"]["verdict"] == "fail"
    assert group_verdicts(v) == {"level": {"pass": ["stream@q8"], "fail": [], "undecided": []},
                                 "strategy": {"pass": [], "fail": ["default@20mbps"],
                                              "undecided": []}}
    assert _check(v) == 1
    assert _check({k: x for k, x in v.items() if k != "default@20mbps"}) == 0
    assert verdicts(res, rows, seed=3) == v                              # seeded


def test_quality_table_fills_every_group_present():
    rows = _dedup(_rows("stream@q8", "level", 25, 1.0, 60, 60, level="q8")
                  + _rows("local/block_sparse", "backend", 25, 0.9, backend="block_sparse")
                  + _rows("bf16", "dtype", 25, 1.0, dtype="bfloat16")
                  + _rows("press:adakv@0.5", "press", 25, 0.5, press="adakv", ratio=0.5)
                  + _rows("device@0.75", "device", 25, 1.0, ratio=0.75)
                  + _rows("default@20mbps", "strategy", 25, 1.0))
    configs = [Config("dense", "dense"), Config("stream@q8", "level", "stream", "q8", "dense"),
               Config("local/block_sparse", "backend", "local", None, "block_sparse"),
               Config("bf16", "dtype"), Config("press:adakv@0.5", "press"),
               Config("device@0.75", "device"), Config("default@20mbps", "strategy",
                                                       "default")]
    lm = SimpleNamespace(fingerprint="fp123", name="tiny",
                         config=SimpleNamespace(num_hidden_layers=2))
    t = quality_table(rows, configs, lm, {"benchmark": "test"}, seed=1)
    assert [e.name for e in t.levels] == ["q8"] and t.levels[0].verdict_name == "pass"
    assert t.backend("block_sparse").verdict_name == "fail"
    assert t.entry("dtypes", "bfloat16").params == {"dtype": "bfloat16"}
    assert t.entry("presses", "adakv:0.5").verdict_name == "fail"
    dev = t.entry("device", "device@0.75")
    assert dev.params == {"ratio": 0.75} and dev.verdict_name == "pass"
    assert "strategy" not in t.sections and t.has_verdicts()
    assert QualityTable.from_dict(json.loads(json.dumps(t.to_dict()))).to_dict() == t.to_dict()


# ---- the server warns about a press that fails (a real server process) ----------------------------
def test_post_contexts_warns_on_a_failing_press(tmp_path):
    from helpers import api_client, shared_tiny_checkpoint

    from sparkv.edge.client import EdgeClient, QualityWarning
    from sparkv.server.process import ServerProcess, write_config

    keys = write_config(tmp_path / "server.yaml", ["alice"],
                        models={"tiny": str(shared_tiny_checkpoint())}, default_model="tiny",
                        default_levels=["raw"], default_chunk_tokens=32)
    srv = ServerProcess(tmp_path / "server.yaml", f"file://{tmp_path}/store",
                        log_path=tmp_path / "server.log",
                        env={"SPARKV_CACHE_DIR": str(tmp_path / "cache")}).start()
    try:
        c = api_client(srv, keys["alice"])
        ids = list(range(10, 90))
        r = c.post("/v1/contexts", json={"token_ids": ids, "press": "adakv:0.5"})
        assert r.status_code in (200, 202), r.text
        assert r.json()["quality_warning"] is None          # no table: as before
        assert "x-sparkv-quality-warning" not in r.headers
        fp = c.get(f"/v1/contexts/{r.json()['context_id']}")
        fp = fp.json()["model"]["fingerprint"] if fp.status_code == 200 else None
        if fp is None:                                       # still encoding: ask the model
            from sparkv.runtime import load_model
            fp = load_model(shared_tiny_checkpoint()).fingerprint
        QualityTable(fp, levels=[_e("raw")], sections={"presses": [
            _e("adakv:0.5", "fail"), _e("snapkv:0.5", "pass")]}).save(
            tmp_path / "cache" / "predictor" / f"{fp}.quality.json")
        r = c.post("/v1/contexts", json={"token_ids": ids[:60], "press": "AdaKV:50%"})
        assert r.status_code in (200, 202), r.text
        w = r.json()["quality_warning"]
        assert w and "adakv:0.5 fails" in w and r.headers["x-sparkv-quality-warning"] == w
        r = c.post("/v1/contexts", json={"token_ids": ids[:60], "press": "snapkv:0.5"})
        assert r.json()["quality_warning"] is None
        ec = EdgeClient(srv.url, api_key=keys["alice"])
        with pytest.warns(QualityWarning, match="adakv:0.5 fails"):
            cid = ec.create_context(token_ids=ids[:50], press="adakv:0.5", wait=False)
        assert "fails" in ec.quality_warnings[cid]
        with warnings.catch_warnings():
            warnings.simplefilter("error", QualityWarning)
            ec.create_context(token_ids=ids[:50], wait=False)   # no press: no warning
        ec.close()
        c.close()
    finally:
        srv.stop()
