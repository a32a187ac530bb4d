"""What the scheduler core looks up on every event, kept up to date as leases move.

Placement asks the same questions for every event: how much memory a slot holds, which
leases run there and whether a newcomer may share it with them (their priority bands,
SM shares, exclusive wishes), how many leases a user holds, which leases a process
runs, which waiters wait for an eviction.  Answered by scanning every lease, an event
cost grew with the host's load.  :class:`LeaseIndex` keeps those answers as aggregates,
changed at the one place a lease's state, slot or identity changes (:meth:`~LeaseIndex.move`,
:meth:`~LeaseIndex.add`, :meth:`~LeaseIndex.drop`, :meth:`~LeaseIndex.reidentify`), so
an event costs about the same with one lease and with a thousand.

:func:`rebuilt` recomputes the same index from the leases alone, and
:meth:`LeaseIndex.mismatch` names the first difference between the two: the property
tests compare them after every event.

It must not decide anything (placement and preemption stay in the core); like the core
it does no I/O and reads no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

from gpushare_ext.lease_state import LeaseState, check_move
from gpushare_ext.protocol import SliceWish
from gpushare_ext.units import priority_band

if TYPE_CHECKING:
    from gpushare_ext.broker.core import Identity, Lease

HOLDING = (LeaseState.RUNNING, LeaseState.PAUSED)  # states whose memory stays on the slot
WAITING = (LeaseState.QUEUED, LeaseState.PAUSED, LeaseState.EVICTED)
# The core's tolerance for SM shares adding up to one, as an exact number: the sum of
# shares is kept exactly, so it does not drift as leases come and go.
SPATIAL_LIMIT = Fraction(1.0 + 1e-9)


def exact_share(share: float) -> Fraction:
    """An SM share as an exact fraction (a share the core never accepted counts as 0)."""
    return Fraction(share) if math.isfinite(share) else Fraction(0)


@dataclass(kw_only=True)
class SlotLoad:
    """What one slot holds, as placement and the queue notices read it."""

    held: int = 0  # memory of its running and paused leases
    holders: dict[str, Lease] = field(default_factory=dict)  # its running and paused leases
    holder_bands: dict[int, tuple[int, int]] = field(default_factory=dict)  # band: (count, memory)
    running: dict[str, Lease] = field(default_factory=dict)
    running_ids: list[str] = field(default_factory=list)  # sorted, as queue notices list them
    exclusive: int = 0  # running leases that asked for a GPU of their own
    whole: int = 0  # running leases with a whole SM share: nothing shares spatially beside them
    shares: Fraction = Fraction(0)  # the running leases' SM shares below one, summed
    bands: dict[int, int] = field(default_factory=dict)  # running leases per priority band
    base_priorities: dict[int, int] = field(default_factory=dict)  # running leases per base
    tops: dict[int, int] = field(default_factory=dict)  # per whole running priority
    granted: dict[int, dict[str, float]] = field(default_factory=dict)  # uid: {id: granted at}
    version: int = 0  # changes whenever the running leases do

    def lower_band_memory(self, band: int) -> int:
        """Memory held here by leases of a band below ``band``."""
        return sum(memory for b, (_, memory) in self.holder_bands.items() if b < band)

    def summary(self) -> tuple:
        """The aggregates as plain values, for comparing two loads."""
        return (
            self.held,
            sorted(self.holders),
            sorted(self.holder_bands.items()),
            sorted(self.running),
            self.running_ids,
            self.exclusive,
            self.whole,
            self.shares,
            sorted(self.bands.items()),
            sorted(self.base_priorities.items()),
            sorted(self.tops.items()),
            sorted((uid, sorted(grants.items())) for uid, grants in self.granted.items()),
        )


@dataclass(kw_only=True, slots=True)  # not frozen: made twice per event, kept unchanged
class _Entry:
    """What one lease added to the index, so that taking it out removes exactly that."""

    state: LeaseState
    slot: str | None
    memory: int
    band: int
    base_priority: int
    top: int  # the running priority, whole
    granted_at: float | None
    share: Fraction | None  # None: a whole share
    exclusive: bool
    uid: int
    pid: int


class LeaseIndex:
    """Per slot, per user and per process views of the active leases."""

    def __init__(self, slot_keys: Iterable[str]) -> None:
        self.slots: dict[str, SlotLoad] = {key: SlotLoad() for key in slot_keys}
        self.waiters: dict[str, Lease] = {}  # queued, paused and evicted leases
        self.by_uid: dict[int, dict[str, Lease]] = {}
        self.by_pid: dict[int, dict[str, Lease]] = {}
        self.making_room: dict[str, Lease] = {}  # waiters whose victims are being evicted
        self._entries: dict[str, _Entry] = {}

    # ---- changes

    def add(self, lease: Lease) -> None:
        """A lease enters the system, in the state and on the slot it has."""
        running = lease.state == LeaseState.RUNNING
        whole = not lease.sm_share < 1.0
        entry = _Entry(
            state=lease.state,
            slot=lease.slot,
            memory=lease.memory_bytes,
            band=priority_band(lease.running_priority()),
            base_priority=lease.base_priority,
            top=int(lease.running_priority()),
            granted_at=lease.granted_at,
            share=None if whole else exact_share(lease.sm_share),
            exclusive=lease.slice == SliceWish.EXCLUSIVE,
            uid=lease.identity.uid,
            pid=lease.identity.pid,
        )
        self._entries[lease.lease_id] = entry
        self.by_uid.setdefault(entry.uid, {})[lease.lease_id] = lease
        self.by_pid.setdefault(entry.pid, {})[lease.lease_id] = lease
        if entry.state in WAITING:
            self.waiters[lease.lease_id] = lease
        if entry.slot is None or entry.state not in HOLDING:
            return
        load = self.slots[entry.slot]
        load.held += entry.memory
        load.holders[lease.lease_id] = lease
        count, memory = load.holder_bands.get(entry.band, (0, 0))
        load.holder_bands[entry.band] = (count + 1, memory + entry.memory)
        if not running:
            return
        load.version += 1
        load.running[lease.lease_id] = lease
        bisect.insort(load.running_ids, lease.lease_id)
        load.exclusive += entry.exclusive
        if entry.share is None:
            load.whole += 1
        else:
            load.shares += entry.share
        _count(load.bands, entry.band, 1)
        _count(load.base_priorities, entry.base_priority, 1)
        _count(load.tops, entry.top, 1)
        if entry.granted_at is not None:
            load.granted.setdefault(entry.uid, {})[lease.lease_id] = entry.granted_at

    def drop(self, lease: Lease) -> None:
        """A lease leaves the system (or is about to be added again, changed)."""
        entry = self._entries.pop(lease.lease_id)
        _discard(self.by_uid, entry.uid, lease.lease_id)
        _discard(self.by_pid, entry.pid, lease.lease_id)
        self.waiters.pop(lease.lease_id, None)
        self.making_room.pop(lease.lease_id, None)
        if entry.slot is None or entry.state not in HOLDING:
            return
        load = self.slots[entry.slot]
        load.held -= entry.memory
        del load.holders[lease.lease_id]
        count, memory = load.holder_bands.pop(entry.band)
        if count > 1:
            load.holder_bands[entry.band] = (count - 1, memory - entry.memory)
        if entry.state != LeaseState.RUNNING:
            return
        load.version += 1
        del load.running[lease.lease_id]
        del load.running_ids[bisect.bisect_left(load.running_ids, lease.lease_id)]
        load.exclusive -= entry.exclusive
        if entry.share is None:
            load.whole -= 1
        else:
            load.shares -= entry.share
        _count(load.bands, entry.band, -1)
        _count(load.base_priorities, entry.base_priority, -1)
        _count(load.tops, entry.top, -1)
        if entry.granted_at is not None:
            grants = load.granted[entry.uid]
            del grants[lease.lease_id]
            if not grants:
                del load.granted[entry.uid]

    def move(self, lease: Lease, state: LeaseState, slot: str | None = None) -> None:
        """Put ``lease`` in ``state`` (and on ``slot`` when one is given); a move the
        state table does not allow raises IllegalMove and changes nothing."""
        check_move(lease.lease_id, lease.state, state)
        making_room = lease.lease_id in self.making_room
        self.drop(lease)
        lease.state = state
        if slot is not None:
            lease.slot = slot
        self.add(lease)
        if making_room:
            self.making_room[lease.lease_id] = lease

    def reidentify(self, lease: Lease, identity: Identity) -> None:
        """The lease now belongs to another session of (checked by the core) its process."""
        making_room = lease.lease_id in self.making_room
        self.drop(lease)
        lease.identity = identity
        self.add(lease)
        if making_room:
            self.making_room[lease.lease_id] = lease

    def await_evictions(self, lease: Lease, victims: frozenset[str]) -> None:
        lease.awaiting_memory_from = victims
        if victims:
            self.making_room[lease.lease_id] = lease
        else:
            self.making_room.pop(lease.lease_id, None)

    def victim_done(self, victim_id: str, *, give_up: bool = False) -> None:
        """``victim_id`` was evicted or ended (or, ``give_up``, cannot be evicted): the
        waiters making room with it stop waiting for it (for any victim, ``give_up``)."""
        for waiter in list(self.making_room.values()):
            if victim_id in waiter.awaiting_memory_from:
                rest = frozenset() if give_up else waiter.awaiting_memory_from - {victim_id}
                self.await_evictions(waiter, rest)

    # ---- the check

    def mismatch(self, leases: Iterable[Lease]) -> str:
        """The first difference from an index rebuilt from ``leases``; "" if none."""
        fresh = rebuilt(self.slots, leases)
        for key, load in self.slots.items():
            if load.summary() != fresh.slots[key].summary():
                return f"slot {key}: kept {load.summary()}, recomputed {fresh.slots[key].summary()}"
        views = ("waiters", "by_uid", "by_pid", "making_room")
        for name in views:
            kept, recomputed = _ids(getattr(self, name)), _ids(getattr(fresh, name))
            if kept != recomputed:
                return f"{name}: kept {kept}, recomputed {recomputed}"
        return ""


def rebuilt(slot_keys: Iterable[str], leases: Iterable[Lease]) -> LeaseIndex:
    """The index of ``leases`` computed from scratch."""
    index = LeaseIndex(slot_keys)
    for lease in leases:
        index.add(lease)
        if lease.awaiting_memory_from:
            index.making_room[lease.lease_id] = lease
    return index


def _count(counts: dict[int, int], key: int, change: int) -> None:
    """Add ``change`` to a count, keeping no zero counts (so that max() of the keys and
    comparisons with a recomputed index mean what they say)."""
    count = counts.get(key, 0) + change
    if count:
        counts[key] = count
    else:
        del counts[key]


def _discard(groups: dict[int, dict[str, Lease]], key: int, lease_id: str) -> None:
    group = groups[key]
    del group[lease_id]
    if not group:
        del groups[key]


def _ids(view: dict) -> object:
    if all(isinstance(value, dict) for value in view.values()):
        return sorted((key, sorted(value)) for key, value in view.items())
    return sorted(view)
