"""Chaos mode: when to pause one chosen session, for how long and at which ladder level.

An admin (or a test) asks the broker to pause one process at random moments, so that
anyone can see whether their code survives preemption: every ``every_ms`` (a random gap
in the range, measured from the end of the last pause) the session is paused for
``pause_ms`` (a random length in the range) at a level drawn from ``levels`` (only those
the session can be stopped at), until ``duration_s`` has passed or the admin stops it.

This module only draws the schedule: from a seed and the times it is given, each pause
follows from the one before, so a run can be replayed.  It must not act (the chaos
runner beside it applies and undoes each pause through the ladder), read a clock, or
know about asyncio.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.protocol import PreemptionLevel

DEFAULT_EVERY_MS = (5.0, 50.0)
DEFAULT_PAUSE_MS = (1.0, 20.0)
DEFAULT_LEVELS = (PreemptionLevel.GATE, PreemptionLevel.YIELD, PreemptionLevel.LOCK)
LONGEST_MS = 600_000.0  # a gap or pause longer than ten minutes is no chaos


class ChaosError(DaemonError):
    """A chaos request that cannot be followed; the message says why in one line."""


@dataclass(frozen=True, kw_only=True)
class ChaosSpec:
    """What an admin asked for: the process, the ranges (milliseconds), the levels."""

    pid: int
    every_ms: tuple[float, float] = DEFAULT_EVERY_MS
    pause_ms: tuple[float, float] = DEFAULT_PAUSE_MS
    levels: tuple[PreemptionLevel, ...] = DEFAULT_LEVELS
    duration_s: float | None = None  # None: until stopped
    seed: int = 0

    def check(self) -> None:
        """ChaosError naming the first thing wrong with the request."""
        for name, (low, high) in (("every", self.every_ms), ("pause", self.pause_ms)):
            if not 0 < low <= high <= LONGEST_MS:
                raise ChaosError(
                    f"{name} must be a range of milliseconds like 5-50, from above 0 up to "
                    f"{LONGEST_MS:g}; got {low:g}-{high:g}"
                )
        if not self.levels:
            raise ChaosError("chaos needs at least one ladder level to pause at")
        if self.duration_s is not None and not 0 < self.duration_s <= 7 * 24 * 3600:
            raise ChaosError(f"duration must be between 0 and a week, not {self.duration_s:g} s")

    def describe(self) -> str:
        levels = ", ".join(f"{int(level)} ({level.name.lower()})" for level in self.levels)
        until = "until stopped" if self.duration_s is None else f"for {self.duration_s:g} s"
        return (
            f"pid {self.pid} paused every {_range(self.every_ms)} ms for "
            f"{_range(self.pause_ms)} ms at level {levels}, {until} (seed {self.seed})"
        )


def _range(bounds: tuple[float, float]) -> str:
    low, high = bounds
    return f"{low:g}" if low == high else f"{low:g}-{high:g}"


@dataclass(frozen=True)
class ChaosPause:
    """One pause: it starts at ``starts_at`` and ends at ``ends_at`` (seconds, on the
    clock the runner gave), at ``level``."""

    starts_at: float
    ends_at: float
    level: PreemptionLevel


@dataclass
class ChaosSchedule:
    """The pauses of one chaos request, drawn one at a time.

    ``allowed`` are the levels the session can be stopped at (the runner knows: a yield
    needs a registered flag, a lock a process the checkpoint API can lock, a simulated
    GPU only gates); the schedule draws from those the request named, or from the
    deepest allowed one below them when none of them is allowed."""

    spec: ChaosSpec
    started_at: float
    allowed: tuple[PreemptionLevel, ...] = tuple(PreemptionLevel)
    pauses: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.spec.seed)

    def levels(self) -> tuple[PreemptionLevel, ...]:
        usable = tuple(level for level in self.spec.levels if level in self.allowed)
        if usable:
            return usable
        below = [level for level in self.allowed if level <= max(self.spec.levels)]
        return (max(below),) if below else (min(self.allowed),)

    def next_pause(self, after: float) -> ChaosPause | None:
        """The pause that follows a running stretch starting at ``after``; None once the
        request's duration has passed."""
        gap = self._rng.uniform(*self.spec.every_ms) / 1e3
        length = self._rng.uniform(*self.spec.pause_ms) / 1e3
        level = self._rng.choice(self.levels())
        starts = after + gap
        if self.spec.duration_s is not None and starts >= self.started_at + self.spec.duration_s:
            return None
        self.pauses += 1
        return ChaosPause(starts_at=starts, ends_at=starts + length, level=level)
