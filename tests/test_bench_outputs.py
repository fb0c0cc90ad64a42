"""Where benchmarks write (docs/benchmarks.md): nothing under bench/results/ unless ``--json`` or
``--out`` asks; a ``--quick`` run writes ``NAME_quick.json`` and never overwrites a full run's
file; scratch directories go to the system's temp dir. Only the cheap quick forms run here."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from helpers import shared_tiny_checkpoint
from sparkv.bench.common import RESULTS_DIR_ENV, result_path, write_result
from sparkv.cli import main
from sparkv.errors import SparkvError

ROOT = Path(__file__).resolve().parent.parent
#: the scheduler benchmark cut down to seconds
SCHEDULER_QUICK = ["bench", "scheduler", "--quick", "--sizes", "2", "--mbps", "50",
                   "--milp-time-limit-s", "2"]


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in folder.rglob("*") if p.is_file()} if folder.is_dir() else {}


def _scratch_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("sparkv-dynakv-*")}


def test_a_quick_run_leaves_the_published_results_alone(monkeypatch, capsys):
    monkeypatch.delenv(RESULTS_DIR_ENV, raising=False)
    monkeypatch.chdir(ROOT)            # bench/results of this checkout: the published results
    before = _snapshot(ROOT / "bench" / "results")
    assert main(SCHEDULER_QUICK) == 0
    assert "wrote" not in capsys.readouterr().out
    assert _snapshot(ROOT / "bench" / "results") == before


def test_quick_json_writes_its_own_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path))
    assert main(SCHEDULER_QUICK + ["--json"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scheduler_quick.json",
                                                         "scheduler_quick.png"]
    doc = json.loads((tmp_path / "scheduler_quick.json").read_text())
    assert doc["quick"] is True and doc["config"]["quick"] is True
    assert "scheduler_quick.json" in capsys.readouterr().out


def test_a_quick_run_refuses_to_overwrite_a_full_one(tmp_path, monkeypatch, capsys):
    full = write_result("dynakv", {"results": []}, path=tmp_path / "dynakv.json")
    text = full.read_text()
    with pytest.raises(SparkvError, match="full run"):
        result_path("dynakv", full, quick=True)
    # the check comes before the model loads: no model is needed to see it
    rc = main(["bench", "dynakv", "--quick", "--out", str(full), "--model", "/nonexistent"])
    assert rc == 2 and "full run" in capsys.readouterr().err
    assert full.read_text() == text
    quick = write_result("dynakv", {"results": []}, path=tmp_path / "q.json", quick=True)
    assert result_path("dynakv", quick, quick=True) == quick      # a quick file may be replaced
    assert result_path("dynakv", full) == full                    # and a full run replaces any
    monkeypatch.setenv(RESULTS_DIR_ENV, str(tmp_path))
    assert result_path("dynakv", quick=True) == tmp_path / "dynakv_quick.json"


def test_dynakv_quick_writes_nothing_unless_asked(tmp_path, monkeypatch, capsys):
    """The issue's smoke run (on the tiny model): no JSON, and its flash dir in the system's
    temp dir, removed after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(RESULTS_DIR_ENV, raising=False)
    scratch = _scratch_dirs()
    args = ["bench", "dynakv", "--quick", "--policies", "dynakv,local", "--decode-budgets", "0.25",
            "--prompt-tokens", "128", "--model", str(shared_tiny_checkpoint()), "--threads", "1"]
    assert main(args) == 0
    assert not (tmp_path / "bench").exists() and _scratch_dirs() == scratch
    assert main(args + ["--json"]) == 0
    out = tmp_path / "bench" / "results" / "dynakv_quick.json"
    assert json.loads(out.read_text())["config"]["quick"] is True
    assert [p.name for p in out.parent.iterdir()] == ["dynakv_quick.json"]


def test_a_config_with_tuple_keys_is_written(tmp_path):
    """``--group-trials backend@8192=10`` parses to a tuple key: the result must still be
    written (a table build once measured for an hour, then lost its JSON to this)."""
    path = write_result("x", {"results": []}, {"group_trials": {("backend", 8192): 10,
                                                                 "press": 5}},
                        tmp_path / "x.json")
    assert json.loads(path.read_text())["config"]["group_trials"] == {"backend@8192": 10,
                                                                      "press": 5}


def test_peak_rss_counts_what_its_block_held_and_not_what_an_earlier_one_freed():
    import pytest
    import torch

    from sparkv.bench.common import PeakRss

    with PeakRss() as held:
        x = torch.ones(40_000_000)      # 160 MB, touched
        del x
    if held.bytes is None:
        pytest.skip("no /proc/self/clear_refs here")
    with PeakRss() as after:
        torch.ones(1000)
    assert held.bytes - after.bytes > 120e6
