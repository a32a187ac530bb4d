"""An admin's chaos mode wired to the broker's state: one runner per process, started here.

:func:`start_chaos` builds a :class:`~gpushare_ext.broker.hands.chaos_runner.ChaosRunner` for
the chosen process from a :class:`~gpushare_ext.broker.edges.context.BrokerContext`: how it
finds the process's lease (as the scheduler has it), how its locks and evictions are
journaled before they are applied, and the core told that the process's long kernels
must be ready to stop while it runs (``ChaosChanged``, on the context's event queue).

It must not decide when or how long to pause (:mod:`~gpushare_ext.broker.hands.chaos` does),
nor apply a pause itself (the runner does, through the ladder).
"""

from __future__ import annotations

import time

from gpushare_ext.broker.edges.context import BrokerContext
from gpushare_ext.broker.hands.chaos import ChaosSpec
from gpushare_ext.broker.hands.chaos_runner import (
    ChaosRunner,
    ChaosTarget,
    allowed_levels,
    running_untouched,
)
from gpushare_ext.broker.scheduler import core
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.protocol import PreemptionLevel


def start_chaos(ctx: BrokerContext, spec: ChaosSpec) -> ChaosRunner:
    """Start pausing ``spec.pid`` at random moments (an admin asked; see chaos.py)."""
    runner = ChaosRunner(
        spec,
        ladder=ctx.ladder,
        find=lambda pid: chaos_target(ctx, pid),
        journal_applied=lambda found, level: _journal_applied(ctx, found, level),
        journal_undone=ctx.record.step_undone,
    )
    ctx.chaos[spec.pid] = runner
    # While it runs, the process's long kernels must be ready to stop.
    ctx.events.post(core.ChaosChanged(now=time.time(), pid=spec.pid, on=True))

    async def run() -> None:
        try:
            await runner.run()
        finally:
            if ctx.chaos.get(spec.pid) is runner:
                del ctx.chaos[spec.pid]
            if spec.pid not in ctx.chaos:  # stopped, and no newer chaos for it
                ctx.events.post(core.ChaosChanged(now=time.time(), pid=spec.pid, on=False))

    ctx.tasks.spawn(run())
    return runner


def chaos_target(ctx: BrokerContext, pid: int) -> ChaosTarget | None:
    """The lease the process ``pid`` holds (the first, by id), as chaos sees it."""
    leases = sorted(
        (
            lease
            for lease in ctx.scheduler.active_leases()
            if lease.identity.pid == pid
            and lease.slot is not None
            and lease.state in (LeaseState.RUNNING, LeaseState.PAUSED, LeaseState.EVICTED)
        ),
        key=lambda lease: lease.lease_id,
    )
    if not leases:
        return None
    lease = leases[0]
    target = ctx.target(lease.lease_id, pid, lease.slot)
    return ChaosTarget(
        lease_id=lease.lease_id,
        running_untouched=running_untouched(lease.state, lease.pending_level, lease.applied_level),
        target=target,
        allowed=allowed_levels(
            target, lockable=lease.capabilities.lockable, simulated=ctx.simulated_control
        ),
    )


def _journal_applied(ctx: BrokerContext, found: ChaosTarget, level: PreemptionLevel) -> int | None:
    """A chaos lock or eviction is journaled before it is applied (crash recovery
    undoes it); a gate or a yield needs nothing: a session whose broker is gone
    opens its control block itself."""
    if level < PreemptionLevel.LOCK:
        return None
    block = found.target.control_block
    return ctx.record.step_applied(
        found.lease_id,
        found.target.pid,
        found.target.device_index,
        int(level),
        str(block.path) if block is not None else "",
    )
