"""The device service against hostile paths, a full disk, a second service and many clients
(issue 42: M3, M4, M6, L1, L5).

* M3: ``sparkv device serve`` refuses, with one ``sparkv: error:`` line and exit 2, a flash dir,
  socket directory or token file directory that another user controls anywhere up to ``/``
  (a directory of another uid, a symlink of another uid, a directory others may write);
* M4: a full flash (a real 2 MB tmpfs) answers a JSON 507 ``flash_full`` naming the file system,
  leaves no half-made context, reports the flash as degraded in ``/healthz``, and loses nothing
  kept; the service takes calls again once there is room;
* M6: one service per flash dir: a second ``serve`` on it is refused naming the first's pid; a
  SIGKILL-ed service leaves no lock behind;
* L1: concurrent clients of contexts that each fit get answers, not ``507``; memory held by a
  context in use is a ``503 budget_busy`` with ``Retry-After``, and ``507`` is kept for a context
  that can never fit;
* L5: a FIFO or a 20 GB sparse file in place of a segment (or a FIFO journal record) neither hangs
  nor slows the reopen: skipped with a logged reason, pruned; the service starts and answers.

Real processes run the tiny random Llama (fast to load); the full-disk test runs the service
in-process over a real small file system (skipped where mounting one is not allowed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from helpers import flash_profile, shared_tiny_checkpoint
from sparkv.device import BudgetTooSmall, ContextService, DeviceError
from sparkv.device.access import ensure_token
from sparkv.device.app import create_app
from sparkv.device.client import DeviceClient, DeviceProcess
from sparkv.device.errors import BudgetBusy
from sparkv.device.private import check_path

OTHER_UID = 12345
DOC = [(7 * i + 3) % 120 + 1 for i in range(400)]
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="making paths of another uid needs root")


def _proc(swap: Path, name: str, budget_mb: float = 4.0, **kw) -> DeviceProcess:
    """The tiny model's ``serve`` on ``swap``, its socket and log named ``name``."""
    return DeviceProcess(swap, budget_mb=budget_mb, model=str(shared_tiny_checkpoint()),
                         socket=swap.parent / f"{name}.sock", log_path=swap.parent / f"{name}.log",
                         **kw)


# ---- M3: the whole path is checked, as OpenSSH's StrictModes -------------------------------------
def _refused(*args: str) -> str:
    """Runs ``sparkv device serve ARGS`` (the tiny model, a budget it runs in): it must exit 2
    with one ``sparkv: error:`` line, before loading the model (the timeout bounds a serve that
    would start and listen)."""
    out = subprocess.run([sys.executable, "-m", "sparkv.cli", "device", "serve",
                          "--memory-budget-mb", "4", "--model", str(shared_tiny_checkpoint()),
                          *args],
                         capture_output=True, timeout=180,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 2, out.stderr.decode()[-2000:]
    assert len(lines) == 1 and lines[0].startswith("sparkv: error:"), lines
    return lines[0]


@root_only
def test_serve_refuses_a_path_another_user_controls(tmp_path):
    other = tmp_path / "other"                      # another user's directory, 0755
    other.mkdir(mode=0o755)
    os.chown(other, OTHER_UID, OTHER_UID)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "swap").mkdir(mode=0o700)
    link = tmp_path / "link"                        # a flash dir through another user's symlink
    link.symlink_to(mine / "swap")
    os.lchown(link, OTHER_UID, OTHER_UID)
    shared = tmp_path / "shared"                    # writable by everyone, not sticky
    shared.mkdir()
    os.chmod(shared, 0o777)
    # the real command, twice: the socket's directory, a symlinked flash dir
    line = _refused("--flash-dir", str(tmp_path / "s1"), "--socket", str(other / "dev.sock"))
    assert f"the socket's directory {other}: {other} belongs to uid {OTHER_UID}" in line, line
    line = _refused("--flash-dir", str(link), "--socket", str(tmp_path / "s2.sock"))
    assert f"the flash dir {link}: {link} belongs to uid {OTHER_UID}" in line, line
    # the same check, in process: the flash dir's parent, the token file's directory, a
    # directory others may write
    with pytest.raises(DeviceError, match=f"{other} belongs to uid {OTHER_UID}"):
        check_path(other / "swap", "the flash dir", leaf_mode=False)
    with pytest.raises(DeviceError, match=f"{other} belongs to uid {OTHER_UID}"):
        ensure_token(other / "token")
    with pytest.raises(DeviceError, match=f"{shared} is writable by its group or others"):
        check_path(shared / "swap", "the flash dir", leaf_mode=False)
    # nothing was made in the paths it refused: no socket, no flash dir, no token
    assert sorted(p.name for p in other.iterdir()) == []
    assert sorted(p.name for p in (mine / "swap").iterdir()) == []
    assert not (tmp_path / "s1").exists()


@root_only
def test_the_python_api_checks_the_flash_dirs_whole_path(tiny_llama, tmp_path):
    other = tmp_path / "other"
    other.mkdir(mode=0o755)
    os.chown(other, OTHER_UID, OTHER_UID)
    with pytest.raises(DeviceError, match=f"belongs to uid {OTHER_UID}"):
        ContextService(tiny_llama, 1 << 20, other / "swap", io_profile=flash_profile())
    assert not (other / "swap").exists()
    sticky = tmp_path / "sticky"                   # as /tmp: writable by all, sticky: fine
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    svc = ContextService(tiny_llama, 1 << 20, sticky / "swap", io_profile=flash_profile())
    svc.close()


# ---- M6: one service per flash dir ---------------------------------------------------------------
def test_a_second_service_on_a_flash_dir_is_refused_and_a_killed_one_leaves_no_lock(tmp_path):
    swap = tmp_path / "swap"
    first = _proc(swap, "first").start()
    try:
        with first.client() as c:
            cid = c.new_context(system_ids=DOC[:40])
            c.call(cid, prompt_ids=[5, 6, 7], max_new_tokens=3)
        second = _proc(swap, "second")
        with pytest.raises(DeviceError, match="exited"):
            second.start(timeout=180)
        assert second.proc.returncode == 2
        said = [x for x in second.log().splitlines() if x.startswith("sparkv: error:")]
        assert len(said) == 1 and f"in use by another sparkv device service (pid " \
            f"{first.proc.pid})" in said[0], second.log()[-2000:]
        assert not second.socket.exists()
        with first.client() as c:                   # the first one is unharmed
            assert [d["id"] for d in c.list()] == [cid]
    finally:
        first.kill()                                 # SIGKILL: the lock file stays, the lock not
    assert (swap / "lock").exists()
    third = _proc(swap, "third").start(timeout=180)
    try:
        with third.client() as c:
            assert [d["id"] for d in c.list()] == [cid]
            assert c.call(cid, prompt_ids=[8], max_new_tokens=2).stats["context_tokens"] > 40
    finally:
        third.stop()


# ---- L1: contention is a 503 with Retry-After, never-fits a 507 ----------------------------------
def test_concurrent_clients_of_contexts_that_fit_alone_get_answers(tmp_path):
    """8 clients, one context each (each fits the budget alone, not all at once), calling at
    once: every call answers. A context queued behind another's call holds no memory (before,
    its lock pinned its memory and the running call got 507 ``budget_too_small``)."""
    swap = tmp_path / "swap"
    proc = _proc(swap, "busy", budget_mb=0.7).start(timeout=180)
    try:
        with proc.client() as c:
            ids = [c.new_context(system_ids=DOC[i:i + 360]) for i in range(8)]
        start = threading.Barrier(len(ids))
        failures: list[str] = []
        answered: list[int] = []

        def client(cid: str) -> None:
            with proc.client() as c:
                start.wait(timeout=120)
                for turn in range(4):
                    try:
                        r = c.call(cid, prompt_ids=[3 + turn, 9, 27], max_new_tokens=3)
                        answered.append(len(r.tokens))
                    except DeviceError as e:
                        failures.append(f"{e.status} {e.code}: {e}")

        threads = [threading.Thread(target=client, args=(cid,)) for cid in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not any(t.is_alive() for t in threads)
        assert failures == [] and len(answered) == 4 * len(ids)
        with proc.client() as c:
            st = c.stats()
            assert st["budget_violations"] == 0 and st["calls"] == 4 * len(ids)
            with pytest.raises(BudgetTooSmall) as e:     # never fits: still a 507
                c.new_context(system_ids=(DOC * 8)[:3000])
            assert e.value.status == 507 and e.value.code == "budget_too_small"
    finally:
        proc.stop()


def test_memory_held_by_a_context_in_use_is_a_503_with_retry_after(tiny_llama, tmp_path):
    from sparkv.device.loader import working_nbytes
    from sparkv.layout import ChunkGeometry

    svc = ContextService(tiny_llama, 64 << 20, tmp_path / "swap", io_profile=flash_profile(),
                         keep_working=False)
    a = svc.new_context(system_ids=DOC[:300])
    b = svc.new_context(system_ids=DOC[50:350])
    g = ChunkGeometry.from_config(tiny_llama.config, 300, 16)
    w = working_nbytes(g, 0, tiny_llama.dtype)
    need = w + w // g.num_layers + 4096              # what a new 300-token context reserves
    svc.budget = svc.used_bytes() + need // 2        # it fits alone, not beside a and b
    assert need <= svc.budget
    with TestClient(create_app(svc), base_url="http://localhost") as http:
        with svc.locked(a), svc.locked(b):        # in use: their memory cannot be reclaimed
            with pytest.raises(BudgetBusy):
                svc.new_context(system_ids=DOC[100:400])
            r = http.post("/v1/contexts", json={"system_ids": DOC[100:400]})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "budget_busy"
            assert len(svc.list()) == 2              # nothing half-made, nothing evicted
        r = http.post("/v1/contexts", json={"system_ids": DOC[100:400]})
        assert r.status_code == 201                  # once they are free, it runs
        svc.budget = need - 1                          # never fits, whatever is freed: 507
        r = http.post("/v1/contexts", json={"system_ids": DOC[:300]})
        assert r.status_code == 507 and r.json()["error"]["code"] == "budget_too_small"
    svc.close()


# ---- L5: segment files a reopen must not trust ---------------------------------------------------
def test_a_fifo_or_a_huge_sparse_segment_neither_hangs_nor_slows_the_reopen(tmp_path):
    swap = tmp_path / "swap"
    proc = _proc(swap, "before").start(timeout=180)
    try:
        with proc.client() as c:
            cid = c.new_context(system_ids=DOC[:100])
            c.call(cid, prompt_ids=[5, 6], max_new_tokens=2)
            want = c.call(cid, prompt_ids=[9, 10], max_new_tokens=4, grow=False)
    finally:
        proc.stop()
    ctx_dir = swap / "contexts" / cid
    fifo = ctx_dir / "seg-00000090.skvs"
    os.mkfifo(fifo, 0o600)                            # no writer: an open would block for ever
    huge = ctx_dir / "seg-00000091.skvs"
    with open(huge, "wb") as f:
        f.truncate(20 << 30)                          # 20 GB of holes
    chunk_fifo = ctx_dir / "3.skvt"
    os.mkfifo(chunk_fifo, 0o600)
    record_fifo = swap / "journal" / "00ff00ff00ff00ff.json"
    os.mkfifo(record_fifo, 0o600)
    again = _proc(swap, "after").start(timeout=180)
    try:
        with again.client() as c:
            assert [d["id"] for d in c.list()] == [cid]
            r = c.call(cid, prompt_ids=[9, 10], max_new_tokens=4, grow=False)
            assert len(r.tokens) == 4 and r.stats["context_tokens"] == want.stats["context_tokens"]
            damaged = {d["id"]: d["reason"] for d in c.damaged()}
            assert "not a regular file" in damaged["00ff00ff00ff00ff"]
    finally:
        again.stop()
    log = again.log()
    assert f"skipping {fifo}: not a regular file" in log
    assert f"skipping {huge}: {20 << 30} bytes, more than" in log
    assert f"skipping {chunk_fifo}: not a regular file" in log
    assert not fifo.exists() and not huge.exists()     # pruned: no record of them was attached


# ---- M4: a full flash ----------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MB tmpfs under ``tmp_path`` (skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                          capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(mnt: Path) -> Path:
    """Fills the file system with one file until it has no byte left."""
    filler = mnt / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"\1" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def test_a_full_flash_is_a_507_naming_it_and_loses_nothing_kept(tiny_llama, small_disk):
    svc = ContextService(tiny_llama, 8 << 20, small_disk / "swap", io_profile=flash_profile(),
                         compression="fp")        # fp: answers identical after a reopen
    kept = svc.new_context(system_ids=DOC[:120])
    svc.call(kept, prompt_ids=[5, 6, 7], max_new_tokens=3)
    before = svc.describe(kept)
    want = svc.call(kept, prompt_ids=[9, 10], max_new_tokens=4, grow=False).tokens
    filler = _fill(small_disk)
    with TestClient(create_app(svc), base_url="http://localhost",
                    raise_server_exceptions=False) as http:
        r = http.post("/v1/contexts", json={"system_ids": DOC[:200]})
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "flash_full" and str(small_disk) in err["message"]
        listed = http.get("/v1/contexts").json()
        assert [d["id"] for d in listed["contexts"]] == [kept] and listed["damaged"] == []
        assert sorted(p.name for p in (small_disk / "swap" / "contexts").iterdir()) == [kept]
        assert sorted(p.stem for p in (small_disk / "swap" / "journal").iterdir()) == [kept]
        health = http.get("/healthz").json()
        assert health["ok"] and health["flash"]["state"] == "degraded"
        assert "no space left" in health["flash"]["reason"]
        assert health["flash"]["mount"] == str(small_disk)
        # a call that cannot be kept is a 507 too, and leaves the context as it was
        r = http.post(f"/v1/contexts/{kept}/call", json={"prompt_ids": [11, 12],
                                                          "max_new_tokens": 3})
        assert r.status_code == 507 and r.json()["error"]["code"] == "flash_full"
        after = http.get(f"/v1/contexts/{kept}").json()
        assert after["tokens"] == before.tokens and after["calls"] == before.calls + 1
        filler.unlink()                                # room again: nothing kept was lost
        r = http.post(f"/v1/contexts/{kept}/call", json={"prompt_ids": [9, 10],
                                                          "max_new_tokens": 4, "grow": False})
        assert r.status_code == 200 and r.json()["tokens"] == want
        assert http.get("/healthz").json()["flash"]["state"] == "ok"
        assert http.post("/v1/contexts", json={"system_ids": DOC[:200]}).status_code == 201
    svc.close()
    again = ContextService(tiny_llama, 8 << 20, small_disk / "swap", io_profile=flash_profile(),
                           compression="fp")
    assert kept in {d.id for d in again.list()} and again.damaged_list() == []
    assert again.describe(kept).tokens == before.tokens
    again.close()
