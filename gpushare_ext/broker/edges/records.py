"""Every journal write for a request, an action or an actuator step goes through here.

:class:`Recorder` is the one writer the broker's edges share: requests, effects,
recovery and chaos mode say what happened (a lease waits, is granted, paused, resumed,
ended; an actuator step applied or undone; a note for the history) and it writes the
rows :mod:`~gpushare_ext.broker.hands.journal` keeps.  It also keeps what deciding a write
needs: which queued leases are written already (a request is written once, when it
first waits), and the newest actuation of each lease (an undo marks undone only what
was written before it was decided, never a newer pause still on its way).

It writes, nothing else: it must not decide for the scheduler, read the journal back
(recovery reads :class:`~gpushare_ext.broker.hands.journal.Journal` itself), or touch sockets
and actuators.
"""

from __future__ import annotations

import msgspec

from gpushare_ext.broker.hands.journal import Journal, JournaledLease
from gpushare_ext.broker.scheduler import core
from gpushare_ext.protocol import LeaseState, PreemptionLevel


def journal_record(lease: core.Lease) -> JournaledLease:
    """What the journal keeps of a lease, as the core has it now."""
    level = lease.stop.in_force
    return JournaledLease(
        lease_id=lease.lease_id,
        pid=lease.identity.pid,
        start_ticks=lease.identity.start_ticks,
        uid=lease.identity.uid,
        gid=lease.identity.gid,
        state=lease.state.value,
        slot=lease.slot,
        priority=lease.base_priority,
        memory_bytes=lease.memory_bytes,
        sm_share=lease.sm_share,
        slice=lease.slice.value,
        device=lease.device_wish,
        capabilities=msgspec.to_builtins(lease.capabilities),
        label=lease.label,
        requested_at=lease.requested_at,
        granted_at=lease.granted_at,
        aging_bonus=lease.aging_bonus,
        level=None if level is None else int(level),
        paused_for=lease.paused_for,
        reason=lease.reason,
    )


class Recorder:
    """The journal's one writer for leases, actuations and notes."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self._waiting: set[str] = set()  # queued leases already written
        self._last_actuation: dict[str, int] = {}  # lease id -> its newest actuation

    # ---- leases

    def new_lease_id(self) -> str:
        """A lease id no broker of this journal gave before."""
        return f"L{self.journal.next_lease_number()}"

    def lease(self, lease: core.Lease) -> None:
        """The lease as the core has it now (its ranks attached, say)."""
        self.journal.lease_recorded(journal_record(lease))

    def granted(self, lease: core.Lease) -> None:
        self.journal.lease_recorded(journal_record(lease))
        self._waiting.discard(lease.lease_id)

    def waiting(self, lease: core.Lease) -> None:
        """A request is written once, when it first waits, so that a restart keeps it.
        (A park is not a request: a restart restores it through its actuation.)"""
        if lease.lease_id not in self._waiting and not lease.parks_session:
            self.journal.lease_recorded(journal_record(lease))
            self._waiting.add(lease.lease_id)

    def preempted(self, action: core.PauseLease, lease: core.Lease | None, block_path: str) -> None:
        """The step first (recovery undoes it), then the lease's new state."""
        self._last_actuation[action.lease_id] = self.journal.actuation_applied(
            action.lease_id, action.pid, action.device_index, int(action.level), block_path
        )
        if lease is not None:
            self.journal.lease_state(
                action.lease_id,
                action.resulting_state,
                level=int(action.level),
                paused_for=lease.paused_for,
                reason=lease.reason,
            )

    def evicted(self, lease: core.Lease, level: PreemptionLevel) -> None:
        self.journal.lease_state(
            lease.lease_id,
            LeaseState.EVICTED,
            level=int(level),
            paused_for=lease.paused_for,
            reason=lease.reason,
        )

    def running(self, lease_id: str, *, aging_bonus: float | None = None, reason: str = "") -> None:
        """Resumed, or left running after a pause that failed."""
        self.journal.lease_state(
            lease_id, LeaseState.RUNNING, aging_bonus=aging_bonus, reason=reason
        )

    def ended(self, lease_id: str, reason: str) -> None:
        self.journal.lease_ended(lease_id, reason)
        self._waiting.discard(lease_id)

    # ---- actuator steps

    def last_actuation(self, lease_id: str) -> int | None:
        """The newest step written for the lease: what an undo decided now may mark."""
        return self._last_actuation.get(lease_id)

    def forget_actuation(self, lease_id: str) -> int | None:
        """:meth:`last_actuation` of a lease that has ended, no longer kept."""
        return self._last_actuation.pop(lease_id, None)

    def undone(self, lease_id: str, up_to: int | None = None) -> None:
        """Every step applied to the lease (up to actuation ``up_to``) is undone."""
        self.journal.actuations_undone(lease_id, up_to=up_to)

    def step_applied(
        self, lease_id: str, pid: int, device_index: int, level: int, block_path: str
    ) -> int:
        """A step outside the scheduler's (chaos mode's): its id marks it undone later."""
        return self.journal.actuation_applied(lease_id, pid, device_index, level, block_path)

    def step_undone(self, actuation_id: int) -> None:
        self.journal.actuation_undone(actuation_id)

    # ---- history

    def note(self, kind: str, lease_id: str | None, detail: dict) -> None:
        self.journal.note(kind, lease_id, detail)
