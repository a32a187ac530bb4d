"""What a waiter is told: its place, who holds its slots, why it waits, and for how long.

What it is for: :class:`QueueNotices` words a waiter's :class:`NotifyQueued` -- the
leases in its way and their priority, the reason in its session's words, an estimate
from their users' habits -- and says it only when something in it changed as its
session would read it: the place as :func:`~gpushare_ext.protocol.told_place` rounds
it, the holders by their users (the server names users, not leases).  A grant at the
head of a long queue moves every waiter up and replaces a holder, yet a waiter far back
reads no change in either and is not told.  Every waiter for the same slots is told
about the same holders (remembered per set of slots and their versions), and an
estimate holds for one scheduling pass.

What it must not do: place, pause or resume anyone; it reads the scheduler's state and
changes only what a lease remembers of its last notice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpushare_ext.broker.scheduler.actions import Action, NotifyQueued
from gpushare_ext.broker.scheduler.idle_parking import IdleParking
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.memory_seen import MemorySeen
from gpushare_ext.broker.scheduler.scheduler_records import Lease
from gpushare_ext.broker.scheduler.slot_finder import SlotFinder
from gpushare_ext.protocol import EXACT_PLACES, LeaseState, priority_class, told_place
from gpushare_ext.units import format_size

HOLDERS_MEMO = 256  # sets of slots whose running leases are remembered, per version


@dataclass(kw_only=True)
class Holders:
    """The leases running on a set of slots, as a queue notice describes them."""

    keys: tuple[str, ...]
    waiting_for: tuple[str, ...]  # their ids, sorted
    holder_priority: int | None  # the highest base priority among them
    top: int | None  # the highest running priority among them, whole
    # What a waiter sees of them: their users (uid, name; the server names users, not
    # leases), holder_priority and the class of top.  One holder replaced by another of
    # the same user changes none of it.  Equal ones are one object (compared at once).
    seen: tuple = ()
    estimate: float | None = None
    estimated_in: int = -1  # the scheduling pass that worked the estimate out
    # Per slot, the holder whose slot is likely free last, as (typical hold, granted at)
    # (None: no estimate for that slot), worked out for the users' habits of that version.
    last_to_leave: tuple[tuple[float, float] | None, ...] = ()
    habits_version: int = -1


class QueueNotices:
    """Queue notices, worded once per change."""

    def __init__(
        self, book: LeaseBook, finder: SlotFinder, memory: MemorySeen, parking: IdleParking
    ) -> None:
        self._book = book
        self._finder = finder
        self._memory = memory
        self._parking = parking
        # What queue notices say of the leases running on a set of slots, per set and the
        # slots' versions: every waiter for the same slots is told about the same holders.
        self._known_holders: dict[tuple, Holders] = {}
        self._seen: dict[tuple, tuple] = {}  # what waiters see of holders, one object each
        self._users: dict[tuple, tuple] = {}  # the users on slots, per their users_version
        self._passes = 0  # scheduling passes so far: an estimate holds for one

    def begin_pass(self) -> None:
        """A new scheduling pass: estimates are worked out anew."""
        self._passes += 1

    def queue_notice(
        self, lease: Lease, candidates: list[str], now: float, ahead: int, force_reason: str = ""
    ) -> list[Action]:
        """Tell a queued lease where it stands (``ahead``: queued leases ranked higher),
        unless nothing changed since it was last told."""
        if lease.state != LeaseState.QUEUED and not lease.parks_session:
            return []
        holders = self.holders(candidates)
        reason = force_reason or self.queue_reason(lease, candidates, holders, ahead)
        restricted = self._finder.reachable_note(lease) if lease.reachable is not None else ""
        if restricted and restricted not in reason:
            reason = f"{reason} ({restricted})"
        return self.tell_queued(lease, holders, reason, ahead, now)

    def queue_reason(
        self, lease: Lease, candidates: list[str], holders: Holders, ahead: int
    ) -> str:
        """Why a queued lease waits for ``candidates``, in its session's words."""
        slots = self._finder.slots
        unleased = [self._memory.unleased_memory(k, lease) for k in candidates]
        if candidates and all(self._finder.is_drained(k) for k in candidates):
            return "the device is drained by an admin"
        if candidates and all(
            slots[k].memory_bytes - extra < lease.memory_bytes
            for k, extra in zip(candidates, unleased, strict=True)
        ):
            refusals = self._parking.refusals
            refusal = next((refusals[k] for k in candidates if k in refusals), "")
            return (
                f"{format_size(min(unleased))} of the GPU is held outside any lease (idle "
                "notebooks or other processes); waiting for it to be freed"
                + (f" ({refusal})" if refusal else "")
            )
        if holders.top is not None:
            return f"the GPU is held by {priority_class(holders.top)}-priority work"
        if ahead:
            return "waiting behind earlier requests"
        return "waiting for memory"

    def tell_queued(
        self, lease: Lease, holders: Holders, reason: str, ahead: int, now: float
    ) -> list[Action]:
        """The notice for ``lease``, or nothing if it would say what it said last: its
        place as the notice tells it (exact near the head, rounded up further back), its
        holders as the session sees them (their users), the reason.

        Only a place told exactly comes with an estimate: it is when the GPU is likely
        free, which is when the head's wait ends, not that of a request further back
        (and its notices come only when its rounded place changes)."""
        position = ahead + 1
        exact = position <= EXACT_PLACES
        if not exact:
            position = told_place(position)
        if lease.reason != reason:  # every waiter, at every event: only what changes
            transition(lease, now, reason=reason)
        signature = (position, holders.seen, reason)
        if signature == lease.last_queue_notice:
            return []
        lease.last_queue_notice = signature
        if lease.freeing_bytes:
            lease.estimate_s = self._freeing_estimate(lease.freeing_bytes)
        else:
            lease.estimate_s = self._hold_estimate(holders, now) if exact else None
        lease.estimated_at = now
        return [
            NotifyQueued(
                session_id=lease.session_id,
                lease_id=lease.lease_id,
                position=position,
                waiting_for=holders.waiting_for,
                holder_priority=holders.holder_priority,
                estimate_s=lease.estimate_s,
                reason=reason,
                notice=lease.notice,
                freeing_bytes=lease.freeing_bytes or None,
            )
        ]

    def _freeing_estimate(self, freeing_bytes: int) -> float | None:
        """Seconds to move ``freeing_bytes`` to the host at the rate evictions and parks
        went at so far (None before any was timed)."""
        rate = self._book.freeing_rate
        return None if rate is None else round(freeing_bytes / rate, 1)

    def what_they_hear(self, wanted: tuple[str, ...]) -> tuple[list[str], Holders, bool]:
        """For the plain requests that want ``wanted``: the slots their notices speak of,
        who holds those, and whether all hear the same reason (no NVML reading there:
        then only drains, holders and whether anyone is ahead make the reason)."""
        keys = self._finder.not_drained(list(wanted)) or list(wanted)
        return keys, self.holders(keys), not any(self._memory.by_slot.get(k) for k in keys)

    def look_of(self, keys: tuple[str, ...]) -> tuple:
        """What a queue notice reads of ``keys`` besides the place: who holds them as a
        waiter sees them (their users, priority and class), the readings (and, where
        there are some, every holder's memory, which they are compared with), why no idle
        session was parked there in this pass, and whether they are drained."""
        slots, seen, readings = self._book.index.slots, self._memory.by_slot, self._memory.readings
        refusals, drained = self._parking.refusals, self._finder.is_drained
        return tuple(
            (
                self.holders((key,)).seen,
                slots[key].holders_version if seen.get(key) else None,
                readings.get(key, 0),
                refusals.get(key, ""),
                drained(key),
            )
            for key in keys
        )

    def holders(self, keys: list[str] | tuple[str, ...]) -> Holders:
        """Who runs on ``keys``, as every waiter for them is told."""
        slots = self._book.index.slots
        if len(keys) == 1:  # most often: one GPU or slice
            signature: tuple = (keys[0], slots[keys[0]].version)
        else:
            signature = tuple((key, slots[key].version) for key in keys)
        known = self._known_holders.get(signature)
        if known is None:
            known = self._holders_now(keys)
            if len(self._known_holders) >= HOLDERS_MEMO:
                self._known_holders.clear()
            self._known_holders[signature] = known
        return known

    def _holders_now(self, keys: list[str] | tuple[str, ...]) -> Holders:
        loads = [self._book.index.slots[key] for key in keys]
        holder_priority = max(
            (max(load.base_priorities) for load in loads if load.base_priorities), default=None
        )
        top = max((max(load.tops) for load in loads if load.tops), default=None)
        seen = (self._users_of(keys), holder_priority, None if top is None else priority_class(top))
        if len(self._seen) >= HOLDERS_MEMO:
            self._seen.clear()
        if len(loads) == 1:
            waiting_for = tuple(loads[0].running_ids)
        else:
            waiting_for = tuple(sorted(i for load in loads for i in load.running_ids))
        return Holders(
            keys=tuple(keys),
            waiting_for=waiting_for,
            holder_priority=holder_priority,
            top=top,
            seen=self._seen.setdefault(seen, seen),
        )

    def _users_of(self, keys: list[str] | tuple[str, ...]) -> tuple[tuple[int, str], ...]:
        """The users running on ``keys``, sorted (kept while the same users run there)."""
        slots = self._book.index.slots
        signature = tuple((key, slots[key].users_version) for key in keys)
        users = self._users.get(signature)
        if users is None:
            users = tuple(sorted({user for key in keys for user in slots[key].users}))
            if len(self._users) >= HOLDERS_MEMO:
                self._users.clear()
            self._users[signature] = users
        return users

    def _hold_estimate(self, holders: Holders, now: float) -> float | None:
        """Seconds until one of the waiter's slots is likely free, from its holders'
        users' habits: a slot is free once every lease running there is likely done.

        Not the least time left among the holders: a short lease beside a long one
        made that "any moment now" while the long one had 41 s to go.  A slot with a
        holder whose user has no habits yet gives no estimate (it could be any time).
        """
        if holders.estimated_in == self._passes:
            return holders.estimate
        book = self._book
        if holders.habits_version != book.habits_version:
            slots = book.index.slots
            holders.last_to_leave = tuple(
                self._last_to_leave(slots[key].latest_grant) for key in holders.keys
            )
            holders.habits_version = book.habits_version
        free_in = [
            max(0.0, typical - (now - granted))
            for typical, granted in filter(None, holders.last_to_leave)
        ]
        holders.estimate = round(min(free_in), 1) if free_in else None
        holders.estimated_in = self._passes
        return holders.estimate

    def _last_to_leave(self, latest_grant: dict[int, float]) -> tuple[float, float] | None:
        """Of a slot's running leases (per user, the latest granted), the one likely done
        last, as (its user's typical hold, granted at); None if a user has no habits yet
        (the slot could be free any time) or nobody runs there.

        A user's latest lease on the slot has the most time left, and the time left,
        typical - (now - granted), is largest where typical + granted is, at any time:
        worked out once per holders and habits, not at every pass."""
        habits = self._book.hold_ema
        last, most = None, -math.inf
        for uid, granted in latest_grant.items():
            typical = habits.get(uid)
            if typical is None:
                return None
            if typical + granted > most:
                last, most = (typical, granted), typical + granted
        return last
