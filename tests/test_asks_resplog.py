"""The events of a streamed background response (sparkv/asks/resplog.py), without a service
(tests/test_asks_service.py reads them through the ``openai`` client): readers follow a log from
any event, as it grows, until it ends; a reader that leaves stops nothing; the logs of ended
responses are kept for their app alone, the last few, within their bytes."""

from __future__ import annotations

import asyncio
import os

from sparkv.asks.resplog import EventLog, EventLogs


async def _read(log: EventLog, after: int = -1, leave_after: int | None = None) -> list[bytes]:
    out = []
    async for ev in log.follow(after):
        out.append(ev)
        if leave_after is not None and len(out) >= leave_after:
            break
    return out


def test_readers_follow_a_log_as_it_grows_from_any_event_until_it_ends():
    async def go():
        log = EventLog("app:a")
        whole = asyncio.ensure_future(_read(log))
        tail = asyncio.ensure_future(_read(log, after=1))
        leaver = asyncio.ensure_future(_read(log, leave_after=2))
        for k in range(5):
            log.add(f"e{k}".encode())
            await asyncio.sleep(0)
        assert await leaver == [b"e0", b"e1"]         # it left; the log goes on
        assert not whole.done()
        log.add(b"e5")
        log.end()
        assert await whole == [f"e{k}".encode() for k in range(6)]
        assert await tail == [f"e{k}".encode() for k in range(2, 6)]
        assert await _read(log, after=3) == [b"e4", b"e5"]      # after it ended
        assert await _read(log, after=99) == []
        assert log.nbytes == 12

    asyncio.run(go())


def test_ended_logs_are_kept_for_their_app_the_last_few_within_their_bytes():
    async def go():
        logs = EventLogs(finished=2, finished_bytes=100)
        for k in range(3):
            logs.open("app:a", f"r{k}").add(b"x" * 10)
            assert logs.get("app:a", f"r{k}") is not None
            assert logs.get("app:b", f"r{k}") is None          # another app's
            logs.end(f"r{k}")
        assert [logs.get("app:a", f"r{k}") is not None for k in range(3)] == [False, True, True]
        logs.open("app:a", "big").add(b"x" * 101)
        logs.end("big")
        assert logs.get("app:a", "big") is None                # over the bytes alone
        logs.forget("app:b", "r2")
        assert logs.get("app:a", "r2") is not None
        logs.forget("app:a", "r2")
        assert logs.get("app:a", "r2") is None
        gone = logs.open("app:a", "deleted")
        logs.end("deleted", keep=False)
        assert gone.ended and logs.get("app:a", "deleted") is None
        running = logs.open("app:a", "run")
        reader = asyncio.ensure_future(_read(running))
        await asyncio.sleep(0)
        logs.close()                                           # the service stops
        assert await reader == [] and logs.get("app:a", "run") is None

    asyncio.run(go())


# ---- on the flash (sparkv/asks/resplogfiles.py) ------------------------------------------------
def _ev(k: int, kind: str = "response.output_text.delta") -> bytes:
    return f'event: {kind}\ndata: {{"type": "{kind}", "sequence_number": {k}}}\n\n'.encode()


def _rid(k: int) -> str:
    return f"resp_{k:032x}"


def _ran(logs: EventLogs, rid: str, n: int, end: bool = True) -> None:
    log = logs.open("app:a", rid)
    for k in range(n):
        log.add(_ev(k))
    if end:
        logs.end(rid)


def test_a_restarted_service_streams_the_ended_logs_again_and_one_cut_short_to_its_end(
        tmp_path):
    """Each log is a file as it comes: the next service reads the ended ones back, event for
    event, for the responses still kept (the others' files removed); one cut short (the service
    stopped it, or a power cut took its tail) reads on to the event its response ended with,
    numbered on, added once (a stopped one's response.failed); ended logs past the bounds, or
    forgotten, lose their files."""
    import json

    from sparkv.asks.respfiles import STOPPED
    from sparkv.asks.resplogfiles import EventFiles

    async def before():
        logs = EventLogs(files=EventFiles(tmp_path))
        _ran(logs, _rid(1), 3)
        _ran(logs, _rid(2), 2)
        _ran(logs, _rid(3), 4, end=False)           # running when the service stops
        _ran(logs, _rid(4), 1, end=False)           # (as a power cut leaves a completed one)
        _ran(logs, _rid(5), 1)
        logs.forget("app:a", _rid(5))               # deleted: its file goes
        assert (tmp_path / f"{_rid(3)}.events").stat().st_mode & 0o777 == 0o600
        logs.close()

    asyncio.run(before())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{_rid(k)}.events" for k in (1, 2, 3, 4)]
    for k in (1, 2, 3, 4):                          # their order (the clock's steps are coarse)
        os.utime(tmp_path / f"{_rid(k)}.events", (1e9 + k, 1e9 + k))
    stopped = {"id": _rid(3), "status": "failed", "error": STOPPED}
    completed = {"id": _rid(4), "status": "completed", "output": [{"type": "message"}]}
    kept = {_rid(1): {"status": "completed"}, _rid(3): stopped, _rid(4): completed}

    async def after():
        logs = EventLogs(files=EventFiles(tmp_path))
        assert logs.load(lambda app, rid: kept.get(rid) if app == "app:a" else None) == 3
        assert await _read(logs.get("app:a", _rid(1))) == [_ev(k) for k in range(3)]
        assert logs.get("app:b", _rid(1)) is None and logs.get("app:a", _rid(2)) is None
        got = await _read(logs.get("app:a", _rid(3)), after=2)
        assert got[0] == _ev(3)
        last = json.loads(got[1].split(b"data: ", 1)[1])
        assert last == {"type": "response.failed", "sequence_number": 4, "response": stopped}
        cut = await _read(logs.get("app:a", _rid(4)))
        assert cut[0] == _ev(0) and json.loads(cut[1].split(b"data: ", 1)[1]) == {
            "type": "response.completed", "sequence_number": 1, "response": completed}
        return got

    got = asyncio.run(after())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{_rid(k)}.events" for k in (1, 3, 4)]

    async def again():                              # the ends were added once, the logs ended
        logs = EventLogs(finished=2, files=EventFiles(tmp_path))
        assert logs.load(lambda app, rid: kept.get(rid)) == 2
        assert (await _read(logs.get("app:a", _rid(3))))[3:] == got
        assert len(await _read(logs.get("app:a", _rid(4)))) == 2
        assert logs.get("app:a", _rid(1)) is None      # past the bounds: its file too

    asyncio.run(again())
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{_rid(k)}.events" for k in (3, 4)]


def test_a_reader_after_the_last_event_learns_how_the_response_ended():
    """A reader that asks after the last event of an ended log, or after events it does not
    hold (a power cut took them), is given the event its stream ended with; a log that ended
    otherwise (cancelled) gives it nothing; a reader that read on to the end is given no
    event twice."""
    from sparkv.asks.resplogfiles import end_event

    async def go():
        logs = EventLogs()
        log = logs.open("app:a", _rid(1))
        reader = asyncio.ensure_future(_read(log))
        past = asyncio.ensure_future(_read(log, after=5))       # waits: the log runs on
        await asyncio.sleep(0)
        log.add(_ev(0))
        log.add(end_event(1, {"status": "incomplete"}))
        logs.end(_rid(1))
        ending = log.events[1]
        assert await reader == [_ev(0), ending] and await past == [ending]
        assert await _read(log, after=1) == [ending] == await _read(log, after=40)
        assert await _read(log, after=0) == [ending]
        _ran(logs, _rid(2), 2)                      # cancelled: it just ends
        assert await _read(logs.get("app:a", _rid(2)), after=1) == []

    asyncio.run(go())


def test_files_are_synced_in_groups_off_the_event_loop(tmp_path, monkeypatch, caplog):
    """A running log's file is synced once SYNC_S passed since it last was (its folder with the
    first), an ended or stopped one's at once; each in the syncing thread, of a duplicate
    descriptor, so the file closes without waiting; a failing sync is said in the log."""
    import errno
    import logging
    import threading

    from sparkv.asks import resplogfiles
    from sparkv.asks.resplogfiles import SYNC_S, EventFiles

    now, synced = [0.0], []
    real = os.fdatasync

    def recording(fd: int) -> None:
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), threading.current_thread().name))
        real(fd)

    monkeypatch.setattr(resplogfiles.os, "fdatasync", recording)
    files = EventFiles(tmp_path / "ev", clock=lambda: now[0])

    async def go():
        logs = EventLogs(files=files)
        log = logs.open("app:a", _rid(1))
        for k in range(3):
            log.add(_ev(k))
        files.syncs.wait()
        assert synced == []                         # within SYNC_S: the page cache only
        now[0] += SYNC_S
        log.add(_ev(3))
        log.add(_ev(4))
        files.syncs.wait()
        assert len(synced) == 1 and synced[0][0].endswith(f"{_rid(1)}.events")
        assert synced[0][1].startswith("sparkv-events-sync")
        logs.end(_rid(1))                           # its end mark synced at once
        _ran(logs, _rid(2), 1, end=False)
        logs.close()                                # stopped: synced, the thread ended
        assert [s[0].rsplit("/", 1)[1] for s in synced[1:]] == [
            f"{_rid(1)}.events", f"{_rid(2)}.events"]

    asyncio.run(go())

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(resplogfiles.os, "fdatasync", failing)
    with caplog.at_level(logging.WARNING, "sparkv.asks"):
        asyncio.run(_end_one(EventLogs(files=files)))
    files.syncs.wait()
    assert f"the events of {_rid(3)} may not all reach the disk" in caplog.text
    assert (tmp_path / "ev" / f"{_rid(3)}.events").read_bytes().endswith(b": end\n\n")


async def _end_one(logs: EventLogs) -> None:
    _ran(logs, _rid(3), 1)


def test_a_damaged_events_file_is_removed_and_a_torn_last_event_left_out(tmp_path):
    """A file read back that is not a log of its id (another format, id or name, an event out
    of order or no event, text after the end mark) is removed; a last event a crash cut short
    is left out of a stopped response's log."""
    from sparkv.asks.respfiles import STOPPED
    from sparkv.asks.resplogfiles import END, EventFiles, FORMAT

    def head(rid: str, fmt: str = FORMAT) -> bytes:
        return f'{{"format": "{fmt}", "app": "app:a", "id": "{rid}"}}\n'.encode()

    bad = {_rid(1): head(_rid(1), "other/1") + END,
           _rid(2): head(_rid(9)) + END,
           _rid(3): head(_rid(3)) + _ev(1) + END,
           _rid(4): head(_rid(4)) + b"data: {}\n\n" + END,
           _rid(5): head(_rid(5)) + _ev(0) + END + b"x",
           _rid(6): b"not json\n"}
    for rid, data in bad.items():
        (tmp_path / f"{rid}.events").write_bytes(data)
    (tmp_path / "resp_x.events").write_bytes(head("resp_x") + END)
    torn = _rid(7)
    (tmp_path / f"{torn}.events").write_bytes(head(torn) + _ev(0) + _ev(1)[:20])
    logs = EventLogs(files=EventFiles(tmp_path))
    failed = {"status": "failed", "error": STOPPED}
    assert logs.load(lambda app, rid: failed) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f"{torn}.events"]
    events = asyncio.run(_read(logs.get("app:a", torn)))
    assert events[0] == _ev(0) and b'"sequence_number": 1' in events[1] and len(events) == 2
    again = EventLogs(files=EventFiles(tmp_path))       # written again whole: read the same
    assert again.load(lambda app, rid: {"status": "completed"}) == 1
    assert asyncio.run(_read(again.get("app:a", torn))) == events


def test_a_disk_that_fails_a_write_leaves_the_log_in_memory_only(tmp_path, monkeypatch, caplog):
    """An event whose write fails (a full disk): the log goes on in memory, whole for its
    readers, its file removed (said in the log) and never read back half."""
    import errno

    from sparkv.asks import resplogfiles
    from sparkv.asks.resplogfiles import EventFiles

    real, calls = os.write, []

    def failing(fd: int, data: bytes) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):    # its file only
            calls.append(data)
            if len(calls) == 3:                   # the header, an event, then a full disk
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    async def go():
        logs = EventLogs(files=EventFiles(tmp_path))
        monkeypatch.setattr(resplogfiles.os, "write", failing)
        _ran(logs, _rid(1), 4)
        assert await _read(logs.get("app:a", _rid(1))) == [_ev(k) for k in range(4)]

    asyncio.run(go())
    assert "in memory only" in caplog.text and list(tmp_path.iterdir()) == []
    assert EventLogs(files=EventFiles(tmp_path)).load(lambda app, rid: {}) == 0
