"""Host time of one engine step, split into named phases (EngineStats.record_step's fields).

Every moment between `start` and `stop` is charged to exactly one phase: the innermost one open
(`with timer.phase(name):`), else the base phase. Phases nest (time inside an inner phase is not
charged to the outer one), so the phases always add up to the step's wall time, and the timing
stays out of the step loop's logic. A phase is a context-manager object made once and reused,
not a generator context manager (a generator and a manager per use): the engine opens four or
five phases every step.
"""

from __future__ import annotations

import time

# EngineStats.record_step's keyword arguments (serving/metrics.py)
STEP_PHASES = ("schedule", "build", "dispatch", "device_wait", "overlap", "post")


class StepTimer:
    def __init__(self, phases=STEP_PHASES, base: str = "post", clock=time.perf_counter):
        if base not in phases:
            raise ValueError(f"StepTimer: base phase {base!r} is not one of {phases}")
        self.phases, self.base, self.clock = tuple(phases), base, clock
        self.seconds = dict.fromkeys(self.phases, 0.0)
        self._open = [base]
        self._last = clock()
        self._phase = {name: _Phase(self, name) for name in self.phases}

    def start(self) -> None:
        """Begin a step: every phase back to zero, the clock charged to the base phase."""
        self.seconds = dict.fromkeys(self.phases, 0.0)
        self._open = [self.base]
        self._last = self.clock()

    def _charge(self) -> None:
        now = self.clock()
        self.seconds[self._open[-1]] += now - self._last
        self._last = now

    def phase(self, name: str) -> "_Phase":
        """`with timer.phase(name):` charges the time inside the block to `name` (minus its
        inner phases)."""
        try:
            return self._phase[name]
        except KeyError:
            raise ValueError(f"StepTimer: unknown phase {name!r} (phases: {self.phases})") from None

    def enter(self, name: str) -> None:
        """Open phase `name` (what `with timer.phase(name):` does on entry)."""
        self._charge()
        self._open.append(name)

    def leave(self) -> None:
        """Close the innermost phase (what `with timer.phase(name):` does on exit)."""
        self._charge()
        self._open.pop()

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-charge `seconds` measured elsewhere (e.g. inside a call) from one phase to another."""
        self.seconds[source] -= seconds
        self.seconds[target] += seconds

    def stop(self) -> dict:
        """End the step: seconds per phase (they add up to the step's wall time)."""
        self._charge()
        return dict(self.seconds)


class _Phase:
    """One phase of a StepTimer as a context manager, made once and reused (nesting and
    re-entry are fine: the open phases are the timer's stack)."""
    __slots__ = ("timer", "name")

    def __init__(self, timer: StepTimer, name: str):
        self.timer, self.name = timer, name

    def __enter__(self) -> None:
        self.timer.enter(self.name)

    def __exit__(self, *exc) -> bool:
        self.timer.leave()
        return False
