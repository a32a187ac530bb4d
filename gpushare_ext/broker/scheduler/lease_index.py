"""What the scheduler core looks up on every event, kept up to date as leases move.

Placement asks the same questions for every event: how much memory a slot holds, which
leases run there and whether a newcomer may share it with them (their priority bands,
SM shares, exclusive wishes), how many leases a user holds, which leases a process
runs, which waiters wait for an eviction.  Answered by scanning every lease, an event
cost grew with the host's load.  :class:`LeaseIndex` keeps those answers as aggregates,
changed wherever a lease's state, slot or identity changes (:meth:`~LeaseIndex.take_out` and :meth:`~LeaseIndex.put_back`,
:meth:`~LeaseIndex.add`, :meth:`~LeaseIndex.drop`, :meth:`~LeaseIndex.reidentify`), so
an event costs about the same with one lease and with a thousand.

:func:`rebuilt` recomputes the same index from the leases alone, and
:meth:`LeaseIndex.mismatch` names the first difference between the two: the property
tests compare them after every event.

:class:`WaitingLine` keeps the waiters in the order the core serves them, so that an
event looks at the few waiters it may concern instead of sorting them all (see its
docstring for how the order stays right while effective priorities grow with time).

It must not decide anything (placement and preemption stay in the core); like the core
it does no I/O and reads no clock.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import pairwise
from typing import TYPE_CHECKING

from gpushare_ext.broker.settings.policy import effective_priority
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.protocol import SliceWish
from gpushare_ext.units import priority_band

if TYPE_CHECKING:
    from gpushare_ext.broker.scheduler.scheduler_records import Identity, Lease

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
    users: dict[tuple[int, str], int] = field(default_factory=dict)  # running, per (uid, user)
    users_version: int = 0  # changes whenever a user comes to run here or no longer does
    granted: dict[int, dict[str, float]] = field(default_factory=dict)  # uid: {id: granted at}
    latest_grant: dict[int, float] = field(default_factory=dict)  # uid: its latest granted at
    version: int = 0  # changes whenever the running leases do
    holders_version: int = 0  # changes whenever the running or paused leases do

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
            sorted(self.users.items()),
            sorted((uid, sorted(grants.items())) for uid, grants in self.granted.items()),
            sorted(self.latest_grant.items()),
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
    user: str
    pid: int


class LeaseIndex:
    """Per slot, per user and per process views of the active leases."""

    def __init__(self, slot_keys: Iterable[str]) -> None:
        self.slots: dict[str, SlotLoad] = {key: SlotLoad() for key in slot_keys}
        self.waiters: dict[str, Lease] = {}  # queued, paused and evicted leases
        self.by_uid: dict[int, dict[str, Lease]] = {}
        self.by_pid: dict[int, dict[str, Lease]] = {}
        self.making_room: dict[str, Lease] = {}  # waiters whose victims are being evicted
        # Leases added, dropped or given victims to wait for since the core last asked
        # (take_changed): the waiting line is brought up to date with these alone.
        self.changed: dict[str, Lease] = {}
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
            user=lease.identity.user,
            pid=lease.identity.pid,
        )
        self._entries[lease.lease_id] = entry
        self.changed[lease.lease_id] = lease
        self.by_uid.setdefault(entry.uid, {})[lease.lease_id] = lease
        self.by_pid.setdefault(entry.pid, {})[lease.lease_id] = lease
        if entry.state in WAITING:
            self.waiters[lease.lease_id] = lease
        if entry.slot is None or entry.state not in HOLDING:
            return
        load = self.slots[entry.slot]
        load.held += entry.memory
        load.holders[lease.lease_id] = lease
        load.holders_version += 1
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
        user = (entry.uid, entry.user)
        if user not in load.users:
            load.users_version += 1
        _count(load.users, user, 1)
        if entry.granted_at is not None:
            load.granted.setdefault(entry.uid, {})[lease.lease_id] = entry.granted_at
            latest = load.latest_grant.get(entry.uid)
            if latest is None or entry.granted_at > latest:
                load.latest_grant[entry.uid] = entry.granted_at

    def drop(self, lease: Lease) -> None:
        """A lease leaves the system (or is about to be added again, changed)."""
        entry = self._entries.pop(lease.lease_id)
        self.changed[lease.lease_id] = lease
        _discard(self.by_uid, entry.uid, lease.lease_id)
        _discard(self.by_pid, entry.pid, lease.lease_id)
        self.waiters.pop(lease.lease_id, None)
        self.making_room.pop(lease.lease_id, None)
        if entry.slot is None or entry.state not in HOLDING:
            return
        load = self.slots[entry.slot]
        load.held -= entry.memory
        del load.holders[lease.lease_id]
        load.holders_version += 1
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
        user = (entry.uid, entry.user)
        _count(load.users, user, -1)
        if user not in load.users:
            load.users_version += 1
        if entry.granted_at is not None:
            grants = load.granted[entry.uid]
            del grants[lease.lease_id]
            if not grants:
                del load.granted[entry.uid]
                del load.latest_grant[entry.uid]
            elif entry.granted_at == load.latest_grant[entry.uid]:
                load.latest_grant[entry.uid] = max(grants.values())

    # Around a change of a lease's state or slot (made by
    # lease_transitions.transition, checked before): the lease is taken out, and put
    # back as it is then.  Two calls, not a context manager: this runs on most events.

    def take_out(self, lease: Lease) -> bool:
        """Take ``lease`` out before its state or slot changes; whether it was making room."""
        making_room = lease.lease_id in self.making_room
        self.drop(lease)
        return making_room

    def put_back(self, lease: Lease, making_room: bool) -> None:
        """Put ``lease`` back as it is now (after :meth:`take_out`)."""
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
        self.changed[lease.lease_id] = lease
        if victims:
            self.making_room[lease.lease_id] = lease
        else:
            self.making_room.pop(lease.lease_id, None)
            lease.freeing_bytes = 0  # what it waited to be freed has left, or never will

    def victim_done(self, victim_id: str, *, give_up: bool = False) -> None:
        """``victim_id`` was evicted or ended (or, ``give_up``, cannot be evicted): the
        waiters making room with it stop waiting for it (for any victim, ``give_up``)."""
        for waiter in list(self.making_room.values()):
            if victim_id in waiter.awaiting_memory_from:
                rest = frozenset() if give_up else waiter.awaiting_memory_from - {victim_id}
                self.await_evictions(waiter, rest)

    def take_changed(self) -> list[Lease]:
        """The leases changed since the last call (see ``changed``), in the order changed."""
        changed = list(self.changed.values())
        self.changed.clear()
        return changed

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

    def touch(self, lease: Lease) -> None:
        """The core changed what the waiting line reads of ``lease`` without moving it (a
        detached lease reclaimed, a parked session asking for its memory)."""
        self.changed[lease.lease_id] = lease


def rebuilt(slot_keys: Iterable[str], leases: Iterable[Lease]) -> LeaseIndex:
    """The index of ``leases`` computed from scratch."""
    index = LeaseIndex(slot_keys)
    for lease in leases:
        index.add(lease)
        if lease.awaiting_memory_from:
            index.making_room[lease.lease_id] = lease
    return index


def _count(counts: dict, key: Hashable, change: int) -> None:
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


# ------------------------------------------------------------------ the waiting line

TOP_PRIORITY = 299.0  # effective priorities stop growing here
# How far apart (in priority points) two effective priorities must be for their order to
# hold without computing them again: far above their rounding (about 1e-13 points), far
# below any difference a policy makes.
NEAR = 1e-9
TICKET_GAP = 1 << 20  # between neighbours' tickets when the line is numbered afresh
OTHERS = "others"  # the group of every waiter that is not a plain queued request


@dataclass(frozen=True, slots=True)
class Trajectory:
    """How a waiter's effective priority grows while it waits: ``start`` points at time
    ``since``, ``rate`` points a minute after that, never above 299; ``arrival`` breaks
    ties (the earlier goes first)."""

    start: float  # base priority plus the aging kept from earlier waits
    since: float
    rate: float
    arrival: int

    def key_at(self, now: float) -> tuple[float, int]:
        """Its place in the line at ``now``: the core's queue key, computed the same way."""
        earned = effective_priority(0, now - self.since, self.rate)
        return (-min(TOP_PRIORITY, self.start + earned), self.arrival)

    def uncapped_at(self, now: float) -> float:
        return self.start + self.rate * (now - self.since) / 60.0

    def tops_out_at(self) -> float:
        """When it reaches the top priority (never without aging)."""
        if self.rate <= 0:
            return math.inf
        return self.since + (TOP_PRIORITY - self.start) * 60.0 / self.rate


def ahead_until(first: Trajectory, second: Trajectory, now: float) -> float:
    """Until when ``first``, ahead of ``second`` at ``now``, surely stays ahead:
    ``math.inf`` for ever, ``now`` when only computing both again can tell.

    A computed effective priority never decreases as time passes (every step of its sum
    rounds monotonically), so a waiter stays ahead of one whose priority no longer grows.
    Otherwise the second catches up only by growing faster (it overtakes where the two
    lines cross) or by reaching the top with an earlier arrival; both times are taken a
    little early, by the time the priorities need to come within ``NEAR`` of each other.
    """
    if (first.start, first.since, first.rate) == (second.start, second.since, second.rate):
        return math.inf  # the same sums: arrival decides, for ever
    if first.rate < 0 or second.rate < 0:
        return now  # a policy built in code may age backwards: no promise
    behind = second.uncapped_at(now)
    if second.rate == 0 or behind >= TOP_PRIORITY:
        return math.inf
    ahead = min(TOP_PRIORITY, first.uncapped_at(now))
    if ahead - behind <= NEAR:
        return now
    until = math.inf
    if second.arrival < first.arrival:  # at the top, the earlier arrival goes first
        until = second.tops_out_at() - NEAR * 60.0 / second.rate
    if second.rate > first.rate and ahead < TOP_PRIORITY:
        faster = second.rate - first.rate
        until = min(until, now + (ahead - behind - NEAR) * 60.0 / faster)
    return until


@dataclass(kw_only=True, slots=True)
class Place:
    """A waiter's place in the line."""

    lease: Lease
    group: Hashable  # a plain queued request's wanted slots; OTHERS for any other waiter
    counted: bool  # a queued request (a gang by its rank 0): the places behind count it
    trajectory: Trajectory
    ticket: int = 0  # given by the line: tickets increase along it


class WaitingLine:
    """The waiters (queued, paused, evicted) in the order the core serves them, kept
    from one event to the next.

    Sorting every waiter on every event cost more than a millisecond with a thousand of
    them.  The line keeps them sorted instead.  Each holds a *ticket*, increasing along
    the line, so that its groups (the plain queued requests by the slots they want, the
    other waiters, and the queued requests whose places are told) are lists of tickets
    that bisect without computing a priority.

    Effective priorities grow while leases wait, at rates that may differ, so time alone
    could change the order.  For each pair of neighbours the line works out until when
    the first surely stays ahead (:func:`ahead_until`) and keeps the earliest such time;
    pairs too close to tell are compared again at every event.  When that time has come,
    or a close pair has swapped, :meth:`in_order_at` says so and the core sorts the line
    afresh (:meth:`rebuild`).

    A queued request that joins or leaves the line moves the places of those behind it
    by one: ``moves`` keeps each such ``(ticket, +1 or -1)``, and a queued request behind
    those tickets stands that many places further back than it was last told.
    ``first_change`` is the index into ``counted`` from which places may have changed
    otherwise (the line was sorted afresh).  The core forgets both once it has told
    everyone (:meth:`told`).  The core says who waits and in which group
    (:meth:`update`); the line only keeps order.
    """

    def __init__(self) -> None:
        self.places: dict[str, Place] = {}
        self.tickets: list[int] = []  # every waiter's, in order
        self.counted: list[int] = []  # the queued requests', in order
        self.groups: dict[Hashable, list[int]] = {}
        self.first_change = 0
        self.moves: list[tuple[int, int]] = []  # (ticket, +1/-1), in the order they came
        self.ordered_until = math.inf
        self._at: dict[int, Place] = {}
        self._close: list[tuple[Place, Place]] = []  # neighbours compared at every event

    def at(self, ticket: int) -> Place:
        return self._at[ticket]

    def counted_before(self, ticket: float) -> int:
        """How many queued requests stand ahead of ``ticket``."""
        return bisect.bisect_left(self.counted, ticket)

    def in_order_at(self, now: float) -> bool:
        """Whether the line is still sorted at ``now`` (if not, :meth:`rebuild` it)."""
        if now >= self.ordered_until:
            return False
        close = []
        for first, second in self._close:
            places = self.places
            if places.get(first.lease.lease_id) is not first:
                continue  # it left the line (or came back elsewhere)
            if places.get(second.lease.lease_id) is not second:
                continue
            if first.trajectory.key_at(now) > second.trajectory.key_at(now):
                return False
            close.append((first, second))
        self._close = close
        return True

    def rebuild(self, places: list[Place], now: float) -> None:
        """The line of ``places``, sorted at ``now``; every place counts as changed."""
        places.sort(key=lambda place: place.trajectory.key_at(now))
        self.places = {place.lease.lease_id: place for place in places}
        self._number(places)
        self.first_change = 0
        self.moves = []
        self.ordered_until = math.inf
        self._close = []
        for first, second in pairwise(places):
            self._watch(first, second, now)

    def update(self, lease_id: str, wanted: Place | None, now: float) -> None:
        """Bring one waiter's place up to date: ``wanted`` says where it belongs (None: it
        waits no more).  The line must be in order at ``now``."""
        place = self.places.get(lease_id)
        if place is not None and (wanted is None or place.trajectory != wanted.trajectory):
            self.remove(lease_id, now)
            place = None
        if wanted is None:
            return
        if place is None:
            self._insert(wanted, now)
            return
        if wanted.group != place.group:
            _untake(self.groups, place.group, place.ticket)
            place.group = wanted.group
            bisect.insort(self.groups.setdefault(place.group, []), place.ticket)
        if wanted.counted != place.counted:
            place.counted = wanted.counted
            index = self.counted_before(place.ticket)
            if place.counted:
                self.counted.insert(index, place.ticket)
            else:
                del self.counted[index]
            self.moves.append((place.ticket, 1 if place.counted else -1))

    def remove(self, lease_id: str, now: float) -> None:
        place = self.places.pop(lease_id)
        index = bisect.bisect_left(self.tickets, place.ticket)
        del self.tickets[index]
        del self._at[place.ticket]
        _untake(self.groups, place.group, place.ticket)
        if place.counted:
            del self.counted[self.counted_before(place.ticket)]
            self.moves.append((place.ticket, -1))
        if 0 < index < len(self.tickets):
            self._watch(self._at[self.tickets[index - 1]], self._at[self.tickets[index]], now)

    def _insert(self, place: Place, now: float) -> None:
        key = place.trajectory.key_at(now)
        tickets, at = self.tickets, self._at
        index = len(tickets)
        if tickets and at[tickets[-1]].trajectory.key_at(now) > key:  # not simply last
            index = bisect.bisect_right(tickets, key, key=lambda t: at[t].trajectory.key_at(now))
        place.ticket = self._ticket_for(index)
        tickets, at = self.tickets, self._at  # numbered afresh if there was no room
        tickets.insert(index, place.ticket)
        at[place.ticket] = place
        self.places[place.lease.lease_id] = place
        bisect.insort(self.groups.setdefault(place.group, []), place.ticket)
        if place.counted:
            self.counted.insert(self.counted_before(place.ticket), place.ticket)
            self.moves.append((place.ticket, 1))
        if index > 0:
            self._watch(at[tickets[index - 1]], place, now)
        if index + 1 < len(tickets):
            self._watch(place, at[tickets[index + 1]], now)

    def _ticket_for(self, index: int) -> int:
        """A ticket between those at ``index - 1`` and ``index``."""
        tickets = self.tickets
        if not tickets:
            return 0
        if index == 0:
            return tickets[0] - TICKET_GAP
        if index == len(tickets):
            return tickets[-1] + TICKET_GAP
        if tickets[index] - tickets[index - 1] < 2:  # no room left: number afresh
            self._number([self._at[ticket] for ticket in tickets])
            self.moves = [(_renumbered(tickets, self.tickets, t), d) for t, d in self.moves]
            tickets = self.tickets
        return (tickets[index - 1] + tickets[index]) // 2

    def told(self) -> None:
        """Every queued request was told where it stands: changes count from here."""
        self.first_change = len(self.counted)
        self.moves = []

    def _number(self, places: list[Place]) -> None:
        """Give ``places`` (in order) tickets TICKET_GAP apart and file them."""
        self.tickets = []
        self.counted = []
        self.groups = {}
        self._at = {}
        for number, place in enumerate(places):
            place.ticket = number * TICKET_GAP
            self.tickets.append(place.ticket)
            self._at[place.ticket] = place
            self.groups.setdefault(place.group, []).append(place.ticket)
            if place.counted:
                self.counted.append(place.ticket)

    def _watch(self, first: Place, second: Place, now: float) -> None:
        until = ahead_until(first.trajectory, second.trajectory, now)
        if until <= now:
            self._close.append((first, second))
        else:
            self.ordered_until = min(self.ordered_until, until)


def _renumbered(old: list[int], new: list[int], ticket: int) -> int:
    """A move's ``ticket`` after the line (``old``, in order) was numbered afresh as
    ``new``: the new ticket of the last place at or before it, so the same places stand
    behind it (one less than every new ticket if none)."""
    before = bisect.bisect_right(old, ticket) - 1
    return new[before] if before >= 0 else new[0] - 1


def _untake(groups: dict[Hashable, list[int]], group: Hashable, ticket: int) -> None:
    tickets = groups[group]
    del tickets[bisect.bisect_left(tickets, ticket)]
    if not tickets:
        del groups[group]
