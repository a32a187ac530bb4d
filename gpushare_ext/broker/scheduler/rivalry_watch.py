"""Telling sessions when they gain or lose their last rival, after each event.

What it is for: :class:`RivalryWatch` feeds :class:`~gpushare_ext.broker.scheduler.rivals.Rivals`
what an event changed -- the sessions it or its actions name (their leases on a GPU,
and the top priority of their requests still queued), and, when a session may now ask
for another band, every session with a lease on a GPU in a band below -- and turns its
answer into :class:`RivalryChanged` actions.  A session without a rival runs its long
kernels as they are.  A request enters or leaves the queue only by an event or an
action that names its session, so those are the only sessions whose queued requests
are read.

What it must not do: walk the waiting line (only the leases of the sessions named), or
change any lease; it only reads them.
"""

from __future__ import annotations

from gpushare_ext.broker.scheduler.actions import Action, NotifyQueued, RivalryChanged
from gpushare_ext.broker.scheduler.events import ChaosChanged, Event
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.rivals import PlacedLease, Rivals
from gpushare_ext.broker.scheduler.scheduler_records import ACTIVE_STATES, Slot, names_of
from gpushare_ext.protocol import LeaseState
from gpushare_ext.units import priority_band


class RivalryWatch:
    """Which sessions' rivalry an event may have changed, and what they are told."""

    def __init__(self, book: LeaseBook, slots: dict[str, Slot]) -> None:
        self._book = book
        self._slots = slots
        self.rivals = Rivals()
        self._below: int | None = None  # this event's band change (Rivals' answer)
        # Sessions with a lease on a GPU, by the lowest band among those leases.
        self._placed_band: dict[str, int] = {}
        # Per slot key: the slot and what sessions' reachable GPUs may call it.
        self._names: dict[str, tuple[Slot, frozenset[str]]] = {}

    def note_band_change(self, below: int | None) -> None:
        """What :class:`Rivals` answered to a session opened, closed or asking: sessions
        placed in a band below ``below`` may have changed too (several answers in one
        event: the highest counts)."""
        if below is not None and (self._below is None or below > self._below):
            self._below = below

    def changes(self, event: Event, actions: list[Action]) -> list[Action]:
        """Tell the sessions whose rivalry changed (:mod:`~gpushare_ext.broker.scheduler.rivals`).

        Only sessions that may have changed are looked at: those the event or an action
        names, and, when a session may now ask for another band, every session with a
        lease on a GPU in a band below the one that changed (the waiters are never looked
        at)."""
        touched = {a.session_id for a in actions if type(a) is not NotifyQueued}
        named = getattr(event, "session_id", None)
        if type(event) is ChaosChanged:
            named = self._book.session_of_pid.get(event.pid)
        if named is not None:
            touched.add(named)
        if not touched and self._below is None:
            return []  # most ticks: nobody named, no band changed
        placed: dict[str, list[PlacedLease]] = {}
        for session_id in touched:  # their requests may have entered or left the queue
            queued_top, placed[session_id] = self._leases_of(session_id)
            self.note_band_change(self.rivals.waiting(session_id, queued_top))
        below, self._below = self._below, None
        if below is not None:
            for session_id, band in list(self._placed_band.items()):
                if band < below and session_id not in placed:
                    placed[session_id] = self._leases_of(session_id)[1]
        if not placed:
            return []
        return [
            RivalryChanged(session_id=session_id, unrivalled=unrivalled)
            for session_id, unrivalled in self.rivals.changes(
                placed if len(placed) == 1 else dict(sorted(placed.items()))
            )
        ]

    def _leases_of(self, session_id: str) -> tuple[int | None, list[PlacedLease]]:
        """A session's highest base priority among its requests still queued (None: none),
        and its leases on a GPU as the rivals see them (its band kept up to date).  One
        pass: this runs for every session an event names."""
        record = self._book.sessions.get(session_id)
        queued_top: int | None = None
        on_gpu: list[PlacedLease] = []
        lowest: int | None = None
        leases, slots = self._book.leases, self._slots
        for lease_id in () if record is None else record.leases:
            lease = leases.get(lease_id)
            if lease is None:
                continue
            state, priority = lease.state, lease.base_priority
            if state == LeaseState.QUEUED and (queued_top is None or priority > queued_top):
                queued_top = priority
            slot = slots.get(lease.slot) if lease.slot is not None else None
            if slot is not None and state in ACTIVE_STATES:
                on_gpu.append(PlacedLease(lease_id, session_id, priority, self._names_of(slot)))
                band = priority_band(priority)
                if lowest is None or band < lowest:
                    lowest = band
        if lowest is not None:
            self._placed_band[session_id] = lowest
        else:
            self._placed_band.pop(session_id, None)
        return queued_top, on_gpu

    def _names_of(self, slot: Slot) -> frozenset[str]:
        """:func:`names_of` ``slot``, kept while the slot is the same object."""
        kept = self._names.get(slot.key)
        if kept is None or kept[0] is not slot:
            kept = self._names[slot.key] = (slot, names_of(slot))
        return kept[1]
