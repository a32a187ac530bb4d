"""Carrying out placement's decisions on the core's state: start, resume, pause, evict, park.

What it is for: :class:`LeaseMoves` starts a lease on a slot (a :class:`GrantLease` for a
request, a :class:`ResumeLease` for a paused or evicted lease, with the aging it earned
kept), and carries out a room plan: parks the idle sessions, makes the plan's stops as
placement decided them, in their order (the ranks of a victim's gang among them), and
either starts the lease or leaves it waiting for what must leave.

What it must not do: choose slots, victims or levels
(:mod:`~gpushare_ext.broker.scheduler.placement` does), tell a waiter where it stands
(the turn that made room does), or read a clock; it moves leases only through
:func:`~gpushare_ext.broker.scheduler.lease_transitions.transition`.
"""

from __future__ import annotations

from gpushare_ext.broker.scheduler import reasons
from gpushare_ext.broker.scheduler.actions import Action, GrantLease, ResumeLease
from gpushare_ext.broker.scheduler.idle_parking import IdleParking
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.placement import RoomPlan
from gpushare_ext.broker.scheduler.scheduler_records import Lease, Slot
from gpushare_ext.broker.settings.policy import (
    StopCause,
    effective_priority,
)
from gpushare_ext.protocol import (
    LeaseState,
    Placement,
    PreemptionLevel,
    describe_priority,
)
from gpushare_ext.units import format_size


class LeaseMoves:
    """Starts, resumes and stops leases, and says so in actions."""

    def __init__(
        self,
        book: LeaseBook,
        slots: dict[str, Slot],
        parking: IdleParking,
    ) -> None:
        self._book = book
        self._slots = slots
        self._parking = parking

    def start(self, lease: Lease, key: str, now: float) -> list[Action]:
        """Run ``lease`` on ``key``: granted if it was queued, else resumed."""
        slot = self._slots[key]
        waited = now - lease.state_since
        limits = self._book.policy.limits_for(lease.identity.user, lease.identity.groups)
        lease.aging_bonus = min(
            299.0 - lease.base_priority,
            lease.aging_bonus + effective_priority(0, waited, limits.aging_per_minute),
        )
        previous = lease.state
        lease.freeing_bytes = 0
        if previous == LeaseState.QUEUED:
            lease.granted_at = now  # before the move: the index keeps when holders were granted
            lease.waited_s = now - lease.requested_at
        stop = lease.stop
        transition(
            lease,
            now,
            state=LeaseState.RUNNING,
            slot=key,
            stop=stop.cleared(),
            reason="",
            index=self._book.index,
        )
        lease.paused_for = ""
        lease.last_queue_notice = None
        if previous == LeaseState.QUEUED:
            return [self._grant(lease, slot)]
        undo = stop.applied_level if stop.applied_level is not None else PreemptionLevel.GATE
        return [
            ResumeLease(
                session_id=lease.session_id,
                lease_id=lease.lease_id,
                pid=lease.identity.pid,
                device_index=slot.device_index,
                undo_level=undo,
                paused_s=waited,
                restores_park=lease.parks_session,
            )
        ]

    def _grant(self, lease: Lease, slot: Slot) -> GrantLease:
        blocks = max(1, round(lease.sm_share * slot.multiprocessor_count))
        placement = Placement(
            device_index=slot.device_index,
            device_uuid=slot.device_uuid,
            mig_uuid=slot.mig_uuid,
            mig_profile=slot.mig_profile,
            memory_bytes=lease.memory_bytes,
            sm_share=lease.sm_share,
            max_blocks_per_sm_share=blocks if lease.sm_share < 1.0 else None,
            mps=self._book.policy.mps and slot.mig_uuid is None,
        )
        return GrantLease(
            session_id=lease.session_id,
            lease_id=lease.lease_id,
            placement=placement,
            priority=lease.base_priority,
            notice=lease.notice,
        )

    def preempt_for(self, lease: Lease, key: str, plan: RoomPlan, now: float) -> list[Action]:
        """Carry out ``plan`` for ``lease`` on ``key``: start it if nothing must leave, else
        leave it waiting (``target_slot``) for what must."""
        actions, awaited = self.stop_victims(lease, key, plan, now)
        if awaited:
            self.await_room(lease, awaited, bool(plan.evictions), now)
            lease.target_slot = key
            return actions
        actions.extend(self.start(lease, key, now))
        return actions

    def await_room(self, lease: Lease, victims: frozenset[str], evicting: bool, now: float) -> None:
        """``lease`` waits until ``victims`` have left (evicted, or parked); its session
        hears how much memory that frees."""
        book = self._book
        self._book.index.await_evictions(lease, victims)
        lease.freeing_bytes = sum(
            book.leases[victim].memory_bytes for victim in victims if victim in book.leases
        )
        transition(lease, now, reason=reasons.freeing(format_size(lease.freeing_bytes), evicting))

    def stop_victims(
        self, lease: Lease, key: str, plan: RoomPlan, now: float
    ) -> tuple[list[Action], frozenset[str]]:
        """Carry out ``plan``'s stops for ``lease`` on ``key`` as placement decided them;
        the actions, and the victims whose memory must leave before ``lease`` fits."""
        who = f"{describe_priority(lease.base_priority)} lease {lease.gang or lease.lease_id}"
        parks = [
            self._parking.park(idle, key, reasons.parked_for(who), lease.lease_id, now)
            for idle in plan.parks
        ]
        actions: list[Action] = list(parks)
        for victim, level, cause in plan.stops:
            evicting = cause is StopCause.FREE_MEMORY
            reason = reasons.evicted_for(who) if evicting else reasons.paused_for(who)
            before = victim.state
            if before == LeaseState.RUNNING:
                transition(
                    victim,
                    now,
                    state=LeaseState.PAUSED,
                    stop=victim.stop.asked(level),
                    reason=reason,
                    index=self._book.index,
                )
            elif evicting or level > (victim.stop.highest or 0):
                # Already paused, by another slot's plan of the same gang say: escalate
                # (a pause row carries the eviction's level where the memory must leave).
                transition(victim, now, stop=victim.stop.asked(level), reason=reason)
            else:
                continue  # a rank another slot's plan of the same gang stopped already
            victim.paused_for = lease.lease_id
            actions.append(
                self._book.pause_action(
                    victim, level, before=before, for_lease=lease.lease_id, reason=reason
                )
            )
        awaited = frozenset(row.victim.lease_id for row in plan.evictions)
        return actions, awaited | {park.lease_id for park in parks}
