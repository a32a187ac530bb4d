"""The core's index: it agrees with a recount, notices a change made behind its back, and
keeps an event's cost flat as the leases grow from ten to a thousand."""

from __future__ import annotations

import time

from scheduler_helpers import GIB, HIGH, LOW, MIB, NORMAL, Hub, of_type

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.lease_index import exact_share
from gpushare_ext.broker.settings.policy import parse_policy
from gpushare_ext.protocol import LeaseState, PreemptionLevel, SliceWish

MANY = parse_policy("[defaults]\nmax_leases = 10000\n")


def test_the_index_agrees_with_a_recount_through_a_busy_story():
    hub = Hub(policy=MANY)  # Hub checks the index after every event
    ada, bo, cy = hub.open("ada"), hub.open("bo"), hub.open("cy")
    for n in range(4):
        hub.request(ada, f"S{n}", memory=10 * GIB, sm_share=0.25)
    hub.request(bo, "X", memory=10 * GIB, slice=SliceWish.EXCLUSIVE)
    hub.request(bo, "L1", priority=LOW, memory=100 * GIB)
    actions = hub.request(cy, "H1", priority=HIGH, memory=120 * GIB)
    for preempt in of_type(actions, core.PauseLease):
        hub.applied(preempt.lease_id, preempt.level)
    hub.advance(30)
    hub.release(cy, "H1")
    hub.memory_seen(hub.pid_of(ada), 200 * GIB)
    hub.close(bo)
    hub.advance(30)
    assert hub.scheduler.index_mismatch() == ""
    held, running = hub.scheduler.slot_usage("0")
    assert held == sum(
        lease.memory_bytes
        for lease in hub.scheduler.leases.values()
        if lease.state in (LeaseState.RUNNING, LeaseState.PAUSED)
    )
    assert running == [
        lease for lease in hub.scheduler.leases.values() if lease.state == LeaseState.RUNNING
    ]


def test_a_lease_changed_behind_the_index_is_named():
    hub = Hub()
    ada = hub.open("ada")
    hub.request(ada, "L1", memory=8 * GIB)
    hub.scheduler.leases["L1"].state = LeaseState.PAUSED  # not through the index
    assert "slot 0" in hub.scheduler.index_mismatch()


def test_spatial_shares_are_summed_exactly_however_leases_come_and_go():
    hub = Hub(policy=MANY)
    ada = hub.open("ada")
    for round_ in range(50):
        for n in range(3):
            hub.request(ada, f"T{round_}-{n}", memory=1 * GIB, sm_share=0.1)
        for n in range(3):
            hub.release(ada, f"T{round_}-{n}")
    for n in range(9):
        hub.request(ada, f"K{n}", memory=1 * GIB, sm_share=0.1)
    load = hub.scheduler.book.index.slots["0"]
    assert load.shares == 9 * exact_share(0.1)


def test_an_eviction_awaited_is_tracked_until_it_lands():
    hub = Hub()
    ada, bo = hub.open("ada"), hub.open("bo")
    hub.request(ada, "L1", priority=LOW, memory=100 * GIB)
    actions = hub.request(bo, "H1", priority=HIGH, memory=100 * GIB)
    [preempt] = of_type(actions, core.PauseLease)
    assert preempt.level == PreemptionLevel.EVICT
    assert set(hub.scheduler.book.index.making_room) == {"H1"}
    hub.applied("L1", PreemptionLevel.EVICT)
    assert hub.scheduler.book.index.making_room == {}
    assert hub.state("H1") == LeaseState.RUNNING


def _cost_per_event(leases: int) -> float:
    """Best of five: µs per event releasing and asking again among ``leases`` leases."""
    hub = Hub(policy=MANY)
    hub.check_index = False  # the recount is what the index saves
    sessions = [hub.open(f"u{n % 20}", uid=3000 + n % 20) for n in range(leases)]
    ids = [f"L{n}" for n in range(leases)]
    for n, session in enumerate(sessions):
        hub.request(session, ids[n], priority=NORMAL, memory=64 * MIB)
    best = float("inf")
    for attempt in range(5):
        started = time.perf_counter()
        for r in range(40):
            n = (attempt * 40 + r) % leases
            hub.release(sessions[n], ids[n])
            ids[n] = f"L{n}x{attempt}-{r}"
            hub.request(sessions[n], ids[n], priority=NORMAL, memory=64 * MIB)
            hub.advance(0.01)
        best = min(best, (time.perf_counter() - started) / 120)
    return best * 1e6


def test_an_event_costs_about_the_same_with_ten_leases_and_with_a_thousand():
    few, many = _cost_per_event(10), _cost_per_event(1000)
    # A scan over every lease made this ratio about 50; the index keeps it near 1.
    assert many < 4 * few, f"{few:.1f} µs per event with 10 leases, {many:.1f} with 1000"
