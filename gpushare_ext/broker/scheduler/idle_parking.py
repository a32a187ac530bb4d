"""The scheduler's parking desk: idle sessions' memory moved to the host, and back.

What it is for: :class:`IdleParking` finds the sessions that may be parked on a slot
(known, idle, never refused by the checkpoint, on a whole GPU, not MPS clients), makes
the park lease of one and evicts it (:meth:`IdleParking.park`), parks the sessions idle
longer than their policy allows at each :class:`Tick`, parks a notebook when someone
asks (:class:`ParkAsked`), and keeps what sessions say of their cells and of their
parked memory (:class:`SessionActivity`, :class:`RestoreAsked`).  The choices
themselves (who first, how much room the host has) are :mod:`~gpushare_ext.broker.scheduler.parking`'s.

What it must not do: pause or evict leases that are not parks, or decide where a
request goes (placement asks it for parks when memory is needed).
"""

from __future__ import annotations

from dataclasses import replace

from gpushare_ext.broker.scheduler.actions import Action, PauseLease
from gpushare_ext.broker.scheduler.events import ParkAsked, RestoreAsked, SessionActivity, Tick
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.memory_seen import MemorySeen
from gpushare_ext.broker.scheduler.parking import (
    HostMemory,
    IdleSession,
    ParkPlan,
    host_room,
    idle_reason,
    park_order,
    plan_parks,
)
from gpushare_ext.broker.scheduler.scheduler_records import (
    Lease,
    SchedulerError,
    SessionRecord,
    Slot,
)
from gpushare_ext.protocol import (
    PARKED_LABEL,
    Capabilities,
    ErrorCode,
    LeaseState,
    PreemptionLevel,
    SliceWish,
)
from gpushare_ext.units import format_size


class IdleParking:
    """Which idle sessions may be parked, the host's room for them, and the parks made."""

    def __init__(self, book: LeaseBook, slots: dict[str, Slot], memory: MemorySeen) -> None:
        self._book = book
        self._slots = slots
        self._memory = memory
        self.host: HostMemory | None = None
        self._on_host_at_reading = 0  # parked and evicted bytes when the host was read
        self.refusals: dict[str, str] = {}  # per slot, this pass: why none was parked

    # ---- events

    def on_session_activity(self, event: SessionActivity, now: float) -> list[Action]:
        record = self._book.session(event.session_id)
        record.cell_running = event.running
        record.checkpoint_unsafe = event.unparkable
        if not event.running:
            record.idle_since = now
            record.parkable_bytes = event.parkable_bytes
        return []

    def on_restore_asked(self, event: RestoreAsked, now: float) -> list[Action]:
        lease = self._book.leases.get(event.lease_id)
        if lease is None or not lease.parks_session or lease.session_id != event.session_id:
            raise SchedulerError(
                ErrorCode.UNKNOWN_LEASE, f"this session has no parked memory {event.lease_id}"
            )
        stop = replace(lease.stop, restore_wanted=not event.cancel)
        transition(lease, now, stop=stop)  # a restore asked waits from now on
        lease.last_queue_notice = None  # a waiting restore is told where it stands anew
        self._book.index.touch(lease)
        return []

    def on_park_asked(self, event: ParkAsked, now: float) -> list[Action]:
        record = self._book.session_of(event.pid)
        if record is None:
            raise SchedulerError(
                ErrorCode.INVALID, f"process {event.pid} is not a notebook session of this broker"
            )
        why = self._why_not_parkable(record)
        if why:
            raise SchedulerError(ErrorCode.INVALID, f"the notebook of pid {event.pid} {why}")
        for key in self._memory.by_slot:
            idle = [s for s in self.idle_sessions(key, None) if s.pid == event.pid]
            if not idle:
                continue
            room = self.host_room()
            if idle[0].held_bytes > room:
                raise SchedulerError(
                    ErrorCode.INVALID,
                    f"the notebook of pid {event.pid} holds {format_size(idle[0].held_bytes)}, "
                    f"but the host has room for {format_size(room)} of parked memory "
                    "(park_host_limit)",
                )
            return [self.park(idle[0], key, f"parked by {event.by}", "", now)]
        raise SchedulerError(
            ErrorCode.INVALID,
            f"the notebook of pid {event.pid} holds no GPU memory outside its leases on a whole "
            "GPU (nothing to park)",
        )

    def on_tick(self, event: Tick, now: float) -> list[Action]:
        """Take the host's memory reading; park the sessions idle longer than their
        ``park_idle_after``."""
        if event.host is not None:
            self.host = event.host
            self._on_host_at_reading = self._on_host()
        actions: list[Action] = []
        if not self._book.policy.parks_idle_sessions:
            return actions
        for key in self._memory.by_slot:
            idle = [
                session
                for session in self.idle_sessions(key, None)
                if self._idle_too_long(session, now)
            ]
            if not idle:
                continue
            room = self.host_room()
            for session in sorted(idle, key=park_order):
                if session.held_bytes > room:
                    continue  # the host cannot take it now; a later tick tries again
                room -= session.held_bytes
                after = self._park_after(session)
                assert after is not None
                reason = idle_reason(now - session.idle_since, after)
                actions.append(self.park(session, key, reason, "", now))
        return actions

    # ---- what placement asks

    def parks_for(self, lease: Lease, key: str, band: int, need: int) -> ParkPlan | None:
        """The idle sessions to park on ``key`` to free ``need`` bytes for ``lease``."""
        if not self._book.policy.park_when_memory_needed:
            return None
        idle = self.idle_sessions(key, lease)
        if not idle:
            return None
        plan = plan_parks(idle, need, band, self.host_room())
        if plan.refusal:
            self.refusals[key] = plan.refusal
        return plan

    def park(
        self, session: IdleSession, key: str, reason: str, for_lease: str, now: float
    ) -> PauseLease:
        """Make the park lease of an idle session and evict it (lock, then checkpoint)."""
        book = self._book
        record = book.sessions[session.session_id]
        record.parks += 1
        lease = Lease(
            lease_id=f"{session.session_id}-P{record.parks}",
            session_id=session.session_id,
            identity=record.identity,
            base_priority=session.last_priority,
            memory_bytes=session.held_bytes,
            sm_share=1.0,
            slice=SliceWish.AUTO,
            device_wish=str(self._slots[key].device_index),
            capabilities=Capabilities(lockable=True),
            label=PARKED_LABEL,
            arrival=book.next_arrival(),
            requested_at=now,
            state_since=now,
            parks_session=True,
        )
        book.add(lease, record)
        uid = lease.identity.uid
        book.parks_of_uid[uid] = book.parks_of_uid.get(uid, 0) + 1
        lease.granted_at = now
        transition(lease, now, state=LeaseState.RUNNING, slot=key, index=book.index)
        evict = lease.stop.asked(PreemptionLevel.EVICT)
        transition(lease, now, state=LeaseState.PAUSED, stop=evict, reason=reason, index=book.index)
        lease.paused_for = for_lease
        return book.pause_action(
            lease,
            PreemptionLevel.EVICT,
            before=LeaseState.RUNNING,
            for_lease=for_lease,
            reason=reason,
            parks_bytes=lease.memory_bytes,
            parks_part=session.part,
        )

    def idle_sessions(self, key: str, asking: Lease | None) -> list[IdleSession]:
        """The sessions that may be parked to free memory on slot ``key`` (see
        :mod:`~gpushare_ext.broker.scheduler.parking`): known, idle, never refused by the checkpoint,
        on a whole GPU and not MPS clients."""
        if self._slots[key].mig_uuid is not None or self._book.policy.mps:
            return []
        idle: list[IdleSession] = []
        for pid, held in self._memory.unleased_by_pid(key, asking).items():
            session_id = self._book.session_of_pid.get(pid)
            record = self._book.sessions.get(session_id) if session_id else None
            if record is None or session_id is None or record.leases or record.detached:
                continue
            if record.cell_running or record.unparkable or record.checkpoint_unsafe != "":
                continue  # (None: it never said whether it can be checkpointed)
            if asking is not None and asking.identity.pid == pid:
                continue
            idle.append(
                IdleSession(
                    session_id=session_id,
                    pid=pid,
                    user=record.identity.user,
                    held_bytes=held,
                    last_priority=record.last_priority,
                    idle_since=record.idle_since,
                    parkable_bytes=min(record.parkable_bytes, held),
                )
            )
        return idle

    def host_room(self) -> int:
        """Host memory parks may still take: parked and evicted memory (and what is on
        its way there) count against ``park_host_limit``."""
        if self.host is None:
            return 0
        on_host = self._on_host()
        limit = self._book.policy.park_host_limit.of(self.host.total_bytes)
        since = max(0, on_host - self._on_host_at_reading)  # not in the reading's figure yet
        return host_room(self.host, limit, on_host, since)

    # ---- inside

    def _on_host(self) -> int:
        """Bytes parked and evicted sessions hold on the host, or are on their way there."""
        return sum(
            lease.memory_bytes
            for lease in self._book.leases.values()
            if lease.state == LeaseState.EVICTED or lease.pending_level == PreemptionLevel.EVICT
        )

    def _why_not_parkable(self, record: SessionRecord) -> str:
        leases = self._book.leases
        if any(leases[lid].parks_session for lid in record.leases if lid in leases):
            return "is parked already"
        if record.leases:
            return "holds a lease (release it, or wait for its cell to end)"
        if record.cell_running:
            return "has a cell running; park it once the cell ends"
        if record.unparkable:
            return record.unparkable
        if record.checkpoint_unsafe is None:
            return "has not said yet whether it can be checkpointed (it runs no cell hooks)"
        if record.checkpoint_unsafe:
            return f"cannot be parked: {record.checkpoint_unsafe}"
        if self._book.policy.mps:
            return "is an MPS client (mps = true): the checkpoint lock does not work for it"
        return ""

    def _park_after(self, session: IdleSession) -> float | None:
        identity = self._book.sessions[session.session_id].identity
        return self._book.policy.limits_for(identity.user, identity.groups).park_idle_after

    def _idle_too_long(self, session: IdleSession, now: float) -> bool:
        after = self._park_after(session)
        return after is not None and now - session.idle_since >= after
