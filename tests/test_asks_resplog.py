"""The events of a streamed background response (sparkv/asks/resplog.py), without a service
(tests/test_asks_service.py reads them through the ``openai`` client): readers follow a log from
any event, as it grows, until it ends; a reader that leaves stops nothing; the logs of ended
responses are kept for their app alone, the last few, within their bytes."""

from __future__ import annotations

import asyncio

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
