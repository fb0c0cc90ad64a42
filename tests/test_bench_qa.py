"""The natural QA sets (sparkv/bench/qa.py, sparkv/data/qa_*.json): every bundled set loads, its
ids are unique, its passages hold the answers and its slices fit the model; bad files fail
clearly."""

from __future__ import annotations

import json
import shutil

import pytest

from sparkv.bench.qa import (QA_FILE, QAItem, QASetError, bundled_qa_files, load_qa_set,
                             load_qa_sets, qa_paths)

NEW_KINDS = {"manual", "transcript", "code", "narrative"}
MAX_SLICE_TOKENS = 8192 - 256  # the model's window less the question and the answer


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def test_every_bundled_set_loads_with_unique_ids():
    files = bundled_qa_files()
    assert files[0] == QA_FILE and len(files) >= 5
    for path in files:
        assert load_qa_set(path).items, path
    qa = load_qa_sets()
    assert len(qa.items) >= 87
    assert len({it.id for it in qa.items}) == len(qa.items)
    assert set(qa.by_slice()) == set(qa.slices)
    assert qa.items[0].id == "gpl-a-1"            # the license set keeps its place
    assert [it.id for it in qa.limit(3).items] == ["gpl-a-1", "gpl-a-2", "gpl-a-3"]


def test_kinds_cover_four_kinds_of_text_besides_licenses():
    qa = load_qa_sets()
    kinds = qa.by_kind()
    assert NEW_KINDS <= set(kinds) and "license" in kinds
    assert sum(len(v) for k, v in kinds.items() if k != "license") >= 60
    for kind in NEW_KINDS:
        assert len(kinds[kind]) >= 15, kind
    for it in qa.items:
        assert it.kind == qa.slices[it.slice].kind


def test_passages_hold_a_keyword_and_spread_over_the_text():
    qa = load_qa_sets()
    for it in qa.items:
        passage = _norm(qa.passage(it))
        assert any(_norm(k) in passage for k in it.keywords), it.id
    for slice_id, items in qa.by_slice().items():
        if qa.slices[slice_id].kind == "license":
            continue
        a, b = qa.slices[slice_id].lines
        thirds = {min(2, 3 * (it.passage[0] - a) // (b - a + 1)) for it in items}
        assert thirds == {0, 1, 2}, slice_id       # early, middle and late questions


def test_every_slice_fits_the_model(smollm2):
    qa = load_qa_sets()
    for s in qa.slices.values():
        n = len(smollm2.encode_text(qa.text(s.id)))
        assert 1500 <= n <= MAX_SLICE_TOKENS, (s.id, n)


def test_contexts_carry_the_kind(smollm2):
    from sparkv.bench.quality import build_contexts

    ctxs = build_contexts(smollm2, ["qa"], [], lambda fam, size: 0)
    probes = [p for c in ctxs for p in c.probes]
    assert len(probes) == len(load_qa_sets().items)
    assert {p.qa.kind for p in probes} >= NEW_KINDS | {"license"}
    one = build_contexts(smollm2, ["qa"], [], lambda fam, size: 0,
                         qa_path=str(bundled_qa_files()[1]))
    assert {p.qa.kind for c in one for p in c.probes} == {load_qa_set(bundled_qa_files()[1])
                                                          .items[0].kind}


def test_qa_paths():
    assert qa_paths(None) == bundled_qa_files() == qa_paths("")
    assert [p.name for p in qa_paths(" a.json, b.json ,")] == ["a.json", "b.json"]
    assert [p.name for p in qa_paths(["a.json", "b.json"])] == ["a.json", "b.json"]
    with pytest.raises(QASetError):
        qa_paths(" , ")
    two = load_qa_sets(",".join(str(p) for p in bundled_qa_files()[:2]))
    assert len({it.kind for it in two.items}) == 2
    with pytest.raises(QASetError):
        _ = two.source_lines                      # two sources: ask text() instead


def _write(tmp_path, name: str, doc: dict) -> str:
    (tmp_path / name).write_text(json.dumps(doc))
    return str(tmp_path / name)


def test_bad_files_fail_clearly(tmp_path):
    (tmp_path / "src.txt").write_text("a\nb\nc\n")
    good = {"kind": "toy", "source": "src.txt", "slices": [{"id": "s", "lines": [1, 3]}],
            "questions": [{"id": "q", "slice": "s", "passage": [2, 2], "question": "b?",
                           "keywords": ["b"]}]}
    qa = load_qa_set(_write(tmp_path, "good.json", good))
    assert qa.items[0].kind == "toy" and qa.passage(qa.items[0]) == "b\n"
    assert QAItem("x", "s", "q?", (1, 1), ("k",)).kind == "other"
    cases = {"does not exist": {"source": "nope.txt"},
             "outside 1-3": {"slices": [{"id": "s", "lines": [0, 3]}]},
             "passage": {"questions": [{**good["questions"][0], "passage": [3, 2]}]},
             "malformed": {"questions": [{**good["questions"][0], "passage": [2]}]},
             "kind": {"kind": ""},
             "missing": {"questions": None}}
    for want, bad in cases.items():
        doc = {k: v for k, v in {**good, **bad}.items() if v is not None}
        with pytest.raises(QASetError, match=want):
            load_qa_set(_write(tmp_path, "bad.json", doc))
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(QASetError, match="not valid JSON"):
        load_qa_set(tmp_path / "broken.json")
    with pytest.raises(QASetError, match="cannot read"):
        load_qa_sets(str(tmp_path / "absent.json"))


def test_ids_shared_by_two_files_fail(tmp_path):
    shutil.copy(QA_FILE.parent / "qa_story.txt", tmp_path / "qa_story.txt")
    doc = json.loads((QA_FILE.parent / "qa_story.json").read_text())
    a = _write(tmp_path, "a.json", doc)
    with pytest.raises(QASetError, match="slice id"):
        load_qa_sets([a, a])
    doc["slices"][0]["id"] = doc["slices"][0]["id"] + "-2"
    for q in doc["questions"]:
        q["slice"] = doc["slices"][0]["id"]
    with pytest.raises(QASetError, match="question id"):
        load_qa_sets([a, _write(tmp_path, "b.json", doc)])
