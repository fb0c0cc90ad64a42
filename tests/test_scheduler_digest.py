"""The runtime controller decides exactly as it did when the digest was stored: every 13th case
of ``tests/ctl_digest.py`` (simulated timelines, loads driven the way the edge engine drives the
controller) and 28 recorded real-engine loads replayed call by call, each reduced to one sha256
of everything it produced (docs/scheduler.md, "Rules and their compositions").

A change that alters a decision fails here. If the change is meant to, regenerate the digest
and say in the commit how many cases changed and why::

    PYTHONPATH=. python tests/ctl_digest.py --reduced --out tests/data/controller_digest.json \
        --replay tests/data/controller_engine_calls.json.gz
"""

from __future__ import annotations

import json

import pytest

import ctl_digest as cd


@pytest.fixture(scope="module")
def stored() -> dict[str, str]:
    return json.loads(cd.DIGEST_FILE.read_text())


@pytest.fixture(scope="module")
def replays():
    return cd.load_replays(cd.ENGINE_CALLS_FILE)


def _differ(cases: list, stored: dict[str, str], replays=None) -> list[str]:
    return [c.key for c in cases if cd.run_case(c, replays) != stored.get(c.key)]


def test_the_stored_digest_covers_the_reduced_cases(stored, replays):
    keys = {c.key for c in cd.reduced(cd.all_cases())} | {c.key for c in replays[1]}
    assert keys == set(stored)


@pytest.mark.parametrize("kind", ["sim", "drive"])
def test_simulated_and_driven_loads_are_unchanged(stored, kind):
    cases = [c for c in cd.reduced(cd.all_cases()) if c.kind == kind]
    assert len(cases) > 40
    assert _differ(cases, stored) == []


def test_recorded_engine_loads_replay_unchanged(stored, replays):
    doc, cases = replays
    for c in cases:
        assert cd.run_replay(doc, c)["mismatches"] == [], c.key   # every answer as recorded
    assert _differ(cases, stored, doc) == []
