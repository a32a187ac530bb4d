"""The records the scheduler core is made of: who a session is, its slots, leases and sessions.

What it is for: :class:`Identity` (a session's owner, as the kernel vouches for it),
:class:`Slot` (a whole GPU or one MIG instance), :class:`Lease` and
:class:`SessionRecord` (what the core keeps per lease and per session), and
:class:`SchedulerError`, the refusal of an event that changes nothing.  The lease index,
the events, the actions and every part of the scheduler read these, so they sit below
all of them.

What it must not do: import any other part of the scheduler (the lease index, events,
actions, the ``Scheduler``) or decide anything; records hold state, they do not change
it on their own (a lease's state, slot and stop sub-state change only through
:func:`~gpushare_ext.broker.scheduler.lease_transitions.transition`, its identity only through
the :class:`~gpushare_ext.broker.scheduler.lease_index.LeaseIndex`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.devices import DeviceInfo
from gpushare_ext.lease_state import ACTIVE, NO_STOP, StopState
from gpushare_ext.protocol import (
    PRIORITY_CLASSES,
    Capabilities,
    ErrorCode,
    LeaseState,
    PreemptionLevel,
    SliceWish,
)

MIB = 1024 * 1024
ACTIVE_STATES = ACTIVE  # queued, running, paused, evicted: the core still keeps it


class SchedulerError(DaemonError):
    """An event the core cannot accept; state is unchanged.  ``code`` is a protocol ErrorCode."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, kw_only=True)
class Identity:
    """Who a session belongs to, as the kernel vouches for it (peer credentials)."""

    uid: int
    gid: int
    pid: int
    user: str
    groups: tuple[str, ...] = ()
    start_ticks: int | None = None  # when the process started: a reused pid is not it


@dataclass(frozen=True, kw_only=True)
class Slot:
    """A unit of placement: a whole GPU, or one MIG instance."""

    key: str
    device_index: int
    device_uuid: str
    memory_bytes: int
    multiprocessor_count: int
    mig_uuid: str | None = None
    mig_profile: str | None = None


@dataclass(kw_only=True)
class Lease:
    lease_id: str
    session_id: str
    identity: Identity
    base_priority: int
    memory_bytes: int
    sm_share: float
    slice: SliceWish
    device_wish: str
    reachable: tuple[str, ...] | None = None  # its process's GPUs (None: every one)
    capabilities: Capabilities
    label: str
    arrival: int  # tie-breaker: FIFO within equal effective priority
    requested_at: float
    # state, slot and the stop sub-state (one StopState: the level asked and confirmed,
    # held by the watchdog, detached, a park's restore asked) change only through
    # lease_transitions.transition, which keeps the LeaseIndex in step; identity and
    # awaiting_memory_from through the index.
    state: LeaseState = LeaseState.QUEUED
    state_since: float = 0.0
    slot: str | None = None
    granted_at: float | None = None
    waited_s: float = 0.0
    aging_bonus: float = 0.0  # priority earned while waiting, kept while running
    stop: StopState = NO_STOP
    lockable: bool = True
    evictable: bool = True
    awaiting_memory_from: frozenset[str] = frozenset()  # victims whose eviction we wait for
    freeing_bytes: int = 0  # the memory of those victims, as told to its session
    target_slot: str | None = None  # where those evictions make room
    reason: str = ""
    notice: str = ""
    last_queue_notice: tuple | None = None
    estimate_s: float | None = None  # the last wait estimate told, and when (for status)
    estimated_at: float = 0.0
    paused_for: str = ""  # the lease it was paused for (shown to the paused session)
    parks_session: bool = False  # the memory of an idle session, checkpointed to the host
    gang: str | None = (
        None  # the gang it is a rank of (:mod:`~gpushare_ext.broker.scheduler.gangs`)
    )
    rank: int = 0

    def running_priority(self) -> float:
        return min(299.0, self.base_priority + self.aging_bonus)

    # The stop's parts, read where the core asks one question of it.
    @property
    def pending_level(self) -> PreemptionLevel | None:
        return self.stop.pending_level

    @property
    def applied_level(self) -> PreemptionLevel | None:
        return self.stop.applied_level

    @property
    def held_by_watchdog(self) -> bool:
        return self.stop.held_by_watchdog

    @property
    def detached(self) -> bool:
        return self.stop.detached

    @property
    def restore_wanted(self) -> bool:
        return self.stop.restore_wanted


@dataclass(kw_only=True)
class SessionRecord:
    identity: Identity
    notebook: str
    reachable: tuple[str, ...] | None = None  # the GPUs its process can use (None: all)
    leases: set[str] = field(default_factory=set)
    detached: bool = False  # the placeholder of a process that has not reconnected yet
    idle_since: float = 0.0  # when its last cell or lease ended
    cell_running: bool = False  # a cell runs now (with or without a lease): never parked
    last_priority: int = PRIORITY_CLASSES["normal"]  # its last lease's, for park order
    unparkable: str = ""  # why it is never parked (its checkpoint failed once)
    checkpoint_unsafe: str | None = None  # what it last said of itself; None: nothing yet
    parkable_bytes: int = 0  # what its launch shim can park itself (in part), as it said
    parks: int = 0  # parks so far, for the park leases' ids


def names_of(slot: Slot) -> frozenset[str]:
    """What a session's reachable GPUs may call ``slot``'s GPU: its UUID, its host index,
    its MIG instance's UUID (as
    :meth:`~gpushare_ext.broker.scheduler.slot_finder.SlotFinder.only_reachable` matches them)."""
    return frozenset(
        name for name in (slot.device_uuid, slot.mig_uuid, str(slot.device_index)) if name
    )


def slots_of(device: DeviceInfo) -> list[Slot]:
    if device.mig_enabled:
        return [
            Slot(
                key=f"{device.index}/{instance.uuid}",
                device_index=device.index,
                device_uuid=device.uuid,
                memory_bytes=instance.memory_mib * MIB,
                multiprocessor_count=instance.multiprocessor_count,
                mig_uuid=instance.uuid,
                mig_profile=instance.name,
            )
            for instance in device.instances
        ]
    return [
        Slot(
            key=str(device.index),
            device_index=device.index,
            device_uuid=device.uuid,
            memory_bytes=device.memory_total_mib * MIB,
            multiprocessor_count=device.multiprocessor_count,
        )
    ]
