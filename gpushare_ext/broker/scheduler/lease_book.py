"""The scheduler's book of leases and sessions: who holds what, and how a lease ends.

What it is for: :class:`LeaseBook` keeps the active leases, the recently ended ones, the
sessions and their processes, the gangs, and the :class:`LeaseIndex` placement reads;
it hands out arrival numbers, ends a lease (:meth:`LeaseBook.end`), and answers what a
lease id stands for (a gang's id or a member's).  It also says how a waiter ranks (its
effective priority under the policy, and the priority band placement weighs it by, once
for its turn: :meth:`LeaseBook.waiting_band`), since every part of the scheduler ranks
alike, and words every stop the same way (:meth:`LeaseBook.pause_action`: the level
asked, the rung that really holds it, the state its notice gives the session).

What it must not do: place, pause or tell anyone anything; the parts of the scheduler
above it decide, and change a lease's state or stop only through
:func:`~gpushare_ext.broker.scheduler.lease_transitions.transition` (its identity through the index).
"""

from __future__ import annotations

from gpushare_ext.broker.scheduler.actions import LeaseEnded, PauseLease
from gpushare_ext.broker.scheduler.lease_index import LeaseIndex
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.scheduler_records import (
    Lease,
    SchedulerError,
    SessionRecord,
    Slot,
)
from gpushare_ext.broker.settings.policy import Policy, effective_priority, lock_kept_when_failing
from gpushare_ext.lease_state import state_told, stopped_state
from gpushare_ext.protocol import ErrorCode, LeaseState, PreemptionLevel, applied_level
from gpushare_ext.units import priority_band

ENDED_KEPT = 512  # ended leases kept for status and replay checks


# An eviction confirmed sooner than this after it was asked is not timed (nothing moved).
MIN_FREEING_S = 0.05


class LeaseBook:
    """The leases, sessions and gangs the scheduler keeps, and the policy they are under."""

    def __init__(
        self, slots: dict[str, Slot], policy: Policy, *, simulated_control: bool = False
    ) -> None:
        self.policy = policy
        # A simulated GPU has no process to flag, lock or checkpoint: only the gate holds.
        self.simulated_control = simulated_control
        self.slots = slots
        self.sessions: dict[str, SessionRecord] = {}
        self.leases: dict[str, Lease] = {}
        self.ended: dict[str, Lease] = {}  # recently ended, for status and replay checks
        self.arrivals = 0
        self.hold_ema: dict[int, float] = {}  # uid -> typical hold time, for estimates
        self.habits_version = 0  # changes whenever hold_ema does
        # How fast evictions and parks moved memory to the host (bytes/s), as measured
        # from each ask to its confirmation: what a request waiting for them is told.
        self.freeing_rate: float | None = None
        self.index = LeaseIndex(slots)
        self.session_of_pid: dict[int, str] = {}  # the sessions' processes, for parking
        self.parks_of_uid: dict[int, int] = {}  # park leases per user: not counted as leases
        self.gangs: dict[str, tuple[str, ...]] = {}  # gang id -> its members' ids, rank order
        self.gang_targets: dict[str, tuple[str, ...]] = {}  # slots made room on for a gang

    # ---- stops

    def observe_freeing(self, num_bytes: int, seconds: float) -> None:
        """An eviction or a park moved ``num_bytes`` off the GPU in ``seconds``."""
        if num_bytes <= 0 or seconds < MIN_FREEING_S:
            return  # too quick to time (a simulated GPU checkpoints nothing)
        rate = num_bytes / seconds
        previous = self.freeing_rate
        self.freeing_rate = rate if previous is None else 0.7 * previous + 0.3 * rate

    def pause_action(
        self,
        lease: Lease,
        level: PreemptionLevel,
        *,
        before: LeaseState,
        for_lease: str,
        reason: str,
        parks_bytes: int = 0,
        parks_part: bool = False,
    ) -> PauseLease:
        """The action that stops ``lease`` (on its slot) at ``level``, ``before`` being
        the state it was in: everything the edges say of the stop is decided here."""
        return PauseLease(
            session_id=lease.session_id,
            lease_id=lease.lease_id,
            pid=lease.identity.pid,
            device_index=self.slots[lease.slot].device_index,  # type: ignore[index]
            level=level,
            for_lease=for_lease,
            reason=reason,
            keeps_lock=lock_kept_when_failing(level, parks=parks_bytes > 0),
            resulting_state=stopped_state(level),
            held_by=self.rung_holding(level),
            session_state=state_told(before, level),
            parks_bytes=parks_bytes,
            parks_part=parks_part,
        )

    def rung_holding(self, level: PreemptionLevel) -> PreemptionLevel:
        """The rung that really holds a lease stopped at ``level``."""
        return applied_level(level, self.simulated_control)

    # ---- sessions and leases

    def next_arrival(self) -> int:
        """The next arrival number: the tie-breaker among equal effective priorities."""
        self.arrivals += 1
        return self.arrivals

    def session(self, session_id: str) -> SessionRecord:
        record = self.sessions.get(session_id)
        if record is None:
            raise SchedulerError(ErrorCode.OUT_OF_ORDER, f"no session {session_id}")
        return record

    def session_of(self, pid: int) -> SessionRecord | None:
        session_id = self.session_of_pid.get(pid)
        return self.sessions.get(session_id) if session_id else None

    def add(self, lease: Lease, record: SessionRecord) -> None:
        """Keep a new lease of ``record``'s session."""
        self.leases[lease.lease_id] = lease
        self.index.add(lease)
        record.leases.add(lease.lease_id)

    def leases_held(self, uid: int) -> int:
        """Leases a user holds or waits for, parks not counted (the policy's max_leases)."""
        return len(self.index.by_uid.get(uid, ())) - self.parks_of_uid.get(uid, 0)

    def is_known(self, lease_id: str) -> bool:
        return lease_id in self.leases or lease_id in self.ended

    def end(self, lease: Lease, state: LeaseState, now: float, reason: str) -> LeaseEnded:
        """Take ``lease`` out of the active ones, and say what the actuators must undo."""
        stop = lease.stop
        undo = stop.highest
        transition(lease, now, state=state, stop=stop.cleared(), reason=reason)
        held = now - lease.granted_at if lease.granted_at is not None else 0.0
        device_index = self.slots[lease.slot].device_index if lease.slot else None
        self.index.drop(lease)
        if lease.granted_at is not None and not lease.parks_session:
            previous = self.hold_ema.get(lease.identity.uid, held)
            self.hold_ema[lease.identity.uid] = 0.7 * previous + 0.3 * held
            self.habits_version += 1
        del self.leases[lease.lease_id]
        if lease.parks_session:
            left = self.parks_of_uid.get(lease.identity.uid, 1) - 1
            if left:
                self.parks_of_uid[lease.identity.uid] = left
            else:
                self.parks_of_uid.pop(lease.identity.uid, None)
        self.ended[lease.lease_id] = lease
        if len(self.ended) > ENDED_KEPT:
            self.ended.pop(next(iter(self.ended)))
        record = self.sessions.get(lease.session_id)
        if record is not None:
            record.leases.discard(lease.lease_id)
            record.idle_since = now
        self.index.victim_done(lease.lease_id)
        return LeaseEnded(
            session_id=lease.session_id,
            lease_id=lease.lease_id,
            pid=lease.identity.pid,
            device_index=device_index,
            held_s=held,
            undo_level=undo,
            reason=reason,
        )

    # ---- what a lease id stands for

    def gang_of(self, lease_id: str) -> str | None:
        """The gang ``lease_id`` names (a gang's id, or one of its members'), if any."""
        if lease_id in self.gangs:
            return lease_id
        lease = self.leases.get(lease_id)
        return lease.gang if lease is not None else None

    def members(self, lease_id: str) -> list[Lease]:
        """The active leases a lease id stands for: a gang's members, or the lease itself."""
        gang = self.gang_of(lease_id)
        if gang is None:
            lease = self.leases.get(lease_id)
            return [lease] if lease is not None else []
        return [self.leases[m] for m in self.gangs[gang] if m in self.leases]

    def lease_of(self, lease_id: str) -> Lease | None:
        """The active lease ``lease_id``; for a gang's id, its first active rank."""
        lease = self.leases.get(lease_id)
        if lease is None and lease_id in self.gangs:
            lease = next((self.leases[m] for m in self.gangs[lease_id] if m in self.leases), None)
        return lease

    def forget_gang(self, gang: str) -> None:
        self.gangs.pop(gang, None)
        self.gang_targets.pop(gang, None)

    # ---- ranking

    def queue_key(self, lease: Lease, now: float) -> tuple:
        return (-self.effective(lease, now), lease.arrival)

    def effective(self, lease: Lease, now: float) -> float:
        """A lease's effective priority at ``now``: base, plus aging kept and earned."""
        limits = self.policy.limits_for(lease.identity.user, lease.identity.groups)
        if lease.state == LeaseState.RUNNING:
            return lease.running_priority()
        waiting_since = lease.state_since
        earned = effective_priority(0, now - waiting_since, limits.aging_per_minute)
        return min(299.0, lease.base_priority + lease.aging_bonus + earned)

    def waiting_band(self, lease: Lease, now: float) -> int:
        """The priority band ``lease`` waits in at ``now``: that of its effective
        priority, which grows as it waits.  Placement weighs a waiter by it (whom it
        time-slices with, whom it may stop); a turn works it out once and hands it to
        every question of the turn, so that placement asks the book nothing back."""
        return priority_band(self.effective(lease, now))
