"""Whether a lease fits a slot, which slot it prefers, and what stopping whom makes room.

What it is for: :class:`Placer` answers placement's questions from the lease index and
the memory seen: may a lease run on a slot now (memory, then time-slicing or spatial
sharing with what runs there), which of several slots it prefers, and, when it may not,
the plan that makes room -- running leases to pause, holders to evict, idle sessions to
park -- as rows that each name a victim, the ladder level that stops it and why
(:meth:`Placer.stopping_level_of`, through
:func:`~gpushare_ext.broker.settings.policy.ladder_level`), in the order they are carried
out: the stop is decided here, once, and carried out as it is.  A waiter comes with the
priority band the book worked out once for its turn
(:meth:`~gpushare_ext.broker.scheduler.lease_book.LeaseBook.waiting_band`), and a victim's
gang is read from the book's records: placement reasons over values and calls nothing
back in the book.

What it must not do: change any lease (carrying a plan out is
:mod:`~gpushare_ext.broker.scheduler.lease_moves`'s job), or tell anyone anything.  Asking it for
a plan may note why no idle session could be parked (:class:`IdleParking`'s refusals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from gpushare_ext.broker.scheduler.idle_parking import IdleParking
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_index import SPATIAL_LIMIT, SlotLoad, exact_share
from gpushare_ext.broker.scheduler.memory_seen import MemorySeen
from gpushare_ext.broker.scheduler.parking import IdleSession
from gpushare_ext.broker.scheduler.scheduler_records import Lease, Slot
from gpushare_ext.broker.settings.policy import (
    StopCause,
    VictimTraits,
    ladder_level,
    priority_band,
    victim_order_key,
)
from gpushare_ext.protocol import LeaseState, PreemptionLevel, SliceWish


class VictimStop(NamedTuple):
    """One victim of a room plan, with the level that stops it and why."""

    victim: Lease
    level: PreemptionLevel
    cause: StopCause  # MAKE_ROOM: paused; FREE_MEMORY: its memory must leave the GPU


@dataclass(frozen=True)
class RoomPlan:
    """What making room on a slot takes: every lease stop, in the order it is carried out
    (:func:`stop_order`); among them, the running leases in the way and the holders to
    evict (what a plan's cost counts); and idle sessions to park."""

    stops: tuple[VictimStop, ...]
    pauses: tuple[VictimStop, ...]  # the running leases in the way
    evictions: tuple[VictimStop, ...]  # the holders whose memory must leave: waited for
    parks: tuple[IdleSession, ...]


def stop_order(
    pauses: list[VictimStop], evictions: list[VictimStop], companions: list[VictimStop]
) -> tuple[VictimStop, ...]:
    """Every lease stop of a plan in the order it is carried out: the pauses (at the
    eviction's level for a victim whose memory must leave too), the running ranks of
    the victims' gangs (a gang never runs in part), then the evictions of leases not
    paused here."""
    evicted = {row.victim.lease_id: row.level for row in evictions}
    paused = [row._replace(level=evicted.get(row.victim.lease_id, row.level)) for row in pauses]
    named = {row.victim.lease_id for row in pauses}
    rest = [row for row in evictions if row.victim.lease_id not in named]
    return (*paused, *companions, *rest)


def traits(lease: Lease) -> VictimTraits:
    """What the policy reads of a lease to choose the level that stops it."""
    return VictimTraits(
        gate=lease.capabilities.gate,
        yield_flag=lease.capabilities.yield_flag,
        instrumented_only=lease.capabilities.instrumented_only,
        lockable=lease.lockable,
        evictable=lease.evictable,
    )


def plan_cost(plan: RoomPlan) -> tuple:
    """How much a plan disturbs: evictions and parks first, then their memory, then pauses."""
    return (
        len(plan.evictions) + len(plan.parks),
        sum(row.victim.memory_bytes for row in plan.evictions)
        + sum(park.held_bytes for park in plan.parks),
        len(plan.pauses),
    )


class Placer:
    """Fit, preference and room plans for a lease on a slot, in the band it waits in."""

    def __init__(
        self,
        book: LeaseBook,
        slots: dict[str, Slot],
        memory: MemorySeen,
        parking: IdleParking,
    ) -> None:
        self._book = book
        self._slots = slots
        self._memory = memory
        self._parking = parking

    def _gang_of(self, victim: Lease) -> list[Lease]:
        """``victim`` and, for a rank, every other active rank of its gang: what stopping
        it stops (read from the book's gangs, not asked of it)."""
        if victim.gang is None:
            return [victim]
        leases = self._book.leases
        return [leases[m] for m in self._book.gangs.get(victim.gang, ()) if m in leases]

    def stopping_level_of(self, victim: Lease) -> PreemptionLevel | None:
        """The ladder level that stops ``victim`` (for a rank: that stops every running
        rank of its gang, the highest any needs); None if one of them cannot be stopped."""
        stopping = [
            traits(mate)
            for mate in self._gang_of(victim)
            if mate is victim or mate.state == LeaseState.RUNNING
        ]
        return ladder_level(StopCause.MAKE_ROOM, stopping)

    def compute_compatible(self, lease: Lease, running: list[Lease], band: int) -> bool:
        """Whether ``lease``, waiting in ``band``, may run beside ``running`` (time-slicing
        or spatial sharing)."""
        if not running:
            return True
        if lease.slice == SliceWish.EXCLUSIVE or any(
            r.slice == SliceWish.EXCLUSIVE for r in running
        ):
            return False
        spatial = lease.sm_share < 1.0 and all(r.sm_share < 1.0 for r in running)
        if spatial and lease.sm_share + sum(r.sm_share for r in running) <= 1.0 + 1e-9:
            return True
        if self._book.policy.sharing == "exclusive":
            return False
        return all(priority_band(r.running_priority()) == band for r in running)

    def compatible_with_slot(self, lease: Lease, load: SlotLoad, band: int) -> bool:
        """:meth:`compute_compatible` with every lease running on a slot, read from the
        slot's aggregates instead of its leases."""
        count = len(load.running)
        if not count:
            return True
        if lease.slice == SliceWish.EXCLUSIVE or load.exclusive:
            return False
        if (
            lease.sm_share < 1.0
            and not load.whole
            and exact_share(lease.sm_share) + load.shares <= SPATIAL_LIMIT
        ):
            return True
        if self._book.policy.sharing == "exclusive":
            return False
        return load.bands.get(band, 0) == count

    def _taken(self, key: str, lease: Lease) -> int:
        """Memory taken on slot ``key`` as ``lease`` sees it: what leases hold there and
        what processes hold beyond their leases (``lease`` counted as granted, so memory
        its process already holds is not asked for twice)."""
        return self._book.index.slots[key].held + self._memory.unleased_memory(key, lease)

    def fits_now(self, lease: Lease, key: str, band: int) -> bool:
        """Whether ``lease``, waiting in ``band``, may run on ``key`` now, with nobody
        stopped."""
        slot = self._slots[key]
        load = self._book.index.slots[key]
        held = self._taken(key, lease)
        if lease.state in (LeaseState.PAUSED,):
            held -= lease.memory_bytes  # it already holds its memory there
        if held + lease.memory_bytes > slot.memory_bytes:
            return False
        return self.compatible_with_slot(lease, load, band)

    def overfills(self, lease: Lease) -> bool:
        """Whether the memory held on ``lease``'s slot, its own included, is more than the
        slot has (a lease paused again after a restart whose memory came back)."""
        if lease.slot is None:
            return False
        return self._taken(lease.slot, lease) > self._slots[lease.slot].memory_bytes

    def slot_preference(self, lease: Lease, key: str) -> tuple:
        """Sort key of the slots ``lease`` could use: the smallest is taken."""
        slot = self._slots[key]
        load = self._book.index.slots[key]
        # Least loaded first.  Then an idle MIG instance before a whole GPU (AUTO means "a
        # MIG instance where MIG is on"), best fit among instances (keeps big ones free for
        # big requests), and the whole GPU with the most memory free.
        if slot.mig_uuid:
            return (len(load.running), 0, slot.memory_bytes, key)
        free = slot.memory_bytes - self._taken(key, lease)
        return (len(load.running), 1, -free, key)

    def preemption_plan(self, lease: Lease, key: str, band: int) -> RoomPlan | None:
        """Victims to pause and to evict so ``lease``, waiting in ``band``, can run on
        ``key``; None if impossible."""
        slot = self._slots[key]
        load = self._book.index.slots[key]
        pauses = self._victims_to_pause(lease, load, band)
        if pauses is None:
            return None
        # Memory: evict lower-band leases (paused ones first) until the request fits.
        own = lease.memory_bytes if lease.state == LeaseState.PAUSED else 0
        # Memory no lease declares is freed by parking idle sessions, not by evictions.
        need = (self._taken(key, lease) - own + lease.memory_bytes) - slot.memory_bytes
        to_park: list[IdleSession] = []
        if need > 0:  # idle sessions first, before any lease is evicted
            parks = self._parking.parks_for(lease, key, band, need)
            if parks is not None:
                to_park = list(parks.chosen)
                need -= parks.freed_bytes
        evictions: list[VictimStop] = []
        if need > 0:
            if not self._book.policy.evict_when_memory_needed:
                return None
            evicted = self._victims_to_evict(lease, load, band, need)
            if evicted is None:
                return None
            evict = ladder_level(StopCause.FREE_MEMORY, [])
            assert evict is not None  # memory is always freed by the same rung
            evictions = [VictimStop(victim, evict, StopCause.FREE_MEMORY) for victim in evicted]
        companions = self._gang_companions([*pauses, *evictions])
        return RoomPlan(
            stops=stop_order(pauses, evictions, companions),
            pauses=tuple(pauses),
            evictions=tuple(evictions),
            parks=tuple(to_park),
        )

    def room_out_of_reach(self, lease: Lease, key: str, band: int) -> bool:
        """Whether ``lease``, waiting in ``band``, can neither run on ``key`` nor have room
        made there, for reasons the slot's load and readings alone give: it needs memory
        that no park frees (nobody holds memory outside a lease there, or parks are off)
        and no eviction frees (the lower bands hold too little, or the policy evicts
        nobody).  False says only that more must be weighed (:meth:`preemption_plan`).

        True implies :meth:`fits_now` and :meth:`preemption_plan` say no, and that
        neither reads a victim's traits or an idle session to say it: what the answer
        reads is the lease, ``band``, the policy, the slot's holders (memory held, their
        bands) and its NVML readings -- what a remembered turn compares
        (:mod:`~gpushare_ext.broker.scheduler.quiet_turns`)."""
        slot = self._slots[key]
        policy = self._book.policy
        unleased = self._memory.unleased_by_pid(key, lease)
        parks_possible = policy.park_when_memory_needed and slot.mig_uuid is None and not policy.mps
        if unleased and parks_possible:
            return False  # an idle session might be parked: that reads its session
        load = self._book.index.slots[key]
        own = lease.memory_bytes if lease.state == LeaseState.PAUSED else 0
        need = load.held + sum(unleased.values()) - own + lease.memory_bytes - slot.memory_bytes
        if need <= 0:
            return False  # the memory is there: whom it may share with decides
        return not policy.evict_when_memory_needed or load.lower_band_memory(band) < need

    def _gang_companions(self, rows: list[VictimStop]) -> list[VictimStop]:
        """The running ranks of the victims' gangs that are not victims already, each
        paused at the level that stops its whole gang."""
        chosen = {row.victim.lease_id for row in rows}
        companions: list[VictimStop] = []
        for row in rows:
            if row.victim.gang is None:
                continue
            for mate in self._gang_of(row.victim):
                if mate.lease_id not in chosen and mate.state == LeaseState.RUNNING:
                    level = self.stopping_level_of(mate)
                    assert level is not None  # the victim's gang was found stoppable
                    chosen.add(mate.lease_id)
                    companions.append(VictimStop(mate, level, StopCause.MAKE_ROOM))
        return companions

    def _victims_to_pause(self, lease: Lease, load: SlotLoad, band: int) -> list[VictimStop] | None:
        """The running leases in ``lease``'s way, in arrival order, each with the level
        that stops it; None if one of them may not be stopped for it (then the others
        need no look)."""
        everyone = self._book.policy.sharing == "exclusive" or lease.slice == SliceWish.EXCLUSIVE
        if not everyone and not load.exclusive and load.bands.get(band, 0) == len(load.running):
            return []  # all of them time-slice with it: nobody is in its way
        to_pause: list[VictimStop] = []
        for victim in load.running.values():
            if not everyone and self.compute_compatible(lease, [victim], band):
                continue
            if priority_band(victim.running_priority()) >= band:
                return None
            if any(member.pending_level is not None for member in self._gang_of(victim)):
                return None  # already being stopped; wait for that
            level = self.stopping_level_of(victim)
            if level is None:
                continue  # cannot be stopped: it will time-slice with us (said in status)
            to_pause.append(VictimStop(victim, level, StopCause.MAKE_ROOM))
        to_pause.sort(key=lambda row: row.victim.arrival)
        return to_pause

    def _victims_to_evict(
        self, lease: Lease, load: SlotLoad, band: int, need: int
    ) -> list[Lease] | None:
        """Lower-band holders of the slot to evict for ``need`` bytes; None if too few."""
        if load.lower_band_memory(band) < need:
            return None  # evicting every lower band would not be enough
        candidates = [
            other
            for other in load.holders.values()
            if other.lease_id != lease.lease_id
            and not (lease.gang is not None and other.gang == lease.gang)
            and priority_band(other.running_priority()) < band
            and other.evictable
            and (other.lockable or other.state == LeaseState.PAUSED)
            and other.pending_level is None
            # A rank is evicted only if the rest of its gang can be stopped with it.
            and (other.gang is None or self.stopping_level_of(other) is not None)
        ]
        candidates.sort(
            key=lambda o: victim_order_key(o.running_priority(), o.memory_bytes, o.arrival)
        )
        to_evict: list[Lease] = []
        for other in candidates:
            if need <= 0:
                break
            to_evict.append(other)
            need -= other.memory_bytes
        return to_evict if need <= 0 else None
