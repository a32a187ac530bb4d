"""Carrying out the scheduler's actions: journal first, then the actuators, then the clients.

One typed method per action of :mod:`gpushare_ext.broker.core`.  Each writes what must
survive a crash to the journal before anything else happens, then starts the ladder
step (off the event loop, as a tracked task the shutdown waits for), then tells the
sessions concerned.  A session may have gone meanwhile: its control block is then
closed and writes to it are ignored, and whatever was applied for its lease is still
undone and journaled as undone.

It decides nothing: the core chose the action, the ladder knows how.  What its log lines
quote that someone wrote (a user name, a refusal that repeats a device wish, a reason)
goes through :func:`~gpushare_ext.plain_text.plain_text`, so a line of the log is one
event and holds no escape sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from gpushare_ext.broker import core
from gpushare_ext.broker.actuators import ActuatorError, Target, pid_alive
from gpushare_ext.broker.journal import JournaledLease
from gpushare_ext.broker.peers import Connection
from gpushare_ext.broker.views import display_user
from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import (
    Granted,
    LeaseState,
    Parked,
    Preempt,
    PreemptionLevel,
    Queued,
    Refused,
    Released,
    Resume,
    Revoked,
    applied_level,
)
from gpushare_ext.units import format_size

if TYPE_CHECKING:
    from gpushare_ext.broker.server import Broker

log = logging.getLogger("gpushare.broker")
# One line per lease event (grants, pauses, resumes, refusals, ends) for an admin to
# follow; `--log-level warning` leaves them out.
events = logging.getLogger("gpushare.broker.leases")


@dataclass(frozen=True)
class Reply:
    """Which request the actions of one event answer.

    ``to`` is the request's ``seq``; actions about ``lease_id`` carry it back.  ``conn``
    receives the ``Released`` of a lease ended on its behalf (an admin's cancel, or a
    release from another notebook of the same user).
    """

    to: int = 0
    lease_id: str | None = None
    conn: Connection | None = None


NO_REPLY = Reply()


def journal_record(lease: core.Lease) -> JournaledLease:
    """What the journal keeps of a lease, as the core has it now."""
    level = lease.applied_level if lease.applied_level is not None else lease.pending_level
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


class Effects:
    """The broker's hands.  ``carry_out`` takes one action of the core."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.tasks: set[asyncio.Task] = set()
        self._journaled: set[str] = set()  # queued leases already written
        # The newest journaled actuation of each lease: an undo marks undone only what
        # was journaled before it was decided, never a newer pause still on its way.
        self._last_actuation: dict[str, int] = {}
        self._handlers: dict[type, Callable[[Any, Reply], None]] = {
            core.GrantLease: self.grant,
            core.NotifyQueued: self.notify_queued,
            core.RefuseRequest: self.refuse,
            core.PauseLease: self.preempt,
            core.ResumeLease: self.resume,
            core.RevokeLease: self.revoke,
            core.LeaseEnded: self.lease_ended,
            core.RivalryChanged: self.rivalry_changed,
        }

    def carry_out(self, action: core.Action, reply: Reply = NO_REPLY) -> None:
        self._handlers[type(action)](action, reply)

    def rivalry_changed(self, action: core.RivalryChanged, reply: Reply) -> None:
        """The session's launch shim reads this word before each long launch."""
        conn = self._conn(action.session_id)
        if conn is not None and conn.control_block is not None:
            conn.control_block.set_unrivalled(action.unrivalled)

    # ---- tasks

    def spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("an actuator step failed unexpectedly: %r", task.exception())

    async def drain(self, timeout: float) -> None:
        """Let the ladder steps under way finish (shutdown), cancelling the rest after ``timeout``."""
        pending = set(self.tasks)
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=1)

    # ---- helpers

    def _conn(self, session_id: str) -> Connection | None:
        return self.broker.connections.get(session_id)

    @staticmethod
    def _direct(action: Any, reply: Reply) -> int:
        return reply.to if getattr(action, "lease_id", None) == reply.lease_id else 0

    def target(
        self, lease_id: str, pid: int, slot: str | None, device_index: int | None = None
    ) -> Target:
        broker = self.broker
        lease = broker.scheduler.lease_of(lease_id)
        session = broker.connections.get(lease.session_id) if lease else None
        if device_index is None:
            key = slot or (lease.slot if lease else None)
            device_index = broker.scheduler.slots[key].device_index if key else 0
        return Target(
            lease_id=lease_id,
            pid=pid,
            device_index=device_index,
            control_block=session.control_block if session else None,
            yield_flag=broker.yield_flags.get(lease_id),
        )

    # ---- one method per action

    def grant(self, action: core.GrantLease, reply: Reply) -> None:
        broker = self.broker
        leases = broker.scheduler.members(action.lease_id)  # a gang: each of its ranks
        for lease in leases:
            broker.journal.lease_recorded(journal_record(lease))
            self._journaled.discard(lease.lease_id)
            broker.timeline.granted(
                lease.lease_id,
                lease.identity,
                action.priority,
                broker.scheduler.slots[lease.slot or ""].device_index,
                time.time(),
            )
        if leases:
            lease = leases[0]
            broker.metrics.observe_grant(action.priority, lease.waited_s)
            if events.isEnabledFor(logging.INFO):
                where = action.placement.mig_profile or f"GPU {action.placement.device_index}"
                if action.ranks:
                    devices = sorted({r.placement.mig_profile or f"GPU {r.placement.device_index}"
                                      for r in action.ranks})  # fmt: skip
                    where = f"{len(action.ranks)} ranks on {', '.join(devices)}"
                events.info(
                    "%s granted to %s (pid %s) on %s: %s, priority %s, after %.1f s%s",
                    action.lease_id, plain_text(lease.identity.user), lease.identity.pid,
                    where, format_size(action.placement.memory_bytes), action.priority,
                    lease.waited_s,
                    f" ({plain_text(action.notice, SENTENCE_LIMIT)})" if action.notice else "",
                )  # fmt: skip
        if action.notice:
            broker.metrics.observe_priority_lowered()
        conn = self._conn(action.session_id)
        if conn is None:
            return
        if conn.control_block is not None:
            conn.control_block.publish(gate_closed=False, state=LeaseState.RUNNING)
        broker.send(
            conn,
            Granted(
                reply_to=self._direct(action, reply),
                lease_id=action.lease_id,
                placement=action.placement,
                priority=action.priority,
                notice=action.notice,
                ranks=list(action.ranks),
            ),
        )

    def notify_queued(self, action: core.NotifyQueued, reply: Reply) -> None:
        broker = self.broker
        for lease in broker.scheduler.members(action.lease_id):
            if lease.lease_id not in self._journaled and not lease.parks_session:
                # A request is journaled once, when it first waits, so a restart keeps it.
                # (A park is not a request: a restart restores it through its actuation.)
                broker.journal.lease_recorded(journal_record(lease))
                self._journaled.add(lease.lease_id)
        conn = self._conn(action.session_id)
        if conn is None:
            return
        holders = [broker.scheduler.lease_of(lid) for lid in action.waiting_for]
        names = sorted({display_user(broker, h.identity, conn) for h in holders if h is not None})
        if conn.control_block is not None:
            conn.control_block.publish(
                gate_closed=False, state=LeaseState.QUEUED, reason=action.reason
            )
        broker.send(
            conn,
            Queued(
                reply_to=self._direct(action, reply),
                lease_id=action.lease_id,
                position=action.position,
                waiting_for=", ".join(names) if names else "earlier requests",
                holder_priority=action.holder_priority,
                estimate_s=action.estimate_s,
                reason=action.reason,
                notice=action.notice,
            ),
        )

    def refuse(self, action: core.RefuseRequest, reply: Reply) -> None:
        self.broker.metrics.observe_refusal(action.code.value)
        events.info(
            "%s refused (%s): %s",
            action.lease_id, action.code.value, plain_text(action.message, SENTENCE_LIMIT),
        )  # fmt: skip
        conn = self._conn(action.session_id)
        if conn is not None:
            self.broker.send(
                conn,
                Refused(
                    reply_to=self._direct(action, reply),
                    lease_id=action.lease_id,
                    code=action.code,
                    message=action.message,
                ),
            )

    def preempt(self, action: core.PauseLease, reply: Reply) -> None:
        broker = self.broker
        conn = self._conn(action.session_id)
        self._last_actuation[action.lease_id] = broker.journal.actuation_applied(
            action.lease_id,
            action.pid,
            action.device_index,
            int(action.level),
            str(conn.control_block.path) if conn and conn.control_block else "",
        )
        lease = broker.scheduler.lease_of(action.lease_id)
        if lease is not None:
            broker.journal.lease_state(
                action.lease_id,
                LeaseState.EVICTED if action.level == PreemptionLevel.EVICT else LeaseState.PAUSED,
                level=int(action.level),
                paused_for=lease.paused_for,
                reason=lease.reason,
            )
        broker.metrics.observe_preemption(int(action.level))
        # The rung that holds it (on a simulated GPU the gate), as status and the cell say.
        held_by = applied_level(action.level, broker.control.kind == "simulated")
        broker.timeline.paused(action.lease_id, int(held_by), time.time())
        asked = (
            ""
            if held_by == action.level
            else f"; level {int(action.level)} asked, which only the gate holds on a simulated GPU"
        )
        events.info(
            "%s (pid %s) %s at level %s (%s) for %s%s: %s",
            action.lease_id, action.pid,
            "parked" if action.parks_bytes
            else "evicted" if action.level == PreemptionLevel.EVICT
            else "paused",
            int(held_by), held_by.name.lower(), action.for_lease or "the broker", asked,
            plain_text(action.reason, SENTENCE_LIMIT),
        )  # fmt: skip
        if action.parks_bytes:
            broker.journal.note(
                "parked",
                action.lease_id,
                {"pid": action.pid, "bytes": action.parks_bytes, "reason": action.reason},
            )
            if conn is not None:
                broker.send(
                    conn,
                    Parked(
                        lease_id=action.lease_id,
                        memory_bytes=action.parks_bytes,
                        device_index=action.device_index,
                        reason=action.reason,
                    ),
                )
        elif conn is not None:
            for_lease = broker.scheduler.lease_of(action.for_lease) if action.for_lease else None
            for_user = display_user(broker, for_lease.identity, conn) if for_lease else "the broker"
            broker.send(
                conn,
                Preempt(
                    lease_id=action.lease_id,
                    level=action.level,
                    reason=action.reason,
                    for_user=for_user,
                ),
            )
        already = lease.applied_level if lease else None
        target = self.target(action.lease_id, action.pid, lease.slot if lease else None)
        self.spawn(self._apply_preemption(target, action, already))

    def resume(self, action: core.ResumeLease, reply: Reply) -> None:
        lease = self.broker.scheduler.lease_of(action.lease_id)
        self.broker.timeline.resumed(action.lease_id, time.time())
        events.info(
            "%s (pid %s) %s after %.1f s",
            action.lease_id, action.pid, "restored" if action.restores_park else "resumed",
            action.paused_s,
        )  # fmt: skip
        self.broker.journal.lease_state(
            action.lease_id,
            LeaseState.RUNNING,
            aging_bonus=lease.aging_bonus if lease else None,
        )
        target = self.target(action.lease_id, action.pid, None, device_index=action.device_index)
        self.spawn(
            self._undo_preemption(
                target,
                action.undo_level,
                self._last_actuation.get(action.lease_id),
                resume=action,
            )
        )

    def revoke(self, action: core.RevokeLease, reply: Reply) -> None:
        events.info(
            "%s (pid %s) revoked: %s",
            action.lease_id, action.pid, plain_text(action.reason, SENTENCE_LIMIT),
        )  # fmt: skip
        conn = self._conn(action.session_id)
        if conn is not None:
            self.broker.send(conn, Revoked(lease_id=action.lease_id, reason=action.reason))

    def lease_ended(self, action: core.LeaseEnded, reply: Reply) -> None:
        broker = self.broker
        broker.journal.lease_ended(action.lease_id, action.reason)
        broker.timeline.ended(action.lease_id, time.time())
        events.info(
            "%s (pid %s) ended after %.1f s: %s",
            action.lease_id, action.pid, action.held_s, plain_text(action.reason, SENTENCE_LIMIT),
        )  # fmt: skip
        self._journaled.discard(action.lease_id)
        broker.yield_flags.pop(action.lease_id, None)
        broker.notes.pop(action.lease_id, None)
        conn = self._conn(action.session_id)
        if action.undo_level is not None and action.device_index is not None:
            target = self.target(
                action.lease_id, action.pid, None, device_index=action.device_index
            )
            # The lease has left the core, so the target names no session: the block is
            # the connection's.  Left as it was, it would say "paused" to the session for
            # ever, and the shim would hold every later launch of the process.
            target.control_block = conn.control_block if conn is not None else None
            self.spawn(
                self._undo_preemption(
                    target,
                    action.undo_level,
                    self._last_actuation.pop(action.lease_id, None),
                    lease_ended=True,
                )
            )
        else:
            self._last_actuation.pop(action.lease_id, None)
            if conn is not None and conn.control_block is not None:
                conn.control_block.publish(gate_closed=False, state=None)
        to = reply.conn if reply.conn is not None else conn
        if to is not None:
            broker.send(
                to,
                Released(
                    reply_to=reply.to if reply.conn is not None else 0,
                    lease_id=action.lease_id,
                    held_s=action.held_s,
                ),
            )

    # ---- the ladder, off the event loop

    async def _apply_preemption(
        self, target: Target, action: core.PauseLease, already: PreemptionLevel | None
    ) -> None:
        broker = self.broker
        block = target.control_block
        if action.parks_bytes and block is not None and block.ipc_imports:
            # Its shim counted an import since the session last said it may be parked: a
            # checkpoint of it could not be restored.  Undone before anything is applied.
            refusal = ActuatorError(
                "it opened another process's GPU memory (CUDA IPC), which a checkpoint "
                "cannot restore",
                not_supported=True,
            )
            await self._preemption_failed(target, action, refusal)
            return
        try:
            note = await broker.ladder.apply(target, action.level, action.reason, already)
        except ActuatorError as exc:
            await self._preemption_failed(target, action, exc)
            return
        if note:
            broker.notes[action.lease_id] = note
        broker.dispatch(
            core.PreemptionApplied(now=time.time(), lease_id=action.lease_id, level=action.level)
        )
        lease = broker.scheduler.lease_of(action.lease_id)
        if lease is None or lease.state not in core.ACTIVE_STATES:
            # It ended while this step ran: the undo queued behind it releases the process.
            return
        if lease.state == LeaseState.EVICTED:
            broker.journal.lease_state(
                action.lease_id,
                LeaseState.EVICTED,
                level=int(action.level),
                paused_for=lease.paused_for,
                reason=lease.reason,
            )

    async def _preemption_failed(
        self, target: Target, action: core.PauseLease, exc: ActuatorError
    ) -> None:
        broker = self.broker
        broker.metrics.observe_preemption(int(action.level), failed=True)
        broker.notes[action.lease_id] = (
            f"level {int(action.level)} not supported: {exc}"
            if exc.not_supported
            else f"level {int(action.level)} failed: {exc}"
        )
        log.warning(
            "preemption of %s at level %s failed: %s", action.lease_id, int(action.level), exc
        )
        if not (action.keeps_lock and broker.ladder.is_locked(target.pid)):
            # Whatever was applied (the gate) is undone: it keeps running, time-sliced.
            # (A failed eviction keeps the lock: it stays paused, its memory on the device;
            # a failed park is undone whole: the idle session must be able to run again.)
            with contextlib.suppress(ActuatorError):
                await broker.ladder.undo(target, None)
            broker.journal.actuations_undone(
                action.lease_id, up_to=self._last_actuation.get(action.lease_id)
            )
        broker.dispatch(
            core.PreemptionFailed(
                now=time.time(), lease_id=action.lease_id, level=action.level, reason=str(exc)
            )
        )
        lease = broker.scheduler.lease_of(action.lease_id)
        if lease is not None and lease.state == LeaseState.RUNNING:
            broker.journal.lease_state(action.lease_id, LeaseState.RUNNING, reason=lease.reason)
            broker.timeline.resumed(action.lease_id, time.time())
        conn = self._conn(action.session_id)
        if conn is not None and action.level != PreemptionLevel.EVICT:
            broker.send(
                conn,
                Resume(
                    lease_id=action.lease_id,
                    paused_s=0.0,
                    note=f"could not be paused ({exc}); it runs beside the other session",
                ),
            )

    def _restore_failed(self, target: Target, resume: core.ResumeLease, exc: ActuatorError) -> None:
        """A parked session could not be restored: say so, with what was lost, and end
        the park (the checkpoint API cannot restore a process twice)."""
        broker = self.broker
        lease = broker.scheduler.lease_of(resume.lease_id)
        lost = format_size(lease.memory_bytes) if lease else "its parked memory"
        reason = (
            f"restore failed ({exc}): the {lost} of GPU memory this notebook held is lost; "
            "restart the kernel"
        )
        broker.journal.note(
            "restore failed", resume.lease_id, {"pid": target.pid, "error": str(exc)}
        )
        broker.journal.actuations_undone(resume.lease_id)
        conn = self._conn(resume.session_id)
        if conn is not None:
            broker.send(conn, Revoked(lease_id=resume.lease_id, reason=reason))
        if lease is not None:
            broker.dispatch(
                core.LeaseReleased(
                    now=time.time(), session_id=resume.session_id, lease_id=resume.lease_id
                )
            )

    async def _undo_preemption(
        self,
        target: Target,
        level: PreemptionLevel | None,
        up_to: int | None,
        resume: core.ResumeLease | None = None,
        *,
        lease_ended: bool = False,
    ) -> None:
        broker = self.broker
        try:
            await broker.ladder.undo(target, level, lease_ended=lease_ended)
        except ActuatorError as exc:
            log.error("could not undo level %s for %s: %s", level, target.lease_id, exc)
            if resume is not None and resume.restores_park:
                self._restore_failed(target, resume, exc)
                return
            broker.notes[target.lease_id] = f"resume failed: {exc}"
            if pid_alive(target.pid):
                return  # it may still be locked: the journal keeps it for the next start
        # Undone, or its process is gone: either way nothing is left for recovery.
        broker.journal.actuations_undone(target.lease_id, up_to=up_to)
        if resume is not None:
            broker.notes.pop(target.lease_id, None)
            conn = self._conn(resume.session_id)
            if conn is not None:
                broker.send(conn, Resume(lease_id=resume.lease_id, paused_s=resume.paused_s))
