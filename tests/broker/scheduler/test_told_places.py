"""A queue notice tells what the waiter's session would read, and only when that changes.

A memory-bound queue (issue 44, item 7): ~140 leases of 1 GiB fill an H200 and ~860
wait.  Each release lets the head in, which moves every waiter up one place and replaces
one of the holders; told exactly, each of the ~860 heard a notice at every grant.  Now a
place is told exactly near the head and as a round number further back ("within the first
200"), and the holders by their users (the server names users, not leases), so a grant
tells the first ten and the few whose place crossed a round number -- and the pass only
looks at those, not at every waiter behind the grant.
"""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

from hypothesis import given
from hypothesis import strategies as st
from scheduler_helpers import GIB, NORMAL, Hub, h200_devices, of_type

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.lease_index import OTHERS, Place, Trajectory, WaitingLine
from gpushare_ext.broker.scheduler.queue_notices import QueueNotices
from gpushare_ext.broker.scheduler.scheduling_pass import places_told_anew
from gpushare_ext.broker.settings.policy import parse_policy
from gpushare_ext.protocol import EXACT_PLACES, LeaseState, told_place

# ------------------------------------------------------------------ places as told


def test_a_place_is_told_exactly_near_the_head_and_rounded_up_behind():
    assert [told_place(p) for p in range(1, EXACT_PLACES + 1)] == list(range(1, 11))
    told = {p: told_place(p) for p in (11, 20, 21, 50, 51, 100, 101, 201, 500, 501, 1001, 2001)}
    assert told == {11: 20, 20: 20, 21: 50, 50: 50, 51: 100, 100: 100, 101: 200, 201: 500,
                    500: 500, 501: 1000, 1001: 2000, 2001: 5000}  # fmt: skip


@given(place=st.integers(1, 100_000))
def test_a_told_place_is_that_place_or_further_back(place):
    told = told_place(place)
    assert told >= place and told_place(told) == told
    assert told == place or told_place(place - 1) in (told, place - 1)  # bands are runs


@given(
    first=st.integers(1, 3000),
    length=st.integers(0, 3000),
    moved=st.one_of(st.sampled_from([-1, 1, -2, 2, -10]), st.integers(-1500, 1500)),
)
def test_the_places_told_anew_are_those_that_read_otherwise(first, length, moved):
    last = first + length - 1
    expected = [
        p
        for p in range(first, last + 1)
        if p - moved >= 1 and told_place(p) != told_place(p - moved)
    ]
    found = list(places_told_anew(first, last, moved))
    assert len(found) == len(set(found)) and all(first <= p <= last for p in found)
    assert [p for p in found if p - moved >= 1] == expected


# ------------------------------------------------------------------ a memory-bound queue


def memory_bound(leases: int = 1000, *, every_waiter: bool = False) -> tuple[Hub, list[str]]:
    """``leases`` requests of 1 GiB from 50 users on one H200, as the core benchmark makes
    them: the first ~140 run, the rest wait.  Returns the hub and the sessions in order."""
    hub = Hub(h200_devices(1), parse_policy("[defaults]\nmax_leases = 10000\n"))
    hub.scheduler.passes.recompute_every_waiter = every_waiter
    hub.check_index = False  # checked once at the end: a recount per event is quadratic
    sessions = [hub.open(f"u{n % 50}", uid=2000 + n % 50) for n in range(leases)]
    for n, session in enumerate(sessions):
        hub.request(session, f"L{n}", priority=NORMAL, memory=1 * GIB)
    hub.advance(0.01)
    hub.check_index = True
    return hub, sessions


def release_the_first_running(hub: Hub, sessions: list[str]) -> list[core.Action]:
    lease = next(
        lease for lease in hub.scheduler.leases.values() if lease.state == LeaseState.RUNNING
    )
    return hub.release(lease.session_id, lease.lease_id)


def test_a_grant_at_the_head_of_a_thousand_memory_bound_leases_tells_a_few_waiters():
    hub, sessions = memory_bound()
    waiting = [lease.lease_id for lease in hub.scheduler.queue()]
    assert len(waiting) > 800

    released = release_the_first_running(hub, sessions)

    [granted] = of_type(released, core.GrantLease)
    assert granted.lease_id == waiting[0]
    told = {n.lease_id: n for n in of_type(released, core.NotifyQueued)}
    # The first ten hear their exact places; behind them, only those now at a round
    # number, whose place read the next one up before (the 21st was "within the first
    # 50" and is 20th now).  With every waiter told exactly, this was all ~860.
    places = {waiting[i]: i for i in range(1, len(waiting))}  # place now: index in waiting
    rounded = [20, 50, 100, 200, 500]
    in_order = sorted(told, key=places.get)
    assert in_order == [waiting[place] for place in [*range(1, 11), *rounded]]
    assert [told[w].position for w in in_order] == [*range(1, 11), *rounded]
    # Further back no estimate: it says when the GPU is likely free, when the head gets in.
    assert all(told[waiting[place]].estimate_s is None for place in rounded)
    # A waiter far back whose place reads the same is not told: the 301st was "within
    # the first 500" and still is, and its holders' users are the same fifty.
    assert waiting[300] not in told
    assert hub.scheduler.lease_of(waiting[300]).last_queue_notice[0] == 500


def test_the_pass_looks_only_at_the_waiters_it_tells(monkeypatch):
    hub, sessions = memory_bound()
    looked_at: list[str] = []
    tell = QueueNotices.tell_queued

    def counting(self, lease, *args):
        looked_at.append(lease.lease_id)
        return tell(self, lease, *args)

    monkeypatch.setattr(QueueNotices, "tell_queued", counting)
    for _ in range(5):
        looked_at.clear()
        released = release_the_first_running(hub, sessions)
        # The told and the head of the line served in turn: a few dozen, not ~860.
        assert len(of_type(released, core.NotifyQueued)) == 15
        assert len(looked_at) <= 20, len(looked_at)


def test_a_thousand_memory_bound_leases_hear_what_telling_every_waiter_would_say():
    kept, sessions = memory_bound(400)
    everyone, _ = memory_bound(400, every_waiter=True)
    for step in range(6):
        actions = [release_the_first_running(hub, sessions) for hub in (kept, everyone)]
        assert actions[0] == actions[1], step
        again = [
            hub.request(sessions[step], f"again{step}", memory=1 * GIB) for hub in (kept, everyone)
        ]
        assert again[0] == again[1], step
        assert of_type(again[0], core.NotifyQueued)  # the newcomer hears where it stands


def test_a_holder_replaced_by_another_of_the_same_user_tells_far_back_waiters_nothing():
    hub = Hub(h200_devices(1), parse_policy("[defaults]\nmax_leases = 1000\n"))
    ada, bo = hub.open("ada"), hub.open("bo")
    hub.request(ada, "A1", memory=70 * GIB)
    hub.request(ada, "A2", memory=70 * GIB)
    hub.request(ada, "A3", memory=40 * GIB)  # place 1
    hub.request(bo, "B1", memory=50 * GIB)  # place 2
    waiters = [hub.open(f"w{n}") for n in range(30)]
    for n, session in enumerate(waiters):
        hub.request(session, f"W{n}", memory=100 * GIB)  # places 3..32
    told_before = hub.lease("W25").last_queue_notice

    # A2 ends and A3 takes its place: a holder replaced, everyone a place up, but W25
    # (28th, now 27th) still reads "within the first 50" and "waiting for ada".
    replaced = hub.release(ada, "A2")

    assert hub.state("A3") == LeaseState.RUNNING
    told = {n.lease_id: n.position for n in of_type(replaced, core.NotifyQueued)}
    assert told == {"B1": 1, **{f"W{n}": n + 2 for n in range(9)}, "W18": 20}
    assert hub.lease("W25").last_queue_notice == told_before

    # A1 ends and B1 gets in: bo holds the GPU beside ada now, which every waiter reads.
    joined = hub.release(ada, "A1")

    assert hub.state("B1") == LeaseState.RUNNING
    assert {n.lease_id for n in of_type(joined, core.NotifyQueued)} == {f"W{n}" for n in range(30)}


def test_requests_cutting_in_at_one_spot_until_the_line_is_numbered_afresh():
    # Each newcomer ranks just below the one before and above every earlier waiter, so
    # each lands in the same gap between tickets, halving it, until the line numbers its
    # tickets afresh (after about twenty): the moves it keeps must follow.
    def story(hub: Hub) -> list[list[core.Action]]:
        hub.request(hub.open("holder"), "FULL", priority=NORMAL + 90, memory=140 * GIB)
        for n in range(30):
            hub.request(hub.open(f"w{n}"), f"W{n}", priority=NORMAL, memory=10 * GIB)
        return [
            hub.request(hub.open(f"c{n}"), f"C{n}", priority=NORMAL + 40 - n, memory=10 * GIB)
            for n in range(36)
        ]

    kept, everyone = Hub(h200_devices(1)), Hub(h200_devices(1))
    everyone.scheduler.passes.recompute_every_waiter = True
    renumbered = []
    line = kept.scheduler.passes._line
    number = line._number
    line._number = lambda places: (renumbered.append(len(places)), number(places))[1]
    steps = story(kept)
    assert renumbered  # the line was numbered afresh while newcomers cut in
    assert steps == story(everyone)
    # The last newcomer is 36th ("within the first 50"); W0 went from 1st to 37th.
    [last] = [n for n in of_type(steps[-1], core.NotifyQueued) if n.lease_id == "C35"]
    assert last.position == 50
    assert kept.lease("W0").last_queue_notice[0] == 50


def test_the_lines_moves_say_how_far_each_waiter_stands_from_where_it_was_told():
    def place(name: str, start: float, arrival: int) -> Place:
        trajectory = Trajectory(start=start, since=0.0, rate=0.0, arrival=arrival)
        return Place(lease=SimpleNamespace(lease_id=name), group=OTHERS, counted=True,
                     trajectory=trajectory)  # fmt: skip

    line = WaitingLine()
    line.rebuild([place(f"W{n}", 150.0, n) for n in range(10)], 0.0)
    line.told()
    told = {line.at(t).lease.lease_id: i for i, t in enumerate(line.counted)}
    gaps = []
    for n in range(30):  # each just behind the one before, ahead of every W: one gap
        line.update(f"C{n}", place(f"C{n}", 190.0 - n, 100 + n), 0.0)
        gaps.append(min(b - a for a, b in pairwise(line.tickets)))
        if n in (5, 25):
            line.update(f"W{n // 5}", None, 0.0)  # W1 and W5 leave meanwhile
    assert any(b > a for a, b in pairwise(gaps))  # the tickets were numbered afresh

    for index, ticket in enumerate(line.counted):
        name = line.at(ticket).lease.lease_id
        if name in told:
            moved = sum(delta for at, delta in line.moves if at < ticket)
            assert index - told[name] == moved, name
