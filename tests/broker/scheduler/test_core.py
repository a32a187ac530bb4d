"""The scheduler core, example by example: what a notebook user sees happen to their cell."""

from __future__ import annotations

import pytest
from scheduler_helpers import (
    GATED,
    GIB,
    HIGH,
    LOW,
    MIB,
    NORMAL,
    UNINSTRUMENTED,
    YIELDING,
    Hub,
    fingerprint,
    h200_devices,
    mig_devices,
    of_type,
    only,
)

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.settings.policy import Limits, Policy, parse_policy
from gpushare_ext.protocol import Capabilities, ErrorCode, LeaseState, PreemptionLevel, SliceWish

# ------------------------------------------------------------------ preemption


@pytest.mark.parametrize(
    ("capabilities", "level"),
    [
        (UNINSTRUMENTED, PreemptionLevel.LOCK),
        (YIELDING, PreemptionLevel.YIELD),
        (GATED, PreemptionLevel.LOCK),
    ],
    ids=["uninstrumented-lock", "instrumented-yield", "gated-without-flag-lock"],
)
def test_high_preempts_low_immediately_at_the_cheapest_level(capabilities, level):
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW, capabilities=capabilities)

    actions = hub.request(explorer, "high", priority=HIGH)

    preempt = only(actions, core.PauseLease)
    assert (preempt.lease_id, preempt.level, preempt.for_lease) == ("low", level, "high")
    assert not preempt.keeps_lock  # a failed pause is undone: it runs on, time-sliced
    assert preempt.pid == hub.pid_of(trainer)
    grant = only(actions, core.GrantLease)
    assert grant.lease_id == "high"
    # The grant does not wait for the drain: it comes in the same step, after the preempt.
    assert actions.index(preempt) < actions.index(grant)
    assert hub.state("low") == LeaseState.PAUSED
    assert hub.state("high") == LeaseState.RUNNING
    assert "higher-priority" in hub.lease("low").reason


def test_requests_of_equal_priority_are_served_first_come_first_served():
    hub = Hub()
    holder, first, second = hub.open("holder"), hub.open("first"), hub.open("second")
    hub.request(holder, "L1", memory=100 * GIB)
    queued_first = only(hub.request(first, "L2", memory=100 * GIB), core.NotifyQueued)
    queued_second = only(hub.request(second, "L3", memory=100 * GIB), core.NotifyQueued)
    assert (queued_first.position, queued_second.position) == (1, 2)

    actions = hub.release(holder, "L1")

    assert [g.lease_id for g in of_type(actions, core.GrantLease)] == ["L2"]
    assert hub.state("L3") == LeaseState.QUEUED
    assert hub.scheduler.queued_position("L3") == 1


def test_leases_of_the_same_band_time_slice_one_gpu():
    hub = Hub()
    alice, bob = hub.open("alice"), hub.open("bob")
    first = hub.request(alice, "L1", priority=NORMAL)
    second = hub.request(bob, "L2", priority=NORMAL + 30)

    assert only(first, core.GrantLease).placement.device_index == 0
    assert only(second, core.GrantLease).placement.device_index == 0
    assert not of_type(second, core.PauseLease)
    assert hub.state("L1") == hub.state("L2") == LeaseState.RUNNING


def test_exclusive_sharing_runs_one_lease_per_gpu():
    hub = Hub(policy=Policy(sharing="exclusive"))
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.request(alice, "L1", priority=NORMAL)

    queued = only(hub.request(bob, "L2", priority=NORMAL), core.NotifyQueued)

    assert queued.waiting_for == ("L1",)
    assert "normal-priority" in queued.reason
    assert only(hub.release(alice, "L1"), core.GrantLease).lease_id == "L2"


def test_an_exclusive_slice_wish_is_not_shared_even_when_sharing_is_timeslice():
    hub = Hub()
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.request(alice, "L1", slice=SliceWish.EXCLUSIVE)
    assert of_type(hub.request(bob, "L2"), core.NotifyQueued)


def test_leases_whose_sm_shares_fit_share_a_gpu_across_bands_without_preemption():
    hub = Hub()
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.request(alice, "low", priority=LOW, sm_share=0.5)
    actions = hub.request(bob, "high", priority=HIGH, sm_share=0.5)
    grant = only(actions, core.GrantLease)
    assert not of_type(actions, core.PauseLease)
    assert grant.placement.max_blocks_per_sm_share == 66  # half of 132 SMs


def test_a_grant_that_needs_memory_waits_for_the_eviction():
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW, memory=100 * GIB)

    actions = hub.request(explorer, "high", priority=HIGH, memory=100 * GIB)

    preempt = only(actions, core.PauseLease)
    assert (preempt.lease_id, preempt.level) == ("low", PreemptionLevel.EVICT)
    assert preempt.keeps_lock  # a failed eviction leaves it paused, its memory on the device
    assert not of_type(actions, core.GrantLease)
    assert "evicted" in only(actions, core.NotifyQueued).reason
    assert hub.state("high") == LeaseState.QUEUED

    actions = hub.applied("low", PreemptionLevel.EVICT)

    assert only(actions, core.GrantLease).lease_id == "high"
    assert hub.state("low") == LeaseState.EVICTED
    # Once the high lease is done, the evicted one comes back (restore, then unlock).
    resume = only(hub.release(explorer, "high"), core.ResumeLease)
    assert (resume.lease_id, resume.undo_level) == ("low", PreemptionLevel.EVICT)


def test_a_failed_lock_leaves_the_victim_running_and_the_newcomer_granted():
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW)
    hub.request(explorer, "high", priority=HIGH)

    actions = hub.failed("low", PreemptionLevel.LOCK, "CUDA_ERROR_NOT_SUPPORTED (MPS client)")

    assert not of_type(actions, core.RevokeLease)
    assert hub.state("low") == LeaseState.RUNNING
    assert hub.state("high") == LeaseState.RUNNING
    assert "could not be paused" in hub.lease("low").reason
    # It is not tried again: the next high request time-slices with it.
    third = hub.open("third")
    assert not of_type(hub.request(third, "high2", priority=HIGH), core.PauseLease)


def test_a_paused_lease_resumes_when_the_high_lease_is_released():
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW)
    hub.request(explorer, "high", priority=HIGH)
    hub.applied("low", PreemptionLevel.LOCK)
    hub.advance(42)

    actions = hub.release(explorer, "high")

    resume = only(actions, core.ResumeLease)
    assert resume.lease_id == "low"
    assert resume.undo_level == PreemptionLevel.LOCK
    assert resume.paused_s == pytest.approx(42)
    assert hub.state("low") == LeaseState.RUNNING


def test_a_paused_lease_does_not_resume_while_the_high_lease_runs():
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW)
    hub.request(explorer, "high", priority=HIGH)
    hub.applied("low", PreemptionLevel.LOCK)
    for _ in range(5):
        assert not of_type(hub.advance(5), core.ResumeLease)
    assert hub.state("low") == LeaseState.PAUSED


# ------------------------------------------------------------------ policy


def test_policy_max_priority_clamps_with_a_notice():
    hub = Hub(policy=parse_policy('[groups.students]\nmax_priority = "normal"\n'))
    student = hub.open("student", groups=("students",))

    grant = only(hub.request(student, "L1", priority=HIGH), core.GrantLease)

    assert grant.priority == NORMAL
    assert grant.notice == "priority lowered from high to normal by policy"


def test_memory_over_quota_is_refused_by_policy():
    hub = Hub(policy=Policy(defaults=Limits(memory_quota=16 * GIB)))
    alice = hub.open("alice")

    refuse = only(hub.request(alice, "L1", memory=40 * GIB), core.RefuseRequest)

    assert refuse.code == ErrorCode.POLICY
    assert "40.0 GiB asked" in refuse.message and "16.0 GiB" in refuse.message
    assert "L1" not in hub.scheduler.leases


def test_a_lease_without_memory_gets_the_default_capped_by_the_quota():
    hub = Hub(policy=Policy(defaults=Limits(memory_quota=4 * GIB, default_memory=8 * GIB)))
    alice = hub.open("alice")
    grant = only(hub.request(alice, "L1", memory=None), core.GrantLease)
    assert grant.placement.memory_bytes == 4 * GIB


def test_max_leases_counts_held_and_waiting_leases():
    hub = Hub(policy=Policy(defaults=Limits(max_leases=2)))
    alice = hub.open("alice")
    hub.request(alice, "L1")
    hub.request(alice, "L2")

    refuse = only(hub.request(alice, "L3"), core.RefuseRequest)

    assert refuse.code == ErrorCode.POLICY
    assert "2 lease(s)" in refuse.message
    hub.release(alice, "L1")
    assert of_type(hub.request(alice, "L4"), core.GrantLease)


def test_a_drained_device_queues_new_requests_until_undrained():
    hub = Hub()
    alice = hub.open("alice")
    hub.drain(0)

    queued = only(hub.request(alice, "L1"), core.NotifyQueued)

    assert queued.reason == "the device is drained by an admin"
    assert only(hub.drain(0, drained=False), core.GrantLease).lease_id == "L1"


def test_draining_an_unknown_device_is_an_error_and_changes_nothing():
    hub = Hub()
    before = fingerprint(hub.scheduler)
    with pytest.raises(core.SchedulerError) as raised:
        hub.drain(5)
    assert raised.value.code == ErrorCode.INVALID
    assert fingerprint(hub.scheduler) == before


# ------------------------------------------------------------------ placement


def test_device_wish_by_index():
    hub = Hub(h200_devices(2))
    alice = hub.open("alice")
    assert only(hub.request(alice, "L1", device="1"), core.GrantLease).placement.device_index == 1


def test_device_wish_by_uuid():
    devices = h200_devices(2)
    hub = Hub(devices)
    alice = hub.open("alice")
    grant = only(hub.request(alice, "L1", device=devices[1].uuid), core.GrantLease)
    assert grant.placement.device_uuid == devices[1].uuid


@pytest.mark.parametrize(
    ("wish", "words"),
    [("7", "there is no device 7"), ("GPU-nope", "no device or MIG instance has the UUID")],
)
def test_an_impossible_device_wish_is_refused_as_invalid(wish, words):
    hub = Hub(h200_devices(2))
    alice = hub.open("alice")
    refuse = only(hub.request(alice, "L1", device=wish), core.RefuseRequest)
    assert refuse.code == ErrorCode.INVALID
    assert words in refuse.message


def test_a_request_bigger_than_any_device_is_refused():
    hub = Hub()
    alice = hub.open("alice")
    refuse = only(hub.request(alice, "L1", memory=200 * GIB), core.RefuseRequest)
    assert refuse.code == ErrorCode.INVALID
    assert "does not fit" in refuse.message


@pytest.mark.parametrize(
    ("memory", "profile"),
    [(10 * GIB, "1g.18gb"), (20 * GIB, "2g.35gb"), (50 * GIB, "3g.71gb")],
)
def test_mig_instances_are_placed_best_fit(memory, profile):
    hub = Hub(mig_devices())
    alice = hub.open("alice")

    grant = only(hub.request(alice, "L1", memory=memory), core.GrantLease)

    assert grant.placement.mig_profile == profile
    assert grant.placement.cuda_visible_devices.startswith("MIG-")


def test_best_fit_moves_to_the_next_instance_when_the_smallest_is_busy():
    hub = Hub(mig_devices(), policy=Policy(sharing="exclusive"))
    alice, bob = hub.open("alice"), hub.open("bob")
    first = only(hub.request(alice, "L1", memory=10 * GIB), core.GrantLease)
    second = only(hub.request(bob, "L2", memory=10 * GIB), core.GrantLease)
    assert (first.placement.mig_profile, second.placement.mig_profile) == ("1g.18gb", "2g.35gb")


def test_mig_layout_refuses_a_shared_slice_and_oversized_requests():
    hub = Hub(mig_devices())
    alice = hub.open("alice")
    shared = only(hub.request(alice, "L1", slice=SliceWish.SHARED), core.RefuseRequest)
    assert "cut into MIG instances" in shared.message
    too_big = only(hub.request(alice, "L2", memory=100 * GIB), core.RefuseRequest)
    assert "does not fit" in too_big.message


def test_mig_wish_without_mig_is_refused():
    hub = Hub()
    alice = hub.open("alice")
    refuse = only(hub.request(alice, "L1", slice=SliceWish.MIG), core.RefuseRequest)
    assert "MIG is off" in refuse.message


# ------------------------------------------------------------------ watchdog and errors


def test_the_memory_watchdog_pauses_an_over_quota_lease_at_lock_and_keeps_it_paused():
    hub = Hub()
    alice = hub.open("alice")
    hub.request(alice, "L1", memory=8 * GIB)
    pid = hub.pid_of(alice)

    assert hub.memory_seen(pid, 8 * GIB + 32 * MIB) == []  # context overhead is tolerated
    actions = hub.memory_seen(pid, 12 * GIB)

    preempt = only(actions, core.PauseLease)
    assert (preempt.lease_id, preempt.level, preempt.for_lease) == ("L1", PreemptionLevel.LOCK, "")
    assert "over its memory quota" in preempt.reason
    hub.applied("L1", PreemptionLevel.LOCK)
    for _ in range(10):
        assert not of_type(hub.advance(600), core.ResumeLease)
    assert hub.state("L1") == LeaseState.PAUSED
    # Releasing it is the way out, and the release undoes the lock.
    ended = only(hub.release(alice, "L1"), core.LeaseEnded)
    assert ended.undo_level == PreemptionLevel.LOCK


def test_releasing_an_unknown_lease_raises_and_changes_nothing():
    hub = Hub()
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.request(alice, "L1", priority=LOW)
    hub.request(bob, "L2", priority=HIGH)
    before = fingerprint(hub.scheduler)

    with pytest.raises(core.SchedulerError) as raised:
        hub.release(alice, "L99")

    assert raised.value.code == ErrorCode.UNKNOWN_LEASE
    assert fingerprint(hub.scheduler) == before


def test_releasing_another_sessions_lease_is_refused_and_changes_nothing():
    hub = Hub()
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.request(alice, "L1")
    before = fingerprint(hub.scheduler)
    with pytest.raises(core.SchedulerError) as raised:
        hub.release(bob, "L1")
    assert raised.value.code == ErrorCode.PERMISSION
    assert fingerprint(hub.scheduler) == before


def test_an_admin_cancel_revokes_and_ends_the_lease():
    hub = Hub()
    alice = hub.open("alice")
    hub.request(alice, "L1")
    actions = hub.release(alice, "L1", by_admin=True)
    assert only(actions, core.RevokeLease).lease_id == "L1"
    assert hub.state("L1") == LeaseState.REVOKED


def test_a_closed_session_loses_its_leases_and_the_queue_moves_on():
    hub = Hub()
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.request(alice, "L1", memory=100 * GIB)
    hub.request(bob, "L2", memory=100 * GIB)

    actions = hub.close(alice, "its process ended")

    assert only(actions, core.LeaseEnded).reason == "its process ended"
    assert only(actions, core.GrantLease).lease_id == "L2"


def test_a_request_from_an_unknown_session_is_out_of_order():
    hub = Hub()
    with pytest.raises(core.SchedulerError) as raised:
        hub.request("S-ghost", "L1")
    assert raised.value.code == ErrorCode.OUT_OF_ORDER


def test_a_reused_lease_id_is_refused_and_changes_nothing():
    hub = Hub()
    alice = hub.open("alice")
    hub.request(alice, "L1")
    hub.release(alice, "L1")
    before = fingerprint(hub.scheduler)
    with pytest.raises(core.SchedulerError):
        hub.request(alice, "L1")
    assert fingerprint(hub.scheduler) == before


def test_an_unstoppable_victim_time_slices_and_status_can_say_why():
    hub = Hub()
    mps, explorer = hub.open("mps"), hub.open("explorer")
    hub.request(mps, "low", priority=LOW, capabilities=Capabilities(lockable=False))
    actions = hub.request(explorer, "high", priority=HIGH)
    assert not of_type(actions, core.PauseLease)
    assert of_type(actions, core.GrantLease)
    assert not hub.lease("low").lockable


def test_an_event_the_scheduler_has_no_handler_for_is_refused_and_changes_nothing():
    hub = Hub()
    hub.open("ada")
    before = fingerprint(hub.scheduler)

    class Unknown:
        now = 5.0

    with pytest.raises(core.SchedulerError, match="no handler for Unknown") as refused:
        hub.scheduler.handle(Unknown())  # type: ignore[arg-type]
    assert refused.value.code == ErrorCode.INVALID
    assert fingerprint(hub.scheduler) == before
