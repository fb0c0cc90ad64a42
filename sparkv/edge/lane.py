"""What one ask shares with the other asks of a device: its **lane** to the device's cores.

An ask alone owns the cores. Under a device service answering several apps at once
(docs/device-service.md, "Asks"), each ask gets a lane from the service's compute worker: its
layer steps run only while the lane holds the cores (one unit of compute at a time across every
ask, granted in turn), the controller plans the ask's remaining compute with the load of the
others (:attr:`ComputeEstimator.load <sparkv.scheduler.estimators.ComputeEstimator.load>`), and
a cancelled ask stops at its next step. Its **link turn** (:meth:`Lane.link_turn`) is the
service's plan of the one link across asks: whether the ask may send a request now, and how many
bytes of the others the link carries before its own (the controller plans its remaining link
time with them: :attr:`LinkEstimator.ahead_bytes
<sparkv.scheduler.estimators.LinkEstimator.ahead_bytes>`).

:class:`Lane` is the protocol :meth:`EdgeSession.ask <sparkv.edge.session.EdgeSession.ask>`
takes (``ask(..., lane=...)``); :class:`LaneStepper` runs a stepper's steps on it. Without a lane
nothing changes: the steps run at once, the load is 1.
"""

from __future__ import annotations

from typing import Any, ContextManager, NamedTuple, Protocol

from sparkv.layout import StepId

__all__ = ["AskCancelled", "Lane", "LaneStepper", "LinkTurn", "on_lane"]


class LinkTurn(NamedTuple):
    """What the device's link plan says to one ask now.

    Attributes:
        ahead_bytes: bytes of other asks the link carries before this ask's (0: none).
        go: whether the ask may send a request now (``False``: wait for its turn; a request
            already sent goes on).
    """

    ahead_bytes: float = 0.0
    go: bool = True


class AskCancelled(Exception):
    """The ask was cancelled (its client went away): raised at its next unit of compute."""


class Lane(Protocol):
    """One ask's share of the device."""

    def hold(self) -> ContextManager[None]:
        """The cores for one unit of compute (a layer step, a column of them, a forward pass),
        waiting for the ask's turn; raises :class:`AskCancelled` once the ask was cancelled."""
        ...

    def run_step(self, stepper: Any, step: StepId) -> Any:
        """``stepper.run_step(step)`` while the lane holds the cores (one unit), waiting for
        the ask's turn; a device service may run it in one call with other asks' steps at the
        same layer (:func:`~sparkv.runtime.stepper.run_steps_together`). Raises
        :class:`AskCancelled` once the ask was cancelled."""
        ...

    def check(self) -> None:
        """Raises :class:`AskCancelled` once the ask was cancelled."""
        ...

    def load(self) -> float:
        """How many asks share the compute path now, this one included (1.0: alone): the
        controller's :attr:`~sparkv.scheduler.estimators.ComputeEstimator.load`."""
        ...

    def first(self) -> bool:
        """Whether no other ask's units go before this one's now (alone, or the oldest ask):
        a long unit of its own (a column of layer steps) then keeps none waiting that should
        not wait."""
        ...

    def link_turn(self, pending_bytes: float) -> LinkTurn:
        """The ask has ``pending_bytes`` still to arrive over the link (queued and in flight):
        its turn on the link now (:class:`LinkTurn`). Called by the compute thread at every
        look for a step, and by the link thread before each request."""
        ...

    def attach(self, memory: Any) -> None:
        """The ask's KV memory (a stepper's ``kv``): a service counts what its asks hold (it
        keeps no strong reference: the memory is freed with the ask)."""
        ...


class LaneStepper:
    """A :class:`~sparkv.runtime.stepper.LayerStepper` whose steps run when ``lane`` holds the
    cores. Everything else (its KV memory, ``done``, ``ready``, the geometry) is the stepper's.
    A step's own time (``StepResult.seconds``, what the controller learns the device's speed
    from) excludes the wait for the lane: the wait is the load's, not the device's."""

    def __init__(self, stepper: Any, lane: Lane) -> None:
        self._stepper = stepper
        self._lane = lane
        lane.attach(stepper.kv)

    def run_step(self, step: StepId) -> Any:
        return self._lane.run_step(self._stepper, step)

    def run_column(self, t: int, l0: int, l1: int) -> list[Any]:  # noqa: E741
        """The column as one call while no other ask goes before this one
        (:meth:`Lane.first`); else layer by layer (each its own turn: a long column would hold
        the cores from them)."""
        if not self._lane.first():
            return [self.run_step(StepId(t, l)) for l in range(l0, l1)]  # noqa: E741
        with self._lane.hold():
            return self._stepper.run_column(t, l0, l1)

    def run_span(self, t0: int, t1: int, l: int) -> list[Any]:  # noqa: E741
        """A layer's token chunks as one call (a launch-bound device's span) while no other ask
        goes before this one; else chunk by chunk, each its own turn (as :meth:`run_column`)."""
        if not self._lane.first():
            return [self.run_step(StepId(t, l)) for t in range(t0, t1)]
        with self._lane.hold():
            return self._stepper.run_span(t0, t1, l)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stepper, name)


def on_lane(stepper: Any, lane: Lane | None) -> Any:
    """``stepper`` on ``lane`` (itself without one)."""
    return stepper if lane is None else LaneStepper(stepper, lane)
