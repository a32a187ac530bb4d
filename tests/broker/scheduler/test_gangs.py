"""Gang leases in the scheduler core: several slices asked for at once, for one training
spread over ranks, granted all or nothing, stopped and resumed as one unit."""

from __future__ import annotations

import pytest
from scheduler_helpers import (
    GIB,
    HIGH,
    LOW,
    NORMAL,
    YIELDING,
    Hub,
    h200_devices,
    mig_devices,
    of_type,
    only,
)

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.gangs import assign_ranks, member_id, most_ranks, split_member_id
from gpushare_ext.broker.settings.policy import Limits, Policy
from gpushare_ext.protocol import ErrorCode, LeaseState, PreemptionLevel

SEVEN_SMALL = [{"profile_id": 0, "start": i, "gpu_instance_id": 7 + i} for i in range(7)]


def states(hub: Hub, gang: str) -> list[LeaseState]:
    """The state of each rank of a gang that is still active, in rank order."""
    return [hub.state(m) for m in hub.scheduler.gangs[gang]]


# ------------------------------------------------------------------ the arithmetic


def test_member_ids_name_their_gang_and_rank():
    assert member_id("L7", 3) == "L7.3"
    assert split_member_id("L7.3") == ("L7", 3)
    assert split_member_id("L7") is None
    assert split_member_id("park.L3") is None


def test_ranks_go_one_per_slot_when_enough_slots_fit_and_are_packed_otherwise():
    room = {"a": 1, "b": 3, "c": 2}
    fits = lambda key, count: count <= room[key]  # noqa: E731
    assert assign_ranks(3, ["a", "b", "c"], fits) == ["a", "b", "c"]
    assert assign_ranks(4, ["b", "a", "c"], fits) == ["b", "b", "b", "a"]
    assert assign_ranks(7, ["a", "b", "c"], fits) is None
    assert assign_ranks(2, [], fits) is None


def test_an_empty_slot_holds_as_many_ranks_as_its_memory_allows():
    assert most_ranks(140 * GIB, 30 * GIB, 8) == 4
    assert most_ranks(140 * GIB, 30 * GIB, 3) == 3
    assert most_ranks(140 * GIB, 0, 5) == 5


# ------------------------------------------------------------------ grants


def test_a_gang_on_one_gpu_is_granted_all_its_ranks_in_one_grant():
    hub = Hub()
    trainer = hub.open("trainer")

    actions = hub.request(trainer, "L1", memory=20 * GIB, sm_share=0.25, ranks=4)

    grant = only(actions, core.GrantLease)
    assert grant.lease_id == "L1"
    assert [r.lease_id for r in grant.ranks] == ["L1.0", "L1.1", "L1.2", "L1.3"]
    assert {r.placement.device_index for r in grant.ranks} == {0}
    assert all(r.placement.memory_bytes == 20 * GIB for r in grant.ranks)
    assert all(r.placement.sm_share == 0.25 for r in grant.ranks)
    assert grant.placement == grant.ranks[0].placement
    assert states(hub, "L1") == [LeaseState.RUNNING] * 4
    held, running = hub.scheduler.slot_usage("0")
    assert held == 80 * GIB and len(running) == 4


def test_a_gang_on_mig_gets_an_instance_per_rank():
    hub = Hub(mig_devices(SEVEN_SMALL))
    trainer = hub.open("trainer")

    grant = only(hub.request(trainer, "L1", memory=8 * GIB, ranks=3), core.GrantLease)

    instances = [r.placement.mig_uuid for r in grant.ranks]
    assert len(set(instances)) == 3 and None not in instances


def test_a_gang_on_two_gpus_puts_one_rank_on_each():
    hub = Hub(h200_devices(2))
    trainer = hub.open("trainer")

    grant = only(hub.request(trainer, "L1", memory=40 * GIB, ranks=2), core.GrantLease)

    assert sorted(r.placement.device_index for r in grant.ranks) == [0, 1]


def test_a_gang_that_does_not_fit_whole_waits_whole_and_is_told_once():
    hub = Hub()
    holder, trainer = hub.open("holder"), hub.open("trainer")
    hub.request(holder, "L1", memory=60 * GIB, priority=NORMAL)

    actions = hub.request(trainer, "L2", memory=30 * GIB, ranks=3, priority=NORMAL)

    assert not of_type(actions, core.GrantLease)
    notice = only(actions, core.NotifyQueued)
    assert (notice.lease_id, notice.position) == ("L2", 1)
    assert states(hub, "L2") == [LeaseState.QUEUED] * 3
    assert hub.scheduler.queued_position("L2") == 1 == hub.scheduler.queued_position("L2.2")

    grant = only(hub.release(holder, "L1"), core.GrantLease)
    assert grant.lease_id == "L2" and len(grant.ranks) == 3
    assert states(hub, "L2") == [LeaseState.RUNNING] * 3


def test_a_gang_asking_for_more_than_the_host_can_ever_hold_is_refused_with_the_count():
    hub = Hub()
    trainer = hub.open("trainer")

    refusal = only(hub.request(trainer, "L1", memory=50 * GIB, ranks=3), core.RefuseRequest)

    assert refusal.code == ErrorCode.INVALID
    assert refusal.message == (
        "3 ranks of 50.0 GiB can never run at once here: the matching devices and "
        "slices hold 2 at most"
    )
    assert not hub.scheduler.leases and not hub.scheduler.gangs


def test_a_gang_above_the_users_lease_limit_is_refused_by_policy():
    hub = Hub(policy=Policy(defaults=Limits(max_leases=3)))
    trainer = hub.open("trainer")
    hub.request(trainer, "L1", memory=1 * GIB)

    refusal = only(hub.request(trainer, "L2", memory=1 * GIB, ranks=3), core.RefuseRequest)

    assert refusal.code == ErrorCode.POLICY
    assert "a gang of 3 ranks takes 3 leases; you hold or wait for 1" in refusal.message
    assert list(hub.scheduler.leases) == ["L1"] and not hub.scheduler.gangs


# ------------------------------------------------------------------ preemption


def test_a_high_cell_pauses_every_rank_of_a_low_gang_and_they_resume_together():
    hub = Hub(h200_devices(2))
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "L1", memory=20 * GIB, ranks=2, priority=LOW, capabilities=YIELDING)
    assert sorted(hub.lease(m).slot for m in ("L1.0", "L1.1")) == ["0", "1"]

    actions = hub.request(explorer, "L2", memory=8 * GIB, priority=HIGH, device="0")

    preempts = of_type(actions, core.PauseLease)
    # Only rank 0 is on GPU 0, but rank 1 on GPU 1 stops too: a gang never runs in part.
    assert sorted(p.lease_id for p in preempts) == ["L1.0", "L1.1"]
    assert {p.level for p in preempts} == {PreemptionLevel.YIELD}
    assert only(actions, core.GrantLease).lease_id == "L2"
    assert states(hub, "L1") == [LeaseState.PAUSED] * 2
    for p in preempts:
        hub.applied(p.lease_id, p.level)

    resumed = of_type(hub.release(explorer, "L2"), core.ResumeLease)

    assert sorted(r.lease_id for r in resumed) == ["L1.0", "L1.1"]
    assert states(hub, "L1") == [LeaseState.RUNNING] * 2


def test_a_high_gang_preempts_low_work_and_is_granted_whole():
    hub = Hub()
    low, trainer = hub.open("low"), hub.open("trainer")
    hub.request(low, "L1", memory=10 * GIB, priority=LOW)

    actions = hub.request(trainer, "L2", memory=10 * GIB, ranks=2, priority=HIGH)

    assert only(actions, core.PauseLease).lease_id == "L1"
    assert len(only(actions, core.GrantLease).ranks) == 2


def test_a_gang_that_needs_memory_waits_for_the_evictions_then_takes_all_of_it():
    hub = Hub()
    low, trainer = hub.open("low"), hub.open("trainer")
    hub.request(low, "L1", memory=100 * GIB, priority=LOW)

    actions = hub.request(trainer, "L2", memory=40 * GIB, ranks=2, priority=HIGH)

    evict = only(actions, core.PauseLease)
    assert (evict.lease_id, evict.level) == ("L1", PreemptionLevel.EVICT)
    assert not of_type(actions, core.GrantLease)
    assert only(actions, core.NotifyQueued).lease_id == "L2"

    grant = only(hub.applied("L1", PreemptionLevel.EVICT), core.GrantLease)
    assert grant.lease_id == "L2" and len(grant.ranks) == 2


# ------------------------------------------------------------------ ends


@pytest.mark.parametrize("named", ["L1", "L1.1"])
def test_releasing_the_gang_or_any_rank_ends_every_rank(named):
    hub = Hub()
    trainer = hub.open("trainer")
    hub.request(trainer, "L1", memory=10 * GIB, ranks=3)

    ended = of_type(hub.release(trainer, named), core.LeaseEnded)

    assert sorted(e.lease_id for e in ended) == ["L1.0", "L1.1", "L1.2"]
    assert not hub.scheduler.leases and not hub.scheduler.gangs


def test_a_rank_revoked_alone_takes_its_gang_with_it():
    hub = Hub()
    trainer = hub.open("trainer")
    hub.request(trainer, "L1", memory=10 * GIB, ranks=2)
    lease = hub.lease("L1.1")

    # The watchdog ends one rank (its process broke its quota): the other cannot go on.
    actions = hub.handle(core.LeaseReleased(now=hub.now, session_id=lease.session_id,
                                            lease_id="L1.1", by_admin=True))  # fmt: skip

    assert sorted(e.lease_id for e in of_type(actions, core.LeaseEnded)) == ["L1.0", "L1.1"]
    assert not hub.scheduler.gangs


def test_closing_the_session_ends_the_gang_and_frees_its_memory():
    hub = Hub()
    trainer, other = hub.open("trainer"), hub.open("other")
    hub.request(trainer, "L1", memory=60 * GIB, ranks=2)
    hub.request(other, "L2", memory=60 * GIB)

    actions = hub.close(trainer)

    assert len(of_type(actions, core.LeaseEnded)) == 2
    assert only(actions, core.GrantLease).lease_id == "L2"


def test_two_gangs_that_each_need_most_of_the_gpu_run_one_after_the_other():
    hub = Hub()
    first, second = hub.open("first"), hub.open("second")
    hub.request(first, "L1", memory=40 * GIB, ranks=3)
    actions = hub.request(second, "L2", memory=40 * GIB, ranks=3)
    assert not of_type(actions, core.GrantLease)  # no rank of L2 runs beside L1 in part
    assert states(hub, "L2") == [LeaseState.QUEUED] * 3

    grant = only(hub.release(first, "L1"), core.GrantLease)

    assert grant.lease_id == "L2"


# ------------------------------------------------------------------ worker processes


def _attach(hub: Hub, session: str, gang: str, pids: list[int]) -> list[core.Action]:
    return hub.handle(core.RanksAttached(now=hub.now, session_id=session, gang=gang,
                                         pids=tuple((pid, None) for pid in pids)))  # fmt: skip


def test_once_its_workers_are_named_a_gangs_ranks_are_stopped_in_those_processes():
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "L1", memory=10 * GIB, ranks=2, priority=LOW)

    _attach(hub, trainer, "L1", [7001, 7002])

    assert [hub.lease(m).identity.pid for m in ("L1.0", "L1.1")] == [7001, 7002]
    assert hub.lease("L1.0").session_id == trainer  # still the notebook's to release
    preempts = of_type(hub.request(explorer, "L2", priority=HIGH), core.PauseLease)
    assert sorted(p.pid for p in preempts) == [7001, 7002]


def test_naming_workers_is_refused_while_the_gang_is_paused_or_for_the_wrong_count():
    hub = Hub()
    trainer, explorer, other = hub.open("trainer"), hub.open("explorer"), hub.open("other")
    hub.request(trainer, "L1", memory=10 * GIB, ranks=2, priority=LOW)

    with pytest.raises(core.SchedulerError) as wrong:
        _attach(hub, trainer, "L1", [7001])
    assert wrong.value.code == ErrorCode.INVALID
    with pytest.raises(core.SchedulerError) as twice:
        _attach(hub, trainer, "L1", [7001, 7001])
    assert "one rank only" in twice.value.message
    with pytest.raises(core.SchedulerError) as foreign:
        _attach(hub, other, "L1", [7001, 7002])
    assert foreign.value.code == ErrorCode.PERMISSION
    hub.request(explorer, "L2", priority=HIGH)
    with pytest.raises(core.SchedulerError) as paused:
        _attach(hub, trainer, "L1", [7001, 7002])
    assert paused.value.code == ErrorCode.OUT_OF_ORDER
    assert hub.lease("L1.0").identity.pid == hub.pid_of(trainer)


def test_a_gang_under_mps_is_held_at_the_gate_and_one_without_a_gate_time_slices():
    from gpushare_ext.protocol import Capabilities

    hub = Hub()
    trainer, other, explorer = hub.open("trainer"), hub.open("other"), hub.open("explorer")
    # MPS clients cannot be locked; workers that inherited the launch shim follow the gate.
    hub.request(trainer, "L1", memory=10 * GIB, ranks=2, priority=LOW,
                capabilities=Capabilities(gate=True, lockable=False))  # fmt: skip
    hub.request(other, "L2", memory=10 * GIB, ranks=2, priority=LOW,
                capabilities=Capabilities(lockable=False))  # fmt: skip

    actions = hub.request(explorer, "L3", memory=8 * GIB, priority=HIGH)

    preempts = of_type(actions, core.PauseLease)
    assert sorted((p.lease_id, p.level) for p in preempts) == [
        ("L1.0", PreemptionLevel.GATE), ("L1.1", PreemptionLevel.GATE),
    ]  # fmt: skip
    assert states(hub, "L2") == [LeaseState.RUNNING] * 2  # nothing can stop it: it time-slices
    assert only(actions, core.GrantLease).lease_id == "L3"


def test_a_gang_with_a_rank_that_cannot_be_evicted_runs_on_rather_than_hold_the_gpu():
    """One rank evicted, the other's eviction failed: that rank's memory stays whatever
    happens, so the request it was stopped for can never fit.  The gang comes back and
    runs to its end (freeing the memory), rather than everyone waiting for ever."""
    hub = Hub()
    trainer, other = hub.open("trainer"), hub.open("other")
    hub.request(trainer, "L1", memory=60 * GIB, ranks=2, priority=LOW)
    actions = hub.request(other, "L2", memory=100 * GIB, priority=NORMAL)
    assert {p.lease_id for p in of_type(actions, core.PauseLease)} == {"L1.0", "L1.1"}

    hub.applied("L1.0", PreemptionLevel.EVICT)
    resumed = hub.failed("L1.1", PreemptionLevel.EVICT, "cannot be evicted: checkpoint failed")
    resumed += hub.advance(1.0)

    assert states(hub, "L1") == [LeaseState.RUNNING] * 2, resumed
    assert hub.state("L2") == LeaseState.QUEUED
    grant = only(hub.release(trainer, "L1"), core.GrantLease)  # the gang's end frees the GPU
    assert grant.lease_id == "L2"
