"""The one loop: the only reader of the event queue.

Every wait of r1sup (a launch starting, the probe, serving, a drain, a backoff, the output that follows
an exit) is a :class:`Phase`. :meth:`Loop.run` turns the loop for it::

    event = queue.get(timeout)
    outcome = phase.on(event, now)

``on`` returns None to go on, another phase to hand over to, or :class:`Done` with the phase's outcome.
Before each read the loop hands the phase what the signal handlers queued (``Signalled``, and
``ReloadRequested`` to a phase that takes reloads: events of :mod:`r1sup.core.events`, as the queue's are)
and, for phases that want it, calls the tick (watchdog, start timeout, the progress line). A stop
signal a phase does not take ends the loop as :class:`StopRequested`, raised here and nowhere else; a
fault of r1sup's own (an exception in a check thread) is raised here too.

The loop is entered once per process (``r1sup run``, ``tune``, ``worker``), with a :data:`Script`: the
supervisor's control flow as a generator that yields the phase to wait in and is sent that phase's
outcome (``result = yield Starting(...)``; its steps are generators too, joined with ``yield from``).
A stop signal a phase does not take is thrown into the script as :class:`StopRequested`, as is an
exception of a phase's turn, at the ``yield`` that waited; what the script returns ends the run. A
phase never enters the loop from its own turn: it hands over to another phase (a flush of the output
that explains a failure, the stop after it) and that phase's outcome goes to the script; a run inside a
run raises :class:`LoopReentered`. Work that blocks (a readiness or health check, the probe, the preflight's
import of vLLM, NVML, the wait for the device memory after a stop) runs off the loop's thread and comes
back as a ``CheckDone`` event.

The clock is the loop's: a replay test gives it a fake one and a scripted queue, and the same phases
run in milliseconds.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from r1sup.core.events import EventQueue, ReloadRequested, Signalled

TURN_S = 0.2  # the longest a turn waits for an event: signals and timers are looked at this often


class LoopReentered(RuntimeError):
    """A phase entered the loop from inside one of its turns (r1sup's own bug)."""


class StopRequested(Exception):
    """A stop signal arrived while a phase waited; the caller stops the child and exits."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"signal {signum}")


@dataclass(frozen=True)
class Done:
    """What a phase ended in."""

    value: Any = None


@dataclass(frozen=True)
class _Raised:
    """How a wait ended when the script is to be thrown an error instead of sent an outcome."""

    error: Exception


@dataclass(frozen=True)
class Stop:
    """A phase's answer to a stop signal it does not wait through."""

    signum: int


class Phase(abc.ABC):
    """One way of waiting. Subclasses implement :meth:`on`; the class attributes say what the loop
    gives them."""

    ticks = True  # the loop's tick runs on each turn (watchdog, start timeout, progress line)
    faults = True  # a fault of r1sup's own from a check thread ends the wait (raised by the loop)
    reloads = False  # SIGHUP is handed over as ReloadRequested (else it stays queued)

    def due(self, now: float) -> float:
        """Seconds until this phase needs a turn without an event (a timer); the loop caps it."""
        return TURN_S

    def on_signal(self, signal: Signalled, now: float) -> Any:
        """A stop signal is pending: by default the wait ends and the caller stops."""
        return Stop(signal.signum)

    @abc.abstractmethod
    def on(self, event: Any, now: float) -> Any:
        """One turn: ``event`` is what the queue gave (None when nothing came in time)."""


Fault = Callable[[], BaseException | None]
# a process's control flow: yields the phase to wait in, is sent its outcome, returns the run's outcome
Script = Generator[Phase, Any, Any]


def _single(phase: Phase) -> Script:
    """The script of one phase: its outcome is the run's."""
    return (yield phase)


def _name(work: Any) -> str:
    return type(work).__name__ if isinstance(work, Phase) else getattr(work, "__qualname__", "script")


class Loop:
    """Runs phases against one :class:`EventQueue` and one clock."""

    def __init__(
        self,
        events: EventQueue,
        *,
        clock: Callable[[], float] = time.monotonic,
        tick: Callable[[], None] = lambda: None,
        fault: Fault = lambda: None,
    ) -> None:
        self.events = events
        self.clock = clock
        self.tick = tick
        self.fault = fault
        self.phase: Phase | None = None  # the phase turning now (or last, while the script runs)
        self.running = False  # a run is under way: its script or one of its phases has the thread

    def run(self, work: Phase | Script) -> Any:
        """Turn until ``work`` is done; returns its outcome. ``work`` is a :data:`Script` (the process's
        whole control flow: the one entry of a process) or a single phase (and the phases it hands
        over to).

        A phase never enters the loop itself (it hands over to another phase instead): a run inside a
        run is r1sup's own bug and raises :class:`LoopReentered`."""
        if self.running:
            inside = type(self.phase).__name__ if self.phase is not None else "a script"
            raise LoopReentered(f"{_name(work)} inside {inside}")
        self.running = True
        script = _single(work) if isinstance(work, Phase) else work
        try:
            step: Callable[[], Phase] = functools.partial(script.send, None)
            while True:
                try:
                    phase = step()
                except StopIteration as end:
                    return end.value
                outcome = self._wait(phase)
                if isinstance(outcome, _Raised):
                    step = functools.partial(script.throw, outcome.error)
                else:
                    step = functools.partial(script.send, outcome)
        finally:
            self.phase = None
            self.running = False
            script.close()

    def _wait(self, phase: Phase) -> Any:
        """Turn ``phase`` (and the phases it hands over to) until it is done: its outcome, or the
        exception the script is to be thrown (a stop signal, a fault, a phase's own error)."""
        try:
            while True:
                self.phase = phase
                outcome = self._turn(phase)
                if isinstance(outcome, Phase):
                    phase = outcome
                elif isinstance(outcome, Done):
                    return outcome.value
                elif isinstance(outcome, Stop):
                    return _Raised(StopRequested(outcome.signum))
        except Exception as exc:  # the script decides what an error of the wait means, as a caller did
            return _Raised(exc)

    def _turn(self, phase: Phase) -> Any:
        if phase.faults:
            fault = self.fault()
            if fault is not None:
                raise fault
        events = self.events
        if events.signals:
            outcome = phase.on_signal(Signalled(events.signals[0], len(events.signals)), self.clock())
            if outcome is not None:
                return outcome
        if phase.reloads and events.reloads:
            events.reloads.clear()
            outcome = phase.on(ReloadRequested(), self.clock())
            if outcome is not None:
                return outcome
        if phase.ticks:
            self.tick()
        wait = min(TURN_S, max(0.0, phase.due(self.clock())))
        event = events.get(wait)
        return phase.on(event, self.clock())


class Waiting(Phase):
    """Wait until a moment (a backoff, a worker's next look at its leader); ``output`` takes what the queue
    brings meanwhile (a running engine's lines)."""

    def __init__(self, until: float, output: Callable[[Any], None] | None = None) -> None:
        self.until = until
        self.output = output

    def due(self, now: float) -> float:
        return self.until - now

    def on(self, event: Any, now: float) -> Any:
        if event is not None and self.output is not None:
            self.output(event)
        return Done() if now >= self.until else None
