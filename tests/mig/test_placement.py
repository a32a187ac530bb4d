"""MIG placement: the scheduler hands out existing MIG instances, by UUID, best fit first.

Every test builds :class:`core.Scheduler` on one of the shipped simulated layouts
(``gpushare_ext/fixtures/h200-*.json``) and checks what a user would see: where a
lease lands, or the message that says why it cannot.
"""

from __future__ import annotations

import json

import pytest
from mig_helpers import GIB, HIGH, Hub, device_of, devices_of

from gpushare_ext.broker.hands.inventory import fixture_path, shipped_fixtures
from gpushare_ext.protocol import DeviceView, LeaseState, LeaseView, SliceWish, Snapshot
from gpushare_ext.status_view import status_text

MIG_FIXTURES = [
    "h200-mig-7x1g",
    "h200-mig-mixed",
    "h200-mig-full",
    "h200-mig-fragmented",
    "h200-mig-empty",
]
ALL_FIXTURES = [*MIG_FIXTURES, "h200-x2", "h200-x2-mixed"]


def uuid_of(fixture: str, profile: str, start: int, device: int = 0) -> str:
    return next(
        i.uuid
        for i in device_of(fixture, device).instances
        if i.name == profile and i.start == start
    )


# ------------------------------------------------------------------ the fixtures


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_layout_ships_and_says_it_is_simulated(name):
    assert name in shipped_fixtures()
    document = json.loads(fixture_path(name).read_text())
    assert "simulated" in document["_about"].lower()
    assert "h200.json" in document["_about"]
    assert all(d.simulated for d in devices_of(name))


@pytest.mark.parametrize("name", ALL_FIXTURES)
def test_every_layout_keeps_the_real_readouts_profiles(name):
    real = device_of("h200")
    for device in devices_of(name):
        assert device.profiles == real.profiles
        assert device.memory_total_mib == real.memory_total_mib


def test_the_layouts_are_cut_as_their_names_say():
    def cut(name, index=0):
        return sorted((i.start, i.name) for i in device_of(name, index).instances)

    assert cut("h200-mig-7x1g") == [(s, "1g.18gb") for s in range(7)]
    assert cut("h200-mig-mixed") == [(0, "2g.35gb"), (2, "1g.18gb"), (3, "1g.18gb"), (4, "3g.71gb")]
    assert cut("h200-mig-full") == [(0, "7g.141gb")]
    assert cut("h200-mig-fragmented") == [(1, "1g.18gb"), (5, "1g.18gb")]
    assert cut("h200-mig-empty") == []
    assert device_of("h200-mig-empty").mig_enabled
    assert [d.mig_enabled for d in devices_of("h200-x2")] == [False, False]
    assert [d.mig_enabled for d in devices_of("h200-x2-mixed")] == [True, False]
    assert cut("h200-x2-mixed", 0) == cut("h200-mig-mixed")


# ------------------------------------------------------------------ best fit


def test_a_small_request_lands_on_the_smallest_instance_that_holds_it():
    hub = Hub.on("h200-mig-mixed")
    alice = hub.open("alice")

    placement = hub.grant_of(hub.request(alice, "L1", memory=8 * GIB))

    assert placement.mig_profile == "1g.18gb"
    assert placement.cuda_visible_devices == placement.mig_uuid
    assert placement.mig_uuid.startswith("MIG-")


def test_each_request_gets_the_best_fitting_free_instance():
    hub = Hub.on("h200-mig-mixed")
    alice, bob, carol = hub.open("alice"), hub.open("bob"), hub.open("carol")

    big = hub.grant_of(hub.request(alice, "L1", memory=60 * GIB))
    medium = hub.grant_of(hub.request(bob, "L2", memory=20 * GIB))
    small = hub.grant_of(hub.request(carol, "L3", memory=10 * GIB))

    assert (big.mig_profile, medium.mig_profile, small.mig_profile) == (
        "3g.71gb",
        "2g.35gb",
        "1g.18gb",
    )
    assert len({big.mig_uuid, medium.mig_uuid, small.mig_uuid}) == 3


def test_small_requests_fill_the_small_instances_before_touching_the_big_one():
    hub = Hub.on("h200-mig-mixed")
    sessions = [hub.open(f"user{n}") for n in range(3)]

    profiles = [
        hub.grant_of(hub.request(s, f"L{n}", memory=8 * GIB)).mig_profile
        for n, s in enumerate(sessions)
    ]

    assert profiles == ["1g.18gb", "1g.18gb", "2g.35gb"]


def test_the_grant_caps_persistent_blocks_to_the_share_of_the_instances_sms():
    hub = Hub.on("h200-mig-7x1g")
    alice = hub.open("alice")

    placement = hub.grant_of(hub.request(alice, "L1", memory=4 * GIB, sm_share=0.5))

    assert placement.mig_profile == "1g.18gb"
    assert placement.max_blocks_per_sm_share == 8  # half of a 1g instance's 16 SMs


def test_a_request_too_big_for_every_instance_is_refused_with_the_largest_size():
    hub = Hub.on("h200-mig-mixed")
    alice = hub.open("alice")

    message = hub.refusal_of(hub.request(alice, "L1", memory=100 * GIB))

    assert "100 GiB does not fit" in message
    assert "69.8 GiB" in message  # the 3g.71gb instance, the largest of this layout
    assert hub.scheduler.lease_of("L1") is None


def test_a_request_that_fits_only_a_busy_instance_waits_instead_of_taking_a_smaller_one():
    hub = Hub.on("h200-mig-mixed")
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.grant_of(hub.request(alice, "L1", memory=60 * GIB))

    actions = hub.request(bob, "L2", memory=50 * GIB)

    assert not [a for a in actions if hasattr(a, "placement")]
    assert hub.scheduler.lease_of("L2").state == LeaseState.QUEUED


# ------------------------------------------------------------------ wishes


def test_device_wish_by_mig_uuid_lands_exactly_there():
    hub = Hub.on("h200-mig-mixed")
    alice = hub.open("alice")
    big_one = uuid_of("h200-mig-mixed", "3g.71gb", 4)

    placement = hub.grant_of(hub.request(alice, "L1", memory=1 * GIB, device=big_one))

    assert placement.mig_uuid == big_one


def test_an_unknown_mig_uuid_is_refused_by_name():
    hub = Hub.on("h200-mig-mixed")
    alice = hub.open("alice")

    message = hub.refusal_of(hub.request(alice, "L1", memory=GIB, device="MIG-nope"))

    assert "no device or MIG instance has the UUID MIG-nope" in message


def test_slice_mig_on_a_mixed_host_lands_on_the_mig_gpu():
    hub = Hub.on("h200-x2-mixed")
    alice = hub.open("alice")

    placement = hub.grant_of(hub.request(alice, "L1", memory=8 * GIB, slice=SliceWish.MIG))

    assert placement.device_index == 0
    assert placement.mig_profile == "1g.18gb"


def test_slice_shared_on_a_mixed_host_lands_on_the_whole_gpu():
    hub = Hub.on("h200-x2-mixed")
    alice = hub.open("alice")

    placement = hub.grant_of(hub.request(alice, "L1", memory=8 * GIB, slice=SliceWish.SHARED))

    assert placement.device_index == 1
    assert placement.mig_uuid is None


def test_auto_on_a_mixed_host_prefers_an_idle_mig_instance_to_the_whole_gpu():
    hub = Hub.on("h200-x2-mixed")
    alice = hub.open("alice")

    placement = hub.grant_of(hub.request(alice, "L1", memory=8 * GIB))

    assert placement.device_index == 0
    assert placement.mig_profile == "1g.18gb"


def test_auto_on_a_mixed_host_sends_what_no_instance_holds_to_the_whole_gpu():
    hub = Hub.on("h200-x2-mixed")
    alice = hub.open("alice")

    placement = hub.grant_of(hub.request(alice, "L1", memory=100 * GIB))

    assert placement.device_index == 1
    assert placement.mig_uuid is None


def test_slice_shared_on_a_cut_gpu_is_refused_with_the_hint_to_ask_for_mig():
    hub = Hub.on("h200-mig-mixed")
    alice = hub.open("alice")

    message = hub.refusal_of(hub.request(alice, "L1", memory=GIB, slice=SliceWish.SHARED))

    assert "cut into MIG instances" in message
    assert "mig" in message


def test_slice_mig_where_mig_is_off_is_refused():
    hub = Hub.on("h200-x2")
    alice = hub.open("alice")

    message = hub.refusal_of(hub.request(alice, "L1", memory=GIB, slice=SliceWish.MIG))

    assert "MIG is off" in message


# ------------------------------------------------------------------ MIG on, no instances


@pytest.mark.parametrize("wish", [SliceWish.AUTO, SliceWish.MIG, SliceWish.SHARED])
def test_mig_on_without_instances_refuses_with_the_hint_to_plan(wish):
    hub = Hub.on("h200-mig-empty")
    alice = hub.open("alice")

    message = hub.refusal_of(hub.request(alice, "L1", memory=GIB, slice=wish))

    assert "MIG is on" in message
    assert "no instance exists" in message
    assert "gpushare mig plan" in message


# ------------------------------------------------------------------ late binding


def test_two_concurrent_sessions_land_on_different_gpus_least_loaded_first():
    hub = Hub.on("h200-x2")
    alice, bob = hub.open("alice"), hub.open("bob")

    first = hub.grant_of(hub.request(alice, "L1", memory=8 * GIB))
    second = hub.grant_of(hub.request(bob, "L2", memory=8 * GIB))

    assert {first.device_index, second.device_index} == {0, 1}


def test_a_sessions_next_lease_can_land_on_another_gpu():
    hub = Hub.on("h200-x2")
    alice, bob, carol = hub.open("alice"), hub.open("bob"), hub.open("carol")
    first_cell = hub.grant_of(hub.request(alice, "A1", memory=8 * GIB))
    hub.grant_of(hub.request(bob, "B1", memory=8 * GIB))  # the other GPU
    hub.release(alice, "A1")
    hub.grant_of(hub.request(carol, "C1", memory=8 * GIB))  # takes the GPU alice left
    hub.release(bob, "B1")

    next_cell = hub.grant_of(hub.request(alice, "A2", memory=8 * GIB))

    assert next_cell.device_index != first_cell.device_index


def test_late_binding_on_mig_instances_picks_a_free_instance_at_grant_time():
    hub = Hub.on("h200-mig-7x1g")
    alice, bob = hub.open("alice"), hub.open("bob")
    first = hub.grant_of(hub.request(alice, "A1", memory=8 * GIB))
    hub.grant_of(hub.request(bob, "B1", memory=8 * GIB))

    again = hub.grant_of(hub.request(alice, "A2", memory=8 * GIB))

    assert again.mig_uuid not in (first.mig_uuid,)
    used = {lease.slot for lease in hub.scheduler.active_leases()}
    assert len(used) == 3


def test_a_high_priority_request_preempts_on_the_mig_instance_it_needs():
    hub = Hub.on("h200-mig-full")
    alice, bob = hub.open("alice"), hub.open("bob")
    hub.grant_of(hub.request(alice, "L1", memory=8 * GIB, priority=50))

    actions = hub.request(bob, "L2", memory=8 * GIB, priority=HIGH)

    placement = hub.grant_of(actions)
    assert placement.mig_profile == "7g.141gb"
    assert hub.scheduler.lease_of("L1").state == LeaseState.PAUSED


# ------------------------------------------------------------------ status


def test_status_shows_the_mig_layout_and_where_each_lease_runs():
    hub = Hub.on("h200-mig-mixed")
    alice = hub.open("alice")
    placement = hub.grant_of(hub.request(alice, "L1", memory=8 * GIB))
    device = device_of("h200-mig-mixed")
    snapshot = Snapshot(
        host="h", node="node1", broker_pid=1, mode="user", inventory="simulated",
        inventory_description="simulated inventory from h200-mig-mixed.json", time=0.0,
        you="alice", is_admin=False,
        devices=[DeviceView(info=device, drained=False, memory_used_mib=0,
                            memory_leased_mib=8192, utilization_pct=0, utilization_history=[],
                            holders=["L1"])],
        leases=[LeaseView(lease_id="L1", user="alice", own=True, priority=150,
                          state=LeaseState.RUNNING, device_index=0, mig_uuid=placement.mig_uuid,
                          memory_bytes=8 * GIB, sm_share=1.0, since_s=1.0, waited_s=0.0)],
        queue_by_priority={},
    )  # fmt: skip

    text = status_text(snapshot, width=200)

    assert "on: 4 instance(s)" in text
    for instance in device.instances:
        assert instance.uuid in text
        assert f"{instance.start}+{instance.size}" in text
    assert placement.mig_uuid[:14] in text
