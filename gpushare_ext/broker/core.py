"""The scheduler as a pure state machine: events in, actions out, time passed in.

Theory of operation
-------------------
Every GPU (or, where MIG is on, every MIG instance) is a *slot* with a memory capacity.
A notebook cell asks for a *lease* on a slot: a priority (0-299, three bands: low,
normal, high), an amount of device memory, an SM share and a wish (device, MIG or not).

* Leases of the same band time-slice a slot (policy ``sharing = "timeslice"``), or a
  slot holds one running lease (``"exclusive"``).  Leases whose SM shares add up to at
  most 1 share a slot spatially whatever their band.
* A request that cannot be placed waits in one queue ordered by *effective priority*
  (base + aging while waiting) and arrival.  A waiter reserves the slots it waits for:
  nobody of lower effective priority is placed there before it.
* A request whose band is higher than every lease in its way *preempts* them: the
  victims are paused at the cheapest ladder level that stops all their work
  (:func:`policy.stopping_level`), and the request is granted at once -- the drain
  happens asynchronously, the waiting session never waits for it.  Only when memory
  must be freed does the grant wait: victims are evicted (level 4) and the grant
  follows their :class:`PreemptionApplied` events.
* Paused and evicted leases wait in the same queue (pinned to their slot) and resume
  when they are again the best candidate; the aging they earned while paused stays with
  them while they run, so a long-starved lease eventually outranks new arrivals.
* Memory that processes hold outside any lease (NVML's per-process readings,
  :class:`DeviceMemorySeen`) counts as taken.  When a request needs memory that idle
  sessions hold, they are *parked* first (:mod:`~gpushare_ext.broker.parking` says who
  and whether the host has room): a park lease is made for what each holds and evicted
  at once, and it comes back only when its session asks (:class:`RestoreAsked`), waiting
  in the queue like a request if it must.

What placement looks up -- a slot's memory held and its running leases' bands, SM
shares and exclusive wishes, a user's lease count, a process's leases, the waiters --
comes from :class:`~gpushare_ext.broker.lease_index.LeaseIndex`, changed wherever a
lease changes state, slot or identity, so an event costs about the same with one lease
as with a thousand.  :meth:`Scheduler.index_mismatch` compares it with a recount.

With more than a handful of waiters (``LINE_FROM``), they stay in order between events
(:class:`~gpushare_ext.broker.lease_index.WaitingLine`), and a pass looks only at those
an event may concern.  A plain queued request (not a gang's rank, not making room, not
detached) whose wanted slots are all reserved or waited for by the waiters ahead can
neither be placed nor make room: the pass serves such requests of the same wanted slots
only until they are, and tells the rest where they stand only if that may have changed
-- their place (a request ahead came or went), what their slots hold (the slots'
versions, drains, NVML readings, parking refusals), or their notice was reset -- each
with the scheduler as it was at its turn.  Every other waiter is served in turn, and a
handful of waiters are all served in turn.  ``Scheduler(..., recompute_every_waiter=True)``
serves every waiter on every pass; the tests check that both act alike.

The core never blocks, never reads a clock and never touches a socket or a GPU: the
server feeds it :data:`Event` values with ``now`` and carries out the returned
:data:`Action` values.  Replaying an event list gives the same actions.  Invalid
events (a release of an unknown lease) raise :class:`SchedulerError` and change nothing.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace

from gpushare_ext.broker.actions import (
    Action,
    Grant,
    LeaseEnded,
    NotifyQueued,
    Preempt,
    Refuse,
    ResumeLease,
    Revoke,
    RivalryChanged,
)
from gpushare_ext.broker.events import (
    ChaosChanged,
    DeviceDrained,
    DeviceMemorySeen,
    Event,
    LeaseReclaimed,
    LeaseReleased,
    LeaseRequested,
    LeaseRestored,
    MemoryObserved,
    ParkAsked,
    PolicyChanged,
    PreemptionApplied,
    PreemptionFailed,
    RanksAttached,
    RestoreAsked,
    SessionActivity,
    SessionClosed,
    SessionOpened,
    Tick,
)
from gpushare_ext.broker.gangs import assign_ranks, member_id, most_ranks, split_member_id
from gpushare_ext.broker.inventory import DeviceInfo
from gpushare_ext.broker.lease_index import (
    OTHERS,
    SPATIAL_LIMIT,
    LeaseIndex,
    Place,
    SlotLoad,
    Trajectory,
    WaitingLine,
    exact_share,
)
from gpushare_ext.broker.parking import (
    HostMemory,
    IdleSession,
    ParkPlan,
    host_room,
    idle_reason,
    park_order,
    parked_for_reason,
    plan_parks,
)
from gpushare_ext.broker.policy import (
    Policy,
    VictimTraits,
    effective_priority,
    format_size,
    priority_band,
    stopping_level,
    victim_order_key,
)
from gpushare_ext.broker.records import (
    ACTIVE_STATES,
    MIB,
    Identity,
    Lease,
    SchedulerError,
    SessionRecord,
    Slot,
    names_of,
    slots_of,
)
from gpushare_ext.broker.rivals import PlacedLease, Rivals
from gpushare_ext.lease_state import check_move
from gpushare_ext.protocol import (
    PARKED_LABEL,
    Capabilities,
    ErrorCode,
    LeaseState,
    Placement,
    PreemptionLevel,
    RankPlacement,
    SliceWish,
    describe_priority,
    priority_class,
)

# The events, actions and records live in their own modules; the server, its parts and
# the tools name them through the core, as before.
__all__ = [
    "ACTIVE_STATES",
    "LINE_FROM",
    "Action",
    "ChaosChanged",
    "DeviceDrained",
    "DeviceMemorySeen",
    "Event",
    "Grant",
    "Identity",
    "Lease",
    "LeaseEnded",
    "LeaseReclaimed",
    "LeaseReleased",
    "LeaseRequested",
    "LeaseRestored",
    "MemoryObserved",
    "NotifyQueued",
    "ParkAsked",
    "PolicyChanged",
    "Preempt",
    "PreemptionApplied",
    "PreemptionFailed",
    "RanksAttached",
    "Refuse",
    "RestoreAsked",
    "ResumeLease",
    "Revoke",
    "RivalryChanged",
    "Scheduler",
    "SchedulerError",
    "SessionActivity",
    "SessionClosed",
    "SessionOpened",
    "SessionRecord",
    "Slot",
    "Tick",
]

CONTEXT_ALLOWANCE = 1024 * MIB
# What making room on a slot takes: leases to pause, leases to evict, idle sessions to park.
RoomPlan = tuple[list["Lease"], list["Lease"], list[IdleSession]]
CANDIDATE_MEMO = 256  # device wishes whose matching slots are remembered
HOLDERS_MEMO = 256  # sets of slots whose running leases are remembered, per version
# Waiters a pass serves one by one without a waiting line: for so few, sorting them and
# serving each costs less than keeping the line.
LINE_FROM = 4


@dataclass(kw_only=True)
class _Holders:
    """The leases running on a set of slots, as a queue notice describes them."""

    keys: tuple[str, ...]
    waiting_for: tuple[str, ...]  # their ids, sorted
    holder_priority: int | None  # the highest base priority among them
    top: int | None  # the highest running priority among them, whole
    estimate: float | None = None
    estimated_in: int = -1  # the scheduling pass that worked the estimate out


@dataclass(kw_only=True)
class _RequestGroup:
    """The plain queued requests that want the same slots, during one scheduling pass.

    While one of their candidate slots is neither reserved nor waited for, the first of
    them is served like any waiter.  Once all are, the rest can neither be placed nor
    make room (their turn would only tell them where they stand): the group is closed,
    and they are passed over (:meth:`Scheduler._tell_passed_over`)."""

    wanted: tuple[str, ...]
    tickets: list[int]  # its requests' tickets in the waiting line, in order
    candidates: frozenset[str]  # the wanted slots on devices not drained
    served: int = 0  # tickets[:served] were served in turn
    open: bool = True
    settled: int = 0  # tickets[:settled] are served, told, or known to be told already
    looks: set[tuple] = field(default_factory=set)  # its slots, as its requests were told


@dataclass(kw_only=True)
class _Pass:
    """One scheduling pass over the waiting line."""

    now: float
    groups: list[_RequestGroup]
    moved_from: int  # counted[moved_from:] may stand elsewhere than they were last told
    reserved: set[str] = field(default_factory=set)
    waited_for: set[str] = field(default_factory=set)
    served: set[str] = field(default_factory=set)  # lease ids served in turn
    granted: list[int] = field(default_factory=list)  # tickets of requests granted in turn
    walked: int = 0  # counted[:walked] were looked at for a changed place
    blocked_size: int = -1  # len(reserved) + len(waited_for) when groups were last closed
    actions: list[Action] = field(default_factory=list)

    def ahead_of(self, line: WaitingLine, ticket: float) -> int:
        """Queued requests ahead of ``ticket`` that still wait after their turn."""
        return line.counted_before(ticket) - bisect.bisect_left(self.granted, ticket)


# ------------------------------------------------------------------ the machine


class Scheduler:
    """Feed it events with :meth:`handle`; carry out the actions it returns."""

    def __init__(
        self,
        devices: list[DeviceInfo],
        policy: Policy | None = None,
        *,
        recompute_every_waiter: bool = False,
        line_from: int = LINE_FROM,
    ) -> None:
        self.policy = policy or Policy()
        # Serve every waiter on every pass (the reference the tests hold the kept pass to).
        self.recompute_every_waiter = recompute_every_waiter
        self.line_from = line_from  # more waiters than this: the pass keeps them in a line
        self.devices = {d.index: d for d in devices}
        self.slots: dict[str, Slot] = {}
        self.drained: set[int] = set()
        for device in devices:
            for slot in slots_of(device):
                self.slots[slot.key] = slot
        self.sessions: dict[str, SessionRecord] = {}
        self.leases: dict[str, Lease] = {}
        self.ended: dict[str, Lease] = {}  # recently ended, for status and replay checks
        self._arrivals = 0
        self._hold_ema: dict[int, float] = {}  # uid -> typical hold time, for estimates
        self.now = 0.0
        self._index = LeaseIndex(self.slots)
        self._candidates: dict[
            tuple[str, SliceWish, tuple[str, ...] | None], tuple[list[str], str]
        ] = {}
        # What queue notices say of the leases running on a set of slots, per set and the
        # slots' versions: every waiter for the same slots is told about the same holders.
        self._known_holders: dict[tuple, _Holders] = {}
        self._passes = 0  # scheduling passes so far: an estimate holds for one
        # Per whole-GPU slot, the memory each process holds there as last seen (NVML):
        # placement counts what no lease declares, so memory idle notebooks keep is not
        # granted a second time.
        self._seen: dict[str, dict[int, int]] = {}
        self.host: HostMemory | None = None
        self._on_host_at_reading = 0  # parked and evicted bytes when the host was read
        self._session_of_pid: dict[int, str] = {}  # the sessions' processes, for parking
        self._parks_of_uid: dict[int, int] = {}  # park leases per user: not counted as leases
        self._park_refusals: dict[str, str] = {}  # per slot, this pass: why none was parked
        self.gangs: dict[str, tuple[str, ...]] = {}  # gang id -> its members' ids, rank order
        self._gang_targets: dict[str, tuple[str, ...]] = {}  # slots made room on for a gang
        self._pass_gangs: set[str] = set()  # gangs served in this scheduling pass
        self._line = WaitingLine()
        self._line_policy: Policy | None = None  # the policy the line's aging rates are of
        self._aging_rates: dict[tuple[str, tuple[str, ...]], float] = {}  # per user, groups
        self._pass: _Pass | None = None
        # Per wanted slots, how they looked when all requests wanting them were last told
        # where they stand (None: told at different times).
        self._told_looks: dict[tuple[str, ...], tuple | None] = {}
        self._notice_due: set[str] = set()  # plain requests to tell anew whatever changed
        self._seen_readings: dict[str, int] = {}  # per slot, NVML readings taken so far
        self.rivals = Rivals()
        self._rivalry_below: int | None = None  # this event's band change (Rivals' answer)
        # Sessions with a lease on a GPU, by the lowest band among those leases.
        self._placed_band: dict[str, int] = {}

    # ---- public

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions to carry out, in order."""
        event_now = max(event.now, self.now)  # time never goes backwards inside the core
        handler = getattr(self, f"_on_{type(event).__name__}")
        actions: list[Action] = handler(event, event_now)
        self.now = event_now
        actions.extend(self._settle_gangs(event_now))
        actions.extend(self._schedule(event_now))
        actions.extend(self._rivalry_changes(event, actions))
        return actions

    def active_leases(self) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.state in ACTIVE_STATES]

    def queue(self) -> list[Lease]:
        """Waiters (queued, paused, evicted) in the order they will be served."""
        return sorted(
            self._index.waiters.values(), key=lambda lease: self._queue_key(lease, self.now)
        )

    def queued_position(self, lease_id: str) -> int | None:
        """Where a queued request stands (a gang counts once, by its id or a member's)."""
        queued = [
            lease for lease in self.queue() if lease.state == LeaseState.QUEUED and lease.rank == 0
        ]
        wanted = self.gang_of(lease_id) or lease_id
        for position, lease in enumerate(queued, start=1):
            if lease.lease_id == lease_id or (lease.gang is not None and lease.gang == wanted):
                return position
        return None

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

    def slot_usage(self, key: str) -> tuple[int, list[Lease]]:
        """Memory held on a slot (running, paused and pending grants) and its running leases."""
        load = self._index.slots[key]
        return load.held, sorted(load.running.values(), key=lambda lease: lease.arrival)

    def index_mismatch(self) -> str:
        """How the kept index and waiting line differ from those recomputed from the
        leases ("" if they do not): the property tests check it after every event."""
        return self._index.mismatch(self.leases.values()) or self._line_mismatch()

    def _line_mismatch(self) -> str:
        if self._line_policy is None:
            return ""  # not kept: few enough waiters to serve one by one
        self._catch_up_line(self.now)  # what the next pass does first
        line = self._line
        if set(line.places) != set(self._index.waiters):
            return (
                f"waiting line: kept {sorted(line.places)}, waiters {sorted(self._index.waiters)}"
            )
        order = [line.at(ticket) for ticket in line.tickets]
        keys = [self._queue_key(place.lease, self.now) for place in order]
        if keys != sorted(keys):
            return f"waiting line out of order at {self.now}: {[p.lease.lease_id for p in order]}"
        for place in order:
            wanted = self._line_place(place.lease)
            kept = (place.group, place.counted, place.trajectory)
            if kept != (wanted.group, wanted.counted, wanted.trajectory):
                return f"waiting line: {place.lease.lease_id} kept as {kept}, is {wanted}"
        if line.counted != [place.ticket for place in order if place.counted]:
            return "waiting line: the counted requests are not those in the line"
        return ""

    def lease_of(self, lease_id: str) -> Lease | None:
        """The active lease ``lease_id``; for a gang's id, its first active rank."""
        lease = self.leases.get(lease_id)
        if lease is None and lease_id in self.gangs:
            lease = next((self.leases[m] for m in self.gangs[lease_id] if m in self.leases), None)
        return lease

    def slots_of_device(self, index: int) -> list[Slot]:
        return [s for s in self.slots.values() if s.device_index == index]

    # ---- event handlers

    def _on_SessionOpened(self, event: SessionOpened, now: float) -> list[Action]:
        if event.session_id in self.sessions:
            raise SchedulerError(
                ErrorCode.OUT_OF_ORDER, f"session {event.session_id} is already open"
            )
        self.sessions[event.session_id] = SessionRecord(
            identity=event.identity,
            notebook=event.notebook,
            idle_since=now,
            reachable=event.reachable,
        )
        self._session_of_pid[event.identity.pid] = event.session_id
        self._rivalry_below = self.rivals.session_opened(
            event.session_id, self.sessions[event.session_id].last_priority, event.reachable
        )
        return []

    def _on_ChaosChanged(self, event: ChaosChanged, now: float) -> list[Action]:
        session_id = self._session_of_pid.get(event.pid)
        if session_id is not None:
            self.rivals.chaos(session_id, event.on)
        return []

    def _on_SessionClosed(self, event: SessionClosed, now: float) -> list[Action]:
        record = self.sessions.pop(event.session_id, None)
        if record is None:
            raise SchedulerError(ErrorCode.OUT_OF_ORDER, f"no session {event.session_id}")
        if self._session_of_pid.get(record.identity.pid) == event.session_id:
            del self._session_of_pid[record.identity.pid]
        self._rivalry_below = self.rivals.session_closed(event.session_id)
        actions: list[Action] = []
        for lease_id in sorted(record.leases):
            lease = self.leases.get(lease_id)
            if lease is not None and lease.state in ACTIVE_STATES:
                actions.append(self._end(lease, LeaseState.RELEASED, now, event.reason))
        return actions

    def _on_LeaseRequested(self, event: LeaseRequested, now: float) -> list[Action]:
        record = self._session(event.session_id)
        asked = event.request
        if event.lease_id in self.leases or event.lease_id in self.ended:
            raise SchedulerError(ErrorCode.INVALID, f"lease id {event.lease_id} is already used")
        identity = record.identity
        limits = self.policy.limits_for(identity.user, identity.groups)

        def refuse(code: ErrorCode, message: str) -> list[Action]:
            return [
                Refuse(
                    session_id=event.session_id, lease_id=event.lease_id, code=code, message=message
                )
            ]

        if not 0 <= asked.priority <= 299:
            return refuse(ErrorCode.INVALID, f"priority {asked.priority} is outside 0-299")
        if not 0.0 < asked.sm_share <= 1.0:
            return refuse(ErrorCode.INVALID, f"sm_share {asked.sm_share} is outside (0, 1]")
        priority = asked.priority
        notice = ""
        if priority > limits.max_priority:
            notice = (
                f"priority lowered from {describe_priority(priority)} to "
                f"{describe_priority(limits.max_priority)} by policy"
            )
            priority = limits.max_priority
        memory = asked.memory_bytes
        if memory is None:
            memory = min(limits.default_memory, limits.memory_quota)
        if memory < 0:
            return refuse(ErrorCode.INVALID, "memory must not be negative")
        if memory > limits.memory_quota:
            return refuse(
                ErrorCode.POLICY,
                f"{format_size(memory)} asked, but your memory quota is "
                f"{format_size(limits.memory_quota)} per lease",
            )
        held = len(self._index.by_uid.get(identity.uid, ())) - self._parks_of_uid.get(
            identity.uid, 0
        )
        if held >= limits.max_leases:
            return refuse(
                ErrorCode.POLICY,
                f"you already hold or wait for {limits.max_leases} lease(s), the most your "
                f"policy allows; release one first (%gpu release)",
            )
        wish = asked.slice if asked.slice != SliceWish.AUTO else limits.slice
        candidates, why_none = self._candidate_slots(asked.device, wish, record.reachable)
        if not candidates:
            return refuse(ErrorCode.INVALID, why_none)
        if not any(self.slots[key].memory_bytes >= memory for key in candidates):
            biggest = max(self.slots[key].memory_bytes for key in candidates)
            return refuse(
                ErrorCode.INVALID,
                f"{format_size(memory)} does not fit any matching device or slice "
                f"(the largest has {format_size(biggest)})",
            )
        if asked.ranks > 1:
            room = sum(
                most_ranks(self.slots[key].memory_bytes, memory, asked.ranks) for key in candidates
            )
            if held + asked.ranks > limits.max_leases:
                return refuse(
                    ErrorCode.POLICY,
                    f"a gang of {asked.ranks} ranks takes {asked.ranks} leases; you hold or "
                    f"wait for {held} and your policy allows {limits.max_leases}",
                )
            if room < asked.ranks:
                return refuse(
                    ErrorCode.INVALID,
                    f"{asked.ranks} ranks of {format_size(memory)} can never run at once here: "
                    f"the matching devices and slices hold {room} at most",
                )
        self._arrivals += 1
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
            arrival=self._arrivals,
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
            self.gangs[event.lease_id] = tuple(lease.lease_id for lease in leases)
        for lease in leases:
            self.leases[lease.lease_id] = lease
            self._index.add(lease)
            record.leases.add(lease.lease_id)
        record.last_priority = priority
        self._rivalry_below = self.rivals.asked(event.session_id, priority)
        return []

    def _on_LeaseRestored(self, event: LeaseRestored, now: float) -> list[Action]:
        if event.lease_id in self.leases or event.lease_id in self.ended:
            raise SchedulerError(ErrorCode.INVALID, f"lease {event.lease_id} is already known")
        if event.state not in ACTIVE_STATES:
            raise SchedulerError(ErrorCode.INVALID, f"lease {event.lease_id} is not open")
        if event.state != LeaseState.QUEUED and event.slot not in self.slots:
            raise SchedulerError(ErrorCode.UNAVAILABLE, f"slot {event.slot} no longer exists")
        record = self.sessions.get(event.session_id)
        if record is None:
            record = SessionRecord(identity=event.identity, notebook="", detached=True)
            self.sessions[event.session_id] = record
        elif not record.detached or record.identity.pid != event.identity.pid:
            raise SchedulerError(
                ErrorCode.INVALID, f"session {event.session_id} is not the placeholder of its pid"
            )
        # An eviction was undone when the broker stopped: its memory is on the device again.
        state = LeaseState.PAUSED if event.state == LeaseState.EVICTED else event.state
        self._arrivals += 1
        lease = Lease(
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
            arrival=self._arrivals,
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
            detached=True,
        )
        membership = split_member_id(event.lease_id)
        if membership is not None:  # a gang's rank: the gang comes back as its ranks do
            lease.gang, lease.rank = membership
            mates = self.gangs.get(lease.gang, ())
            if mates:
                lease.arrival = self.leases[mates[0]].arrival
            self.gangs[lease.gang] = tuple(
                sorted((*mates, lease.lease_id), key=lambda m: (split_member_id(m) or ("", 0))[1])
            )
        self.leases[lease.lease_id] = lease
        self._index.add(lease)
        record.leases.add(lease.lease_id)
        return []

    def reclaimable(self, session_id: str, lease_ids: list[str]) -> list[str]:
        """Which of ``lease_ids`` the session's process may take back (see LeaseReclaimed)."""
        record = self.sessions.get(session_id)
        if record is None:
            return []
        return [
            lease_id
            for lease_id in dict.fromkeys(lease_ids)
            if self._reclaim_refusal(record, lease_id) is None
        ]

    def detached_ranks(self, gang: str) -> list[Lease]:
        """The ranks of ``gang`` waiting to be reclaimed, if every active rank is."""
        members = self.members(gang) if gang in self.gangs else []
        return members if members and all(m.detached for m in members) else []

    def _reclaim_refusal(
        self, record: SessionRecord, lease_id: str, keep_process: bool = False
    ) -> SchedulerError | None:
        lease = self.leases.get(lease_id)
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

    def _on_LeaseReclaimed(self, event: LeaseReclaimed, now: float) -> list[Action]:
        record = self._session(event.session_id)
        refusal = self._reclaim_refusal(record, event.lease_id, event.keep_process)
        if refusal is not None:
            raise refusal
        lease = self.leases[event.lease_id]
        placeholder = self.sessions.get(lease.session_id)
        if placeholder is not None:
            placeholder.leases.discard(lease.lease_id)
            if placeholder.detached and not placeholder.leases:
                del self.sessions[lease.session_id]
        lease.session_id = event.session_id
        lease.reachable = record.reachable  # what the reconnected process can reach
        if not event.keep_process:
            self._index.reidentify(lease, record.identity)
        lease.detached = False
        self._index.touch(lease)  # a plain request now, if it is queued
        record.leases.add(lease.lease_id)
        if lease.state == LeaseState.RUNNING:
            lease.reason = ""
            return []
        if lease.state == LeaseState.QUEUED:
            lease.last_queue_notice = None  # the new session hears where it stands
            return []
        # Paused (or evicted while detached).  If it may run now, the queue resumes it.
        # Otherwise stop it again: the new control block must show it paused, and what
        # was applied before the restart was undone.
        applied = max(
            (level for level in (lease.applied_level, lease.pending_level) if level is not None),
            default=None,
        )
        if applied is None and lease.slot is not None and self._fits_now(lease, lease.slot, now):
            return []
        level = applied if applied is not None else stopping_level(self._traits(lease))
        if level is None:
            self._index.move(lease, LeaseState.RUNNING)  # nothing can stop it: it time-slices
            lease.state_since = now
            lease.reason = "could not be paused again after the broker restarted"
            return []
        lease.pending_level = level
        lease.reason = lease.reason or "paused for a higher-priority session"
        return [
            Preempt(
                session_id=lease.session_id,
                lease_id=lease.lease_id,
                pid=lease.identity.pid,
                device_index=self.slots[lease.slot].device_index,  # type: ignore[index]
                level=level,
                for_lease=lease.paused_for,
                reason=lease.reason,
            )
        ]

    def _on_RanksAttached(self, event: RanksAttached, now: float) -> list[Action]:
        members = self.members(event.gang)  # a plain lease is a gang of one here
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
            self._index.reidentify(member, replace(member.identity, pid=pid, start_ticks=ticks))
            # What failed on the notebook's process (no CUDA context there to lock, say)
            # says nothing of the rank's own: it may be stopped as its request said.
            member.lockable = member.capabilities.lockable
            member.evictable = True
        return []

    def _on_LeaseReleased(self, event: LeaseReleased, now: float) -> list[Action]:
        """A lease ends; a gang's id (or any of its members' ids) ends the whole gang."""
        leases = self.members(event.lease_id)
        if not leases or leases[0].state not in ACTIVE_STATES:
            raise SchedulerError(ErrorCode.UNKNOWN_LEASE, f"no active lease {event.lease_id}")
        lease = leases[0]
        if lease.session_id != event.session_id and not event.by_admin:
            raise SchedulerError(ErrorCode.PERMISSION, f"lease {event.lease_id} is not yours")
        reason = "cancelled by an admin" if event.by_admin else "released"
        state = LeaseState.REVOKED if event.by_admin else LeaseState.RELEASED
        actions: list[Action] = []
        if event.by_admin and lease.session_id in self.sessions:
            actions.append(
                Revoke(
                    session_id=lease.session_id,
                    lease_id=lease.gang or lease.lease_id,
                    pid=lease.identity.pid,
                    reason=reason,
                )
            )
        actions.extend(self._end(member, state, now, reason) for member in leases)
        if lease.gang is not None:
            self.gangs.pop(lease.gang, None)
            self._gang_targets.pop(lease.gang, None)
        return actions

    def _on_PreemptionApplied(self, event: PreemptionApplied, now: float) -> list[Action]:
        lease = self.leases.get(event.lease_id)
        if lease is None or lease.state not in ACTIVE_STATES:
            return []  # it ended meanwhile; the server undoes what was applied
        if lease.pending_level != event.level:
            return []  # a stale confirmation (it was resumed meanwhile)
        lease.pending_level = None
        lease.applied_level = event.level
        if event.level == PreemptionLevel.EVICT and lease.state == LeaseState.PAUSED:
            self._index.move(lease, LeaseState.EVICTED)
            # Its process's device memory is on the host now: the last reading is stale.
            self._seen.get(lease.slot or "", {}).pop(lease.identity.pid, None)
            self._seen_readings[lease.slot or ""] = self._seen_readings.get(lease.slot or "", 0) + 1
            lease.reason = lease.reason or "evicted for a higher-priority session"
            self._index.victim_done(lease.lease_id)
        return []

    def _on_PreemptionFailed(self, event: PreemptionFailed, now: float) -> list[Action]:
        lease = self.leases.get(event.lease_id)
        if lease is None or lease.state not in ACTIVE_STATES or lease.pending_level != event.level:
            return []
        lease.pending_level = None
        if lease.parks_session:
            # It stays on the GPU, unlocked, and is never tried again: a process the
            # checkpoint refused once (MIG, IPC or UVM memory) will refuse again.
            record = self.sessions.get(lease.session_id)
            if record is not None:
                record.unparkable = f"could not be parked: {event.reason}"
            self._index.victim_done(lease.lease_id, give_up=True)
            return [self._end(lease, LeaseState.RELEASED, now, f"not parked: {event.reason}")]
        if event.level == PreemptionLevel.EVICT:
            lease.evictable = False
            lease.reason = f"cannot be evicted: {event.reason}"
        else:
            # It could not be paused: it keeps running, time-sliced with the newcomer.
            lease.lockable = False
            self._index.move(lease, LeaseState.RUNNING)
            lease.state_since = now
            lease.applied_level = None
            lease.reason = f"could not be paused: {event.reason}"
        self._index.victim_done(lease.lease_id, give_up=True)
        return []

    def _on_MemoryObserved(self, event: MemoryObserved, now: float) -> list[Action]:
        running = sorted(
            (
                lease
                for lease in self._index.by_pid.get(event.pid, {}).values()
                if lease.state == LeaseState.RUNNING
            ),
            key=lambda lease: lease.arrival,
        )
        if not running:
            return []
        quota = sum(lease.memory_bytes for lease in running)
        # NVML counts the CUDA context and library workspaces (several hundred MiB on a
        # Hopper GPU) against the process; the quota is about the data.
        tolerance = CONTEXT_ALLOWANCE + quota // 20
        if event.used_bytes <= quota + tolerance:
            return []
        actions: list[Action] = []
        for lease in running:
            reason = (
                f"over its memory quota: {format_size(event.used_bytes)} in use, "
                f"{format_size(quota)} leased"
            )
            level = PreemptionLevel.LOCK if lease.lockable else None
            if level is None:
                continue
            self._index.move(lease, LeaseState.PAUSED)
            lease.state_since = now
            lease.pending_level = level
            lease.reason = reason + "; release the lease or restart the kernel"
            lease.held_by_watchdog = True
            actions.append(
                Preempt(
                    session_id=lease.session_id,
                    lease_id=lease.lease_id,
                    pid=lease.identity.pid,
                    device_index=self.slots[lease.slot].device_index,  # type: ignore[index]
                    level=level,
                    for_lease="",
                    reason=reason,
                )
            )
        return actions

    def _on_DeviceMemorySeen(self, event: DeviceMemorySeen, now: float) -> list[Action]:
        key = str(event.device_index)
        if event.mig_uuid is not None:
            key = f"{event.device_index}/{event.mig_uuid}"
        if key in self.slots:  # a reading of a slot this broker has (not a stale layout)
            self._seen[key] = {pid: used for pid, used in event.used_by_pid if used > 0}
            self._seen_readings[key] = self._seen_readings.get(key, 0) + 1
        return []

    def unleased_memory(self, key: str, asking: Lease | None = None) -> int:
        """Memory seen on slot ``key`` beyond what the leases there declare: per process,
        what it holds over its leases' memory (the whole of it for an idle notebook or a
        process without a lease).  With ``asking``, that lease is counted as granted: a
        process asking for memory it already holds (a notebook's cached arrays) is not
        asked to find it twice."""
        return sum(self.unleased_by_pid(key, asking).values())

    def unleased_by_pid(self, key: str, asking: Lease | None = None) -> dict[int, int]:
        """:meth:`unleased_memory` per process (only those holding some)."""
        beyond: dict[int, int] = {}
        for pid, used in self._seen.get(key, {}).items():
            declared = sum(
                lease.memory_bytes
                for lease in self._index.by_pid.get(pid, {}).values()
                if lease.slot == key and lease.state in (LeaseState.RUNNING, LeaseState.PAUSED)
            )
            counted = asking is not None and asking.state in (LeaseState.RUNNING, LeaseState.PAUSED)
            if asking is not None and asking.identity.pid == pid and not counted:
                declared += asking.memory_bytes
            if used > declared:
                beyond[pid] = used - declared
        return beyond

    def _on_SessionActivity(self, event: SessionActivity, now: float) -> list[Action]:
        record = self._session(event.session_id)
        record.cell_running = event.running
        record.checkpoint_unsafe = event.unparkable
        if not event.running:
            record.idle_since = now
        return []

    def _on_RestoreAsked(self, event: RestoreAsked, now: float) -> list[Action]:
        lease = self.leases.get(event.lease_id)
        if lease is None or not lease.parks_session or lease.session_id != event.session_id:
            raise SchedulerError(
                ErrorCode.UNKNOWN_LEASE, f"this session has no parked memory {event.lease_id}"
            )
        lease.restore_wanted = not event.cancel
        lease.last_queue_notice = None  # a waiting restore is told where it stands anew
        if lease.restore_wanted:
            lease.state_since = now
        self._index.touch(lease)
        return []

    def session_id_of_pid(self, pid: int) -> str | None:
        return self._session_of_pid.get(pid)

    def session_of_pid(self, pid: int) -> SessionRecord | None:
        session_id = self._session_of_pid.get(pid)
        return self.sessions.get(session_id) if session_id else None

    def _on_ParkAsked(self, event: ParkAsked, now: float) -> list[Action]:
        record = self.session_of_pid(event.pid)
        if record is None:
            raise SchedulerError(
                ErrorCode.INVALID, f"process {event.pid} is not a notebook session of this broker"
            )
        why = self._why_not_parkable(record)
        if why:
            raise SchedulerError(ErrorCode.INVALID, f"the notebook of pid {event.pid} {why}")
        for key in self._seen:
            idle = [s for s in self._idle_sessions(key, None) if s.pid == event.pid]
            if not idle:
                continue
            room = self._host_room()
            if idle[0].held_bytes > room:
                raise SchedulerError(
                    ErrorCode.INVALID,
                    f"the notebook of pid {event.pid} holds {format_size(idle[0].held_bytes)}, "
                    f"but the host has room for {format_size(room)} of parked memory "
                    "(park_host_limit)",
                )
            return [self._park(idle[0], key, f"parked by {event.by}", "", now)]
        raise SchedulerError(
            ErrorCode.INVALID,
            f"the notebook of pid {event.pid} holds no GPU memory outside its leases on a whole "
            "GPU (nothing to park)",
        )

    def _why_not_parkable(self, record: SessionRecord) -> str:
        if any(self.leases[lid].parks_session for lid in record.leases if lid in self.leases):
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
        if self.policy.mps:
            return "is an MPS client (mps = true): the checkpoint lock does not work for it"
        return ""

    def _on_DeviceDrained(self, event: DeviceDrained, now: float) -> list[Action]:
        if event.device_index not in self.devices:
            raise SchedulerError(ErrorCode.INVALID, f"there is no device {event.device_index}")
        if event.drained:
            self.drained.add(event.device_index)
        else:
            self.drained.discard(event.device_index)
        return []

    def _on_PolicyChanged(self, event: PolicyChanged, now: float) -> list[Action]:
        self.policy = event.policy
        return []

    def _on_Tick(self, event: Tick, now: float) -> list[Action]:
        """Take the host's memory reading; park the sessions idle longer than their
        ``park_idle_after``."""
        if event.host is not None:
            self.host = event.host
            self._on_host_at_reading = self._on_host()
        actions: list[Action] = []
        if not self.policy.parks_idle_sessions:
            return actions
        for key in self._seen:
            idle = [
                session
                for session in self._idle_sessions(key, None)
                if self._idle_too_long(session, now)
            ]
            if not idle:
                continue
            room = self._host_room()
            for session in sorted(idle, key=park_order):
                if session.held_bytes > room:
                    continue  # the host cannot take it now; a later tick tries again
                room -= session.held_bytes
                after = self._park_after(session)
                assert after is not None
                reason = idle_reason(now - session.idle_since, after)
                actions.append(self._park(session, key, reason, "", now))
        return actions

    def _park_after(self, session: IdleSession) -> float | None:
        identity = self.sessions[session.session_id].identity
        return self.policy.limits_for(identity.user, identity.groups).park_idle_after

    def _idle_too_long(self, session: IdleSession, now: float) -> bool:
        after = self._park_after(session)
        return after is not None and now - session.idle_since >= after

    # ---- helpers

    @staticmethod
    def _traits(lease: Lease) -> VictimTraits:
        return VictimTraits(
            gate=lease.capabilities.gate,
            yield_flag=lease.capabilities.yield_flag,
            instrumented_only=lease.capabilities.instrumented_only,
            lockable=lease.lockable,
            evictable=lease.evictable,
        )

    def _idle_sessions(self, key: str, asking: Lease | None) -> list[IdleSession]:
        """The sessions that may be parked to free memory on slot ``key`` (see
        :mod:`~gpushare_ext.broker.parking`): known, idle, never refused by the checkpoint,
        on a whole GPU and not MPS clients."""
        if self.slots[key].mig_uuid is not None or self.policy.mps:
            return []
        idle: list[IdleSession] = []
        for pid, held in self.unleased_by_pid(key, asking).items():
            session_id = self._session_of_pid.get(pid)
            record = self.sessions.get(session_id) if session_id else None
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
                )
            )
        return idle

    def _host_room(self) -> int:
        """Host memory parks may still take: parked and evicted memory (and what is on
        its way there) count against ``park_host_limit``."""
        if self.host is None:
            return 0
        on_host = self._on_host()
        limit = self.policy.park_host_limit.of(self.host.total_bytes)
        since = max(0, on_host - self._on_host_at_reading)  # not in the reading's figure yet
        return host_room(self.host, limit, on_host, since)

    def _on_host(self) -> int:
        """Bytes parked and evicted sessions hold on the host, or are on their way there."""
        return sum(
            lease.memory_bytes
            for lease in self.leases.values()
            if lease.state == LeaseState.EVICTED or lease.pending_level == PreemptionLevel.EVICT
        )

    def _parks_for(self, lease: Lease, key: str, band: int, need: int) -> ParkPlan | None:
        if not self.policy.park_when_memory_needed:
            return None
        idle = self._idle_sessions(key, lease)
        if not idle:
            return None
        plan = plan_parks(idle, need, band, self._host_room())
        if plan.refusal:
            self._park_refusals[key] = plan.refusal
        return plan

    def _park(
        self, session: IdleSession, key: str, reason: str, for_lease: str, now: float
    ) -> Preempt:
        """Make the park lease of an idle session and evict it (lock, then checkpoint)."""
        record = self.sessions[session.session_id]
        record.parks += 1
        self._arrivals += 1
        lease = Lease(
            lease_id=f"{session.session_id}-P{record.parks}",
            session_id=session.session_id,
            identity=record.identity,
            base_priority=session.last_priority,
            memory_bytes=session.held_bytes,
            sm_share=1.0,
            slice=SliceWish.AUTO,
            device_wish=str(self.slots[key].device_index),
            capabilities=Capabilities(lockable=True),
            label=PARKED_LABEL,
            arrival=self._arrivals,
            requested_at=now,
            state_since=now,
            parks_session=True,
        )
        self.leases[lease.lease_id] = lease
        self._index.add(lease)
        record.leases.add(lease.lease_id)
        uid = lease.identity.uid
        self._parks_of_uid[uid] = self._parks_of_uid.get(uid, 0) + 1
        lease.granted_at = now
        self._index.move(lease, LeaseState.RUNNING, key)
        self._index.move(lease, LeaseState.PAUSED)
        lease.pending_level = PreemptionLevel.EVICT
        lease.reason = reason
        lease.paused_for = for_lease
        return Preempt(
            session_id=lease.session_id,
            lease_id=lease.lease_id,
            pid=lease.identity.pid,
            device_index=self.slots[key].device_index,
            level=PreemptionLevel.EVICT,
            for_lease=for_lease,
            reason=reason,
            parks_bytes=lease.memory_bytes,
        )

    def _session(self, session_id: str) -> SessionRecord:
        record = self.sessions.get(session_id)
        if record is None:
            raise SchedulerError(ErrorCode.OUT_OF_ORDER, f"no session {session_id}")
        return record

    def _candidate_slots(
        self, device_wish: str, wish: SliceWish, reachable: tuple[str, ...] | None = None
    ) -> tuple[list[str], str]:
        """Slots a request may be placed on (only on GPUs its process can reach), or
        ([], why none)."""
        # The slots never change while the scheduler lives, and every waiter asks this on
        # every event.  Device wishes are the clients' text: the memo stays small.
        memo_key = (device_wish, wish, reachable)
        known = self._candidates.get(memo_key)
        if known is None:
            if len(self._candidates) >= CANDIDATE_MEMO:
                self._candidates.clear()
            known = self._match_slots(device_wish, wish)
            if reachable is not None and known[0]:
                known = self._only_reachable(known[0], reachable)
            self._candidates[memo_key] = known
        return list(known[0]), known[1]

    def _only_reachable(self, keys: list[str], reachable: tuple[str, ...]) -> tuple[list[str], str]:
        """``keys`` on GPUs the process can reach (by GPU or MIG UUID, or host index), or
        ([], why none): a pod given some of the node's GPUs cannot use the others."""
        names = set(reachable)
        kept = [
            k
            for k in keys
            if {self.slots[k].device_uuid, self.slots[k].mig_uuid, str(self.slots[k].device_index)}
            & names
        ]
        if kept:
            return kept, ""
        seen = ", ".join(reachable[:4]) + (" ..." if len(reachable) > 4 else "") or "none"
        return [], (
            f"this session's process can reach none of the GPUs that match (it sees {seen}; "
            "its container was given other GPUs than this broker's, or none)"
        )

    def reachable_note(self, lease: Lease) -> str:
        """For status and the queue line: which GPUs a restricted session may use ("" when
        it may use every one this broker manages)."""
        if lease.reachable is None:
            return ""
        keys, _ = self._candidate_slots(lease.device_wish, lease.slice, lease.reachable)
        every, _ = self._candidate_slots(lease.device_wish, lease.slice)
        if set(keys) == set(every):
            return ""
        devices = sorted({self.slots[k].device_index for k in keys})
        named = ", ".join(f"GPU {index}" for index in devices)
        return f"this session's process can use only {named}"

    def _match_slots(self, device_wish: str, wish: SliceWish) -> tuple[list[str], str]:
        keys, matching, refusal = self._slots_for_device(device_wish)
        if refusal:
            return [], refusal
        # MIG on but nothing cut yet: say so whatever the wish (only an admin can fix it).
        mig_without_instances = [
            i for i in matching if self.devices[i].mig_enabled and not self.devices[i].instances
        ]
        no_instance_yet = (
            f"MIG is on for device(s) {mig_without_instances} but no instance exists; "
            "an admin can create some (gpushare mig plan)"
        )
        if wish == SliceWish.MIG:
            keys = [k for k in keys if self.slots[k].mig_uuid]
            if not keys and not mig_without_instances:
                return [], "no MIG instance exists on the matching devices (MIG is off)"
        elif wish == SliceWish.SHARED:
            keys = [k for k in keys if not self.slots[k].mig_uuid]
            if not keys and any(self.devices[i].instances for i in matching):
                return [], "the matching devices are cut into MIG instances; ask for mig"
            if not keys:
                return [], no_instance_yet
        if not keys:
            return [], no_instance_yet if mig_without_instances else "no device matches"
        return keys, ""

    def _slots_for_device(self, device_wish: str) -> tuple[list[str], list[int], str]:
        """(slot keys, device indices) a device wish (auto, an index, a UUID) names, or a
        refusal when it names nothing."""
        keys = sorted(self.slots)
        matching = sorted(self.devices)
        wish_text = (device_wish or "auto").strip()
        if wish_text == "auto":
            return keys, matching, ""
        # isdigit() is true for "²" and "①", which int() refuses: ASCII digits only.
        if wish_text.isascii() and wish_text.isdecimal():
            index = int(wish_text)
            if index not in self.devices:
                return [], [], f"there is no device {index} (devices: {sorted(self.devices)})"
            return [k for k in keys if self.slots[k].device_index == index], [index], ""
        keys = [k for k in keys if wish_text in (self.slots[k].mig_uuid, self.slots[k].device_uuid)]
        matching = [i for i, d in self.devices.items() if d.uuid == wish_text]
        if not keys and not matching:
            return [], [], f"no device or MIG instance has the UUID {wish_text}"
        return keys, matching, ""

    def _queue_key(self, lease: Lease, now: float) -> tuple:
        return (-self._effective(lease, now), lease.arrival)

    def _effective(self, lease: Lease, now: float) -> float:
        limits = self.policy.limits_for(lease.identity.user, lease.identity.groups)
        if lease.state == LeaseState.RUNNING:
            return lease.running_priority()
        waiting_since = lease.state_since
        earned = effective_priority(0, now - waiting_since, limits.aging_per_minute)
        return min(299.0, lease.base_priority + lease.aging_bonus + earned)

    def _end(self, lease: Lease, state: LeaseState, now: float, reason: str) -> LeaseEnded:
        check_move(lease.lease_id, lease.state, state)
        held = now - lease.granted_at if lease.granted_at is not None else 0.0
        undo = lease.pending_level if lease.pending_level is not None else lease.applied_level
        if lease.applied_level is not None and lease.pending_level is not None:
            undo = max(lease.applied_level, lease.pending_level)
        device_index = self.slots[lease.slot].device_index if lease.slot else None
        self._index.drop(lease)
        lease.state = state
        lease.state_since = now
        lease.reason = reason
        lease.applied_level = None
        lease.pending_level = None
        if lease.granted_at is not None and not lease.parks_session:
            previous = self._hold_ema.get(lease.identity.uid, held)
            self._hold_ema[lease.identity.uid] = 0.7 * previous + 0.3 * held
        del self.leases[lease.lease_id]
        if lease.parks_session:
            left = self._parks_of_uid.get(lease.identity.uid, 1) - 1
            if left:
                self._parks_of_uid[lease.identity.uid] = left
            else:
                self._parks_of_uid.pop(lease.identity.uid, None)
        self.ended[lease.lease_id] = lease
        if len(self.ended) > 512:
            self.ended.pop(next(iter(self.ended)))
        record = self.sessions.get(lease.session_id)
        if record is not None:
            record.leases.discard(lease.lease_id)
            record.idle_since = now
        self._index.victim_done(lease.lease_id)
        return LeaseEnded(
            session_id=lease.session_id,
            lease_id=lease.lease_id,
            pid=lease.identity.pid,
            device_index=device_index,
            held_s=held,
            undo_level=undo,
            reason=reason,
        )

    # ---- placement

    def _compute_compatible(self, lease: Lease, running: list[Lease], now: float) -> bool:
        if not running:
            return True
        if lease.slice == SliceWish.EXCLUSIVE or any(
            r.slice == SliceWish.EXCLUSIVE for r in running
        ):
            return False
        spatial = lease.sm_share < 1.0 and all(r.sm_share < 1.0 for r in running)
        if spatial and lease.sm_share + sum(r.sm_share for r in running) <= 1.0 + 1e-9:
            return True
        if self.policy.sharing == "exclusive":
            return False
        band = priority_band(self._effective(lease, now))
        return all(priority_band(r.running_priority()) == band for r in running)

    def _compatible_with_slot(self, lease: Lease, load: SlotLoad, now: float) -> bool:
        """:meth:`_compute_compatible` with every lease running on a slot, read from the
        slot's aggregates instead of its leases."""
        count = len(load.running)
        if not count:
            return True
        if lease.slice == SliceWish.EXCLUSIVE or load.exclusive:
            return False
        if (
            lease.sm_share < 1.0
            and not load.whole
            and exact_share(lease.sm_share) + load.shares <= SPATIAL_LIMIT
        ):
            return True
        if self.policy.sharing == "exclusive":
            return False
        band = priority_band(self._effective(lease, now))
        return load.bands.get(band, 0) == count

    def _fits_now(self, lease: Lease, key: str, now: float) -> bool:
        slot = self.slots[key]
        load = self._index.slots[key]
        held = load.held + self.unleased_memory(key, lease)
        if lease.state in (LeaseState.PAUSED,):
            held -= lease.memory_bytes  # it already holds its memory there
        if held + lease.memory_bytes > slot.memory_bytes:
            return False
        return self._compatible_with_slot(lease, load, now)

    def _slot_preference(self, lease: Lease, key: str) -> tuple:
        slot = self.slots[key]
        load = self._index.slots[key]
        # Least loaded first.  Then an idle MIG instance before a whole GPU (AUTO means "a
        # MIG instance where MIG is on"), best fit among instances (keeps big ones free for
        # big requests), and the whole GPU with the most memory free.
        if slot.mig_uuid:
            return (len(load.running), 0, slot.memory_bytes, key)
        free = slot.memory_bytes - load.held - self.unleased_memory(key, lease)
        return (len(load.running), 1, -free, key)

    def _preemption_plan(self, lease: Lease, key: str, now: float) -> RoomPlan | None:
        """Victims to pause and to evict so ``lease`` can run on ``key``; None if impossible."""
        slot = self.slots[key]
        load = self._index.slots[key]
        band = priority_band(self._effective(lease, now))
        to_pause = self._victims_to_pause(lease, load, band, now)
        if to_pause is None:
            return None
        # Memory: evict lower-band leases (paused ones first) until the request fits.
        own = lease.memory_bytes if lease.state == LeaseState.PAUSED else 0
        # Memory no lease declares is freed by parking idle sessions, not by evictions.
        need = (
            load.held + self.unleased_memory(key, lease) - own + lease.memory_bytes
        ) - slot.memory_bytes
        to_park: list[IdleSession] = []
        if need > 0:  # idle sessions first, before any lease is evicted
            parks = self._parks_for(lease, key, band, need)
            if parks is not None:
                to_park = list(parks.chosen)
                need -= parks.freed_bytes
        to_evict: list[Lease] = []
        if need > 0:
            if not self.policy.evict_when_memory_needed:
                return None
            evicted = self._victims_to_evict(lease, load, band, need)
            if evicted is None:
                return None
            to_evict = evicted
        return to_pause, to_evict, to_park

    def _victims_to_pause(
        self, lease: Lease, load: SlotLoad, band: int, now: float
    ) -> list[Lease] | None:
        """The running leases in ``lease``'s way, in arrival order; None if one of them
        may not be stopped for it (then the others need no look)."""
        everyone = self.policy.sharing == "exclusive" or lease.slice == SliceWish.EXCLUSIVE
        if not everyone and not load.exclusive and load.bands.get(band, 0) == len(load.running):
            return []  # all of them time-slice with it: nobody is in its way
        to_pause: list[Lease] = []
        for victim in load.running.values():
            if not everyone and self._compute_compatible(lease, [victim], now):
                continue
            if priority_band(victim.running_priority()) >= band:
                return None
            if any(member.pending_level is not None for member in self._gang_mates(victim)):
                return None  # already being stopped; wait for that
            if self._gang_stopping_level(victim) is None:
                continue  # cannot be stopped: it will time-slice with us (said in status)
            to_pause.append(victim)
        to_pause.sort(key=lambda victim: victim.arrival)
        return to_pause

    def _victims_to_evict(
        self, lease: Lease, load: SlotLoad, band: int, need: int
    ) -> list[Lease] | None:
        """Lower-band holders of the slot to evict for ``need`` bytes; None if too few."""
        if load.lower_band_memory(band) < need:
            return None  # evicting every lower band would not be enough
        candidates = [
            other
            for other in load.holders.values()
            if other.lease_id != lease.lease_id
            and not (lease.gang is not None and other.gang == lease.gang)
            and priority_band(other.running_priority()) < band
            and other.evictable
            and (other.lockable or other.state == LeaseState.PAUSED)
            and other.pending_level is None
            # A rank is evicted only if the rest of its gang can be stopped with it.
            and (other.gang is None or self._gang_stopping_level(other) is not None)
        ]
        candidates.sort(
            key=lambda o: victim_order_key(o.running_priority(), o.memory_bytes, o.arrival)
        )
        to_evict: list[Lease] = []
        for other in candidates:
            if need <= 0:
                break
            to_evict.append(other)
            need -= other.memory_bytes
        return to_evict if need <= 0 else None

    def _schedule(self, now: float) -> list[Action]:
        # Slots kept for waiters ranked higher: ``reserved`` for one that is being made
        # room for (or could be placed), ``waited_for`` for one that can neither be
        # placed nor make room.  A paused lease may resume on a slot that is only waited
        # for: it holds its memory there anyway, and running to its end may be the only
        # way that memory is ever freed (it cannot be evicted).  Both only grow as the
        # pass goes down the line, and nothing in it puts a lease back into the queue.
        self._passes += 1
        self._park_refusals.clear()
        self._pass_gangs.clear()
        if self.recompute_every_waiter or len(self._index.waiters) <= self.line_from:
            self._drop_line()  # a handful of waiters: serving each costs less than a line
            return self._serve_every_waiter(now)
        self._catch_up_line(now)
        line = self._line
        drained = self.drained
        groups = [
            _RequestGroup(
                wanted=wanted,
                tickets=tickets,
                candidates=frozenset(
                    k for k in wanted if self.slots[k].device_index not in drained
                ),
            )
            for wanted, tickets in line.groups.items()
            if wanted != OTHERS
        ]
        state = _Pass(now=now, groups=groups, moved_from=line.first_change)
        self._pass = state
        try:
            self._close_groups(state)
            others = line.groups.get(OTHERS, [])
            next_other = 0
            while True:  # the next turn: the first of the other waiters and open groups
                ticket = others[next_other] if next_other < len(others) else math.inf
                first = None
                for group in groups:
                    waiting = group.open and group.served < len(group.tickets)
                    if waiting and group.tickets[group.served] < ticket:
                        ticket, first = group.tickets[group.served], group
                if ticket == math.inf:
                    break
                if first is not None:
                    first.served += 1
                else:
                    next_other += 1
                self._take_turn(state, line.at(ticket), first)  # type: ignore[arg-type]
            self._tell_passed_over(state, math.inf)
            self._end_pass(state)
        finally:
            self._pass = None
        return state.actions

    def _serve_every_waiter(self, now: float) -> list[Action]:
        """The pass as a full recomputation: every waiter served in turn."""
        actions: list[Action] = []
        reserved: set[str] = set()
        waited_for: set[str] = set()
        ahead = 0  # queued leases ranked higher that still wait after their turn
        for lease in self.queue():
            actions.extend(self._serve(lease, reserved, waited_for, ahead, now))
            if lease.state == LeaseState.QUEUED and lease.rank == 0:
                ahead += 1
        return actions

    def _take_turn(self, state: _Pass, place: Place, group: _RequestGroup | None) -> None:
        lease = place.lease
        self._tell_passed_over(state, place.ticket)  # before anything changes
        ahead = state.ahead_of(self._line, place.ticket)
        state.actions.extend(self._serve(lease, state.reserved, state.waited_for, ahead, state.now))
        state.served.add(lease.lease_id)
        if (
            group is not None
            and lease.state == LeaseState.QUEUED
            and not lease.awaiting_memory_from
        ):
            group.looks.add(self._look_of(group.wanted))  # it was told where it stands
        self._close_groups(state)

    def _close_groups(self, state: _Pass) -> None:
        """Close the groups whose candidate slots are now all reserved or waited for."""
        size = len(state.reserved) + len(state.waited_for)
        if size == state.blocked_size:
            return
        state.blocked_size = size
        blocked = state.reserved | state.waited_for
        for group in state.groups:
            if group.open and group.candidates <= blocked:
                group.open = False
                group.settled = group.served

    def _tell_passed_over(self, state: _Pass, before: float) -> None:
        """Tell the requests passed over ahead of ticket ``before`` where they stand, where
        that may have changed: their place, how their slots look, or a reset notice.

        Nothing has changed since their turn: this runs before every turn (and at the end
        of the pass), and a turn is the only thing in a pass that changes anything."""
        line = self._line
        due: dict[int, int | None] = {}  # ticket: its index in line.counted, if known
        stop = line.counted_before(before)
        for index in range(max(state.walked, state.moved_from), stop):
            ticket = line.counted[index]
            if line.at(ticket).lease.lease_id not in state.served:
                due[ticket] = index
        state.walked = max(state.walked, stop)
        self._tell_changed_looks(state, before, due)
        if self._notice_due:
            self._tell_reset(state, before, due)
        if due:
            self._tell_due(state, due)

    def _tell_changed_looks(self, state: _Pass, before: float, due: dict[int, int | None]) -> None:
        """Add to ``due`` the passed-over requests whose slots look otherwise than when
        they were last told."""
        for group in state.groups:
            end = bisect.bisect_left(group.tickets, before)
            if group.open or group.settled >= end:
                continue
            look = self._look_of(group.wanted)
            group.looks.add(look)
            if look != self._told_looks.get(group.wanted):
                for ticket in group.tickets[group.settled : end]:
                    due.setdefault(ticket, None)
            group.settled = end

    def _tell_reset(self, state: _Pass, before: float, due: dict[int, int | None]) -> None:
        """Add to ``due`` the passed-over requests to tell anew whatever changed."""
        line = self._line
        for lease_id in list(self._notice_due):
            place = line.places.get(lease_id)
            if place is None or lease_id in state.served:
                self._notice_due.discard(lease_id)
            elif place.ticket < before:
                due.setdefault(place.ticket, None)
                self._notice_due.discard(lease_id)

    def _tell_due(self, state: _Pass, due: dict[int, int | None]) -> None:
        """Tell the requests in ``due`` (ticket: index in the counted, if known) where
        they stand, in line order."""
        line = self._line
        telling: dict[tuple, tuple] = {}  # per wanted slots: what all their requests hear
        reasons: dict[tuple, str] = {}  # per wanted slots and whether anyone is ahead
        for ticket in sorted(due):
            place = line.at(ticket)
            index = due[ticket]
            if index is None:
                index = line.counted_before(ticket)
            ahead = index - bisect.bisect_left(state.granted, ticket)
            lease, wanted = place.lease, place.group
            if wanted not in telling:
                telling[wanted] = self._what_they_hear(wanted)  # type: ignore[arg-type]
            keys, holders, same_reason = telling[wanted]
            reason = reasons.get((wanted, bool(ahead)), "") if same_reason else ""
            if not reason:
                reason = self._queue_reason(lease, keys, holders, ahead)
                reasons[(wanted, bool(ahead))] = reason
            lease.target_slot = None
            state.actions.extend(self._tell_queued(lease, holders, reason, ahead, state.now))

    def _what_they_hear(self, wanted: tuple[str, ...]) -> tuple[list[str], _Holders, bool]:
        """For the plain requests that want ``wanted``: the slots their notices speak of,
        who holds those, and whether all hear the same reason (no NVML reading there:
        then only drains, holders and whether anyone is ahead make the reason)."""
        candidates = [k for k in wanted if self.slots[k].device_index not in self.drained]
        keys = candidates or list(wanted)
        return keys, self._holders(keys), not any(self._seen.get(k) for k in keys)

    def _look_of(self, keys: tuple[str, ...]) -> tuple:
        """What a queue notice reads of ``keys`` besides the place: who holds them (and
        their memory, which NVML's readings are compared with), the readings, why no
        idle session was parked there in this pass, and whether they are drained."""
        return tuple(
            (
                self._index.slots[key].holders_version,
                self._seen_readings.get(key, 0),
                self._park_refusals.get(key, ""),
                self.slots[key].device_index in self.drained,
            )
            for key in keys
        )

    def _end_pass(self, state: _Pass) -> None:
        """Everyone was told where they stand: the line starts the next pass clean."""
        line = self._line
        for ticket in state.granted:
            line.remove(line.at(ticket).lease.lease_id, state.now)
        line.first_change = len(line.counted)
        self._told_looks = {
            group.wanted: next(iter(group.looks)) if len(group.looks) == 1 else None
            for group in state.groups
        }
        self._notice_due.clear()

    def _drop_line(self) -> None:
        """Stop keeping the waiting line (the next pass that needs it sorts it afresh)."""
        if self._line_policy is not None or self._index.changed:
            self._line_policy = None
            self._index.changed.clear()
            self._notice_due.clear()

    def _catch_up_line(self, now: float) -> None:
        """Bring the waiting line up to date with the leases changed since the last pass
        (or sort it afresh when time or a new policy may have changed its order, or the
        line was not kept)."""
        changed = self._index.take_changed()
        line = self._line
        if self.policy is not self._line_policy or not line.in_order_at(now):
            self._line_policy = self.policy
            self._aging_rates.clear()
            places = [self._line_place(lease) for lease in self._index.waiters.values()]
            line.rebuild(places, now)
            self._told_looks.clear()  # nobody is known to have been told anything yet
            self._notice_due.clear()
            return
        for lease in changed:
            wanted = self._line_place(lease) if lease.lease_id in self._index.waiters else None
            line.update(lease.lease_id, wanted, now)
            if wanted is not None and wanted.group != OTHERS:
                self._notice_due.add(lease.lease_id)

    def _line_place(self, lease: Lease) -> Place:
        """Where a waiter belongs in the waiting line."""
        who = (lease.identity.user, lease.identity.groups)
        rate = self._aging_rates.get(who)
        if rate is None:
            rate = self._aging_rates[who] = self.policy.limits_for(*who).aging_per_minute
        plain = (
            lease.state == LeaseState.QUEUED
            and lease.gang is None
            and not lease.detached
            and not lease.awaiting_memory_from
            and lease.pending_level is None
            and not lease.parks_session
        )
        return Place(
            lease=lease,
            group=tuple(self._wanted_slots(lease)) if plain else OTHERS,
            counted=lease.state == LeaseState.QUEUED and lease.rank == 0,
            trajectory=Trajectory(
                start=lease.base_priority + lease.aging_bonus,
                since=lease.state_since,
                rate=rate,
                arrival=lease.arrival,
            ),
        )

    def _serve(
        self, lease: Lease, reserved: set[str], waited_for: set[str], ahead: int, now: float
    ) -> list[Action]:
        """One waiter's turn in the pass: placed, made room for, or told why it waits."""
        if lease.state not in (LeaseState.QUEUED, LeaseState.PAUSED, LeaseState.EVICTED):
            return []
        if lease.gang is not None:  # a gang is served whole, at the first member met
            if lease.gang in self._pass_gangs:
                return []
            self._pass_gangs.add(lease.gang)
            return self._serve_gang(lease.gang, reserved, waited_for, ahead, now)
        if lease.held_by_watchdog or lease.detached:
            return []
        if lease.parks_session and not lease.restore_wanted:
            return []  # parked memory comes back when its session asks, not before
        if lease.pending_level is not None:
            reserved.add(lease.slot)  # type: ignore[arg-type]
            return []
        if lease.awaiting_memory_from:
            reserved.add(lease.target_slot)  # type: ignore[arg-type]
            return []
        lease.target_slot = None
        wanted = self._wanted_slots(lease)  # before draining: the notice says when drain is why
        candidates = [
            k
            for k in wanted
            if self.slots[k].device_index not in self.drained or lease.state != LeaseState.QUEUED
        ]
        blocked = reserved if lease.state == LeaseState.PAUSED else reserved | waited_for
        open_slots = [k for k in candidates if k not in blocked]
        placed = [k for k in open_slots if self._fits_now(lease, k, now)]
        if placed:
            return self._start(
                lease, min(placed, key=lambda k: self._slot_preference(lease, k)), now
            )
        plans = []
        for key in open_slots:
            plan = self._preemption_plan(lease, key, now)
            if plan is not None:
                cost = (*self._plan_cost(plan), self._slot_preference(lease, key))
                plans.append((cost, key, plan))
        if plans:
            _, key, plan = min(plans, key=lambda p: p[0])
            reserved.add(key)
            return self._preempt_for(lease, key, plan, now, ahead)
        waited_for.update(candidates)
        return self._queue_notice(lease, candidates or wanted, now, ahead)

    def _wanted_slots(self, lease: Lease) -> list[str]:
        """The slots a waiter may run on: its own if it holds one, else those it fits."""
        if lease.slot is not None:
            return [lease.slot]
        candidates, _ = self._candidate_slots(lease.device_wish, lease.slice, lease.reachable)
        return [k for k in candidates if self.slots[k].memory_bytes >= lease.memory_bytes]

    # ---- gangs (ids and placement arithmetic: broker/gangs.py)

    def _gang_mates(self, lease: Lease) -> list[Lease]:
        """``lease`` and, for a gang's rank, every other active rank of its gang."""
        if lease.gang is None:
            return [lease]
        return [self.leases[m] for m in self.gangs.get(lease.gang, ()) if m in self.leases]

    def _gang_companions(self, victims: list[Lease]) -> list[Lease]:
        """The running ranks of the victims' gangs that are not victims already: a gang
        never runs in part."""
        chosen = {victim.lease_id for victim in victims}
        companions: list[Lease] = []
        for victim in victims:
            for mate in self._gang_mates(victim):
                if mate.lease_id not in chosen and mate.state == LeaseState.RUNNING:
                    chosen.add(mate.lease_id)
                    companions.append(mate)
        return companions

    def _gang_stopping_level(self, victim: Lease) -> PreemptionLevel | None:
        """The ladder level that stops ``victim`` (for a rank: that stops every running
        rank of its gang, the highest any needs); None if one of them cannot be stopped."""
        levels = [
            stopping_level(self._traits(mate))
            for mate in self._gang_mates(victim)
            if mate is victim or mate.state == LeaseState.RUNNING
        ]
        if any(level is None for level in levels):
            return None
        return max(levels)  # type: ignore[type-var]

    def _gang_probe(self, leader: Lease, ranks: list[Lease], key: str) -> Lease:
        """A stand-in for ``ranks`` of one gang on slot ``key``, as one lease: the memory
        they still need there (paused ranks hold theirs) and their SM shares summed.  It
        is never added to the index."""
        share = sum(rank.sm_share for rank in ranks)
        return replace(
            leader,
            lease_id=f"{leader.gang}@{key}",
            memory_bytes=sum(r.memory_bytes for r in ranks if r.state != LeaseState.PAUSED),
            sm_share=share if share < 1.0 and all(r.sm_share < 1.0 for r in ranks) else 1.0,
            state=LeaseState.QUEUED,
            slot=None,
        )

    def _serve_gang(
        self, gang: str, reserved: set[str], waited_for: set[str], ahead: int, now: float
    ) -> list[Action]:
        """A gang's turn in the pass: all its ranks placed or resumed at once, room made
        for all of them, or told why it waits."""
        members = [self.leases[m] for m in self.gangs[gang] if m in self.leases]
        if any(m.held_by_watchdog or m.detached for m in members):
            return []
        if any(m.pending_level is not None or m.awaiting_memory_from for m in members):
            reserved.update(self._gang_targets.get(gang) or {m.slot for m in members if m.slot})
            return []
        if any(m.state == LeaseState.RUNNING for m in members):
            return []  # settled at the next event (see _settle_gangs)
        self._gang_targets.pop(gang, None)
        leader = members[0]
        if leader.state == LeaseState.QUEUED:
            return self._serve_queued_gang(leader, members, reserved, waited_for, ahead, now)
        return self._serve_stopped_gang(leader, members, reserved, waited_for, now)

    def _serve_queued_gang(
        self,
        leader: Lease,
        members: list[Lease],
        reserved: set[str],
        waited_for: set[str],
        ahead: int,
        now: float,
    ) -> list[Action]:
        wanted = self._wanted_slots(leader)
        candidates = [k for k in wanted if self.slots[k].device_index not in self.drained]
        open_slots = sorted(
            (k for k in candidates if k not in reserved and k not in waited_for),
            key=lambda k: self._slot_preference(leader, k),
        )

        def fits_now(key: str, count: int) -> bool:
            probe = self._gang_probe(leader, members[:count], key)
            return self._fits_now(probe, key, now)

        assignment = assign_ranks(len(members), open_slots, fits_now)
        if assignment is not None:
            return self._start_gang(members, assignment, now)
        planned = self._gang_room_plan(leader, members, open_slots, now)
        if planned is not None:
            assignment, plans = planned
            reserved.update(assignment)
            return self._make_room_for_gang(leader, members, assignment, plans, now, ahead)
        waited_for.update(candidates)
        return self._gang_notices(
            leader, self._queue_notice(leader, candidates or wanted, now, ahead)
        )

    def _gang_room_plan(
        self, leader: Lease, members: list[Lease], open_slots: list[str], now: float
    ) -> tuple[list[str], dict[str, RoomPlan]] | None:
        """Where a queued gang could go by preempting, and what on each slot: one rank per
        slot where enough slots allow it, else all ranks on the one cheapest slot."""
        count = len(members)
        single: dict[str, RoomPlan] = {}
        for key in open_slots:
            plan = self._preemption_plan(self._gang_probe(leader, members[:1], key), key, now)
            if plan is not None:
                single[key] = plan
        if len(single) >= count:
            cheapest = sorted(
                single, key=lambda k: (self._plan_cost(single[k]), open_slots.index(k))
            )
            chosen = sorted(cheapest[:count], key=open_slots.index)
            return chosen, {key: single[key] for key in chosen}
        packed = []
        for key in open_slots:
            plan = self._preemption_plan(self._gang_probe(leader, members, key), key, now)
            if plan is not None:
                packed.append((self._plan_cost(plan), open_slots.index(key), key, plan))
        if not packed:
            return None
        _, _, key, plan = min(packed)
        return [key] * count, {key: plan}

    @staticmethod
    def _plan_cost(plan: RoomPlan) -> tuple:
        to_pause, to_evict, to_park = plan
        return (
            len(to_evict) + len(to_park),
            sum(v.memory_bytes for v in to_evict) + sum(p.held_bytes for p in to_park),
            len(to_pause),
        )

    def _make_room_for_gang(
        self,
        leader: Lease,
        members: list[Lease],
        assignment: list[str],
        plans: dict[str, RoomPlan],
        now: float,
        ahead: int,
    ) -> list[Action]:
        actions: list[Action] = []
        awaited: frozenset[str] = frozenset()
        evicting = False
        for key, plan in plans.items():
            stopped, waiting_on = self._stop_victims(leader, key, plan, now)
            actions.extend(stopped)
            awaited |= waiting_on
            evicting = evicting or bool(plan[1])
        if not awaited:
            actions.extend(self._start_gang(members, assignment, now))
            return actions
        self._await_room(leader, awaited, evicting)
        leader.target_slot = assignment[0]
        self._gang_targets[leader.gang or ""] = tuple(dict.fromkeys(assignment))
        notices = self._queue_notice(
            leader, list(dict.fromkeys(assignment)), now, ahead, force_reason=leader.reason
        )
        actions.extend(self._gang_notices(leader, notices))
        return actions

    def _serve_stopped_gang(
        self,
        leader: Lease,
        members: list[Lease],
        reserved: set[str],
        waited_for: set[str],
        now: float,
    ) -> list[Action]:
        """A paused or evicted gang resumes on the slots it holds, all ranks at once."""
        by_slot: dict[str, list[Lease]] = {}
        for member in members:
            by_slot.setdefault(member.slot or "", []).append(member)
        everyone_paused = all(m.state == LeaseState.PAUSED for m in members)
        # A paused rank that cannot be evicted holds its memory whatever happens: running
        # the gang to its end may be the only way that memory is ever freed, so, as for a
        # single paused lease, slots that are only waited for do not hold the gang back.
        holds_for_good = any(m.state == LeaseState.PAUSED and not m.evictable for m in members)
        blocked = reserved if everyone_paused or holds_for_good else reserved | waited_for
        if any(key in blocked for key in by_slot):
            return []
        probes = {key: self._gang_probe(leader, ranks, key) for key, ranks in by_slot.items()}
        if all(self._fits_now(probe, key, now) for key, probe in probes.items()):
            return self._start_gang(members, [m.slot or "" for m in members], now)
        plans = {key: self._preemption_plan(probe, key, now) for key, probe in probes.items()}
        if all(plan is not None for plan in plans.values()):
            reserved.update(by_slot)
            return self._make_room_for_gang(
                leader, members, [m.slot or "" for m in members], plans, now, 0
            )
        waited_for.update(by_slot)
        return []

    def _start_gang(self, members: list[Lease], slots: list[str], now: float) -> list[Action]:
        """Every rank on its slot at once: one grant for the gang (or a resume per rank)."""
        actions: list[Action] = []
        grants: list[Grant] = []
        for member, key in zip(members, slots, strict=True):
            for action in self._start(member, key, now):
                if isinstance(action, Grant):
                    grants.append(action)
                else:
                    actions.append(action)
        if grants:
            first = grants[0]
            gang = members[0].gang or first.lease_id
            ranks = tuple(RankPlacement(lease_id=g.lease_id, placement=g.placement) for g in grants)
            actions.insert(0, replace(first, lease_id=gang, ranks=ranks))
        return actions

    @staticmethod
    def _gang_notices(leader: Lease, actions: list[Action]) -> list[Action]:
        """A gang's queue notices speak of the gang, the one request its session made."""
        return [
            replace(action, lease_id=leader.gang) if isinstance(action, NotifyQueued) else action
            for action in actions
        ]

    def _rivalry_changes(self, event: Event, actions: list[Action]) -> list[Action]:
        """Tell the sessions whose rivalry changed (:mod:`~gpushare_ext.broker.rivals`).

        Only sessions that may have changed are looked at: those the event or an action
        names, and, when a session may now ask for another band, every session with a
        lease on a GPU in a band below the one that changed (the waiters are never looked
        at)."""
        touched = {a.session_id for a in actions if not isinstance(a, NotifyQueued)}
        named = getattr(event, "session_id", None)
        if isinstance(event, ChaosChanged):
            named = self._session_of_pid.get(event.pid)
        if named is not None:
            touched.add(named)
        below, self._rivalry_below = self._rivalry_below, None
        if below is not None:
            touched.update(s for s, band in self._placed_band.items() if band < below)
        if not touched:
            return []
        placed: dict[str, list[PlacedLease]] = {}
        for session_id in touched:
            record = self.sessions.get(session_id)
            leases = [] if record is None else [self.leases.get(i) for i in record.leases]
            on_gpu = [
                PlacedLease(
                    lease_id=lease.lease_id,
                    session_id=session_id,
                    priority=lease.base_priority,
                    gpu_names=names_of(self.slots[lease.slot]),
                )
                for lease in leases
                if lease is not None and lease.state in ACTIVE_STATES and lease.slot in self.slots
            ]
            if on_gpu:
                self._placed_band[session_id] = min(priority_band(p.priority) for p in on_gpu)
            else:
                self._placed_band.pop(session_id, None)
            placed[session_id] = on_gpu
        return [
            RivalryChanged(session_id=session_id, unrivalled=unrivalled)
            for session_id, unrivalled in self.rivals.changes(dict(sorted(placed.items())))
        ]

    def _settle_gangs(self, now: float) -> list[Action]:
        """Keep every gang whole after an event: when a rank has ended, the rest end too
        (a rank that dies takes its gang with it); when a rank could not be paused and
        runs on, its paused mates resume beside it."""
        actions: list[Action] = []
        for gang, member_ids in list(self.gangs.items()):
            live = [self.leases[m] for m in member_ids if m in self.leases]
            if len(live) < len(member_ids):
                ended = next(m for m in member_ids if m not in self.leases)
                why = self.ended[ended].reason if ended in self.ended else "ended"
                for member in live:
                    actions.append(
                        self._end(member, LeaseState.RELEASED, now, f"rank {ended} {why}")
                    )
                del self.gangs[gang]
                self._gang_targets.pop(gang, None)
                continue
            if any(m.pending_level is not None for m in live):
                continue
            if any(m.state == LeaseState.RUNNING for m in live):
                for member in live:
                    stopped = member.state in (LeaseState.PAUSED, LeaseState.EVICTED)
                    if stopped and self._fits_now(member, member.slot or "", now):
                        member.lockable = False  # its gang cannot be paused: it runs on
                        actions.extend(self._start(member, member.slot or "", now))
        return actions

    def _start(self, lease: Lease, key: str, now: float) -> list[Action]:
        slot = self.slots[key]
        waited = now - lease.state_since
        limits = self.policy.limits_for(lease.identity.user, lease.identity.groups)
        lease.aging_bonus = min(
            299.0 - lease.base_priority,
            lease.aging_bonus + effective_priority(0, waited, limits.aging_per_minute),
        )
        previous = lease.state
        if previous == LeaseState.QUEUED:
            lease.granted_at = now  # before the move: the index keeps when holders were granted
            lease.waited_s = now - lease.requested_at
            place = self._line.places.get(lease.lease_id)
            if self._pass is not None and place is not None and place.counted:
                bisect.insort(self._pass.granted, place.ticket)  # the places behind move up
                index = self._line.counted_before(place.ticket)
                self._pass.moved_from = min(self._pass.moved_from, index)
        self._index.move(lease, LeaseState.RUNNING, key)
        lease.state_since = now
        lease.reason = ""
        lease.paused_for = ""
        lease.last_queue_notice = None
        if previous == LeaseState.QUEUED:
            blocks = max(1, round(lease.sm_share * slot.multiprocessor_count))
            placement = Placement(
                device_index=slot.device_index,
                device_uuid=slot.device_uuid,
                mig_uuid=slot.mig_uuid,
                mig_profile=slot.mig_profile,
                memory_bytes=lease.memory_bytes,
                sm_share=lease.sm_share,
                max_blocks_per_sm_share=blocks if lease.sm_share < 1.0 else None,
                mps=self.policy.mps and slot.mig_uuid is None,
            )
            return [
                Grant(
                    session_id=lease.session_id,
                    lease_id=lease.lease_id,
                    placement=placement,
                    priority=lease.base_priority,
                    notice=lease.notice,
                )
            ]
        undo = lease.applied_level if lease.applied_level is not None else PreemptionLevel.GATE
        lease.applied_level = None
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

    def _preempt_for(
        self, lease: Lease, key: str, plan: RoomPlan, now: float, ahead: int
    ) -> list[Action]:
        actions, awaited = self._stop_victims(lease, key, plan, now)
        if awaited:
            self._await_room(lease, awaited, bool(plan[1]))
            lease.target_slot = key
            actions.extend(self._queue_notice(lease, [key], now, ahead, force_reason=lease.reason))
            return actions
        actions.extend(self._start(lease, key, now))
        return actions

    def _await_room(self, lease: Lease, victims: frozenset[str], evicting: bool) -> None:
        self._index.await_evictions(lease, victims)
        lease.reason = (
            "freeing memory: waiting for lower-priority sessions to be evicted"
            if evicting
            else "freeing memory: parking idle sessions (their memory goes to the host)"
        )

    def _stop_victims(
        self, lease: Lease, key: str, plan: RoomPlan, now: float
    ) -> tuple[list[Action], frozenset[str]]:
        """Pause, evict and park what is in ``lease``'s way on ``key`` (a victim that is a
        gang's rank stops its whole gang); the actions, and the victims whose memory
        must leave before ``lease`` fits."""
        to_pause, to_evict, to_park = plan
        actions: list[Action] = []
        slot = self.slots[key]
        who = f"{describe_priority(lease.base_priority)} lease {lease.gang or lease.lease_id}"
        parks = [
            self._park(idle, key, parked_for_reason(who), lease.lease_id, now) for idle in to_park
        ]
        actions.extend(parks)
        to_pause = to_pause + self._gang_companions(to_pause + to_evict)
        for victim in to_pause:
            level = self._gang_stopping_level(victim)
            if victim in to_evict:
                level = PreemptionLevel.EVICT
            assert level is not None
            actions.append(
                self._pause(
                    victim, level, lease, f"paused for a higher-priority session ({who})", now
                )
            )
        for victim in to_evict:
            if victim in to_pause:
                continue
            if victim.state == LeaseState.RUNNING:
                actions.append(
                    self._pause(victim, PreemptionLevel.EVICT, lease, f"evicted for {who}", now)
                )
            else:  # already paused: escalate to eviction
                victim.pending_level = PreemptionLevel.EVICT
                victim.reason = f"evicted for {who}"
                victim.paused_for = lease.lease_id
                actions.append(
                    Preempt(
                        session_id=victim.session_id,
                        lease_id=victim.lease_id,
                        pid=victim.identity.pid,
                        device_index=slot.device_index,
                        level=PreemptionLevel.EVICT,
                        for_lease=lease.lease_id,
                        reason=victim.reason,
                    )
                )
        awaited = frozenset(v.lease_id for v in to_evict) | {park.lease_id for park in parks}
        return actions, awaited

    def _pause(
        self, victim: Lease, level: PreemptionLevel, lease: Lease, reason: str, now: float
    ) -> Preempt:
        self._index.move(victim, LeaseState.PAUSED)
        victim.state_since = now
        victim.pending_level = level
        victim.reason = reason
        victim.paused_for = lease.lease_id
        return Preempt(
            session_id=victim.session_id,
            lease_id=victim.lease_id,
            pid=victim.identity.pid,
            device_index=self.slots[victim.slot].device_index,  # type: ignore[index]
            level=level,
            for_lease=lease.lease_id,
            reason=reason,
        )

    def _queue_notice(
        self, lease: Lease, candidates: list[str], now: float, ahead: int, force_reason: str = ""
    ) -> list[Action]:
        """Tell a queued lease where it stands (``ahead``: queued leases ranked higher),
        unless nothing changed since it was last told."""
        if lease.state != LeaseState.QUEUED and not lease.parks_session:
            return []
        holders = self._holders(candidates)
        reason = force_reason or self._queue_reason(lease, candidates, holders, ahead)
        restricted = self.reachable_note(lease) if lease.reachable is not None else ""
        if restricted and restricted not in reason:
            reason = f"{reason} ({restricted})"
        return self._tell_queued(lease, holders, reason, ahead, now)

    def _queue_reason(
        self, lease: Lease, candidates: list[str], holders: _Holders, ahead: int
    ) -> str:
        """Why a queued lease waits for ``candidates``, in its session's words."""
        unleased = [self.unleased_memory(k, lease) for k in candidates]
        if candidates and all(self.slots[k].device_index in self.drained for k in candidates):
            return "the device is drained by an admin"
        if candidates and all(
            self.slots[k].memory_bytes - extra < lease.memory_bytes
            for k, extra in zip(candidates, unleased, strict=True)
        ):
            refusal = next(
                (self._park_refusals[k] for k in candidates if k in self._park_refusals), ""
            )
            return (
                f"{format_size(min(unleased))} of the GPU is held outside any lease (idle "
                "notebooks or other processes); waiting for it to be freed"
                + (f" ({refusal})" if refusal else "")
            )
        if holders.top is not None:
            return f"the GPU is held by {priority_class(holders.top)}-priority work"
        if ahead:
            return "waiting behind earlier requests"
        return "waiting for memory"

    def _tell_queued(
        self, lease: Lease, holders: _Holders, reason: str, ahead: int, now: float
    ) -> list[Action]:
        position = ahead + 1
        waiting_for = holders.waiting_for
        holder_priority = holders.holder_priority
        lease.reason = reason
        signature = (position, waiting_for, holder_priority, reason)
        if signature == lease.last_queue_notice:
            return []
        lease.last_queue_notice = signature
        lease.estimate_s, lease.estimated_at = self._hold_estimate(holders, now), now
        return [
            NotifyQueued(
                session_id=lease.session_id,
                lease_id=lease.lease_id,
                position=position,
                waiting_for=waiting_for,
                holder_priority=holder_priority,
                estimate_s=lease.estimate_s,
                reason=reason,
                notice=lease.notice,
            )
        ]

    def _holders(self, keys: list[str]) -> _Holders:
        loads = [self._index.slots[key] for key in keys]
        signature = tuple((key, load.version) for key, load in zip(keys, loads, strict=True))
        known = self._known_holders.get(signature)
        if known is None:
            if len(self._known_holders) >= HOLDERS_MEMO:
                self._known_holders.clear()
            ids = [lease_id for load in loads for lease_id in load.running_ids]
            known = _Holders(
                keys=tuple(keys),
                waiting_for=tuple(ids if len(loads) == 1 else sorted(ids)),
                holder_priority=max(
                    (max(load.base_priorities) for load in loads if load.base_priorities),
                    default=None,
                ),
                top=max((max(load.tops) for load in loads if load.tops), default=None),
            )
            self._known_holders[signature] = known
        return known

    def _hold_estimate(self, holders: _Holders, now: float) -> float | None:
        """Seconds until the first holder is likely done, from its user's habits."""
        if holders.estimated_in == self._passes:
            return holders.estimate
        remaining = []
        for key in holders.keys:
            for uid, grants in self._index.slots[key].granted.items():
                typical = self._hold_ema.get(uid)
                if typical is not None:
                    # typical - (now - granted) only grows with granted, rounding included:
                    # a user's longest-held lease is the one with the least time left.
                    remaining.append(max(0.0, typical - (now - min(grants.values()))))
        holders.estimate = round(min(remaining), 1) if remaining else None
        holders.estimated_in = self._passes
        return holders.estimate
