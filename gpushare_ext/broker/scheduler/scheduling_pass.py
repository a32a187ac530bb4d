"""One scheduling pass: every waiter that an event may concern gets its turn, in queue order.

What it is for: :class:`SchedulingPass` runs the pass after each event.  A waiter's
turn (:meth:`SchedulingPass.serve`) places it, makes room for it, or tells it why it
waits; a gang's turn is :class:`~gpushare_ext.broker.scheduler.gang_turns.GangTurns`'.  With more
than a handful of waiters (``LINE_FROM``) the pass keeps them in a
:class:`~gpushare_ext.broker.scheduler.lease_index.WaitingLine` between events, and the plain
queued requests that want the same slots form a group: once all those slots are
reserved or waited for by the waiters ahead, the rest of the group can neither be
placed nor make room, so they are only told where they stand, and only if that may
have changed (their place as a notice tells it, how their slots look, or their notice
was reset).  The requests that join or leave ahead of a waiter move its place; as a
notice rounds places far back, only the waiters near the head and those whose place
crosses a round number are looked at (:func:`places_told_anew`).  A waiter served in turn
whose last turn was quiet (memory-bound, nothing new to tell) and read nothing that has
changed since is answered from memory
(:class:`~gpushare_ext.broker.scheduler.quiet_turns.QuietTurns`).

What it must not do: decide fit, victims or levels (placement does), or word notices
(queue notices do); it decides only who has a turn, in which order, and who is told.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpushare_ext.broker.scheduler.actions import Action, GrantLease
from gpushare_ext.broker.scheduler.gang_turns import GangTurns
from gpushare_ext.broker.scheduler.idle_parking import IdleParking
from gpushare_ext.broker.scheduler.lease_book import LeaseBook
from gpushare_ext.broker.scheduler.lease_index import OTHERS, Place, Trajectory, WaitingLine
from gpushare_ext.broker.scheduler.lease_moves import LeaseMoves
from gpushare_ext.broker.scheduler.placement import Placer, plan_cost
from gpushare_ext.broker.scheduler.queue_notices import QueueNotices
from gpushare_ext.broker.scheduler.quiet_turns import QuietTurns
from gpushare_ext.broker.scheduler.scheduler_records import Lease
from gpushare_ext.broker.scheduler.slot_finder import SlotFinder
from gpushare_ext.broker.settings.policy import Policy
from gpushare_ext.protocol import EXACT_PLACES, LeaseState, told_place

# Waiters a pass serves one by one without a waiting line: for so few, sorting them and
# serving each costs less than keeping the line.
LINE_FROM = 4


def places_told_anew(first: int, last: int, moved: int) -> Iterator[int]:
    """The places in ``first..last`` of requests that stand ``moved`` places further
    back (nearer the head, if negative) than they were last told, and whose place a
    notice tells otherwise now (:func:`~gpushare_ext.protocol.told_place`): every place
    near the head, and further back only those that crossed a round number."""
    if not moved or first > last:
        return
    exact_to = min(last, EXACT_PLACES + max(moved, 0))
    yield from range(first, exact_to + 1)
    start, near = max(first, exact_to + 1), abs(moved)
    if start > last:
        return
    # The places that crossed the round number ``top``: top-near+1..top (moved up) or
    # top+1..top+near (moved back).  Rounded up, a place is told otherwise exactly when
    # it crossed one.
    top = told_place(max(EXACT_PLACES + 1, start if moved < 0 else start - near))
    while start <= last:
        low, high = (top - near + 1, top) if moved < 0 else (top + 1, top + near)
        if low > last:
            return
        yield from range(max(start, low), min(last, high) + 1)
        start = max(start, high + 1)
        top = told_place(top + 1)


@dataclass(kw_only=True)
class _RequestGroup:
    """The plain queued requests that want the same slots, during one scheduling pass.

    While one of their candidate slots is neither reserved nor waited for, the first of
    them is served like any waiter.  Once all are, the rest can neither be placed nor
    make room (their turn would only tell them where they stand): the group is closed,
    and they are passed over (:meth:`SchedulingPass._tell_passed_over`)."""

    wanted: tuple[str, ...]
    tickets: list[int]  # its requests' tickets in the waiting line, in order
    candidates: frozenset[str]  # the wanted slots on devices not drained
    served: int = 0  # tickets[:served] were served in turn
    open: bool = True
    settled: int = 0  # tickets[:settled] are served, told, or known to be told already
    looks: set[tuple] = field(default_factory=set)  # its slots, as its requests were told


@dataclass(kw_only=True)
class _Pass:
    """One scheduling pass over the waiting line."""

    now: float
    groups: list[_RequestGroup]
    changed_from: int  # counted[changed_from:] may stand anywhere (the line was sorted anew)
    # Below it, places moved only by the requests that joined or left ahead: after
    # move_tickets[i], each stands move_deltas[i] places further back (a grant: -1).
    move_tickets: list[int]
    move_deltas: list[int]
    reserved: set[str] = field(default_factory=set)
    waited_for: set[str] = field(default_factory=set)
    served: set[str] = field(default_factory=set)  # lease ids served in turn
    granted: list[int] = field(default_factory=list)  # tickets of requests granted in turn
    walked: int = 0  # counted[:walked] were looked at for a changed place
    blocked_size: int = -1  # len(reserved) + len(waited_for) when groups were last closed
    actions: list[Action] = field(default_factory=list)

    def ahead_of(self, line: WaitingLine, ticket: float) -> int:
        """Queued requests ahead of ``ticket`` that still wait after their turn."""
        return line.counted_before(ticket) - bisect.bisect_left(self.granted, ticket)


class SchedulingPass:
    """Who has a turn after an event, in which order, and who is told where they stand."""

    def __init__(
        self,
        book: LeaseBook,
        finder: SlotFinder,
        placer: Placer,
        parking: IdleParking,
        notices: QueueNotices,
        moves: LeaseMoves,
        gangs: GangTurns,
        quiet: QuietTurns,
        *,
        recompute_every_waiter: bool = False,
        line_from: int = LINE_FROM,
    ) -> None:
        self._book = book
        self._finder = finder
        self._placer = placer
        self._parking = parking
        self._notices = notices
        self._moves = moves
        self._gangs = gangs
        self.quiet_turns = quiet  # memory-bound waiters' last turns, while they would repeat
        # Serve every waiter on every pass (the reference the tests hold the kept pass to).
        self.recompute_every_waiter = recompute_every_waiter
        self.line_from = line_from  # more waiters than this: the pass keeps them in a line
        self._line = WaitingLine()
        self._line_policy: Policy | None = None  # the policy the line's aging rates are of
        self._aging_rates: dict[tuple[str, tuple[str, ...]], float] = {}  # per user, groups
        self._pass: _Pass | None = None
        # Per wanted slots, how they looked when all requests wanting them were last told
        # where they stand (None: told at different times).
        self._told_looks: dict[tuple[str, ...], tuple | None] = {}
        self._notice_due: set[str] = set()  # plain requests to tell anew whatever changed

    def run(self, now: float) -> list[Action]:
        """The pass after an event."""
        # Slots kept for waiters ranked higher: ``reserved`` for one that is being made
        # room for (or could be placed), ``waited_for`` for one that can neither be
        # placed nor make room.  A paused lease may resume on a slot that is only waited
        # for: it holds its memory there anyway, and running to its end may be the only
        # way that memory is ever freed (it cannot be evicted).  Both only grow as the
        # pass goes down the line, and nothing in it puts a lease back into the queue.
        self._notices.begin_pass()
        self._parking.refusals.clear()
        self._gangs.begin_pass()
        if self.recompute_every_waiter or len(self._book.index.waiters) <= self.line_from:
            self._drop_line()  # a handful of waiters: serving each costs less than a line
            return self._serve_every_waiter(now)
        self._catch_up_line(now)
        line = self._line
        groups = [
            _RequestGroup(
                wanted=wanted,
                tickets=tickets,
                candidates=frozenset(self._finder.not_drained(list(wanted))),
            )
            for wanted, tickets in line.groups.items()
            if wanted != OTHERS
        ]
        moves = sorted(line.moves)
        state = _Pass(
            now=now,
            groups=groups,
            changed_from=line.first_change,
            move_tickets=[ticket for ticket, _ in moves],
            move_deltas=[delta for _, delta in moves],
        )
        self._pass = state
        try:
            self._close_groups(state)
            self._take_turns(state, line.groups.get(OTHERS, []))
            self._tell_passed_over(state, math.inf)
            self._end_pass(state)
        finally:
            self._pass = None
        return state.actions

    def _take_turns(self, state: _Pass, others: list[int]) -> None:
        """Every turn of the pass: the first of the other waiters and open groups next."""
        line = self._line
        next_other = 0
        while True:
            ticket = others[next_other] if next_other < len(others) else math.inf
            first = None
            for group in state.groups:
                waiting = group.open and group.served < len(group.tickets)
                if waiting and group.tickets[group.served] < ticket:
                    ticket, first = group.tickets[group.served], group
            if ticket == math.inf:
                break
            if first is not None:
                first.served += 1
            else:
                next_other += 1
            self._take_turn(state, line.at(ticket), first)  # type: ignore[arg-type]

    def _granted(self, lease_id: str) -> None:
        """A queued request was granted in this pass: the places behind it move up (the
        line itself drops it when the pass ends)."""
        place = self._line.places.get(lease_id)
        state = self._pass
        if state is not None and place is not None and place.counted:
            bisect.insort(state.granted, place.ticket)
            at = bisect.bisect_right(state.move_tickets, place.ticket)
            state.move_tickets.insert(at, place.ticket)
            state.move_deltas.insert(at, -1)

    def line_mismatch(self, now: float) -> str:
        """How the kept waiting line differs from one recomputed ("" if it does not)."""
        if self._line_policy is None:
            return ""  # not kept: few enough waiters to serve one by one
        self._catch_up_line(now)  # what the next pass does first
        line = self._line
        waiters = self._book.index.waiters
        if set(line.places) != set(waiters):
            return f"waiting line: kept {sorted(line.places)}, waiters {sorted(waiters)}"
        order = [line.at(ticket) for ticket in line.tickets]
        keys = [self._book.queue_key(place.lease, now) for place in order]
        if keys != sorted(keys):
            return f"waiting line out of order at {now}: {[p.lease.lease_id for p in order]}"
        for place in order:
            wanted = self._line_place(place.lease)
            kept = (place.group, place.counted, place.trajectory)
            if kept != (wanted.group, wanted.counted, wanted.trajectory):
                return f"waiting line: {place.lease.lease_id} kept as {kept}, is {wanted}"
        if line.counted != [place.ticket for place in order if place.counted]:
            return "waiting line: the counted requests are not those in the line"
        return ""

    # ---- a waiter's turn

    def serve(
        self,
        lease: Lease,
        reserved: set[str],
        waited_for: set[str],
        ahead: int,
        now: float,
        *,
        recall: bool = False,
    ) -> list[Action]:
        """One waiter's turn in the pass: placed, made room for, or told why it waits.

        ``recall``: a memory-bound waiter's turn that would repeat its last one is not
        worked out again (:mod:`~gpushare_ext.broker.scheduler.quiet_turns`)."""
        if lease.state not in (LeaseState.QUEUED, LeaseState.PAUSED, LeaseState.EVICTED):
            return []
        if lease.gang is not None:  # a gang is served whole, at the first member met
            return self._gangs.serve(lease.gang, reserved, waited_for, ahead, now)
        if self._needs_no_turn(lease, reserved):
            return []
        lease.target_slot = None
        band = self._book.waiting_band(lease, now)  # once for every slot weighed
        blocked = reserved if lease.state == LeaseState.PAUSED else reserved | waited_for
        if recall:
            kept = self.quiet_turns.recall(lease, band, ahead, blocked)
            if kept is not None:
                waited_for.update(kept)
                return []
            self.quiet_turns.forget(lease.lease_id)
        # Before draining: the notice says when drain is why.
        wanted = self._finder.wanted_slots(lease)
        candidates = self._finder.placeable_slots(lease, wanted)
        open_slots = [k for k in candidates if k not in blocked]
        placer = self._placer
        placed = [k for k in open_slots if placer.fits_now(lease, k, band)]
        if placed:  # first: most turns that place someone are of leases that fit
            key = min(placed, key=lambda k: placer.slot_preference(lease, k))
            return self._moves.start(lease, key, now)
        # Memory-bound on every open slot: no room can be made either, and the turn may
        # be remembered (what decided it is all the memo compares).
        out_of_reach = all(placer.room_out_of_reach(lease, k, band) for k in open_slots)
        if not out_of_reach:
            actions = self._make_room(lease, open_slots, band, reserved, ahead, now)
            if actions is not None:
                return actions
        waited_for.update(candidates)
        told_of = candidates or wanted
        notice = self._notices.queue_notice(lease, told_of, now, ahead)
        if recall and out_of_reach:
            self.quiet_turns.remember(lease, band, ahead, open_slots, candidates, told_of)
        return notice

    def _make_room(
        self,
        lease: Lease,
        open_slots: list[str],
        band: int,
        reserved: set[str],
        ahead: int,
        now: float,
    ) -> list[Action] | None:
        """Make room for a waiter that fits no open slot on the one that costs least to
        clear; None when none can be cleared (it waits)."""
        placer = self._placer
        plans = []
        for key in open_slots:
            plan = placer.preemption_plan(lease, key, band)
            if plan is not None:
                cost = (*plan_cost(plan), placer.slot_preference(lease, key))
                plans.append((cost, key, plan))
        if not plans:
            return None
        _, key, plan = min(plans, key=lambda p: p[0])
        reserved.add(key)
        actions = self._moves.preempt_for(lease, key, plan, now)
        if lease.state == LeaseState.RUNNING:
            return actions  # nothing had to leave first
        # It waits for what must leave: its notice says what is being freed.
        notice = self._notices.queue_notice(lease, [key], now, ahead, force_reason=lease.reason)
        return actions + notice

    def _needs_no_turn(self, lease: Lease, reserved: set[str]) -> bool:
        """Whether a waiter (not a gang's rank) has nothing to gain from a turn: held by the
        watchdog, detached, a park its session has not asked back, or making room already
        (the slot it is made room on stays reserved)."""
        if lease.held_by_watchdog or lease.detached:
            return True
        if lease.parks_session and not lease.restore_wanted:
            return True  # parked memory comes back when its session asks, not before
        if lease.pending_level is not None:
            reserved.add(lease.slot)  # type: ignore[arg-type]
            return True
        if lease.awaiting_memory_from:
            reserved.add(lease.target_slot)  # type: ignore[arg-type]
            return True
        return False

    def _serve_every_waiter(self, now: float) -> list[Action]:
        """The pass as a full recomputation: every waiter served in turn."""
        actions: list[Action] = []
        reserved: set[str] = set()
        waited_for: set[str] = set()
        ahead = 0  # queued leases ranked higher that still wait after their turn
        queue = sorted(
            self._book.index.waiters.values(), key=lambda lease: self._book.queue_key(lease, now)
        )
        for lease in queue:
            actions.extend(self.serve(lease, reserved, waited_for, ahead, now))
            if lease.state == LeaseState.QUEUED and lease.rank == 0:
                ahead += 1
        return actions

    def _take_turn(self, state: _Pass, place: Place, group: _RequestGroup | None) -> None:
        lease = place.lease
        self._tell_passed_over(state, place.ticket)  # before anything changes
        ahead = state.ahead_of(self._line, place.ticket)
        turn = self.serve(lease, state.reserved, state.waited_for, ahead, state.now, recall=True)
        for action in turn:
            if isinstance(action, GrantLease):  # a gang's names its ranks
                for granted in action.ranks or (action,):
                    self._granted(granted.lease_id)
        state.actions.extend(turn)
        state.served.add(lease.lease_id)
        if (
            group is not None
            and lease.state == LeaseState.QUEUED
            and not lease.awaiting_memory_from
        ):
            group.looks.add(self._notices.look_of(group.wanted))  # it was told where it stands
        self._close_groups(state)

    def _close_groups(self, state: _Pass) -> None:
        """Close the groups whose candidate slots are now all reserved or waited for."""
        size = len(state.reserved) + len(state.waited_for)
        if size == state.blocked_size:
            return
        state.blocked_size = size
        blocked = state.reserved | state.waited_for
        for group in state.groups:
            if group.open and group.candidates <= blocked:
                group.open = False
                group.settled = group.served

    # ---- telling the passed over

    def _tell_passed_over(self, state: _Pass, before: float) -> None:
        """Tell the requests passed over ahead of ticket ``before`` where they stand, where
        that may have changed: their place as a notice tells it, how their slots look, or
        a reset notice.

        Nothing has changed since their turn: this runs before every turn (and at the end
        of the pass), and a turn is the only thing in a pass that changes anything."""
        line = self._line
        due: dict[int, int | None] = {}  # ticket: its index in line.counted, if known
        stop = line.counted_before(before)
        moved_to = min(stop, state.changed_from)
        if state.walked < moved_to and state.move_tickets:
            self._tell_moved(state, state.walked, moved_to, due)
        for index in range(max(state.walked, state.changed_from), stop):
            ticket = line.counted[index]
            if line.at(ticket).lease.lease_id not in state.served:
                due[ticket] = index
        state.walked = max(state.walked, stop)
        self._tell_changed_looks(state, before, due)
        if self._notice_due:
            self._tell_reset(state, before, due)
        if due:
            self._tell_due(state, due)

    def _tell_moved(self, state: _Pass, start: int, stop: int, due: dict[int, int | None]) -> None:
        """Add to ``due`` the passed-over requests in ``counted[start:stop]`` whose place,
        as a notice tells it, the requests that joined or left ahead of them changed.

        Between two moves every request stands the same number of places from where it
        was last told, so only those whose place crosses a round number
        (:func:`places_told_anew`) are looked at: a grant at the head of a thousand
        waiters looks at a few dozen of them, not at every one."""
        line = self._line
        counted, tickets, deltas = line.counted, state.move_tickets, state.move_deltas
        next_move = bisect.bisect_left(tickets, counted[start])
        moved = sum(deltas[:next_move])  # how far those behind the moves so far stand back
        index = start
        while index < stop:
            while next_move < len(tickets) and tickets[next_move] < counted[index]:
                moved += deltas[next_move]
                next_move += 1
            end = stop
            if next_move < len(tickets):
                end = min(stop, bisect.bisect_right(counted, tickets[next_move], index))
            if moved:
                granted = bisect.bisect_left(state.granted, counted[index])
                first, last = index + 1 - granted, end - granted  # their places, now
                for place in places_told_anew(first, last, moved):
                    at = place - 1 + granted
                    ticket = counted[at]
                    if line.at(ticket).lease.lease_id not in state.served:
                        due[ticket] = at
            index = end

    def _tell_changed_looks(self, state: _Pass, before: float, due: dict[int, int | None]) -> None:
        """Add to ``due`` the passed-over requests whose slots look otherwise than when
        they were last told."""
        for group in state.groups:
            end = bisect.bisect_left(group.tickets, before)
            if group.open or group.settled >= end:
                continue
            look = self._notices.look_of(group.wanted)
            group.looks.add(look)
            if look != self._told_looks.get(group.wanted):
                for ticket in group.tickets[group.settled : end]:
                    due.setdefault(ticket, None)
            group.settled = end

    def _tell_reset(self, state: _Pass, before: float, due: dict[int, int | None]) -> None:
        """Add to ``due`` the passed-over requests to tell anew whatever changed."""
        line = self._line
        for lease_id in list(self._notice_due):
            place = line.places.get(lease_id)
            if place is None or lease_id in state.served:
                self._notice_due.discard(lease_id)
            elif place.ticket < before:
                due.setdefault(place.ticket, None)
                self._notice_due.discard(lease_id)

    def _tell_due(self, state: _Pass, due: dict[int, int | None]) -> None:
        """Tell the requests in ``due`` (ticket: index in the counted, if known) where
        they stand, in line order."""
        line = self._line
        notices = self._notices
        telling: dict[tuple, tuple] = {}  # per wanted slots: what all their requests hear
        reasons: dict[tuple, str] = {}  # per wanted slots and whether anyone is ahead
        for ticket in sorted(due):
            place = line.at(ticket)
            index = due[ticket]
            if index is None:
                index = line.counted_before(ticket)
            ahead = index - bisect.bisect_left(state.granted, ticket)
            lease, wanted = place.lease, place.group
            if wanted not in telling:
                telling[wanted] = notices.what_they_hear(wanted)  # type: ignore[arg-type]
            keys, holders, same_reason = telling[wanted]
            reason = reasons.get((wanted, bool(ahead)), "") if same_reason else ""
            if not reason:
                reason = notices.queue_reason(lease, keys, holders, ahead)
                reasons[(wanted, bool(ahead))] = reason
            lease.target_slot = None
            state.actions.extend(notices.tell_queued(lease, holders, reason, ahead, state.now))

    def _end_pass(self, state: _Pass) -> None:
        """Everyone was told where they stand: the line starts the next pass clean."""
        line = self._line
        for ticket in state.granted:
            line.remove(line.at(ticket).lease.lease_id, state.now)
        line.told()
        self._told_looks = {
            group.wanted: next(iter(group.looks)) if len(group.looks) == 1 else None
            for group in state.groups
        }
        self._notice_due.clear()

    # ---- the waiting line

    def _drop_line(self) -> None:
        """Stop keeping the waiting line (the next pass that needs it sorts it afresh)."""
        index = self._book.index
        if self._line_policy is not None or index.changed:
            self._line_policy = None
            index.changed.clear()
            self._notice_due.clear()
            self.quiet_turns.clear()

    def _catch_up_line(self, now: float) -> None:
        """Bring the waiting line up to date with the leases changed since the last pass
        (or sort it afresh when time or a new policy may have changed its order, or the
        line was not kept)."""
        index = self._book.index
        changed = index.take_changed()
        line = self._line
        policy = self._book.policy
        if policy is not self._line_policy or not line.in_order_at(now):
            self._line_policy = policy
            self._aging_rates.clear()
            places = [self._line_place(lease) for lease in index.waiters.values()]
            line.rebuild(places, now)
            self._told_looks.clear()  # nobody is known to have been told anything yet
            self._notice_due.clear()
            self.quiet_turns.clear()
            return
        for lease in changed:
            if lease.lease_id not in index.waiters:
                self.quiet_turns.forget(lease.lease_id)  # its turns are over
            wanted = self._line_place(lease) if lease.lease_id in index.waiters else None
            line.update(lease.lease_id, wanted, now)
            if wanted is not None and wanted.group != OTHERS:
                self._notice_due.add(lease.lease_id)

    def _line_place(self, lease: Lease) -> Place:
        """Where a waiter belongs in the waiting line."""
        who = (lease.identity.user, lease.identity.groups)
        rate = self._aging_rates.get(who)
        if rate is None:
            rate = self._aging_rates[who] = self._book.policy.limits_for(*who).aging_per_minute
        plain = (
            lease.state == LeaseState.QUEUED
            and lease.gang is None
            and not lease.detached
            and not lease.awaiting_memory_from
            and lease.pending_level is None
            and not lease.parks_session
        )
        return Place(
            lease=lease,
            group=tuple(self._finder.wanted_slots(lease)) if plain else OTHERS,
            counted=lease.state == LeaseState.QUEUED and lease.rank == 0,
            trajectory=Trajectory(
                start=lease.base_priority + lease.aging_bonus,
                since=lease.state_since,
                rate=rate,
                arrival=lease.arrival,
            ),
        )
