"""What the scheduler core is told: one frozen record per thing that happened, each with ``now``.

What it is for: the server (and recovery, and the tests) build these and pass them to
:meth:`~gpushare_ext.broker.scheduler.core.Scheduler.handle`; replaying the same list of events
gives the same actions.  :data:`Event` is the union of them all.

What it must not do: hold behaviour or read a clock (``now`` is what the caller says it
is), or import the scheduler that handles them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare_ext.broker.scheduler.parking import HostMemory
from gpushare_ext.broker.scheduler.scheduler_records import Identity
from gpushare_ext.broker.settings.policy import Policy
from gpushare_ext.protocol import (
    Capabilities,
    LeaseState,
    PreemptionLevel,
    RequestLease,
    SliceWish,
)


@dataclass(frozen=True, kw_only=True)
class SessionOpened:
    now: float
    session_id: str
    identity: Identity
    notebook: str = ""
    # The GPUs its process can reach (GPU or MIG UUIDs, or host indices: a container
    # given only some of the node's GPUs); None: every GPU.  Its leases go only there.
    reachable: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class SessionClosed:
    now: float
    session_id: str
    reason: str = "connection closed"


@dataclass(frozen=True, kw_only=True)
class LeaseRequested:
    """A session asks for a lease: its request as it sent it (the one request struct the
    runtime builds, carried unchanged over the wire and into the core)."""

    now: float
    session_id: str
    lease_id: str
    request: RequestLease


@dataclass(frozen=True, kw_only=True)
class LeaseReleased:
    now: float
    session_id: str
    lease_id: str
    by_admin: bool = False


@dataclass(frozen=True, kw_only=True)
class LeaseRestored:
    """At start-up: a lease the journal kept for a process that still lives.

    It comes back *detached*, in the state it had, under a placeholder session of its
    process: it keeps its slot and memory, is neither granted nor resumed while
    detached, and waits for its process to reconnect (:class:`LeaseReclaimed`) or for
    its placeholder session to close.  Nothing is applied to it, with one exception: the
    broker undid every actuator before (shutdown) or at (crash recovery) this start,
    except the eviction of an evicted lease found at crash recovery, which the new broker
    keeps in force (``eviction_kept``): its memory stays off the device, where the lease
    it was evicted for may now be using it.
    """

    now: float
    session_id: str
    identity: Identity
    lease_id: str
    state: LeaseState
    priority: int
    memory_bytes: int
    slot: str | None
    sm_share: float = 1.0
    slice: SliceWish = SliceWish.AUTO
    device: str = "auto"
    capabilities: Capabilities = Capabilities()  # noqa: RUF009 - frozen, shared safely
    label: str = ""
    requested_at: float = 0.0
    granted_at: float | None = None
    aging_bonus: float = 0.0
    paused_for: str = ""
    reason: str = ""
    eviction_kept: bool = False


@dataclass(frozen=True, kw_only=True)
class LeaseReclaimed:
    """A reconnected session takes back a detached lease of its own process, or, with
    ``keep_process``, the rank of one of its gangs that a worker process it started runs
    (the server checked that the worker descends from it); the rank stays that worker's."""

    now: float
    session_id: str
    lease_id: str
    keep_process: bool = False


@dataclass(frozen=True, kw_only=True)
class RanksAttached:
    """The worker processes of a gang started: ``pids[k]`` (with its start time) runs
    rank k, so preemption and the watchdog act on them (the server checked that each is
    a descendant of the session's process, of its user)."""

    now: float
    session_id: str
    gang: str
    pids: tuple[tuple[int, int | None], ...]


@dataclass(frozen=True, kw_only=True)
class PreemptionApplied:
    """The actuators stopped a lease: ``level`` is the level asked (what the core waits
    to hear of), ``applied_level`` the level they applied (None: the one asked)."""

    now: float
    lease_id: str
    level: PreemptionLevel
    applied_level: PreemptionLevel | None = None


@dataclass(frozen=True, kw_only=True)
class PreemptionFailed:
    now: float
    lease_id: str
    level: PreemptionLevel
    reason: str


@dataclass(frozen=True, kw_only=True)
class MemoryObserved:
    """The watchdog saw ``pid`` holding ``used_bytes`` on a device (NVML)."""

    now: float
    pid: int
    used_bytes: int


@dataclass(frozen=True, kw_only=True)
class DeviceMemorySeen:
    """What each process holds on a whole GPU (MIG off), or with ``mig_uuid`` on that MIG
    instance, as NVML reads it: leased or not, idle notebooks and processes the broker
    does not know included."""

    now: float
    device_index: int
    used_by_pid: tuple[tuple[int, int], ...]  # (pid, bytes)
    mig_uuid: str | None = None


@dataclass(frozen=True, kw_only=True)
class SessionActivity:
    """A session's cell started (``running``) or ended: a running cell is never parked,
    and idle time counts from the end of the last one."""

    now: float
    session_id: str
    running: bool
    unparkable: str = ""  # why its process must not be checkpointed ("" if it may be)
    parkable_bytes: int = 0  # what its launch shim can park itself, in part if need be


@dataclass(frozen=True, kw_only=True)
class RestoreAsked:
    """A parked session wants its memory back before its next cell (or, ``cancel``, no
    longer waits for it)."""

    now: float
    session_id: str
    lease_id: str
    cancel: bool = False


@dataclass(frozen=True, kw_only=True)
class ParkAsked:
    """Someone asks to park the idle notebook of ``pid`` now (the server checked that
    they may: its owner or an admin); ``by`` names them in the park's reason."""

    now: float
    pid: int
    by: str


@dataclass(frozen=True, kw_only=True)
class DeviceDrained:
    now: float
    device_index: int
    drained: bool


@dataclass(frozen=True, kw_only=True)
class PolicyChanged:
    now: float
    policy: Policy


@dataclass(frozen=True, kw_only=True)
class ChaosChanged:
    """An admin's chaos mode started (or ended) for the process ``pid``: while on, the
    broker may pause its session at any moment, as a rival would."""

    now: float
    pid: int
    on: bool


@dataclass(frozen=True, kw_only=True)
class Tick:
    """Once a second; with the host's memory as read then (``/proc/meminfo``), which is
    what parking may still move there (None: not read, the last reading stands)."""

    now: float
    host: HostMemory | None = None


Event = (
    SessionOpened
    | SessionClosed
    | LeaseRequested
    | LeaseReleased
    | LeaseRestored
    | LeaseReclaimed
    | RanksAttached
    | PreemptionApplied
    | PreemptionFailed
    | MemoryObserved
    | DeviceMemorySeen
    | SessionActivity
    | RestoreAsked
    | ParkAsked
    | DeviceDrained
    | PolicyChanged
    | ChaosChanged
    | Tick
)
