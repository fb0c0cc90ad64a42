"""The quality suite (``sparkv bench quality``): task generator, scorers, the QA set, the matrix,
aggregation and verdicts, the planner's quality table (save/load/allowed_levels), and the JSON
shape of a tiny real run (a 300-token pass key and two questions through a real server)."""

from __future__ import annotations

import json

import pytest

from sparkv.bench.qa import QAItem, QASetError, load_qa_set
from sparkv.bench.quality import (Config, aggregate, build_matrix, configs_from_rows,
                                  load_rows, parity_ok, parse_trials, verdicts)
from sparkv.bench.tasks import FILLER, make_task, spread_depths, task_suite
from sparkv.predictor.quality import (QualityEntry, QualityTable, QualityTableError,
                                      RetrievalScore, allowed_backends, allowed_levels,
                                      allowed_levels_for, load_quality_table, quality_floor,
                                      quality_floor_for, quality_table_path)


def _words(text: str) -> int:
    """A stand-in tokenizer for the generator's arithmetic: one token per word."""
    return len(text.split())


# ---- the task generator ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["passkey", "multikey", "multivalue"])
def test_make_task_fits_and_plants(kind):
    task = make_task(kind, 300, 0.5, seed=3, count_tokens=_words)
    per = _words(FILLER)
    assert task.tokens == _words(task.document)
    assert 300 - 2 * per <= task.tokens <= 300 + per
    for a in task.answers:
        assert a in task.document
    for d in task.distractors:
        assert d in task.document
    assert make_task(kind, 300, 0.5, 3, _words).document == task.document   # seeded
    assert make_task(kind, 300, 0.5, 4, _words).answers != task.answers


def test_needle_depth_moves_the_needle():
    early = make_task("passkey", 400, 0.1, 0, _words)
    late = make_task("passkey", 400, 0.9, 0, _words)
    pos = [t.document.index(t.answers[0]) / len(t.document) for t in (early, late)]
    assert pos[0] < 0.3 < 0.7 < pos[1]


def test_spread_depths_and_suite():
    assert spread_depths(1) == [0.1]
    assert spread_depths(3) == [0.1, 0.5, 0.9]
    assert spread_depths(0) == []
    suite = task_suite(("passkey", "multivalue"), (200, 300), 2, _words)
    assert [(t.kind, t.depth) for t in suite][:2] == [("passkey", 0.1), ("passkey", 0.9)]
    assert len(suite) == 8


def test_scorers():
    pk = make_task("passkey", 200, 0.5, 0, _words)
    key = pk.answers[0]
    assert pk.correct(f"The pass key is {key}.") and not pk.correct("The pass key is 12.")
    mk = make_task("multikey", 200, 0.5, 0, _words)
    assert mk.correct(mk.answers[0])
    assert mk.score(mk.distractors[0]) == 0.0            # another word's number
    mv = make_task("multivalue", 200, 0.5, 0, _words)
    assert mv.score(" ".join(mv.answers[:2])) == pytest.approx(2 / 3)
    assert mv.correct(", ".join(mv.answers))
    item = QAItem("x", "s", "q?", (1, 1), ("principal place of business",))
    assert item.keyword_hit("its Principal\n  place of business.")
    assert not item.keyword_hit("the courts")


# ---- the QA set -----------------------------------------------------------------------------------
def test_qa_set_is_valid():
    qa = load_qa_set()
    assert len(qa.items) >= 20
    assert len({it.id for it in qa.items}) == len(qa.items)
    for it in qa.items:
        passage = " ".join(qa.passage(it).lower().split())
        assert any(" ".join(k.lower().split()) in passage for k in it.keywords), it.id
    assert set(qa.by_slice()) == set(qa.slices)
    assert [it.id for it in qa.limit(3).items] == [it.id for it in qa.items[:3]]


def test_qa_slices_are_2k_to_4k_tokens(smollm2):
    qa = load_qa_set()
    for s in qa.slices.values():
        n = len(smollm2.encode_text(qa.text(s.id)))
        assert 2000 <= n <= 4000, (s.id, n)


def test_qa_set_rejects_bad_files(tmp_path):
    (tmp_path / "src.txt").write_text("a\nb\nc\n")
    good = {"source": "src.txt", "slices": [{"id": "s", "lines": [1, 3]}],
            "questions": [{"id": "q", "slice": "s", "passage": [2, 2], "question": "b?",
                           "keywords": ["b"]}]}
    (tmp_path / "qa.json").write_text(json.dumps(good))
    assert len(load_qa_set(tmp_path / "qa.json").items) == 1
    for bad in ({"slices": [{"id": "s", "lines": [1, 9]}]},
                {"questions": [{**good["questions"][0], "slice": "t"}]},
                {"questions": [{**good["questions"][0], "passage": [1, 4]}]},
                {"questions": [{**good["questions"][0], "keywords": []}]},
                {"questions": [good["questions"][0], good["questions"][0]]}):
        (tmp_path / "bad.json").write_text(json.dumps({**good, **bad}))
        with pytest.raises(QASetError):
            load_qa_set(tmp_path / "bad.json")


# ---- the matrix -----------------------------------------------------------------------------------
def test_parse_trials():
    t = parse_trials("10,passkey=20,passkey@2048=30,multikey@8192=0")
    assert t("passkey", 2048) == 30 and t("passkey", 4096) == 20
    assert t("multikey", 8192) == 0 and t("multikey", 2048) == 10
    assert parse_trials("")("multivalue", 1) == 10
    with pytest.raises(ValueError):
        parse_trials("qa=3")


def test_build_matrix():
    cfgs = build_matrix(["raw", "q5"], ["dense", "block_sparse"],
                        ["local", "sparkv", "default"], ["20", "lte"])
    names = [c.name for c in cfgs]
    assert names == ["dense", "stream@raw", "stream@q5", "local/dense", "local/block_sparse",
                     "sparkv@20mbps", "default@20mbps", "sparkv@lte", "default@lte"]
    by = {c.name: c for c in cfgs}
    assert by["default@lte"].ask_kwargs() == {}            # exactly what `sparkv ask` does
    assert by["stream@q5"].ask_kwargs() == {"strategy": "stream", "level": "q5",
                                            "backend": "dense"}
    assert by["sparkv@20mbps"].ask_kwargs()["quality_floor"] == "q5"
    assert by["local/dense"].ask_kwargs() == {"strategy": "local", "backend": "dense"}
    # local in the strategy group runs once, when the backend group lacks what auto resolves to
    assert "local/auto" in [c.name for c in build_matrix([], ["dense"], ["local"], ["20"])]
    with pytest.raises(ValueError):
        build_matrix([], [], ["nope"], ["20"])


# ---- aggregation and verdicts ---------------------------------------------------------------------
def _row(probe, config, correct, family="passkey", size=2048, group="level", **kw):
    r = {"family": family, "size": size, "tokens": 2000, "context": probe, "probe": probe,
         "config": config, "group": group if config != "dense" else "dense",
         "strategy": None, "level": None, "backend": None, "link": None, "error": None,
         "answer": "", "score": float(correct), "correct": correct, "greedy_agreement": 1.0,
         "teacher_forced": 1.0, "first_token_kl": 0.0, "mb": 1.0, "ttft_s": 1.0,
         "fallback": {}}
    r.update(kw)
    return r


def test_parity_rule():
    assert parity_ok(30, 30) and parity_ok(29, 30) and not parity_ok(28, 30)
    assert parity_ok(10, 10) and not parity_ok(9, 10)     # < 30: no miss allowed
    assert parity_ok(0, 0)


def test_aggregate_judges_only_what_dense_answers():
    rows = []
    for i in range(4):
        rows.append(_row(f"p{i}", "dense", i != 3))               # dense misses p3
        rows.append(_row(f"p{i}", "stream@q4", i not in (0,)))     # q4 misses p0, gets p3
        rows.append(_row(f"p{i}", "stream@q8", i != 3))
    for i in range(2):
        rows.append(_row(f"q{i}", "dense", True, family="qa", size=None))
        rows.append(_row(f"q{i}", "stream@q4", False, family="qa", size=None,
                         teacher_forced=0.85 + 0.1 * i, greedy_agreement=0.5,
                         first_token_kl=0.01))
    cfgs = [Config("dense", "dense"), Config("stream@q8", "level", "stream", "q8"),
            Config("stream@q4", "level", "stream", "q4")]
    res = aggregate(rows, cfgs)
    by = {(r["family"], r["config"]): r for r in res}
    q4 = by[("passkey", "stream@q4")]
    assert (q4["n"], q4["correct"], q4["dense_correct"], q4["kept"]) == (4, 3, 3, 2)
    assert q4["relative"] == pytest.approx(2 / 3) and not q4["parity"]
    assert by[("passkey", "stream@q8")]["parity"]
    qa = by[("qa", "stream@q4")]
    assert qa["teacher_forced"] == pytest.approx(0.9) and qa["qa_ok"] and not qa["greedy_ok"]
    assert [r["config"] for r in res if r["family"] == "passkey"] == \
        ["dense", "stream@q8", "stream@q4"]
    v = verdicts(res)
    # q8 had no QA rows: judged on what was measured (pass-key parity)
    assert "qa_ok" not in v["stream@q8"] and v["stream@q8"]["passkey_parity"]
    assert v["stream@q8"]["keeps_quality"] is True
    assert v["stream@q4"]["passkey_parity"] is False and not v["stream@q4"]["keeps_quality"]


def test_errors_fail_the_group():
    rows = [_row("p0", "dense", True), _row("p0", "local/dense", False, group="backend",
                                            error="RuntimeError: boom")]
    res = aggregate(rows)
    r = next(x for x in res if x["config"] == "local/dense")
    assert r["errors"] == 1 and not r["parity"]


def test_rescore_merges_runs(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text("\n".join(json.dumps(r) for r in [_row("p0", "dense", True),
                                                     _row("p0", "stream@q4", False)]) + "\n")
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"answers": [_row("p0", "stream@q4", True),
                                         _row("p1", "dense", True)]}))
    rows = load_rows([a, b])
    assert len(rows) == 3
    assert next(r for r in rows if r["config"] == "stream@q4")["correct"]   # the later run wins
    assert [c.name for c in configs_from_rows(rows)] == ["dense", "stream@q4"]


# ---- the planner's table --------------------------------------------------------------------------
def _entry(name, kept=10, dense=10, tf=0.97, greedy=0.6, kl=0.01):
    return QualityEntry(name, {"passkey": RetrievalScore(dense, kept, dense, kept)}, 20,
                        greedy, tf, kl, 1000.0)


def _table(**entries):
    return QualityTable("fp123", "tiny", 1.0, [_entry("raw", tf=1.0, greedy=1.0, kl=0.0),
                                                *entries.values()],
                        [_entry("dense"), _entry("block_sparse", tf=0.8)], {"sizes": [2048]})


def test_allowed_levels_is_a_prefix_down_to_the_floor():
    t = _table(q8=_entry("q8"), q6=_entry("q6", kept=9), q5=_entry("q5"))
    assert allowed_levels(t) == ["raw", "q8"]                # q6 misses a pass key: stop there
    assert allowed_levels(t, min_passkey=0.9) == ["raw", "q8", "q6", "q5"]
    assert allowed_levels(t, min_passkey=None, min_teacher_forced=0.98) == ["raw"]
    assert allowed_levels(t, min_greedy=0.7) == ["raw"]
    assert allowed_levels(t, max_first_token_kl=0.001) == ["raw"]
    assert quality_floor(t) == "q8"
    assert allowed_backends(t) == ["dense"]
    # raw is lossless: it passes even when measured badly (it is never worse than dense)
    bad_raw = QualityTable("fp", levels=[_entry("raw", kept=0), _entry("q8")])
    assert allowed_levels(bad_raw) == ["raw", "q8"]
    # a level without QA data is not proven
    no_qa = QualityTable("fp", levels=[QualityEntry("q8", {"passkey": RetrievalScore(3, 3, 3,
                                                                                     3)})])
    assert allowed_levels(no_qa) == [] and allowed_levels(no_qa, min_teacher_forced=None) == ["q8"]


def test_quality_table_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    t = _table(q8=_entry("q8"), q4=_entry("q4", tf=0.8))
    path = t.save()
    assert path == quality_table_path("fp123") == tmp_path / "predictor" / "fp123.quality.json"
    back = load_quality_table("fp123")
    assert back is not None and back.to_dict() == t.to_dict()
    assert back.level("q4").qa_teacher_forced == 0.8 and back.level("q3") is None
    assert back.level("q8").passkey_relative == 1.0 and back.backend("dense") is not None
    assert load_quality_table("other") is None
    assert allowed_levels_for("fp123") == ["raw", "q8"]
    assert quality_floor_for("fp123") == "q8"
    assert quality_floor_for("other") == "q5" and allowed_levels_for("other") is None
    # a table of another model at this model's path, and a corrupt file: an error to load,
    # the fallback floor (with a warning) for the policy
    (tmp_path / "predictor" / "fp999.quality.json").write_text(path.read_text())
    with pytest.raises(QualityTableError, match="another|measured on"):
        load_quality_table("fp999")
    (tmp_path / "predictor" / "bad.quality.json").write_text("{not json")
    with pytest.raises(QualityTableError):
        load_quality_table("bad")
    with pytest.warns(UserWarning):
        assert quality_floor_for("bad") == "q5"
    doc = json.loads(path.read_text())
    doc["version"] = 99
    path.write_text(json.dumps(doc))
    with pytest.raises(QualityTableError, match="version"):
        load_quality_table("fp123")


def test_a_table_of_another_codec_is_not_trusted(tmp_path):
    from sparkv.predictor.quality import codec_signature

    sig = codec_signature(30)
    assert len(sig) == 16 and sig == codec_signature(30) != codec_signature(32)
    t = _table(q8=_entry("q8"))
    t.num_layers, t.codec_signature = 30, sig
    t.save(tmp_path / "t.json")
    assert QualityTable.load(tmp_path / "t.json").matches_codec()
    assert allowed_levels_for("fp123", path=tmp_path / "t.json") == ["raw", "q8"]
    t.codec_signature = "0" * 16
    t.save(tmp_path / "t.json")
    with pytest.warns(UserWarning, match="another codec"):
        assert allowed_levels_for("fp123", path=tmp_path / "t.json") is None
    with pytest.warns(UserWarning):
        assert quality_floor_for("fp123", path=tmp_path / "t.json") == "q5"


def test_quality_floor_when_nothing_lossy_passes(tmp_path):
    t = _table(q8=_entry("q8", kept=0))
    t.save(tmp_path / "t.json")
    assert quality_floor_for("fp123", path=tmp_path / "t.json") == "raw"


# ---- a tiny real run: JSON shape -----------------------------------------------------------------
def test_tiny_run_writes_json_plot_and_table(smollm2, tmp_path):
    """A 300-token pass key and a question about a 300-token license passage (an 8-token
    answer, a quarter of the default, to keep the test short): dense, raw and q4 streamed,
    block-sparse local (in process, sparkv/bench/paired.py), the default policy at 20 Mbit/s
    through a real server. Raw frames are bit-exact, so stream@raw must answer exactly as the
    dense reference does."""
    from sparkv.cli import main

    src = load_qa_set()
    (tmp_path / "sample_context.txt").write_text("".join(src.source_lines))
    (tmp_path / "qa.json").write_text(json.dumps({
        "source": "sample_context.txt", "slices": [{"id": "s", "lines": [589, 620]}],
        "questions": [{"id": "w", "slice": "s", "passage": [591, 598], "keywords": ["AS IS"],
                       "question": "On what basis is the program provided?"}]}))
    out = tmp_path / "quality.json"
    table = tmp_path / "table.json"
    rc = main(["bench", "quality", "--tasks", "passkey,qa", "--sizes", "428", "--trials", "1",
               "--new-tokens", "qa=8",
               "--qa-file", str(tmp_path / "qa.json"),
               "--levels", "raw,q4", "--backends", "block_sparse", "--dtypes", "",
               "--presses", "", "--device-ratios", "", "--strategies", "default",
               "--links", "20", "--encode-levels", "raw,q4", "--json", "--out", str(out),
               "--save-table", str(table), "--rows", str(tmp_path / "rows.jsonl"),
               "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    for key in ("benchmark", "created_unix", "machine", "config", "configs", "results",
                "verdicts", "targets", "quality_table", "answers", "wall_s"):
        assert key in doc, key
    assert doc["benchmark"] == "quality"
    assert [c["name"] for c in doc["configs"]] == ["dense", "stream@raw", "stream@q4",
                                                   "local/block_sparse", "default@20mbps"]
    answers = doc["answers"]
    assert len(answers) == 10 and not any(a["error"] for a in answers)
    assert doc["config"]["new_tokens"]["qa"] == 8            # QA's answers: 8 tokens, not 32
    assert {a["new_tokens"] for a in answers if a["family"] == "qa"} == {8}
    by = {(r["family"], r["config"]): r for r in doc["results"]}
    assert set(by) == {(f, c["name"]) for f in ("passkey", "qa") for c in doc["configs"]}
    for r in doc["results"]:
        assert r["n"] == 1
        for k in ("correct", "accuracy", "dense_correct", "kept", "relative", "greedy_agreement",
                  "teacher_forced", "first_token_kl", "mb", "errors", "tokens_min"):
            assert k in r, k
        assert ("parity" in r) == (r["family"] == "passkey")
        assert ("qa_ok" in r) == (r["family"] == "qa")
    assert by[("passkey", "dense")]["correct"] == 1       # SmolLM2 finds a 300-token pass key
    assert 250 <= by[("passkey", "dense")]["tokens_min"] <= 428
    for fam in ("passkey", "qa"):
        raw = by[(fam, "stream@raw")]
        assert raw["greedy_agreement"] == 1.0 and raw["teacher_forced"] == 1.0 and raw["mb"] > 0
        assert raw["first_token_kl"] == pytest.approx(0.0, abs=1e-6)
        assert by[(fam, "local/block_sparse")]["mb"] == 0.0
    assert by[("passkey", "stream@raw")]["correct"] == 1
    # the in-process groups make one cache per context (its cost in load_s), the default
    # policy asks the server afresh
    qa_rows = [a for a in answers if a["family"] == "qa"]
    assert all(a["load_s"] > 0 for a in qa_rows if a["group"] in ("level", "backend"))
    assert not any(a["reused_load"] for a in qa_rows)
    assert (tmp_path / "quality.png").stat().st_size > 0
    assert len((tmp_path / "rows.jsonl").read_text().splitlines()) == 10
    t = QualityTable.load(table)
    assert [e.name for e in t.levels] == ["raw", "q4"]
    assert [e.name for e in t.backends] == ["block_sparse"]
    assert t.level("raw").retrieval["passkey"].n == 1 and t.level("raw").qa_questions == 1
    assert t.level("raw").qa_teacher_forced == 1.0
    assert t.num_layers == 30 and t.matches_codec()
    assert {a["codec"] for a in answers} == {t.codec_signature}
    from sparkv.runtime.device import cpu_bf16_flags      # the machine's bf16 kind, every row
    assert all(a["cpu_bf16"] == cpu_bf16_flags() for a in answers)
    assert doc["quality_table"] == t.to_dict()


# ---- the default policy's floor comes from the table (issue 11 part 3) --------------------------
def _pol(name, **kw):
    """A table entry that meets the default policy's thresholds unless ``kw`` says otherwise."""
    return _entry(name, **{"tf": 0.995, **kw})


_LEVEL_BYTES = {"q8": 1000, "q6": 760, "q5": 640, "q4": 520, "q3": 400}


def _manifest(levels):
    """A manifest of a 4-token-chunk, 3-layer context with every chunk at ``levels`` (sizes
    shrinking with the bits, so a slow link makes the planners want the lowest level)."""
    from sparkv.layout import ChunkGeometry
    from sparkv.protocol import Manifest, checksum

    g = ChunkGeometry(64, 16, 3, 2, 8)
    tq = {"bits": 5, "coding": "huffman"}
    chunks = []
    for c in g.chunk_ids():
        start, end = g.token_range(c.t)
        entry = {lv: {"bytes": _LEVEL_BYTES[lv] * 200, "frame_bytes": _LEVEL_BYTES[lv] * 200,
                      "checksum": checksum(bytes([c.t, c.l, c.g]) + lv.encode()),
                      "bits_per_value": 5.0, "k": tq, "v": tq} for lv in levels}
        chunks.append({"t": c.t, "l": c.l, "g": c.g, "token_start": start,
                       "num_tokens": end - start, "levels": entry})
    return Manifest.build(context_id="b" * 32, model={"name": "m", "fingerprint": "fp123"},
                          token_ids=list(range(64)), geometry=g, levels=list(levels),
                          frame_version=1, chunks=chunks, created_unix=1.0)


def _floored_instance(manifest, floor, mbps=2.0):
    import numpy as np

    from sparkv.edge.planning import build_instance

    g = manifest.chunk_geometry
    t_comp = np.full((g.num_token_chunks, g.num_layers), 0.5)   # computing is slow too
    return build_instance(manifest, t_comp, mbps * 125_000, quality_floor=floor, rtt_s=0.02,
                          t_suffix_s=0.05)


def test_a_table_that_forbids_q4_keeps_q4_out_of_every_plan(tmp_path):
    """q4 loses pass keys in the table: the default floor is q5, and no planner nor controller
    streams q4 or q3, even on a deep fade where the lowest level would be fastest. Without the
    table (the q5 fallback is the same floor here) a table allowing q4 does let q4 through."""
    from sparkv.edge.planning import default_quality_floor
    from sparkv.scheduler.controller import ControllerConfig
    from sparkv.scheduler.planners import get_planner
    from sparkv.scheduler.simulator import simulate
    from sparkv.scheduler.trace import Trace

    path = tmp_path / "fp123.quality.json"
    _table(q8=_pol("q8"), q6=_pol("q6"), q5=_pol("q5"), q4=_pol("q4", kept=2),
           q3=_pol("q3")).save(path)
    floor = default_quality_floor("fp123", path=path)
    assert floor == "q5"
    m = _manifest(["q8", "q6", "q5", "q4", "q3"])
    inst = _floored_instance(m, floor)
    assert inst.quality_floor == "q5"
    for name, ctl in (("sparkv", ControllerConfig()), ("stream", ControllerConfig.cachegen()),
                      ("hybrid", ControllerConfig())):
        plan = get_planner(name).plan(inst)
        assert not {plan.level_of(c) for c in plan.stream_order} & {"q4", "q3"}, name
        for trace in (None, Trace.sample("deep-fade")):
            tl = simulate(plan, inst, trace, controller=ctl)
            used = {x.level for x in tl.transfers}
            assert used and not used & {"q4", "q3"}, (name, used)
    # the same manifest with q4 allowed by the table: the slow link does pick it
    _table(q8=_pol("q8"), q6=_pol("q6"), q5=_pol("q5"), q4=_pol("q4"),
           q3=_pol("q3", tf=0.5)).save(path)
    assert default_quality_floor("fp123", path=path) == "q4"
    plan = get_planner("stream").plan(_floored_instance(m, "q4"))
    assert {plan.level_of(c) for c in plan.stream_order} == {"q4"}


def test_no_table_falls_back_to_q5_and_a_corrupt_one_warns(tmp_path, monkeypatch, recwarn):
    from sparkv.edge.planning import DEFAULT_FLOOR, default_quality_floor

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    assert DEFAULT_FLOOR == "q5"
    assert default_quality_floor("fp123") == "q5"
    assert not [w for w in recwarn if "quality table" in str(w.message)]   # silent: normal
    (tmp_path / "predictor").mkdir()
    quality_table_path("fp123").write_text('{"version": 1, "levels": [')
    with pytest.warns(UserWarning, match="quality table"):
        assert default_quality_floor("fp123") == "q5"
    quality_table_path("fp123").write_text('{"version": 1, "model_fingerprint": "fp123"}')
    with pytest.warns(UserWarning, match="malformed"):
        assert default_quality_floor("fp123") == "q5"
    quality_table_path("fp123").write_text("[1, 2]")
    with pytest.warns(UserWarning, match="not a JSON object"):
        assert default_quality_floor("fp123") == "q5"


def test_the_bundled_model_ships_its_measured_table(smollm2, tmp_path, monkeypatch):
    """A fresh machine (empty cache) uses the table shipped for the bundled SmolLM2, measured on
    this codec; a table this machine made takes precedence."""
    from sparkv.edge.planning import default_quality_floor
    from sparkv.predictor.quality import bundled_quality_table_path, codec_signature

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    fp = smollm2.fingerprint
    assert bundled_quality_table_path(fp).is_file()
    table = load_quality_table(fp)
    assert table is not None and table.model_fingerprint == fp
    assert table.codec_signature == codec_signature(table.num_layers)   # re-measure on change
    assert table.matches_codec()
    assert default_quality_floor(fp) in {e.name for e in table.levels}
    (tmp_path / "predictor").mkdir()
    own = json.loads(bundled_quality_table_path(fp).read_text())
    own["measured_unix"] = 123.0
    quality_table_path(fp).write_text(json.dumps(own))
    assert load_quality_table(fp).measured_unix == own["measured_unix"]


def test_the_floor_when_its_level_was_not_encoded():
    """The floor is a quality rank: a floor level the server did not encode means the next
    encoded level above it (never "no floor"), and nothing at or above it is a clear error."""
    from sparkv.edge.planning import AskError, FloorNotEncoded, effective_floor

    assert effective_floor(["raw", "q8", "q5", "q4"], "q6") == "q8"
    assert effective_floor(["q8", "q6", "q5", "q4", "q3"], "q5") == "q5"
    assert effective_floor(["q8", "q4"], None) is None
    with pytest.raises(FloorNotEncoded, match="raw"):
        effective_floor(["q8", "q6", "q5", "q4", "q3"], "raw")
    with pytest.raises(AskError, match="unknown quality floor"):
        effective_floor(["q8"], "q7")
    inst = _floored_instance(_manifest(["q8", "q4", "q3"]), "q6")
    assert inst.quality_floor == "q8"
    with pytest.raises(FloorNotEncoded):
        _floored_instance(_manifest(["q4", "q3"]), "q5")


def test_ask_with_no_flags_follows_the_stored_table(smollm2, tmp_path, monkeypatch):
    """Through a real server and the real engine: ``ask`` with no policy argument reads the
    model's stored table. q4 forbidden: a slow link streams q8 only; q4 allowed: the same link
    streams q4; even q8 forbidden (floor raw, not encoded): the context is computed locally and
    the breakdown says why; an explicit floor that was not encoded is an error."""
    import sparkv.predictor.quality as pq
    from sparkv.edge import EdgeSession, LinkShaper, chat_context
    from sparkv.edge.planning import AskError
    from sparkv.runtime.generate import sample_context_ids
    from sparkv.server.process import ServerProcess

    table_path = tmp_path / "table.json"
    monkeypatch.setattr(pq, "quality_table_path", lambda fp: table_path)
    lm = smollm2
    context = chat_context(lm, sample_context_ids(lm, 300))
    srv = ServerProcess(None, f"file://{tmp_path}/store", log_path=tmp_path / "server.log").start()
    try:
        session = EdgeSession.connect(srv.url, model=lm, timeout_s=120.0)   # a loaded machine
        cid = session.client.create_context(token_ids=context, levels=["q8", "q4"],
                                            chunk_tokens=128)

        def ask(**kw):
            # 4 Mbit/s: q8 frames take ~8 s, far past the 2 s SLO, so a level allowed below
            # q8 is taken (and 4x faster than the 1 Mbit/s this test once used)
            session.client.shaper = LinkShaper.constant(4.0, 5.0)
            session.priors.bandwidth_Bps = None
            return session.ask(cid, "Who may copy the program?", max_new_tokens=4,
                               use_cache=False, strategy="stream", **kw)

        def table(**levels):
            QualityTable(lm.fingerprint, levels=[_pol("raw"), *(
                _pol(n, kept=10 if ok else 5) for n, ok in levels.items())]).save(table_path)

        table(q8=True, q4=False)
        res = ask()
        assert res.instance.quality_floor == "q8"
        assert set(res.breakdown.levels) == {"q8"} and not res.breakdown.fallback
        table(q8=True, q4=True)
        res = ask()
        assert res.instance.quality_floor == "q4" and "q4" in res.breakdown.levels
        table(q8=False, q4=False)
        res = ask()
        assert res.breakdown.bytes_streamed == 0 and res.breakdown.chunks_streamed == 0
        assert res.breakdown.chunks_computed == res.instance.num_chunks
        assert "quality" in res.breakdown.fallback and len(res.tokens) == 4
        with pytest.raises(AskError, match="quality floor"):
            ask(quality_floor="raw")
        session.close()
    finally:
        srv.stop()


def test_the_policy_demands_greedy_agreement_and_picks_the_backend(tmp_path, monkeypatch):
    """The default policy demands QA teacher-forced agreement >= 0.99: q5 at 0.97 sets the floor
    at q6 though the bare gate (0.9) passes it, and a low greedy agreement alone (noisy) does not
    move it. A backend table where block-sparse misses the thresholds and dense passes makes
    ``auto`` dense; without a table ``auto`` stays ``auto``."""
    from sparkv.edge.planning import default_backend, default_quality_floor

    monkeypatch.setenv("SPARKV_CACHE_DIR", str(tmp_path))
    path = tmp_path / "t.json"
    t = QualityTable("fp123", levels=[_pol("raw"), _pol("q8", greedy=0.8), _pol("q6"),
                                      _pol("q5", tf=0.97), _pol("q4")],
                     backends=[_pol("dense"), _pol("block_sparse", tf=0.96)])
    t.save(path)
    assert default_quality_floor("fp123", path=path) == "q6"
    assert allowed_levels(t) == ["raw", "q8", "q6", "q5", "q4"]     # the bare gate is looser
    assert default_backend("fp123", path=path) == "dense"
    t.backends = [_pol("dense"), _pol("block_sparse")]
    t.save(path)
    assert default_backend("fp123", path=path) == "auto"
    t.backends = []
    t.save(path)
    assert default_backend("fp123", path=path) == "auto"
    assert default_backend("fp123") == "auto"                       # no table at all
