"""Reading the journal back when a broker starts: nothing left paused, no lease lost.

1. Every actuator step the journal says was applied and never undone is undone (the
   process is restored and unlocked), so no process stays paused by a broker that is no
   more.  Except an eviction whose lease comes back evicted: its memory stays off the
   device (the lease it was evicted for may be using that memory now), and this broker
   restores it as any other when the lease resumes or ends.
2. Every open lease (queued, running, paused) whose process still lives, the same
   process and not a reused pid, comes back into the scheduler *detached*, in the
   state it had, until its session reconnects and names it in ``hello`` or the grace
   period ends.  A paused lease is paused again on reconnect if it still has to be.
3. Leases of processes that ended are closed.

It runs before the socket accepts anyone and must not serve clients itself; it reads
the journal back and writes through the context's recorder.
"""

from __future__ import annotations

import logging
import time

import msgspec

from gpushare_ext.broker.edges.context import BrokerContext
from gpushare_ext.broker.hands.actuators import ActuatorError
from gpushare_ext.broker.hands.journal import JournaledActuation, JournaledLease
from gpushare_ext.broker.hands.peers import process_ended, user_and_groups
from gpushare_ext.broker.scheduler import core
from gpushare_ext.protocol import Capabilities, LeaseState, PreemptionLevel, SliceWish

log = logging.getLogger("gpushare.broker")


def placeholder_session(pid: int) -> str:
    """The session id a process's restored leases wait under until it reconnects."""
    return f"R{pid}"


def same_process(pid: int, start_ticks: int | None) -> bool:
    """Whether the process ``pid`` that started at ``start_ticks`` still lives (a zombie
    does not: its leases end with it)."""
    return not process_ended(pid, start_ticks)


def kept_evictions(leases: list[JournaledLease], steps: list[JournaledActuation]) -> frozenset[str]:
    """The evicted leases of live processes whose eviction the journal says is in force:
    they come back evicted, and their steps are not undone."""
    evicted = {
        record.lease_id: record
        for record in leases
        if LeaseState(record.state) == LeaseState.EVICTED
        and same_process(record.pid, record.start_ticks)
    }
    kept: set[str] = set()
    for step in steps:
        record = evicted.get(step.lease_id)
        if record is not None and step.level >= PreemptionLevel.EVICT and step.pid == record.pid:
            kept.add(step.lease_id)
    return frozenset(kept)


def undo_applied_actuators(
    ctx: BrokerContext, steps: list[JournaledActuation], kept: frozenset[str] = frozenset()
) -> None:
    for step in steps:
        if step.lease_id in kept:
            ctx.ladder.keep_eviction(step.pid)
            continue
        log.warning(
            "recovery: undoing level %s on pid %s (lease %s)", step.level, step.pid, step.lease_id
        )
        try:
            ctx.ladder.undo_blocking(step.pid, step.device_index, step.level)
        except ActuatorError as exc:
            log.error("recovery could not undo level %s on pid %s: %s", step.level, step.pid, exc)
        ctx.record.step_undone(step.id)


def _restored_event(record: JournaledLease, eviction_kept: bool) -> core.LeaseRestored:
    user, groups = user_and_groups(record.uid, record.gid)
    identity = core.Identity(
        uid=record.uid,
        gid=record.gid,
        pid=record.pid,
        user=user,
        groups=groups,
        start_ticks=record.start_ticks,
    )
    return core.LeaseRestored(
        now=time.time(),
        session_id=placeholder_session(record.pid),
        identity=identity,
        lease_id=record.lease_id,
        state=LeaseState(record.state),
        priority=record.priority,
        memory_bytes=record.memory_bytes,
        slot=record.slot or None,
        sm_share=record.sm_share,
        slice=SliceWish(record.slice),
        device=record.device,
        capabilities=msgspec.convert(record.capabilities or {}, Capabilities),
        label=record.label,
        requested_at=record.requested_at,
        granted_at=record.granted_at,
        aging_bonus=record.aging_bonus,
        paused_for=record.paused_for,
        reason=record.reason,
        eviction_kept=eviction_kept,
    )


def restore_open_leases(
    ctx: BrokerContext, leases: list[JournaledLease], kept: frozenset[str] = frozenset()
) -> int:
    """Open leases of live processes back into the scheduler; returns how many."""
    restored = 0
    for record in leases:
        if not same_process(record.pid, record.start_ticks):
            ctx.record.ended(record.lease_id, "its process ended while the broker was down")
            continue
        try:
            ctx.events.post(_restored_event(record, record.lease_id in kept))
        except (core.SchedulerError, ValueError, msgspec.ValidationError) as exc:
            reason = getattr(exc, "message", str(exc))
            log.warning("recovery: lease %s not restored: %s", record.lease_id, reason)
            ctx.record.ended(record.lease_id, f"not restored after a restart: {reason}")
            continue
        ctx.record.note("restored", record.lease_id, {"pid": record.pid, "state": record.state})
        restored += 1
    return restored


def recover(ctx: BrokerContext) -> None:
    leases, steps = ctx.journal.open_leases(), ctx.journal.pending_actuations()
    kept = kept_evictions(leases, steps)
    undo_applied_actuators(ctx, steps, kept)
    restored = restore_open_leases(ctx, leases, kept)
    if restored:
        log.info(
            "recovery: %d lease(s) wait %g s for their notebooks to reconnect",
            restored,
            ctx.config.reclaim_grace_s,
        )
