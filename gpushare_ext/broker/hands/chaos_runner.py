"""Chaos mode's runner: apply and undo the pauses a :class:`ChaosSchedule` draws.

One runner per chosen process, on the broker's event loop.  Before each pause it looks
at the process's lease as the scheduler has it: only a lease that runs with nothing
applied to it is paused (a lease the scheduler paused for real is left to the
scheduler, and a process without a lease waits for one).  Each pause goes through the
same ladder as a real one (the control block, the yield flag, the checkpoint lock), and
a lock or eviction is journaled first, so a crash in the middle leaves nothing locked.
When the pause ends it is undone unless the scheduler has paused the lease meanwhile
(then the scheduler's resume undoes both); a lease that ended meanwhile is let go with
its control block saying "no lease".

It must not decide anything the scheduler decides: it never changes a lease's state,
and the sessions get no notices (a line a few milliseconds long, hundreds of times a
second, would only flood the cell).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpushare_ext.broker.hands.actuators import ActuatorError, Ladder, Target
from gpushare_ext.broker.hands.chaos import ChaosPause, ChaosSchedule, ChaosSpec
from gpushare_ext.lease_state import LeaseState, stopped_state
from gpushare_ext.protocol import PreemptionLevel

log = logging.getLogger("gpushare.broker.chaos")


@dataclass(frozen=True)
class ChaosTarget:
    """The chosen process's lease as the scheduler has it now (None: it holds none)."""

    lease_id: str
    running_untouched: bool  # running, nothing applied or asked for by the scheduler
    target: Target
    allowed: tuple[PreemptionLevel, ...]  # levels the ladder can really stop it at


class ChaosRunner:
    """Follows one chaos request until it is stopped or its duration has passed."""

    def __init__(
        self,
        spec: ChaosSpec,
        *,
        ladder: Ladder,
        find: Callable[[int], ChaosTarget | None],
        journal_applied: Callable[[ChaosTarget, PreemptionLevel], int | None],
        journal_undone: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec = spec
        self._ladder = ladder
        self._find = find
        self._journal_applied = journal_applied
        self._journal_undone = journal_undone
        self._clock = clock
        self.schedule = ChaosSchedule(spec, started_at=clock())
        self.applied = 0  # pauses really applied
        self.skipped = 0  # pauses skipped: no lease, or the scheduler had it paused
        self.by_level: dict[int, int] = {}
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def describe(self) -> str:
        levels = ", ".join(f"{n} at level {lv}" for lv, n in sorted(self.by_level.items()))
        return (
            f"chaos: {self.spec.describe()}; {self.applied} pauses so far"
            + (f" ({levels})" if levels else "")
            + (f", {self.skipped} skipped" if self.skipped else "")
        )

    async def _sleep_until(self, when: float) -> bool:
        """Sleep until ``when`` on the runner's clock; False if stopped meanwhile."""
        delay = when - self._clock()
        if delay > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=delay)
        return not self._stop.is_set()

    async def run(self) -> None:
        pause = self.schedule.next_pause(self._clock())
        while pause is not None and await self._sleep_until(pause.starts_at):
            await self._one(pause)
            pause = self.schedule.next_pause(self._clock())
        self._stop.set()
        log.info("chaos for pid %s ended: %s", self.spec.pid, self.describe())

    async def _one(self, pause: ChaosPause) -> None:
        found = self._find(self.spec.pid)
        if found is None or not found.running_untouched:
            self.skipped += 1
            return
        self.schedule.allowed = found.allowed
        level = pause.level
        if level not in found.allowed:  # never deeper than asked: the deepest allowed below
            below = [allowed for allowed in found.allowed if allowed <= level]
            level = max(below) if below else min(found.allowed)
        actuation = self._journal_applied(found, level)
        try:
            await self._ladder.apply(
                found.target, level, "chaos mode: a random pause", stopped_state(level)
            )
        except ActuatorError as exc:
            log.warning("chaos pause of pid %s at level %s failed: %s", self.spec.pid, level, exc)
        self.applied += 1
        self.by_level[int(level)] = self.by_level.get(int(level), 0) + 1
        # The pause lasts its length even when the runner is stopped meanwhile: cut short,
        # it would still be undone just below.
        await asyncio.sleep(max(0.0, pause.ends_at - self._clock()))
        await self._let_go(found, level, actuation)

    async def _let_go(
        self, found: ChaosTarget, level: PreemptionLevel, actuation: int | None
    ) -> None:
        def paused_for_real() -> bool:
            now = self._find(self.spec.pid)
            return now is not None and now.lease_id == found.lease_id and not now.running_untouched

        now = self._find(self.spec.pid)
        ended = now is None or now.lease_id != found.lease_id
        try:
            undone = await self._ladder.undo(
                found.target, level, lease_ended=ended, unless=None if ended else paused_for_real
            )
        except ActuatorError as exc:
            log.error("chaos could not let pid %s go: %s", self.spec.pid, exc)
            return
        if undone and actuation is not None:
            self._journal_undone(actuation)


def allowed_levels(
    target: Target, *, lockable: bool, simulated: bool
) -> tuple[PreemptionLevel, ...]:
    """The ladder levels that really stop this process: the gate always, a yield only with
    a registered flag, the lock and eviction only where the checkpoint API works (not on a
    simulated GPU, not for MPS clients)."""
    levels = [PreemptionLevel.GATE]
    if target.yield_flag is not None and not simulated:
        levels += [PreemptionLevel.YIELD, PreemptionLevel.ABORT]
    if lockable and not simulated:
        levels += [PreemptionLevel.LOCK, PreemptionLevel.EVICT]
    return tuple(levels)


def running_untouched(state: LeaseState, pending: object, applied: object) -> bool:
    return state == LeaseState.RUNNING and pending is None and applied is None
