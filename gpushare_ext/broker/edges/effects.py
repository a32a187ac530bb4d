"""Carrying out the scheduler's actions: journal first, then the actuators, then the clients.

One typed method per action of :mod:`gpushare_ext.broker.scheduler.core`.  Each writes what must
survive a crash to the journal before anything else happens, then starts the ladder
step (off the event loop, as a tracked task the shutdown waits for), then tells the
sessions concerned.  A session may have gone meanwhile: its control block is then
closed and writes to it are ignored, and whatever was applied for its lease is still
undone and journaled as undone.

It works on a :class:`~gpushare_ext.broker.edges.context.BrokerContext`, never the server:
messages leave through its outbox, journal rows through its recorder, and what a ladder
step came to (applied, failed, a park that could not be restored) goes back to the core
as an event on its queue, which the server feeds.

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
from collections.abc import Callable
from typing import Any

from gpushare_ext.broker.edges.context import NO_REPLY, BrokerContext, Reply
from gpushare_ext.broker.edges.views import display_user
from gpushare_ext.broker.hands.actuators import ActuatorError, Target, pid_alive
from gpushare_ext.broker.hands.peers import Connection
from gpushare_ext.broker.scheduler import core
from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import (
    BrokerMessage,
    Granted,
    LeaseState,
    Ok,
    Parked,
    Preempt,
    PreemptionLevel,
    Queued,
    Refused,
    Released,
    Resume,
    Revoked,
    level_word,
)
from gpushare_ext.units import format_size

log = logging.getLogger("gpushare.broker")
# One line per lease event (grants, pauses, resumes, refusals, ends) for an admin to
# follow; `--log-level warning` leaves them out.
events = logging.getLogger("gpushare.broker.leases")


class Effects:
    """The broker's hands.  ``carry_out`` takes one action of the core."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
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
        # The ladder steps under way that stop sessions for a lease (lease id -> tasks):
        # its grant waits for them, bounded by ``grant_after_stops_ms``.
        self._stops_for: dict[str, set[asyncio.Task]] = {}

    def carry_out(self, action: core.Action, reply: Reply = NO_REPLY) -> None:
        self._handlers[type(action)](action, reply)

    def rivalry_changed(self, action: core.RivalryChanged, reply: Reply) -> None:
        """The session's launch shim reads this word before each long launch."""
        conn = self._conn(action.session_id)
        if conn is not None and conn.control_block is not None:
            conn.control_block.set_unrivalled(action.unrivalled)

    # ---- helpers

    def _conn(self, session_id: str) -> Connection | None:
        return self.ctx.connections.get(session_id)

    @staticmethod
    def _direct(action: Any, reply: Reply) -> int:
        return reply.to if getattr(action, "lease_id", None) == reply.lease_id else 0

    # ---- one method per action

    def grant(self, action: core.GrantLease, reply: Reply) -> None:
        ctx = self.ctx
        leases = ctx.scheduler.members(action.lease_id)  # a gang: each of its ranks
        for lease in leases:
            ctx.record.granted(lease)
            ctx.timeline.granted(
                lease.lease_id,
                lease.identity,
                action.priority,
                ctx.scheduler.slots[lease.slot or ""].device_index,
                time.time(),
            )
            if lease.label:  # a lease that ends before the next tick keeps its label too
                ctx.timeline.labelled(lease.lease_id, lease.label)
        if leases:
            lease = leases[0]
            ctx.metrics.observe_grant(action.priority, lease.waited_s)
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
            ctx.metrics.observe_priority_lowered()
        conn = self._conn(action.session_id)
        if conn is None:
            return
        if conn.control_block is not None:
            conn.control_block.publish(gate_closed=False, state=LeaseState.RUNNING)
        granted = Granted(
            reply_to=self._direct(action, reply),
            lease_id=action.lease_id,
            placement=action.placement,
            priority=action.priority,
            notice=action.notice,
            ranks=list(action.ranks),
        )
        stops = self._stops_under_way({action.lease_id, *(lease.lease_id for lease in leases)})
        bound_s = ctx.config.grant_after_stops_ms / 1000
        if stops and bound_s > 0:
            # The paused sessions' last kernels would share the GPU with the new lease's
            # first ones (a time-slice hand-over per cell): the grant waits until they
            # have stopped, or the bound has passed.  Its session's other messages wait
            # behind it, in order.
            place = ctx.outbox.reserve(conn)
            ctx.tasks.spawn(self._grant_after(stops, bound_s, conn, place, granted))
            return
        ctx.outbox.put(conn, granted)

    def _stops_under_way(self, lease_ids: set[str]) -> set[asyncio.Task]:
        return {
            task
            for lease_id in lease_ids
            for task in self._stops_for.get(lease_id, ())
            if not task.done()
        }

    async def _grant_after(
        self,
        stops: set[asyncio.Task],
        bound_s: float,
        conn: Connection,
        place: list[BrokerMessage],
        granted: Granted,
    ) -> None:
        try:
            _, late = await asyncio.wait(stops, timeout=bound_s)
            if late:
                events.info(
                    "%s granted before the sessions it pauses had stopped (after %.0f ms)",
                    granted.lease_id, bound_s * 1000,
                )  # fmt: skip
        finally:
            self.ctx.outbox.fill(conn, place, granted)

    def _track_stop(self, for_lease: str, task: asyncio.Task) -> None:
        tasks = self._stops_for.setdefault(for_lease, set())
        tasks.add(task)

        def finished(done: asyncio.Task) -> None:
            tasks.discard(done)
            if not tasks and self._stops_for.get(for_lease) is tasks:
                del self._stops_for[for_lease]

        task.add_done_callback(finished)

    def notify_queued(self, action: core.NotifyQueued, reply: Reply) -> None:
        ctx = self.ctx
        for lease in ctx.scheduler.members(action.lease_id):
            ctx.record.waiting(lease)
        conn = self._conn(action.session_id)
        if conn is None:
            return
        holders = [ctx.scheduler.lease_of(lid) for lid in action.waiting_for]
        names = sorted({display_user(ctx, h.identity, conn) for h in holders if h is not None})
        if conn.control_block is not None:
            conn.control_block.publish(
                gate_closed=False, state=LeaseState.QUEUED, reason=action.reason
            )
        ctx.outbox.put(
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
                freeing_bytes=action.freeing_bytes,
            ),
        )

    def refuse(self, action: core.RefuseRequest, reply: Reply) -> None:
        self.ctx.metrics.observe_refusal(action.code.value)
        events.info(
            "%s refused (%s): %s",
            action.lease_id, action.code.value, plain_text(action.message, SENTENCE_LIMIT),
        )  # fmt: skip
        conn = self._conn(action.session_id)
        if conn is not None:
            self.ctx.outbox.put(
                conn,
                Refused(
                    reply_to=self._direct(action, reply),
                    lease_id=action.lease_id,
                    code=action.code,
                    message=action.message,
                ),
            )

    def preempt(self, action: core.PauseLease, reply: Reply) -> None:
        ctx = self.ctx
        conn = self._conn(action.session_id)
        lease = ctx.scheduler.lease_of(action.lease_id)
        ctx.record.preempted(
            action, lease, str(conn.control_block.path) if conn and conn.control_block else ""
        )
        ctx.metrics.observe_preemption(int(action.level))
        held_by = action.held_by
        ctx.timeline.paused(action.lease_id, int(held_by), time.time())
        asked = (
            ""
            if held_by == action.level
            else f"; level {int(action.level)} asked, which only the gate holds on a simulated GPU"
        )
        events.info(
            "%s (pid %s) %s at level %s (%s) for %s%s: %s",
            action.lease_id, action.pid,
            "parked" if action.parks_bytes else action.resulting_state.value,
            int(held_by), level_word(held_by), action.for_lease or "the broker", asked,
            plain_text(action.reason, SENTENCE_LIMIT),
        )  # fmt: skip
        if action.parks_bytes:
            ctx.record.note(
                "parked",
                action.lease_id,
                {"pid": action.pid, "bytes": action.parks_bytes, "reason": action.reason},
            )
            if conn is not None:
                ctx.outbox.put(
                    conn,
                    Parked(
                        lease_id=action.lease_id,
                        memory_bytes=action.parks_bytes,
                        device_index=action.device_index,
                        reason=action.reason,
                    ),
                )
        elif conn is not None:
            for_lease = ctx.scheduler.lease_of(action.for_lease) if action.for_lease else None
            for_user = display_user(ctx, for_lease.identity, conn) if for_lease else "the broker"
            ctx.outbox.put(
                conn,
                Preempt(
                    lease_id=action.lease_id,
                    level=action.level,
                    held_by=action.held_by,
                    state=action.session_state,
                    reason=action.reason,
                    for_user=for_user,
                ),
            )
        target = ctx.target(action.lease_id, action.pid, lease.slot if lease else None)
        if action.parks_part:
            target.park_bytes = action.parks_bytes  # the session's shim parks that much itself
        task = ctx.tasks.spawn(self._apply_preemption(target, action))
        if action.for_lease:
            self._track_stop(action.for_lease, task)
        if action.parks_bytes and reply.park:
            self._answer_park(action, reply)

    def _answer_park(self, action: core.PauseLease, reply: Reply) -> None:
        """Whoever asked for the park hears what goes to the host, and for which lease."""
        if reply.conn is not None:
            self.ctx.outbox.put(
                reply.conn,
                Ok(
                    reply_to=reply.to,
                    detail=f"parking pid {action.pid}: {format_size(action.parks_bytes)} to the "
                    f"host (lease {action.lease_id})",
                ),
            )

    def resume(self, action: core.ResumeLease, reply: Reply) -> None:
        ctx = self.ctx
        lease = ctx.scheduler.lease_of(action.lease_id)
        ctx.timeline.resumed(action.lease_id, time.time())
        events.info(
            "%s (pid %s) %s after %.1f s",
            action.lease_id, action.pid, "restored" if action.restores_park else "resumed",
            action.paused_s,
        )  # fmt: skip
        ctx.record.running(action.lease_id, aging_bonus=lease.aging_bonus if lease else None)
        target = ctx.target(action.lease_id, action.pid, None, device_index=action.device_index)
        ctx.tasks.spawn(
            self._undo_preemption(
                target,
                action.undo_level,
                ctx.record.last_actuation(action.lease_id),
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
            self.ctx.outbox.put(conn, Revoked(lease_id=action.lease_id, reason=action.reason))

    def lease_ended(self, action: core.LeaseEnded, reply: Reply) -> None:
        ctx = self.ctx
        ctx.record.ended(action.lease_id, action.reason)
        ctx.timeline.ended(action.lease_id, time.time())
        events.info(
            "%s (pid %s) ended after %.1f s: %s",
            action.lease_id, action.pid, action.held_s, plain_text(action.reason, SENTENCE_LIMIT),
        )  # fmt: skip
        ctx.yield_flags.pop(action.lease_id, None)
        ctx.notes.pop(action.lease_id, None)
        conn = self._conn(action.session_id)
        if action.undo_level is not None and action.device_index is not None:
            target = ctx.target(action.lease_id, action.pid, None, device_index=action.device_index)
            # The lease has left the core, so the target names no session: the block is
            # the connection's.  Left as it was, it would say "paused" to the session for
            # ever, and the shim would hold every later launch of the process.
            target.control_block = conn.control_block if conn is not None else None
            ctx.tasks.spawn(
                self._undo_preemption(
                    target,
                    action.undo_level,
                    ctx.record.forget_actuation(action.lease_id),
                    lease_ended=True,
                )
            )
        else:
            ctx.record.forget_actuation(action.lease_id)
            if conn is not None and conn.control_block is not None:
                conn.control_block.publish(gate_closed=False, state=None)
        to = reply.conn if reply.conn is not None else conn
        if to is not None:
            ctx.outbox.put(
                to,
                Released(
                    reply_to=reply.to if reply.conn is not None else 0,
                    lease_id=action.lease_id,
                    held_s=action.held_s,
                ),
            )

    # ---- the ladder, off the event loop

    async def _apply_preemption(self, target: Target, action: core.PauseLease) -> None:
        ctx = self.ctx
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
        started = time.monotonic()
        try:
            applied = await ctx.ladder.apply(
                target, action.level, action.reason, action.resulting_state
            )
        except ActuatorError as exc:
            await self._preemption_failed(target, action, exc)
            return
        # How long a stop took is what a waiting grant pays: an admin sees it per pause.
        held_by = applied.held_by
        events.info(
            "%s (pid %s) stopped at level %s (%s) in %.1f ms",
            action.lease_id, action.pid, int(held_by), level_word(held_by),
            (time.monotonic() - started) * 1000,
        )  # fmt: skip
        if applied.note:
            ctx.notes[action.lease_id] = applied.note
        ctx.events.post(
            core.PreemptionApplied(
                now=time.time(),
                lease_id=action.lease_id,
                level=action.level,
                applied_level=applied.level,
            )
        )
        lease = ctx.scheduler.lease_of(action.lease_id)
        if lease is None or lease.state not in core.ACTIVE_STATES:
            # It ended while this step ran: the undo queued behind it releases the process.
            return
        if lease.state == LeaseState.EVICTED:
            ctx.record.evicted(lease, applied.level)

    async def _preemption_failed(
        self, target: Target, action: core.PauseLease, exc: ActuatorError
    ) -> None:
        ctx = self.ctx
        ctx.metrics.observe_preemption(int(action.level), failed=True)
        ctx.notes[action.lease_id] = (
            f"level {int(action.level)} not supported: {exc}"
            if exc.not_supported
            else f"level {int(action.level)} failed: {exc}"
        )
        log.warning(
            "preemption of %s at level %s failed: %s", action.lease_id, int(action.level), exc
        )
        if not (action.keeps_lock and ctx.ladder.is_locked(target.pid)):
            # Whatever was applied (the gate) is undone: it keeps running, time-sliced.
            # (A failed eviction keeps the lock: it stays paused, its memory on the device;
            # a failed park is undone whole: the idle session must be able to run again.)
            with contextlib.suppress(ActuatorError):
                await ctx.ladder.undo(target, None)
            ctx.record.undone(action.lease_id, up_to=ctx.record.last_actuation(action.lease_id))
        ctx.events.post(
            core.PreemptionFailed(
                now=time.time(), lease_id=action.lease_id, level=action.level, reason=str(exc)
            )
        )
        lease = ctx.scheduler.lease_of(action.lease_id)
        if lease is not None and lease.state == LeaseState.RUNNING:
            ctx.record.running(action.lease_id, reason=lease.reason)
            ctx.timeline.resumed(action.lease_id, time.time())
        conn = self._conn(action.session_id)
        if conn is not None and action.level != PreemptionLevel.EVICT:
            ctx.outbox.put(
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
        ctx = self.ctx
        lease = ctx.scheduler.lease_of(resume.lease_id)
        lost = format_size(lease.memory_bytes) if lease else "its parked memory"
        reason = (
            f"restore failed ({exc}): the {lost} of GPU memory this notebook held is lost; "
            "restart the kernel"
        )
        ctx.record.note("restore failed", resume.lease_id, {"pid": target.pid, "error": str(exc)})
        ctx.record.undone(resume.lease_id)
        conn = self._conn(resume.session_id)
        if conn is not None:
            ctx.outbox.put(conn, Revoked(lease_id=resume.lease_id, reason=reason))
        if lease is not None:
            ctx.events.post(
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
        ctx = self.ctx
        try:
            await ctx.ladder.undo(target, level, lease_ended=lease_ended)
        except ActuatorError as exc:
            log.error("could not undo level %s for %s: %s", level, target.lease_id, exc)
            if resume is not None and resume.restores_park:
                self._restore_failed(target, resume, exc)
                return
            ctx.notes[target.lease_id] = f"resume failed: {exc}"
            if pid_alive(target.pid):
                return  # it may still be locked: the journal keeps it for the next start
        # Undone, or its process is gone: either way nothing is left for recovery.
        ctx.record.undone(target.lease_id, up_to=up_to)
        if resume is not None:
            ctx.notes.pop(target.lease_id, None)
            conn = self._conn(resume.session_id)
            if conn is not None:
                ctx.outbox.put(conn, Resume(lease_id=resume.lease_id, paused_s=resume.paused_s))
