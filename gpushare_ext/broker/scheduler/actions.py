"""What the scheduler core asks for: one frozen record per thing the broker must carry out.

What it is for: :meth:`~gpushare_ext.broker.scheduler.core.Scheduler.handle` returns these, in
order; :mod:`~gpushare_ext.broker.edges.effects` carries each out (journal first, then the
actuators, then the clients).  :data:`Action` is the union of them all.  Whatever needs
deciding is decided by the core and written into the action.

What it must not do: hold behaviour, or import the scheduler that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare_ext.protocol import (
    ErrorCode,
    LeaseState,
    Placement,
    PreemptionLevel,
    RankPlacement,
)


@dataclass(frozen=True, kw_only=True)
class GrantLease:
    """A lease is granted (the wire's ``Granted``); for a gang, ``lease_id`` is the
    gang's, ``placement`` its rank 0's, and ``ranks`` every member's lease and placement
    in rank order."""

    session_id: str
    lease_id: str
    placement: Placement
    priority: int
    notice: str = ""
    ranks: tuple[RankPlacement, ...] = ()


@dataclass(frozen=True, kw_only=True)
class NotifyQueued:
    session_id: str
    lease_id: str
    position: int
    waiting_for: tuple[str, ...]  # lease ids in the way (the server anonymises their owners)
    holder_priority: int | None
    estimate_s: float | None
    reason: str
    notice: str = ""  # what the policy changed in the request (said while it waits too)
    freeing_bytes: int | None = None  # memory being freed for it (its estimate: that time)


@dataclass(frozen=True, kw_only=True)
class PauseLease:
    """Stop a lease's work at ``level`` of the ladder (level 4 evicts its memory to the
    host; with ``parks_bytes``, the park of an idle session); its session hears of it as
    the wire's ``Preempt`` (or ``Parked``)."""

    session_id: str
    lease_id: str
    pid: int
    device_index: int
    level: PreemptionLevel
    for_lease: str
    reason: str
    # If the stop fails, whether what it locked stays locked (the core's decision:
    # :func:`~gpushare_ext.broker.settings.policy.lock_kept_when_failing`).
    keeps_lock: bool
    # The state the lease is in once the stop is applied (the core's word, from
    # :func:`~gpushare_ext.lease_state.stopped_state`): the journal and the control
    # block say this, never a state of their own making.
    resulting_state: LeaseState
    # The rung that really holds it (on a simulated GPU the gate) and the state its
    # session's notice gives the lease: the status, the broker log and the cell say these.
    held_by: PreemptionLevel
    session_state: LeaseState
    parks_bytes: int = 0  # > 0: this parks an idle session holding that much
    # Only ``parks_bytes`` of what the session holds, which its launch shim parks itself
    # (no checkpoint: that would move the whole process).
    parks_part: bool = False


@dataclass(frozen=True, kw_only=True)
class ResumeLease:
    session_id: str
    lease_id: str
    pid: int
    device_index: int
    undo_level: PreemptionLevel  # the highest level applied, to undo
    paused_s: float
    restores_park: bool = False  # the memory of a parked session comes back


@dataclass(frozen=True, kw_only=True)
class RefuseRequest:
    """A request the policy or the host's slots refuse (the wire's ``Refused``)."""

    session_id: str
    lease_id: str
    code: ErrorCode
    message: str


@dataclass(frozen=True, kw_only=True)
class RevokeLease:
    """An admin cancelled a lease (the wire's ``Revoked``)."""

    session_id: str
    lease_id: str
    pid: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class LeaseEnded:
    """A lease left the system (released, revoked, its session died).

    ``undo_level`` is the preemption level still applied to its process, which the
    actuators must undo (None when nothing is applied).
    """

    session_id: str
    lease_id: str
    pid: int
    device_index: int | None
    held_s: float
    undo_level: PreemptionLevel | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class RivalryChanged:
    """Whether a session has no rival (:mod:`~gpushare_ext.broker.scheduler.rivals`): its long
    kernels may then run as they are, at no cost."""

    session_id: str
    unrivalled: bool


Action = (
    GrantLease
    | NotifyQueued
    | PauseLease
    | ResumeLease
    | RefuseRequest
    | RevokeLease
    | LeaseEnded
    | RivalryChanged
)
