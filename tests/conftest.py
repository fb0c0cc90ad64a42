"""Shared fixtures: the real SmolLM2 (loaded once per session) and a tiny random GQA Llama."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch


def _test_threads() -> int:
    """Torch threads per test process: SPARKV_TEST_THREADS, else the cores shared out among
    pytest-xdist's workers (deploy/run.sh runs one per core), at most 2."""
    if "SPARKV_TEST_THREADS" in os.environ:
        return int(os.environ["SPARKV_TEST_THREADS"])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // workers))


# one thread where the machine is shared (SPARKV_TEST_THREADS=1) avoids OpenMP spin-waits
torch.set_num_threads(_test_threads())


# the servers the tests start compute in float32 on every machine: tests compare what they
# stream with in-process float32 references, and `auto` takes a bf16 configuration on a CPU with
# AVX512-BF16 or AMX where the model's quality table passes one (docs/dtypes.md); a test of
# `auto` itself passes --dtype or a fake cpuinfo. SPARKV_DTYPE=auto runs the suite's servers as
# a user's would.
os.environ.setdefault("SPARKV_DTYPE", "float32")


def _use_the_fork_server() -> None:
    """The servers and device services the tests start come from a fork server that imported
    torch and transformers once (tests/forklaunch.py); ``SPARKV_TEST_FORK=0``: each its own
    interpreter, as ``python -m sparkv.cli`` starts it."""
    if os.environ.get("SPARKV_TEST_FORK", "1") != "0":
        from forklaunch import ForkLauncher

        from sparkv.launch import use_launcher

        use_launcher(ForkLauncher())


_use_the_fork_server()


def _file_seconds() -> dict[str, float]:
    """Each test file's measured seconds (tests/durations.json: a whole-suite run on 2 cores
    with 3 workers, as CI runs it: each file's summed test times from ``--junitxml``, files
    under 3 s left out; test_types.py at a fresh clone's time, where mypy's cache is cold).
    A file it lacks counts as 1 s, so it goes last: re-measure it when a file grows."""
    try:
        return json.loads((Path(__file__).parent / "durations.json").read_text())
    except (OSError, ValueError):
        return {}


def pytest_collection_modifyitems(session, config, items):
    """The longest files first (stable within a file): pytest-xdist's ``--dist loadfile`` hands
    files out in this order (deploy/run.sh passes ``--no-loadscope-reorder``), so the last file a
    worker takes is a short one and no worker idles while another finishes a long one."""
    seconds = _file_seconds()
    items.sort(key=lambda item: -seconds.get(item.path.name, 1.0))


_BAR_SWITCHES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")


@pytest.fixture(autouse=True)
def _progress_bars_as_they_were():
    """``--no-progress`` turns the bars off for the whole process through the environment
    (sparkv.logs.disable_progress_bars): a test that runs ``sparkv.cli.main`` in-process with
    it would leave every later test of its worker without bars. Each test ends with the
    switches as it found them."""
    saved = {name: os.environ.get(name) for name in _BAR_SWITCHES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def _torch_threads_as_they_were():
    """A test that runs a command in-process with ``--threads`` sets torch's count for its
    worker's main thread: each test ends with the count it found, so a worker's later tests run
    on the count this file set (more threads than the worker's share of the cores only spin)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    from sparkv.runtime import load_model

    return load_model(progress=True)


@pytest.fixture(scope="session")
def tiny_llama():
    """A 3-layer random Llama with GQA (4 query heads, 2 KV heads), fp32, seeded."""
    from helpers import tiny_llama_model

    return tiny_llama_model(3)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A throwaway ``redis-server`` for this module (skips when Debian's redis-server is missing)."""
    from sparkv.server.process import RedisProcess, redis_server_available

    if not redis_server_available():
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    proc = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield proc.url
    proc.stop()


@pytest.fixture(params=["file", "redis"])
def store(request, tmp_path):
    """Each ChunkStore implementation, empty (Redis: a key prefix of this test's own)."""
    from sparkv.server.stores import open_store

    if request.param == "file":
        s = open_store(f"file://{tmp_path}/store")
    else:
        url = request.getfixturevalue("redis_url")
        s = open_store(f"{url}?prefix=t{abs(hash(request.node.name)) % 10**9}")
    yield s
    s.close()
