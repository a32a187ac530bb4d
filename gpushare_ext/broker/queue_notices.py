"""What a waiter is told: its place, who holds its slots, why it waits, and for how long.

What it is for: :class:`QueueNotices` words a waiter's :class:`NotifyQueued` -- the
leases in its way and their priority, the reason in its session's words, an estimate
from their users' habits -- and says it only when something in it changed.  Every
waiter for the same slots is told about the same holders (remembered per set of slots
and their versions), and an estimate holds for one scheduling pass.

What it must not do: place, pause or resume anyone; it reads the scheduler's state and
changes only what a lease remembers of its last notice.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare_ext.broker.actions import Action, NotifyQueued
from gpushare_ext.broker.idle_parking import IdleParking
from gpushare_ext.broker.lease_book import LeaseBook
from gpushare_ext.broker.lease_transitions import transition
from gpushare_ext.broker.memory_seen import MemorySeen
from gpushare_ext.broker.scheduler_records import Lease
from gpushare_ext.broker.slot_finder import SlotFinder
from gpushare_ext.protocol import LeaseState, priority_class
from gpushare_ext.units import format_size

HOLDERS_MEMO = 256  # sets of slots whose running leases are remembered, per version


@dataclass(kw_only=True)
class Holders:
    """The leases running on a set of slots, as a queue notice describes them."""

    keys: tuple[str, ...]
    waiting_for: tuple[str, ...]  # their ids, sorted
    holder_priority: int | None  # the highest base priority among them
    top: int | None  # the highest running priority among them, whole
    estimate: float | None = None
    estimated_in: int = -1  # the scheduling pass that worked the estimate out


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
        """The notice for ``lease``, or nothing if it would say what it said last."""
        position = ahead + 1
        waiting_for = holders.waiting_for
        holder_priority = holders.holder_priority
        if lease.reason != reason:  # every waiter, at every event: only what changes
            transition(lease, now, reason=reason)
        signature = (position, waiting_for, holder_priority, reason)
        if signature == lease.last_queue_notice:
            return []
        lease.last_queue_notice = signature
        lease.estimate_s, lease.estimated_at = self._hold_estimate(holders, now), now
        return [
            NotifyQueued(
                session_id=lease.session_id,
                lease_id=lease.lease_id,
                position=position,
                waiting_for=waiting_for,
                holder_priority=holder_priority,
                estimate_s=lease.estimate_s,
                reason=reason,
                notice=lease.notice,
            )
        ]

    def what_they_hear(self, wanted: tuple[str, ...]) -> tuple[list[str], Holders, bool]:
        """For the plain requests that want ``wanted``: the slots their notices speak of,
        who holds those, and whether all hear the same reason (no NVML reading there:
        then only drains, holders and whether anyone is ahead make the reason)."""
        keys = self._finder.not_drained(list(wanted)) or list(wanted)
        return keys, self.holders(keys), not any(self._memory.by_slot.get(k) for k in keys)

    def look_of(self, keys: tuple[str, ...]) -> tuple:
        """What a queue notice reads of ``keys`` besides the place: who holds them (and
        their memory, which NVML's readings are compared with), the readings, why no
        idle session was parked there in this pass, and whether they are drained."""
        return tuple(
            (
                self._book.index.slots[key].holders_version,
                self._memory.readings.get(key, 0),
                self._parking.refusals.get(key, ""),
                self._finder.is_drained(key),
            )
            for key in keys
        )

    def holders(self, keys: list[str]) -> Holders:
        """Who runs on ``keys``, as every waiter for them is told."""
        loads = [self._book.index.slots[key] for key in keys]
        signature = tuple((key, load.version) for key, load in zip(keys, loads, strict=True))
        known = self._known_holders.get(signature)
        if known is None:
            if len(self._known_holders) >= HOLDERS_MEMO:
                self._known_holders.clear()
            ids = [lease_id for load in loads for lease_id in load.running_ids]
            known = Holders(
                keys=tuple(keys),
                waiting_for=tuple(ids if len(loads) == 1 else sorted(ids)),
                holder_priority=max(
                    (max(load.base_priorities) for load in loads if load.base_priorities),
                    default=None,
                ),
                top=max((max(load.tops) for load in loads if load.tops), default=None),
            )
            self._known_holders[signature] = known
        return known

    def _hold_estimate(self, holders: Holders, now: float) -> float | None:
        """Seconds until one of the waiter's slots is likely free, from its holders'
        users' habits: a slot is free once every lease running there is likely done.

        Not the least time left among the holders: a short lease beside a long one
        made that "any moment now" while the long one had 41 s to go.  A slot with a
        holder whose user has no habits yet gives no estimate (it could be any time).
        """
        if holders.estimated_in == self._passes:
            return holders.estimate
        free_in = []
        for key in holders.keys:
            left: list[float] = []
            for uid, grants in self._book.index.slots[key].granted.items():
                typical = self._book.hold_ema.get(uid)
                if typical is None:
                    break  # a user with no habits yet: this slot could be free any time
                # typical - (now - granted) only grows with granted, rounding included:
                # a user's latest lease on the slot is the one with the most time left.
                left.append(max(0.0, typical - (now - max(grants.values()))))
            else:
                if left:
                    free_in.append(max(left))
        holders.estimate = round(min(free_in), 1) if free_in else None
        holders.estimated_in = self._passes
        return holders.estimate
