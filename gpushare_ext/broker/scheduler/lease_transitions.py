"""The one way a lease of the scheduler core changes state: its main state and its stop.

What it is for: :func:`transition` is where the core changes a lease's main state (and
slot), its preemption sub-state (the level asked of the actuators and the level they
confirmed, held by the watchdog, detached, a park's restore asked), when its state
started and why.  It checks the move against the tables of
:mod:`~gpushare_ext.lease_state` (:func:`~gpushare_ext.lease_state.check_move` for the
main state, :func:`~gpushare_ext.lease_state.check_stop` for the stop) before anything
changes, so a refused move leaves the lease and the lease index as they were.

What it must not do: decide which move to make (the core's parts do), read a clock or
do I/O, or import the parts of the core that call it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpushare_ext.lease_state import NO_STOP, LeaseState, StopState, check_move, check_stop

if TYPE_CHECKING:
    from gpushare_ext.broker.scheduler.lease_index import LeaseIndex
    from gpushare_ext.broker.scheduler.scheduler_records import Lease


def transition(
    lease: Lease,
    now: float,
    *,
    state: LeaseState | None = None,
    slot: str | None = None,
    stop: StopState | None = None,
    reason: str | None = None,
    index: LeaseIndex | None = None,
) -> None:
    """Move ``lease`` to ``state`` (and, with a state, onto ``slot``), its stop to ``stop``,
    and say ``reason``; what is None stays as it is.  ``index`` takes the lease out and puts it back around
    a change of state or slot (None: the lease is not, or no longer, in an index).

    ``state_since`` becomes ``now`` on every move of the main state but the one that
    completes an eviction (paused -> evicted: it has been stopped since its pause), and
    when a park's restore is asked (it waits from then on).  An illegal move raises
    :class:`~gpushare_ext.lease_state.IllegalMove` or
    :class:`~gpushare_ext.lease_state.IllegalStop` and changes nothing."""
    before = lease.state
    after = before if state is None else check_move(lease.lease_id, before, state)
    # The stop is read and checked only when it changes: most moves leave it alone.
    current = lease.stop
    if stop is None:
        if state is not None and current is not NO_STOP:
            # The stop it keeps must still fit the state it moves to (no running lease
            # with a level asked of the actuators).
            check_stop(lease.lease_id, after, current, current)
    elif stop is current:
        stop = None  # the same stop: nothing to check or change
    else:
        check_stop(lease.lease_id, after, current, stop)
    if state is None:
        if stop is not None and stop.asks_restore_of(current):
            lease.state_since = now  # a park waits for its memory from the ask on
    else:
        # The index takes the lease out as it was and puts it back as it is now.
        making_room = index.take_out(lease) if index is not None else False
        lease.state = after
        if slot is not None:
            lease.slot = slot
        if index is not None:
            index.put_back(lease, making_room)
        if (before, after) != (LeaseState.PAUSED, LeaseState.EVICTED):
            lease.state_since = now
    if stop is not None:
        lease.stop = stop
    if reason is not None:
        lease.reason = reason
