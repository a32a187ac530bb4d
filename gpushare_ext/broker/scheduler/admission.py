"""Leases coming in: requests checked against the policy, leases restored and reclaimed.

What it is for: :class:`Admission` turns a :class:`LeaseRequested` into the lease (or
a gang's rank leases) the queue serves, or a :class:`RefuseRequest` that says why not
(range, quota, lease count, no matching slot, a gang that can never run at once); it brings back
the leases the journal kept at start-up (:class:`LeaseRestored`, detached), hands them
to the reconnected process that owns them (:class:`LeaseReclaimed`), and names the
processes that run a gang's ranks (:class:`RanksAttached`).

What it must not do: place, grant or resume a lease (the scheduling pass does), or
trust a process it was not told about by the server.
"""

from __future__ import annotations

from dataclasses import replace

from gpushare_ext.broker.scheduler import reasons
from gpushare_ext.broker.scheduler.actions import Action, RefuseRequest
from gpushare_ext.broker.scheduler.events import (
    LeaseReclaimed,
    LeaseRequested,
    LeaseRestored,
    RanksAttached,
)
from gpushare_ext.broker.scheduler.gangs import member_id, most_ranks, split_member_id
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.placement import Placer, traits
from gpushare_ext.broker.scheduler.rivalry_watch import RivalryWatch
from gpushare_ext.broker.scheduler.scheduler_records import (
    ACTIVE_STATES,
    Lease,
    SchedulerError,
    SessionRecord,
)
from gpushare_ext.broker.scheduler.slot_finder import SlotFinder
from gpushare_ext.broker.settings.policy import (
    Limits,
    StopCause,
    format_size,
    ladder_level,
)
from gpushare_ext.lease_state import StopState
from gpushare_ext.protocol import (
    ErrorCode,
    LeaseState,
    PreemptionLevel,
    RequestLease,
    SliceWish,
    describe_priority,
)

Refusal = tuple[ErrorCode, str]


class Admission:
    """Requests admitted or refused; restored leases kept until their process is back."""

    def __init__(
        self, book: LeaseBook, finder: SlotFinder, placer: Placer, rivalry: RivalryWatch
    ) -> None:
        self._book = book
        self._finder = finder
        self._placer = placer
        self._rivalry = rivalry

    # ---- requests

    def on_lease_requested(self, event: LeaseRequested, now: float) -> list[Action]:
        book = self._book
        record = book.session(event.session_id)
        if book.is_known(event.lease_id):
            raise SchedulerError(ErrorCode.INVALID, f"lease id {event.lease_id} is already used")
        asked = event.request
        identity = record.identity
        limits = book.policy.limits_for(identity.user, identity.groups)
        memory = asked.memory_bytes
        if memory is None:
            memory = min(limits.default_memory, limits.memory_quota)
        wish = asked.slice if asked.slice != SliceWish.AUTO else limits.slice
        refusal = _out_of_range(asked) or self._refusal(asked, limits, record, memory, wish)
        if refusal is not None:
            code, message = refusal
            return [
                RefuseRequest(
                    session_id=event.session_id, lease_id=event.lease_id, code=code, message=message
                )
            ]
        priority = min(asked.priority, limits.max_priority)
        notice = ""
        if priority != asked.priority:
            notice = (
                f"priority lowered from {describe_priority(asked.priority)} to "
                f"{describe_priority(priority)} by policy"
            )
        first = Lease(
            lease_id=event.lease_id,
            session_id=event.session_id,
            identity=identity,
            base_priority=priority,
            memory_bytes=memory,
            sm_share=asked.sm_share,
            slice=wish,
            device_wish=asked.device,
            reachable=record.reachable,
            capabilities=asked.capabilities,
            label=asked.label,
            arrival=book.next_arrival(),
            requested_at=now,
            state_since=now,
            lockable=asked.capabilities.lockable,
            notice=notice,
        )
        leases = [first]
        if asked.ranks > 1:  # every rank its own lease, of one arrival: they queue as one
            leases = [
                replace(
                    first, lease_id=member_id(event.lease_id, rank), gang=event.lease_id, rank=rank
                )
                for rank in range(asked.ranks)
            ]
            book.gangs[event.lease_id] = tuple(lease.lease_id for lease in leases)
        for lease in leases:
            book.add(lease, record)
        record.last_priority = priority
        self._rivalry.note_band_change(self._rivalry.rivals.asked(event.session_id, priority))
        return []

    def _refusal(
        self,
        asked: RequestLease,
        limits: Limits,
        record: SessionRecord,
        memory: int,
        wish: SliceWish,
    ) -> Refusal | None:
        """Why the policy or this host's slots refuse a request (None: they do not)."""
        if memory < 0:
            return ErrorCode.INVALID, "memory must not be negative"
        if memory > limits.memory_quota:
            return (
                ErrorCode.POLICY,
                f"{format_size(memory)} asked, but your memory quota is "
                f"{format_size(limits.memory_quota)} per lease",
            )
        held = self._book.leases_held(record.identity.uid)
        if held >= limits.max_leases:
            return (
                ErrorCode.POLICY,
                f"you already hold or wait for {limits.max_leases} lease(s), the most your "
                f"policy allows; release one first (%gpu release)",
            )
        candidates, why_none = self._finder.candidate_slots(asked.device, wish, record.reachable)
        if not candidates:
            return ErrorCode.INVALID, why_none
        sizes = [self._finder.slots[key].memory_bytes for key in candidates]
        if not any(size >= memory for size in sizes):
            return (
                ErrorCode.INVALID,
                f"{format_size(memory)} does not fit any matching device or slice "
                f"(the largest has {format_size(max(sizes))})",
            )
        if asked.ranks > 1:
            return _gang_refusal(asked.ranks, memory, held, limits.max_leases, sizes)
        return None

    # ---- leases kept across a restart

    def on_lease_restored(self, event: LeaseRestored, now: float) -> list[Action]:
        book = self._book
        if book.is_known(event.lease_id):
            raise SchedulerError(ErrorCode.INVALID, f"lease {event.lease_id} is already known")
        if event.state not in ACTIVE_STATES:
            raise SchedulerError(ErrorCode.INVALID, f"lease {event.lease_id} is not open")
        if event.state != LeaseState.QUEUED and event.slot not in self._finder.slots:
            raise SchedulerError(ErrorCode.UNAVAILABLE, f"slot {event.slot} no longer exists")
        record = book.sessions.get(event.session_id)
        if record is None:
            record = SessionRecord(identity=event.identity, notebook="", detached=True)
            book.sessions[event.session_id] = record
        elif not record.detached or record.identity.pid != event.identity.pid:
            raise SchedulerError(
                ErrorCode.INVALID, f"session {event.session_id} is not the placeholder of its pid"
            )
        lease = _restored_lease(event, book.next_arrival(), now)
        membership = split_member_id(event.lease_id)
        if membership is not None:  # a gang's rank: the gang comes back as its ranks do
            lease.gang, lease.rank = membership
            mates = book.gangs.get(lease.gang, ())
            if mates:
                lease.arrival = book.leases[mates[0]].arrival
            book.gangs[lease.gang] = tuple(
                sorted((*mates, lease.lease_id), key=lambda m: (split_member_id(m) or ("", 0))[1])
            )
        book.add(lease, record)
        return []

    def reclaimable(self, session_id: str, lease_ids: list[str]) -> list[str]:
        """Which of ``lease_ids`` the session's process may take back (see LeaseReclaimed)."""
        record = self._book.sessions.get(session_id)
        if record is None:
            return []
        return [
            lease_id
            for lease_id in dict.fromkeys(lease_ids)
            if self._reclaim_refusal(record, lease_id) is None
        ]

    def detached_ranks(self, gang: str) -> list[Lease]:
        """The ranks of ``gang`` waiting to be reclaimed, if every active rank is."""
        members = self._book.members(gang) if gang in self._book.gangs else []
        return members if members and all(m.detached for m in members) else []

    def _reclaim_refusal(
        self, record: SessionRecord, lease_id: str, keep_process: bool = False
    ) -> SchedulerError | None:
        lease = self._book.leases.get(lease_id)
        if lease is None or not lease.detached:
            return SchedulerError(
                ErrorCode.UNKNOWN_LEASE, f"there is no lease {lease_id} waiting to be reclaimed"
            )
        owner = (lease.identity.pid, lease.identity.uid)
        if keep_process:  # the server vouched for the process; the user must match
            owner = (record.identity.pid, lease.identity.uid)
        if owner != (record.identity.pid, record.identity.uid):
            return SchedulerError(
                ErrorCode.PERMISSION, f"lease {lease_id} belongs to another process"
            )
        return None

    def on_lease_reclaimed(self, event: LeaseReclaimed, now: float) -> list[Action]:
        book = self._book
        record = book.session(event.session_id)
        refusal = self._reclaim_refusal(record, event.lease_id, event.keep_process)
        if refusal is not None:
            raise refusal
        lease = book.leases[event.lease_id]
        placeholder = book.sessions.get(lease.session_id)
        if placeholder is not None:
            placeholder.leases.discard(lease.lease_id)
            if placeholder.detached and not placeholder.leases:
                del book.sessions[lease.session_id]
        lease.session_id = event.session_id
        lease.reachable = record.reachable  # what the reconnected process can reach
        if not event.keep_process:
            book.index.reidentify(lease, record.identity)
        running = lease.state == LeaseState.RUNNING
        reattached = replace(lease.stop, detached=False)
        transition(lease, now, stop=reattached, reason="" if running else None)
        book.index.touch(lease)  # a plain request now, if it is queued
        record.leases.add(lease.lease_id)
        if running:
            return []
        if lease.state == LeaseState.QUEUED:
            lease.last_queue_notice = None  # the new session hears where it stands
            return []
        return self._stop_again(lease, now)

    def _stop_again(self, lease: Lease, now: float) -> list[Action]:
        """A reclaimed lease that was paused or evicted.  If it may run now, the queue
        resumes it.  Otherwise stop it again: the new control block must show it paused,
        and what was applied before the restart was undone (but an eviction kept in
        force, which is asked again as it is).  A paused lease whose memory came back
        onto a slot that cannot hold it all is evicted again."""
        stop = lease.stop
        applied = stop.highest
        placer = self._placer
        if (
            applied is None
            and lease.slot is not None
            and placer.fits_now(lease, lease.slot, self._book.waiting_band(lease, now))
        ):
            return []
        cause = StopCause.MAKE_ROOM
        if lease.evictable and placer.overfills(lease):
            cause = StopCause.FREE_MEMORY
        level = ladder_level(cause, [traits(lease)], applied)
        if level is None:  # nothing can stop it: it time-slices
            transition(
                lease,
                now,
                state=LeaseState.RUNNING,
                stop=stop.cleared(),
                reason=reasons.NOT_PAUSED_AGAIN,
                index=self._book.index,
            )
            return []
        reason = lease.reason or reasons.PAUSED_FOR_HIGHER
        before = lease.state
        transition(lease, now, stop=stop.asked(level), reason=reason)
        return [
            self._book.pause_action(
                lease, level, before=before, for_lease=lease.paused_for, reason=lease.reason
            )
        ]

    # ---- a gang's processes

    def on_ranks_attached(self, event: RanksAttached, now: float) -> list[Action]:
        members = self._book.members(event.gang)  # a plain lease is a gang of one here
        if not members:
            raise SchedulerError(ErrorCode.UNKNOWN_LEASE, f"there is no active lease {event.gang}")
        if members[0].session_id != event.session_id:
            raise SchedulerError(ErrorCode.PERMISSION, f"gang {event.gang} is not yours")
        pids = [pid for pid, _ in event.pids]
        if len(pids) != len(members):
            raise SchedulerError(
                ErrorCode.INVALID,
                f"gang {event.gang} has {len(members)} ranks; {len(pids)} processes were named",
            )
        if len(set(pids)) != len(pids):
            raise SchedulerError(ErrorCode.INVALID, "each process can run one rank only")
        if any(
            m.state != LeaseState.RUNNING or m.pending_level is not None or m.applied_level
            for m in members
        ):
            raise SchedulerError(
                ErrorCode.OUT_OF_ORDER,
                f"gang {event.gang} is paused or being paused; name its processes once it runs",
            )
        for member, (pid, ticks) in zip(members, event.pids, strict=True):
            self._book.index.reidentify(
                member, replace(member.identity, pid=pid, start_ticks=ticks)
            )
            # What failed on the notebook's process (no CUDA context there to lock, say)
            # says nothing of the rank's own: it may be stopped as its request said.
            member.lockable = member.capabilities.lockable
            member.evictable = True
        return []


def _out_of_range(asked: RequestLease) -> Refusal | None:
    if not 0 <= asked.priority <= 299:
        return ErrorCode.INVALID, f"priority {asked.priority} is outside 0-299"
    if not 0.0 < asked.sm_share <= 1.0:
        return ErrorCode.INVALID, f"sm_share {asked.sm_share} is outside (0, 1]"
    return None


def _gang_refusal(
    ranks: int, memory: int, held: int, max_leases: int, sizes: list[int]
) -> Refusal | None:
    """Why a gang of ``ranks`` is refused: more leases than the policy allows, or more
    ranks than the matching slots could ever hold at once."""
    room = sum(most_ranks(size, memory, ranks) for size in sizes)
    if held + ranks > max_leases:
        return (
            ErrorCode.POLICY,
            f"a gang of {ranks} ranks takes {ranks} leases; you hold or "
            f"wait for {held} and your policy allows {max_leases}",
        )
    if room < ranks:
        return (
            ErrorCode.INVALID,
            f"{ranks} ranks of {format_size(memory)} can never run at once here: "
            f"the matching devices and slices hold {room} at most",
        )
    return None


def _restored_lease(event: LeaseRestored, arrival: int, now: float) -> Lease:
    """The lease the journal kept, detached, in the state it had."""
    state = event.state
    stop = StopState(detached=True)
    if event.eviction_kept:  # still checkpointed: the actuators hold it evicted
        stop = StopState(detached=True, applied_level=PreemptionLevel.EVICT)
    elif state == LeaseState.EVICTED:
        # The eviction was undone when the broker stopped: its memory is on the device.
        state = LeaseState.PAUSED
    return Lease(
        lease_id=event.lease_id,
        session_id=event.session_id,
        identity=event.identity,
        base_priority=event.priority,
        memory_bytes=event.memory_bytes,
        sm_share=event.sm_share,
        slice=event.slice,
        device_wish=event.device,
        capabilities=event.capabilities,
        label=event.label,
        arrival=arrival,
        requested_at=event.requested_at or now,
        state=state,
        # A request keeps the wait it had: aging counts from when it was made.
        state_since=(event.requested_at or now) if state == LeaseState.QUEUED else now,
        slot=event.slot if state != LeaseState.QUEUED else None,
        granted_at=event.granted_at,
        waited_s=(event.granted_at - event.requested_at)
        if event.granted_at is not None and event.requested_at
        else 0.0,
        aging_bonus=event.aging_bonus,
        lockable=event.capabilities.lockable,
        reason=event.reason,
        paused_for=event.paused_for,
        stop=stop,
    )
