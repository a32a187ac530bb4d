"""A waiter's turn that would only repeat the last one: remembered, and not worked again.

What it is for: a memory-bound waiter -- one that needs memory that neither a park nor
an eviction frees on any slot open to it -- waits, and its turn changes nothing but the
slots it marks waited for; its notice says what it said last, so it is not sent.  At the
head of a long queue that turn comes at every event (a request at the back, a tick)
and worked out in full is most of the event's cost.  :class:`QuietTurns` remembers, per
waiter, what such a turn read, and answers with the slots it waits for while every one
of those reads is as it was.

What a remembered turn read, so what must be unchanged for it to stand: the waiter
(state, slot, stop, identity, memory, SM share and its wishes), its priority band now
(effective priority crosses bands as it waits), the queued requests ahead of it, the
policy, the drained devices, which of its slots are open to it in this pass (not
reserved or waited for by those ahead), per slot the version of its holders (memory
held, leases added or removed, their bands), the NVML readings there and why no idle
session was parked there in this pass, and its last notice and reason.  A turn is
remembered only where those alone decide it: every open slot needs memory out of reach
(:meth:`~gpushare_ext.broker.scheduler.placement.Placer.room_out_of_reach`); a wait that
hangs on victims' traits or idle sessions is worked out in full every time.

What it must not do: change a lease or decide anything; it compares what a turn read.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare_ext.broker.scheduler.idle_parking import IdleParking
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.memory_seen import MemorySeen
from gpushare_ext.broker.scheduler.scheduler_records import Lease
from gpushare_ext.broker.scheduler.slot_finder import SlotFinder


@dataclass(frozen=True, slots=True)
class QuietTurn:
    """What a memory-bound waiter's turn read, and the slots it waited for."""

    reads: tuple
    waited_for: tuple[str, ...]  # its candidate slots (the turn marked them waited for)
    told_of: tuple[str, ...]  # the slots its notice spoke of


class QuietTurns:
    """Per waiter, its last turn if that turn was quiet, until something it read changes."""

    def __init__(
        self, book: LeaseBook, finder: SlotFinder, memory: MemorySeen, parking: IdleParking
    ) -> None:
        self._book = book
        self._finder = finder
        self._memory = memory
        self._parking = parking
        self._turns: dict[str, QuietTurn] = {}
        self.recalled = 0  # turns answered from memory so far (the tests and benchmarks read it)

    def __len__(self) -> int:
        return len(self._turns)

    def recall(
        self, lease: Lease, band: int, ahead: int, blocked: set[str]
    ) -> tuple[str, ...] | None:
        """The slots ``lease`` waits for if its turn now would repeat its remembered
        quiet turn (``blocked``: the slots reserved or waited for ahead of it, as its
        turn would read them); None when it must be worked out."""
        turn = self._turns.get(lease.lease_id)
        if turn is None:
            return None
        open_slots = [key for key in turn.waited_for if key not in blocked]
        if self._reads(lease, band, ahead, open_slots, turn.told_of) != turn.reads:
            return None
        self.recalled += 1
        return turn.waited_for

    def remember(
        self,
        lease: Lease,
        band: int,
        ahead: int,
        open_slots: list[str],
        candidates: list[str],
        told_of: list[str],
    ) -> None:
        """``lease``'s turn just now was quiet (it waits, every open slot out of reach):
        remember what it read, as it left them (its notice and reason told)."""
        self._turns[lease.lease_id] = QuietTurn(
            reads=self._reads(lease, band, ahead, open_slots, told_of),
            waited_for=tuple(candidates),
            told_of=tuple(told_of),
        )

    def remembers(self, lease_id: str) -> bool:
        return lease_id in self._turns

    def forget(self, lease_id: str) -> None:
        self._turns.pop(lease_id, None)

    def clear(self) -> None:
        self._turns.clear()

    def _reads(
        self,
        lease: Lease,
        band: int,
        ahead: int,
        open_slots: list[str],
        told_of: list[str] | tuple[str, ...],
    ) -> tuple:
        """Everything a quiet turn of ``lease`` reads, as plain values (see the module's
        docstring); its open slots are among those its notice speaks of."""
        loads, readings = self._book.index.slots, self._memory.readings
        refusals = self._parking.refusals
        return (
            lease.state,
            lease.slot,
            lease.stop,
            lease.identity,
            lease.memory_bytes,
            lease.sm_share,
            lease.slice,
            lease.device_wish,
            lease.reachable,
            band,
            ahead,
            self._book.policy,
            frozenset(self._finder.drained),
            tuple(open_slots),
            tuple(
                (loads[key].holders_version, readings.get(key, 0), refusals.get(key, ""))
                for key in told_of
            ),
            lease.last_queue_notice,
            lease.reason,
        )
