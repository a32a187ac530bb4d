"""A gang's turn in the scheduling pass, and keeping every gang whole after an event.

What it is for: :class:`GangTurns` serves a gang (the N rank leases of one request) as
one waiter: all its ranks placed or resumed at once, room made for all of them, or the
gang told why it waits; and :meth:`GangTurns.settle` ends a gang whose rank ended and
resumes the paused ranks of a gang that runs on.  Where ranks go is
:mod:`~gpushare_ext.broker.scheduler.gangs`' arithmetic.

What it must not do: serve single leases, or place a gang in part.
"""

from __future__ import annotations

from dataclasses import replace

from gpushare_ext.broker.scheduler.actions import Action, GrantLease, NotifyQueued
from gpushare_ext.broker.scheduler.gangs import assign_ranks
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_moves import LeaseMoves
from gpushare_ext.broker.scheduler.placement import Placer, RoomPlan, plan_cost
from gpushare_ext.broker.scheduler.queue_notices import QueueNotices
from gpushare_ext.broker.scheduler.scheduler_records import Lease
from gpushare_ext.broker.scheduler.slot_finder import SlotFinder
from gpushare_ext.protocol import LeaseState, RankPlacement


class GangTurns:
    """Gangs served whole, once per scheduling pass."""

    def __init__(
        self,
        book: LeaseBook,
        finder: SlotFinder,
        placer: Placer,
        moves: LeaseMoves,
        notices: QueueNotices,
    ) -> None:
        self._book = book
        self._finder = finder
        self._placer = placer
        self._moves = moves
        self._notices = notices
        self._served: set[str] = set()  # gangs served in this scheduling pass

    def begin_pass(self) -> None:
        self._served.clear()

    def serve(
        self, gang: str, reserved: set[str], waited_for: set[str], ahead: int, now: float
    ) -> list[Action]:
        """A gang's turn in the pass (at the first member met): all its ranks placed or
        resumed at once, room made for all of them, or told why it waits."""
        if gang in self._served:
            return []
        self._served.add(gang)
        book = self._book
        members = [book.leases[m] for m in book.gangs[gang] if m in book.leases]
        if any(m.held_by_watchdog or m.detached for m in members):
            return []
        if any(m.pending_level is not None or m.awaiting_memory_from for m in members):
            reserved.update(book.gang_targets.get(gang) or {m.slot for m in members if m.slot})
            return []
        if any(m.state == LeaseState.RUNNING for m in members):
            return []  # settled at the next event (see settle)
        book.gang_targets.pop(gang, None)
        leader = members[0]
        # What stands in for ranks is a copy of the leader (_probe), and no rank runs: they
        # all wait in the leader's band, worked out once for the gang's turn.
        band = book.waiting_band(leader, now)
        if leader.state == LeaseState.QUEUED:
            return self._serve_queued(leader, members, band, reserved, waited_for, ahead, now)
        return self._serve_stopped(leader, members, band, reserved, waited_for, now)

    def settle(self, now: float) -> list[Action]:
        """Keep every gang whole after an event: when a rank has ended, the rest end too
        (a rank that dies takes its gang with it); when a rank could not be paused and
        runs on, its paused mates resume beside it."""
        book = self._book
        if not book.gangs:  # after every event: most hosts have no gang
            return []
        placer = self._placer
        actions: list[Action] = []
        for gang, member_ids in list(book.gangs.items()):
            live = [book.leases[m] for m in member_ids if m in book.leases]
            if len(live) < len(member_ids):
                ended = next(m for m in member_ids if m not in book.leases)
                why = book.ended[ended].reason if ended in book.ended else "ended"
                for member in live:
                    actions.append(
                        book.end(member, LeaseState.RELEASED, now, f"rank {ended} {why}")
                    )
                book.forget_gang(gang)
                continue
            if any(m.pending_level is not None for m in live):
                continue
            if any(m.state == LeaseState.RUNNING for m in live):
                for member in live:
                    stopped = member.state in (LeaseState.PAUSED, LeaseState.EVICTED)
                    slot = member.slot or ""
                    if stopped and placer.fits_now(member, slot, book.waiting_band(member, now)):
                        member.lockable = False  # its gang cannot be paused: it runs on
                        actions.extend(self._moves.start(member, slot, now))
        return actions

    def _serve_queued(
        self,
        leader: Lease,
        members: list[Lease],
        band: int,
        reserved: set[str],
        waited_for: set[str],
        ahead: int,
        now: float,
    ) -> list[Action]:
        wanted = self._finder.wanted_slots(leader)
        candidates = self._finder.not_drained(wanted)
        open_slots = sorted(
            (k for k in candidates if k not in reserved and k not in waited_for),
            key=lambda k: self._placer.slot_preference(leader, k),
        )

        def fits_now(key: str, count: int) -> bool:
            probe = _probe(leader, members[:count], key)
            return self._placer.fits_now(probe, key, band)

        assignment = assign_ranks(len(members), open_slots, fits_now)
        if assignment is not None:
            return self._start(members, assignment, now)
        planned = self._room_plan(leader, members, band, open_slots)
        if planned is not None:
            assignment, plans = planned
            reserved.update(assignment)
            return self._make_room(leader, members, assignment, plans, now, ahead)
        waited_for.update(candidates)
        return _gang_notices(
            leader, self._notices.queue_notice(leader, candidates or wanted, now, ahead)
        )

    def _room_plan(
        self, leader: Lease, members: list[Lease], band: int, open_slots: list[str]
    ) -> tuple[list[str], dict[str, RoomPlan]] | None:
        """Where a queued gang could go by preempting, and what on each slot: one rank per
        slot where enough slots allow it, else all ranks on the one cheapest slot."""
        count = len(members)
        single: dict[str, RoomPlan] = {}
        for key in open_slots:
            plan = self._placer.preemption_plan(_probe(leader, members[:1], key), key, band)
            if plan is not None:
                single[key] = plan
        if len(single) >= count:
            cheapest = sorted(single, key=lambda k: (plan_cost(single[k]), open_slots.index(k)))
            chosen = sorted(cheapest[:count], key=open_slots.index)
            return chosen, {key: single[key] for key in chosen}
        packed = []
        for key in open_slots:
            plan = self._placer.preemption_plan(_probe(leader, members, key), key, band)
            if plan is not None:
                packed.append((plan_cost(plan), open_slots.index(key), key, plan))
        if not packed:
            return None
        _, _, key, plan = min(packed)
        return [key] * count, {key: plan}

    def _make_room(
        self,
        leader: Lease,
        members: list[Lease],
        assignment: list[str],
        plans: dict[str, RoomPlan],
        now: float,
        ahead: int,
    ) -> list[Action]:
        actions: list[Action] = []
        awaited: frozenset[str] = frozenset()
        evicting = False
        for key, plan in plans.items():
            stopped, waiting_on = self._moves.stop_victims(leader, key, plan, now)
            actions.extend(stopped)
            awaited |= waiting_on
            evicting = evicting or bool(plan.evictions)
        if not awaited:
            actions.extend(self._start(members, assignment, now))
            return actions
        self._moves.await_room(leader, awaited, evicting, now)
        leader.target_slot = assignment[0]
        self._book.gang_targets[leader.gang or ""] = tuple(dict.fromkeys(assignment))
        notices = self._notices.queue_notice(
            leader, list(dict.fromkeys(assignment)), now, ahead, force_reason=leader.reason
        )
        actions.extend(_gang_notices(leader, notices))
        return actions

    def _serve_stopped(
        self,
        leader: Lease,
        members: list[Lease],
        band: int,
        reserved: set[str],
        waited_for: set[str],
        now: float,
    ) -> list[Action]:
        """A paused or evicted gang resumes on the slots it holds, all ranks at once."""
        by_slot: dict[str, list[Lease]] = {}
        for member in members:
            by_slot.setdefault(member.slot or "", []).append(member)
        if any(key in self._blocked_for_stopped(members, reserved, waited_for) for key in by_slot):
            return []
        probes = {key: _probe(leader, ranks, key) for key, ranks in by_slot.items()}
        if all(self._placer.fits_now(probe, key, band) for key, probe in probes.items()):
            return self._start(members, [m.slot or "" for m in members], now)
        plans = {
            key: self._placer.preemption_plan(probe, key, band) for key, probe in probes.items()
        }
        if all(plan is not None for plan in plans.values()):
            reserved.update(by_slot)
            return self._make_room(
                leader,
                members,
                [m.slot or "" for m in members],
                plans,  # type: ignore[arg-type]
                now,
                0,
            )
        waited_for.update(by_slot)
        return []

    @staticmethod
    def _blocked_for_stopped(
        members: list[Lease], reserved: set[str], waited_for: set[str]
    ) -> set[str]:
        """The slots a stopped gang may not resume on in this pass."""
        everyone_paused = all(m.state == LeaseState.PAUSED for m in members)
        # A paused rank that cannot be evicted holds its memory whatever happens: running
        # the gang to its end may be the only way that memory is ever freed, so, as for a
        # single paused lease, slots that are only waited for do not hold the gang back.
        holds_for_good = any(m.state == LeaseState.PAUSED and not m.evictable for m in members)
        return reserved if everyone_paused or holds_for_good else reserved | waited_for

    def _start(self, members: list[Lease], slots: list[str], now: float) -> list[Action]:
        """Every rank on its slot at once: one grant for the gang (or a resume per rank)."""
        actions: list[Action] = []
        grants: list[GrantLease] = []
        for member, key in zip(members, slots, strict=True):
            for action in self._moves.start(member, key, now):
                if isinstance(action, GrantLease):
                    grants.append(action)
                else:
                    actions.append(action)
        if grants:
            first = grants[0]
            gang = members[0].gang or first.lease_id
            ranks = tuple(RankPlacement(lease_id=g.lease_id, placement=g.placement) for g in grants)
            actions.insert(0, replace(first, lease_id=gang, ranks=ranks))
        return actions


def _probe(leader: Lease, ranks: list[Lease], key: str) -> Lease:
    """A stand-in for ``ranks`` of one gang on slot ``key``, as one lease: the memory
    they still need there (paused ranks hold theirs) and their SM shares summed.  It
    is never added to the index."""
    share = sum(rank.sm_share for rank in ranks)
    return replace(
        leader,
        lease_id=f"{leader.gang}@{key}",
        memory_bytes=sum(r.memory_bytes for r in ranks if r.state != LeaseState.PAUSED),
        sm_share=share if share < 1.0 and all(r.sm_share < 1.0 for r in ranks) else 1.0,
        state=LeaseState.QUEUED,
        slot=None,
    )


def _gang_notices(leader: Lease, actions: list[Action]) -> list[Action]:
    """A gang's queue notices speak of the gang, the one request its session made."""
    return [
        replace(action, lease_id=leader.gang) if isinstance(action, NotifyQueued) else action
        for action in actions
    ]
