"""Reservations waiting for a turn to end are served first come, first served: a later call
whose reservation would fit does not overtake one already waiting."""

from __future__ import annotations

import threading

import pytest

from sparkv.device.errors import BudgetBusy
from sparkv.device.waitline import RESERVATION_ORDERS, RetryLine, WaitLine

WAIT_S = 30.0


class _Device:
    """A model lock, a turn count and a free-memory count, as the service has them."""

    def __init__(self, free: int, turns: int, line: type[WaitLine] = WaitLine) -> None:
        self.lock = threading.Lock()
        self.turn_ended = threading.Condition(self.lock)
        self.line = line(self.turn_ended, BudgetBusy, lambda: self.turns)
        self.free, self.turns = free, turns
        self.order: list[str] = []
        self.waiting: dict[str, threading.Event] = {}

    def reserve(self, name: str, need: int) -> None:
        waiting = self.waiting.setdefault(name, threading.Event())

        def take() -> None:
            if need > self.free:
                raise BudgetBusy(f"{name} needs {need}")
            self.free -= need
            self.order.append(name)

        def wait() -> None:
            waiting.set()
            self.turn_ended.wait()

        with self.lock:
            self.line.take(take, wait)

    def end_turn(self, frees: int) -> None:
        with self.lock:
            self.turns -= 1
            self.free += frees
            self.turn_ended.notify_all()


def _start(dev: _Device, name: str, need: int, errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            dev.reserve(name, need)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    th = threading.Thread(target=run, name=name)
    th.start()
    return th


def test_with_nobody_waiting_a_reservation_takes_at_once():
    dev = _Device(free=10, turns=1)
    dev.reserve("a", 4)
    assert dev.order == ["a"] and dev.free == 6 and len(dev.line) == 0


def test_busy_with_no_turn_running_is_raised_as_it_comes():
    dev = _Device(free=1, turns=0)
    with pytest.raises(BudgetBusy):
        dev.reserve("a", 4)
    assert len(dev.line) == 0


def test_a_later_reservation_that_fits_waits_behind_an_earlier_one():
    dev = _Device(free=3, turns=1)   # a turn holds the memory the big call needs
    errors: list[BaseException] = []
    big = _start(dev, "big", 8, errors)
    assert dev.waiting.setdefault("big", threading.Event()).wait(WAIT_S)
    small = _start(dev, "small", 2, errors)          # fits in the 3 free bytes now
    assert dev.waiting.setdefault("small", threading.Event()).wait(WAIT_S)
    with dev.lock:
        assert dev.order == [] and len(dev.line) == 2   # it queued instead of overtaking
    dev.end_turn(frees=7)                                # 10 free: the big one, then the small
    big.join(WAIT_S)
    small.join(WAIT_S)
    assert not errors and dev.order == ["big", "small"] and dev.free == 0
    assert len(dev.line) == 0


def test_when_the_first_in_line_fails_the_next_goes_on():
    dev = _Device(free=3, turns=1)
    errors: list[BaseException] = []
    big = _start(dev, "big", 50, errors)             # more than the last turn will free
    assert dev.waiting.setdefault("big", threading.Event()).wait(WAIT_S)
    small = _start(dev, "small", 2, errors)
    assert dev.waiting.setdefault("small", threading.Event()).wait(WAIT_S)
    dev.end_turn(frees=7)                                # no turn left: the big one is refused
    big.join(WAIT_S)
    small.join(WAIT_S)
    assert [type(e) for e in errors] == [BudgetBusy]
    assert dev.order == ["small"] and len(dev.line) == 0


def test_many_waiters_are_served_in_arrival_order():
    dev = _Device(free=0, turns=1)
    errors: list[BaseException] = []
    threads = []
    for i in range(5):
        threads.append(_start(dev, f"c{i}", 1, errors))
        assert dev.waiting.setdefault(f"c{i}", threading.Event()).wait(WAIT_S)
    dev.end_turn(frees=5)
    for th in threads:
        th.join(WAIT_S)
    assert not errors and dev.order == [f"c{i}" for i in range(5)]


def test_the_retry_order_lets_a_later_reservation_that_fits_go_first():
    """The order before the line (kept for comparison): the small reservation takes the free
    memory at once, ahead of the big one that waits."""
    assert RESERVATION_ORDERS == {"fcfs": WaitLine, "retry": RetryLine}
    dev = _Device(free=3, turns=1, line=RetryLine)
    errors: list[BaseException] = []
    big = _start(dev, "big", 8, errors)
    assert dev.waiting.setdefault("big", threading.Event()).wait(WAIT_S)
    small = _start(dev, "small", 2, errors)
    small.join(WAIT_S)
    assert dev.order == ["small"]
    dev.end_turn(frees=7)
    big.join(WAIT_S)
    assert not errors and dev.order == ["small", "big"]
