"""The stop sub-state's tables and the core's one transition function.

A lease's stop (the ladder level asked of the actuators, the level they confirmed, and
the watchdog, detached and restore flags) moves along ``STOP_MOVES`` and ``FLAG_MOVES``;
:func:`~gpushare_ext.broker.scheduler.lease_transitions.transition` checks both tables and the
main state's before it changes anything.  Generated sequences of moves (hypothesis)
keep the invariants when allowed, and change nothing when refused."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpushare_ext.broker.scheduler.lease_index import LeaseIndex
from gpushare_ext.broker.scheduler.lease_transitions import transition
from gpushare_ext.broker.scheduler.scheduler_records import Identity, Lease
from gpushare_ext.lease_state import (
    ENDED,
    FLAG_MOVES,
    STOP_MOVES,
    STOPPED,
    IllegalMove,
    IllegalStop,
    LeaseState,
    PreemptionLevel,
    StopStage,
    StopState,
    check_stop,
    stopped_state,
)
from gpushare_ext.protocol import Capabilities, SliceWish

SLOT = "0"


def a_lease(state: LeaseState = LeaseState.QUEUED) -> Lease:
    return Lease(
        lease_id="L1",
        session_id="S1",
        identity=Identity(uid=1000, gid=1000, pid=4242, user="ada"),
        base_priority=150,
        memory_bytes=1 << 30,
        sm_share=1.0,
        slice=SliceWish.AUTO,
        device_wish="",
        capabilities=Capabilities(),
        label="",
        arrival=1,
        requested_at=0.0,
        state=state,
        slot=SLOT,
    )


def snapshot(lease: Lease) -> dict:
    return dataclasses.asdict(lease)


def test_a_stop_results_in_eviction_at_the_checkpoint_only():
    assert stopped_state(PreemptionLevel.EVICT) == LeaseState.EVICTED
    for level in list(PreemptionLevel)[:-1]:
        assert stopped_state(level) == LeaseState.PAUSED


def test_every_stage_is_reachable_and_every_stage_can_be_cleared():
    reached, frontier = {StopStage.NONE}, [StopStage.NONE]
    while frontier:
        for onward in STOP_MOVES[frontier.pop()] - reached:
            reached.add(onward)
            frontier.append(onward)
    assert reached == set(StopStage)
    assert all(StopStage.NONE in onward for onward in STOP_MOVES.values())


def test_the_named_moves_reach_the_stages_they_say():
    none = StopState()
    asked = none.asked(PreemptionLevel.LOCK)
    held = asked.confirmed(PreemptionLevel.LOCK)
    raised = held.asked(PreemptionLevel.EVICT)
    assert [s.stage for s in (none, asked, held, raised)] == [
        StopStage.NONE,
        StopStage.ASKED,
        StopStage.HELD,
        StopStage.RAISED,
    ]
    assert raised.highest == PreemptionLevel.EVICT and none.highest is None
    assert raised.failed() == held and raised.cleared().stage == StopStage.NONE


@pytest.mark.parametrize(
    ("current", "wanted", "words"),
    [
        (StopState(), StopState(applied_level=PreemptionLevel.LOCK), "from none to held"),
        (
            StopState(applied_level=PreemptionLevel.LOCK),
            StopState(pending_level=PreemptionLevel.EVICT),
            "from held to asked",
        ),
        (StopState(held_by_watchdog=True), StopState(), "held_by_watchdog"),
        (StopState(), StopState(detached=True), "detached"),
    ],
)
def test_an_illegal_stop_is_named_in_one_line(current, wanted, words):
    with pytest.raises(IllegalStop) as raised:
        check_stop("L7", LeaseState.PAUSED, current, wanted)
    message = str(raised.value)
    assert "\n" not in message and "L7" in message and words in message
    assert raised.value.code == "illegal_stop"


def test_a_lease_that_is_not_stopped_has_no_stop_level():
    asked = StopState(pending_level=PreemptionLevel.GATE)
    for state in set(LeaseState) - STOPPED:
        with pytest.raises(IllegalStop):
            check_stop("L1", state, StopState(), asked)
    assert check_stop("L1", LeaseState.PAUSED, StopState(), asked) == asked


def test_a_lease_cannot_leave_its_stop_behind_when_it_moves_on():
    """A move of the main state alone checks the stop it keeps: a paused lease with a
    level asked cannot run on with it."""
    lease = a_lease(LeaseState.RUNNING)
    transition(lease, 1.0, state=LeaseState.PAUSED, stop=StopState().asked(PreemptionLevel.GATE))
    with pytest.raises(IllegalStop, match="has no stop level"):
        transition(lease, 2.0, state=LeaseState.RUNNING, reason="resumed")
    assert lease.state == LeaseState.PAUSED and lease.pending_level == PreemptionLevel.GATE
    assert lease.state_since == 1.0 and lease.reason != "resumed"


def test_the_completed_eviction_keeps_when_the_pause_began():
    lease = a_lease(LeaseState.RUNNING)
    transition(lease, 10.0, state=LeaseState.PAUSED, stop=StopState().asked(PreemptionLevel.EVICT))
    confirmed = lease.stop.confirmed(PreemptionLevel.EVICT)
    transition(lease, 20.0, state=LeaseState.EVICTED, stop=confirmed)
    assert lease.state_since == 10.0 and lease.applied_level == PreemptionLevel.EVICT
    transition(lease, 30.0, state=LeaseState.RUNNING, stop=confirmed.cleared(), reason="")
    assert lease.state_since == 30.0 and lease.applied_level is None


def test_a_restore_asked_waits_from_then_and_a_cancel_keeps_the_time():
    lease = a_lease(LeaseState.EVICTED)
    lease.state_since = 5.0
    transition(lease, 7.0, stop=replace(lease.stop, restore_wanted=False))
    assert lease.state_since == 5.0
    transition(lease, 9.0, stop=replace(lease.stop, restore_wanted=True))
    assert lease.state_since == 9.0 and lease.restore_wanted
    transition(lease, 11.0, reason="still waiting")  # nothing asked: the time stays
    assert lease.state_since == 9.0


def test_only_a_restore_asked_alone_reads_as_a_restore_ask():
    held = StopState().confirmed(PreemptionLevel.EVICT)
    restore = replace(held, restore_wanted=True)
    assert restore.asks_restore_of(held)
    assert not held.asks_restore_of(restore)  # a cancel
    assert not replace(restore, held_by_watchdog=True).asks_restore_of(held)  # and more


# ---- generated sequences

LEVELS = st.sampled_from(list(PreemptionLevel))
STOP_CHANGES = st.one_of(
    st.builds(lambda level: ("asked", level), LEVELS),
    st.builds(lambda level: ("confirmed", level), LEVELS),
    st.just(("failed", None)),
    st.just(("cleared", None)),
    st.builds(
        lambda flag, on: ("flag", (flag, on)), st.sampled_from(sorted(FLAG_MOVES)), st.booleans()
    ),
    st.just(("none", None)),
)
MOVES_TRIED = st.lists(
    st.tuples(st.none() | st.sampled_from(list(LeaseState)), STOP_CHANGES), max_size=25
)


def changed_stop(stop: StopState, change: tuple) -> StopState | None:
    kind, argument = change
    if kind == "asked":
        return stop.asked(argument)
    if kind == "confirmed":
        return stop.confirmed(argument)
    if kind == "failed":
        return stop.failed()
    if kind == "cleared":
        return stop.cleared()
    if kind == "flag":
        flag, on = argument
        return replace(stop, **{flag: on})
    return None


@settings(max_examples=300, deadline=None)
@given(moves=MOVES_TRIED, start_detached=st.booleans())
def test_allowed_moves_keep_the_invariants_and_refused_ones_change_nothing(moves, start_detached):
    lease = a_lease()
    lease.stop = StopState(detached=start_detached)
    index = LeaseIndex([SLOT])
    index.add(lease)
    now = 0.0
    for state, change in moves:
        now += 1.0
        before, stop_before = snapshot(lease), lease.stop
        stop = changed_stop(stop_before, change)
        try:
            transition(lease, now, state=state, stop=stop, reason=f"at {now}", index=index)
        except (IllegalMove, IllegalStop):
            assert snapshot(lease) == before
            assert index.mismatch([lease]) == ""
            continue
        after = lease.stop
        assert after.stage in STOP_MOVES[stop_before.stage]
        assert lease.state in STOPPED or after.stage == StopStage.NONE
        for flag, allowed in FLAG_MOVES.items():
            assert (getattr(stop_before, flag), getattr(after, flag)) in allowed
        assert lease.reason == f"at {now}"
        if state is not None and (before["state"], state) != (
            LeaseState.PAUSED,
            LeaseState.EVICTED,
        ):
            assert lease.state_since == now
        assert index.mismatch([lease]) == ""
        if lease.state in ENDED:
            assert after.stage == StopStage.NONE
            break
