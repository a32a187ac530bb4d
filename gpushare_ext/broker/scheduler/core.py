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
  sessions hold, they are *parked* first (:mod:`~gpushare_ext.broker.scheduler.parking` says who
  and whether the host has room): a park lease is made for what each holds and evicted
  at once, and it comes back only when its session asks (:class:`RestoreAsked`), waiting
  in the queue like a request if it must.

What placement looks up -- a slot's memory held and its running leases' bands, SM
shares and exclusive wishes, a user's lease count, a process's leases, the waiters --
comes from :class:`~gpushare_ext.broker.scheduler.lease_index.LeaseIndex`, changed wherever a
lease changes state, slot or identity, so an event costs about the same with one lease
as with a thousand.  :meth:`Scheduler.index_mismatch` compares it with a recount.

With more than a handful of waiters (``LINE_FROM``), they stay in order between events
(:class:`~gpushare_ext.broker.scheduler.lease_index.WaitingLine`), and a pass looks only at those
an event may concern.  A plain queued request (not a gang's rank, not making room, not
detached) whose wanted slots are all reserved or waited for by the waiters ahead can
neither be placed nor make room: the pass serves such requests of the same wanted slots
only until they are, and tells the rest where they stand only if that may have changed
-- their place (a request ahead came or went), what their slots hold (the slots'
versions, drains, NVML readings, parking refusals), or their notice was reset -- each
with the scheduler as it was at its turn.  Every other waiter is served in turn, and a
handful of waiters are all served in turn; in the line, a memory-bound waiter's turn that
nothing it read changed is answered from memory
(:mod:`~gpushare_ext.broker.scheduler.quiet_turns`).  ``Scheduler(...,
recompute_every_waiter=True)`` serves every waiter in full on every pass; the tests check
that both act alike.

The core never blocks, never reads a clock and never touches a socket or a GPU: the
server feeds it :data:`Event` values with ``now`` and carries out the returned
:data:`Action` values.  Replaying an event list gives the same actions.  Invalid
events (a release of an unknown lease) raise :class:`SchedulerError` and change nothing.

The parts
---------
:class:`Scheduler` owns one object per job, put together in one place
(:func:`wire_parts`, no part handed one that asks it back), and routes each event to
its handler through one table (an event of another type is refused with :class:`SchedulerError`):
:class:`~gpushare_ext.broker.scheduler.lease_book.LeaseBook` (leases, sessions, gangs, the index),
:class:`~gpushare_ext.broker.scheduler.slot_finder.SlotFinder` (slots a request may use, drains),
:class:`~gpushare_ext.broker.scheduler.memory_seen.MemorySeen` (NVML readings),
:class:`~gpushare_ext.broker.scheduler.idle_parking.IdleParking` (parks),
:class:`~gpushare_ext.broker.scheduler.placement.Placer` (fit, preference, room plans, levels),
:class:`~gpushare_ext.broker.scheduler.queue_notices.QueueNotices` (what waiters are told),
:class:`~gpushare_ext.broker.scheduler.quiet_turns.QuietTurns` (memory-bound turns remembered),
:class:`~gpushare_ext.broker.scheduler.lease_moves.LeaseMoves` (grants, resumes, pauses),
:class:`~gpushare_ext.broker.scheduler.gang_turns.GangTurns` (gangs, whole),
:class:`~gpushare_ext.broker.scheduler.scheduling_pass.SchedulingPass` (the pass after each event),
:class:`~gpushare_ext.broker.scheduler.admission.Admission` (requests, restored and reclaimed
leases) and :class:`~gpushare_ext.broker.scheduler.rivalry_watch.RivalryWatch` (who has no rival).
This module keeps only the handlers of sessions, releases, the policy and what the
actuators and the watchdog report, and what the server reads.  It must not do I/O, read
a clock or import the server.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from gpushare_ext.broker.scheduler import reasons
from gpushare_ext.broker.scheduler.actions import (
    Action,
    GrantLease,
    LeaseEnded,
    NotifyQueued,
    PauseLease,
    RefuseRequest,
    ResumeLease,
    RevokeLease,
    RivalryChanged,
)
from gpushare_ext.broker.scheduler.admission import Admission
from gpushare_ext.broker.scheduler.events import (
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
from gpushare_ext.broker.scheduler.gang_turns import GangTurns
from gpushare_ext.broker.scheduler.idle_parking import IdleParking
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_moves import LeaseMoves
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.memory_seen import MemorySeen
from gpushare_ext.broker.scheduler.parking import HostMemory
from gpushare_ext.broker.scheduler.placement import Placer, traits
from gpushare_ext.broker.scheduler.queue_notices import QueueNotices
from gpushare_ext.broker.scheduler.quiet_turns import QuietTurns
from gpushare_ext.broker.scheduler.rivalry_watch import RivalryWatch
from gpushare_ext.broker.scheduler.rivals import Rivals
from gpushare_ext.broker.scheduler.scheduler_records import (
    ACTIVE_STATES,
    Identity,
    Lease,
    SchedulerError,
    SessionRecord,
    Slot,
)
from gpushare_ext.broker.scheduler.scheduling_pass import LINE_FROM, SchedulingPass
from gpushare_ext.broker.scheduler.slot_finder import SlotFinder
from gpushare_ext.broker.settings.policy import (
    Policy,
    StopCause,
    format_size,
    ladder_level,
)
from gpushare_ext.devices import DeviceInfo
from gpushare_ext.lease_state import stopped_state
from gpushare_ext.protocol import ErrorCode, LeaseState, PreemptionLevel

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
    "GrantLease",
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
    "PauseLease",
    "PolicyChanged",
    "PreemptionApplied",
    "PreemptionFailed",
    "RanksAttached",
    "RefuseRequest",
    "RestoreAsked",
    "ResumeLease",
    "RevokeLease",
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

# NVML counts the CUDA context and library workspaces (several hundred MiB on a Hopper
# GPU) against the process; the quota is about the data.
CONTEXT_ALLOWANCE = 1024 * 1024 * 1024

Handler = Callable[[Any, float], list[Action]]


@dataclass(frozen=True)
class SchedulerParts:
    """The core's parts, one object per job, each handed the parts below it."""

    finder: SlotFinder
    book: LeaseBook
    memory: MemorySeen
    parking: IdleParking
    placer: Placer
    notices: QueueNotices
    moves: LeaseMoves
    gang_turns: GangTurns
    passes: SchedulingPass
    rivalry: RivalryWatch
    admission: Admission


def wire_parts(
    devices: list[DeviceInfo],
    policy: Policy,
    *,
    simulated_control: bool,
    recompute_every_waiter: bool,
    line_from: int,
) -> SchedulerParts:
    """The one place the parts are put together: each gets the parts it asks, none a
    part that asks it back (the pass hears of grants from the actions it returns)."""
    finder = SlotFinder(devices)
    book = LeaseBook(finder.slots, policy, simulated_control=simulated_control)
    memory = MemorySeen(set(finder.slots), book.index)
    parking = IdleParking(book, finder.slots, memory)
    placer = Placer(book, finder.slots, memory, parking)
    notices = QueueNotices(book, finder, memory, parking)
    moves = LeaseMoves(book, finder.slots, parking)
    gang_turns = GangTurns(book, finder, placer, moves, notices)
    quiet = QuietTurns(book, finder, memory, parking)
    passes = SchedulingPass(
        book, finder, placer, parking, notices, moves, gang_turns, quiet,
        recompute_every_waiter=recompute_every_waiter, line_from=line_from,
    )  # fmt: skip
    rivalry = RivalryWatch(book, finder.slots)
    admission = Admission(book, finder, placer, rivalry)
    return SchedulerParts(
        finder, book, memory, parking, placer, notices, moves, gang_turns, passes, rivalry,
        admission,
    )  # fmt: skip


class CoreView(Protocol):
    """What the broker's edges read of the core: leases, sessions and slots as they stand.

    No way to change them: only the server feeds the core events (the edges post theirs
    on the context's queue).  :class:`Scheduler` is one."""

    @property
    def leases(self) -> dict[str, Lease]: ...
    @property
    def sessions(self) -> dict[str, SessionRecord]: ...
    @property
    def slots(self) -> dict[str, Slot]: ...
    @property
    def drained(self) -> set[int]: ...
    def active_leases(self) -> list[Lease]: ...
    def queue(self) -> list[Lease]: ...
    def members(self, lease_id: str) -> list[Lease]: ...
    def lease_of(self, lease_id: str) -> Lease | None: ...
    def slots_of_device(self, index: int) -> list[Slot]: ...
    def reclaimable(self, session_id: str, lease_ids: list[str]) -> list[str]: ...
    def detached_ranks(self, gang: str) -> list[Lease]: ...
    def unleased_by_pid(self, key: str, asking: Lease | None = None) -> dict[int, int]: ...
    def session_id_of_pid(self, pid: int) -> str | None: ...
    def session_of_pid(self, pid: int) -> SessionRecord | None: ...
    def rung_holding(self, level: PreemptionLevel) -> PreemptionLevel: ...


class Scheduler:
    """Feed it events with :meth:`handle`; carry out the actions it returns."""

    def __init__(
        self,
        devices: list[DeviceInfo],
        policy: Policy | None = None,
        *,
        recompute_every_waiter: bool = False,
        line_from: int = LINE_FROM,
        simulated_control: bool = False,
    ) -> None:
        self.now = 0.0
        parts = wire_parts(
            devices,
            policy or Policy(),
            simulated_control=simulated_control,
            recompute_every_waiter=recompute_every_waiter,
            line_from=line_from,
        )
        self.parts = parts
        self.finder, self.book, self.memory = parts.finder, parts.book, parts.memory
        self.parking, self.placer, self.notices = parts.parking, parts.placer, parts.notices
        self.moves, self.gang_turns, self.passes = parts.moves, parts.gang_turns, parts.passes
        self.rivalry, self.admission = parts.rivalry, parts.admission
        # Every event's handler, in one place: an event of another type is refused.
        self._handlers: dict[type, Handler] = {
            SessionOpened: self._on_session_opened,
            SessionClosed: self._on_session_closed,
            LeaseRequested: self.admission.on_lease_requested,
            LeaseReleased: self._on_lease_released,
            LeaseRestored: self.admission.on_lease_restored,
            LeaseReclaimed: self.admission.on_lease_reclaimed,
            RanksAttached: self.admission.on_ranks_attached,
            PreemptionApplied: self._on_preemption_applied,
            PreemptionFailed: self._on_preemption_failed,
            MemoryObserved: self._on_memory_observed,
            DeviceMemorySeen: self.memory.on_device_memory_seen,
            SessionActivity: self.parking.on_session_activity,
            RestoreAsked: self.parking.on_restore_asked,
            ParkAsked: self.parking.on_park_asked,
            DeviceDrained: self.finder.on_device_drained,
            PolicyChanged: self._on_policy_changed,
            ChaosChanged: self._on_chaos_changed,
            Tick: self.parking.on_tick,
        }

    # ---- public

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions to carry out, in order."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise SchedulerError(
                ErrorCode.INVALID, f"the scheduler has no handler for {type(event).__name__}"
            )
        event_now = max(event.now, self.now)  # time never goes backwards inside the core
        actions = handler(event, event_now)
        self.now = event_now
        actions.extend(self.gang_turns.settle(event_now))
        actions.extend(self.passes.run(event_now))
        actions.extend(self.rivalry.changes(event, actions))
        return actions

    # What the server, its views and the tests read.

    @property
    def policy(self) -> Policy:
        return self.book.policy

    @property
    def leases(self) -> dict[str, Lease]:
        return self.book.leases

    @property
    def ended(self) -> dict[str, Lease]:
        return self.book.ended

    @property
    def sessions(self) -> dict[str, SessionRecord]:
        return self.book.sessions

    @property
    def gangs(self) -> dict[str, tuple[str, ...]]:
        return self.book.gangs

    @property
    def slots(self) -> dict[str, Slot]:
        return self.finder.slots

    @property
    def devices(self) -> dict[int, DeviceInfo]:
        return self.finder.devices

    @property
    def drained(self) -> set[int]:
        return self.finder.drained

    @property
    def host(self) -> HostMemory | None:
        return self.parking.host

    @property
    def rivals(self) -> Rivals:
        return self.rivalry.rivals

    def active_leases(self) -> list[Lease]:
        return [lease for lease in self.book.leases.values() if lease.state in ACTIVE_STATES]

    def queue(self) -> list[Lease]:
        """Waiters (queued, paused, evicted) in the order they will be served."""
        return sorted(
            self.book.index.waiters.values(), key=lambda lease: self.book.queue_key(lease, self.now)
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
        return self.book.gang_of(lease_id)

    def members(self, lease_id: str) -> list[Lease]:
        """The active leases a lease id stands for: a gang's members, or the lease itself."""
        return self.book.members(lease_id)

    def lease_of(self, lease_id: str) -> Lease | None:
        """The active lease ``lease_id``; for a gang's id, its first active rank."""
        return self.book.lease_of(lease_id)

    def slot_usage(self, key: str) -> tuple[int, list[Lease]]:
        """Memory held on a slot (running, paused and pending grants) and its running leases."""
        load = self.book.index.slots[key]
        return load.held, sorted(load.running.values(), key=lambda lease: lease.arrival)

    def slots_of_device(self, index: int) -> list[Slot]:
        return self.finder.slots_of_device(index)

    def index_mismatch(self) -> str:
        """How the kept index and waiting line differ from those recomputed from the
        leases ("" if they do not): the property tests check it after every event."""
        return self.book.index.mismatch(self.book.leases.values()) or self.passes.line_mismatch(
            self.now
        )

    def reclaimable(self, session_id: str, lease_ids: list[str]) -> list[str]:
        """Which of ``lease_ids`` the session's process may take back (see LeaseReclaimed)."""
        return self.admission.reclaimable(session_id, lease_ids)

    def detached_ranks(self, gang: str) -> list[Lease]:
        """The ranks of ``gang`` waiting to be reclaimed, if every active rank is."""
        return self.admission.detached_ranks(gang)

    def unleased_memory(self, key: str, asking: Lease | None = None) -> int:
        """Memory seen on slot ``key`` beyond what the leases there declare (see
        :meth:`MemorySeen.unleased_memory`)."""
        return self.memory.unleased_memory(key, asking)

    def unleased_by_pid(self, key: str, asking: Lease | None = None) -> dict[int, int]:
        """:meth:`unleased_memory` per process (only those holding some)."""
        return self.memory.unleased_by_pid(key, asking)

    def session_id_of_pid(self, pid: int) -> str | None:
        return self.book.session_of_pid.get(pid)

    def rung_holding(self, level: PreemptionLevel) -> PreemptionLevel:
        """The rung that really holds a lease stopped at ``level`` (a simulated GPU's
        gate)."""
        return self.book.rung_holding(level)

    def session_of_pid(self, pid: int) -> SessionRecord | None:
        return self.book.session_of(pid)

    def reachable_note(self, lease: Lease) -> str:
        """Which GPUs a restricted session may use ("" when it may use every one)."""
        return self.finder.reachable_note(lease)

    # ---- sessions, releases and the policy

    def _on_session_opened(self, event: SessionOpened, now: float) -> list[Action]:
        book = self.book
        if event.session_id in book.sessions:
            raise SchedulerError(
                ErrorCode.OUT_OF_ORDER, f"session {event.session_id} is already open"
            )
        record = SessionRecord(
            identity=event.identity,
            notebook=event.notebook,
            idle_since=now,
            reachable=event.reachable,
        )
        book.sessions[event.session_id] = record
        book.session_of_pid[event.identity.pid] = event.session_id
        self.rivalry.note_band_change(
            self.rivals.session_opened(event.session_id, record.last_priority, event.reachable)
        )
        return []

    def _on_chaos_changed(self, event: ChaosChanged, now: float) -> list[Action]:
        session_id = self.book.session_of_pid.get(event.pid)
        if session_id is not None:
            self.rivals.chaos(session_id, event.on)
        return []

    def _on_session_closed(self, event: SessionClosed, now: float) -> list[Action]:
        book = self.book
        record = book.sessions.pop(event.session_id, None)
        if record is None:
            raise SchedulerError(ErrorCode.OUT_OF_ORDER, f"no session {event.session_id}")
        if book.session_of_pid.get(record.identity.pid) == event.session_id:
            del book.session_of_pid[record.identity.pid]
        self.rivalry.note_band_change(self.rivals.session_closed(event.session_id))
        actions: list[Action] = []
        for lease_id in sorted(record.leases):
            lease = book.leases.get(lease_id)
            if lease is not None and lease.state in ACTIVE_STATES:
                actions.append(book.end(lease, LeaseState.RELEASED, now, event.reason))
        return actions

    def _on_lease_released(self, event: LeaseReleased, now: float) -> list[Action]:
        """A lease ends; a gang's id (or any of its members' ids) ends the whole gang."""
        book = self.book
        leases = book.members(event.lease_id)
        if not leases or leases[0].state not in ACTIVE_STATES:
            raise SchedulerError(ErrorCode.UNKNOWN_LEASE, f"no active lease {event.lease_id}")
        lease = leases[0]
        if lease.session_id != event.session_id and not event.by_admin:
            raise SchedulerError(ErrorCode.PERMISSION, f"lease {event.lease_id} is not yours")
        reason = "cancelled by an admin" if event.by_admin else "released"
        state = LeaseState.REVOKED if event.by_admin else LeaseState.RELEASED
        actions: list[Action] = []
        if event.by_admin and lease.session_id in book.sessions:
            actions.append(
                RevokeLease(
                    session_id=lease.session_id,
                    lease_id=lease.gang or lease.lease_id,
                    pid=lease.identity.pid,
                    reason=reason,
                )
            )
        actions.extend(book.end(member, state, now, reason) for member in leases)
        if lease.gang is not None:
            book.forget_gang(lease.gang)
        return actions

    def _on_policy_changed(self, event: PolicyChanged, now: float) -> list[Action]:
        self.book.policy = event.policy
        return []

    # ---- what the actuators and the watchdog report

    def _on_preemption_applied(self, event: PreemptionApplied, now: float) -> list[Action]:
        lease = self.book.leases.get(event.lease_id)
        if lease is None or lease.state not in ACTIVE_STATES:
            return []  # it ended meanwhile; the server undoes what was applied
        if lease.pending_level != event.level:
            return []  # a stale confirmation (it was resumed meanwhile)
        applied = event.level if event.applied_level is None else event.applied_level
        confirmed = lease.stop.confirmed(applied)
        after = stopped_state(applied)
        if lease.state == LeaseState.PAUSED and after != LeaseState.PAUSED:
            self.book.observe_freeing(lease.memory_bytes, now - lease.state_since)  # the ask
            transition(
                lease,
                now,
                state=after,
                stop=confirmed,
                reason=lease.reason or reasons.EVICTED_FOR_HIGHER,
                index=self.book.index,
            )
            # Its process's device memory is on the host now: the last reading is stale.
            self.memory.forget_process(lease.slot or "", lease.identity.pid)
            self.book.index.victim_done(lease.lease_id)
        else:
            transition(lease, now, stop=confirmed)
        return []

    def _on_preemption_failed(self, event: PreemptionFailed, now: float) -> list[Action]:
        book = self.book
        lease = book.leases.get(event.lease_id)
        if lease is None or lease.state not in ACTIVE_STATES or lease.pending_level != event.level:
            return []
        stop = lease.stop
        if lease.parks_session:
            # It stays on the GPU, unlocked, and is never tried again: a process the
            # checkpoint refused once (MIG, IPC or UVM memory) will refuse again.
            transition(lease, now, stop=stop.failed())
            record = book.sessions.get(lease.session_id)
            if record is not None:
                record.unparkable = f"could not be parked: {event.reason}"
            book.index.victim_done(lease.lease_id, give_up=True)
            return [book.end(lease, LeaseState.RELEASED, now, f"not parked: {event.reason}")]
        if event.level == PreemptionLevel.EVICT:
            lease.evictable = False
            transition(lease, now, stop=stop.failed(), reason=f"cannot be evicted: {event.reason}")
        else:
            # It could not be paused: it keeps running, time-sliced with the newcomer.
            lease.lockable = False
            transition(
                lease,
                now,
                state=LeaseState.RUNNING,
                stop=stop.cleared(),
                reason=f"could not be paused: {event.reason}",
                index=book.index,
            )
        book.index.victim_done(lease.lease_id, give_up=True)
        return []

    def _on_memory_observed(self, event: MemoryObserved, now: float) -> list[Action]:
        """The watchdog: a process holding more than its running leases declare (beyond
        the context's allowance) has them paused until they are released."""
        book = self.book
        running = sorted(
            (
                lease
                for lease in book.index.by_pid.get(event.pid, {}).values()
                if lease.state == LeaseState.RUNNING
            ),
            key=lambda lease: lease.arrival,
        )
        if not running:
            return []
        quota = sum(lease.memory_bytes for lease in running)
        tolerance = CONTEXT_ALLOWANCE + quota // 20
        if event.used_bytes <= quota + tolerance:
            return []
        actions: list[Action] = []
        reason = reasons.over_quota(format_size(event.used_bytes), format_size(quota))
        for lease in running:
            level = ladder_level(StopCause.OVER_QUOTA, [traits(lease)])
            if level is None:
                continue
            held = replace(lease.stop.asked(level), held_by_watchdog=True)
            before = lease.state
            transition(
                lease,
                now,
                state=LeaseState.PAUSED,
                stop=held,
                reason=reason + "; release the lease or restart the kernel",
                index=book.index,
            )
            actions.append(
                book.pause_action(lease, level, before=before, for_lease="", reason=reason)
            )
        return actions
