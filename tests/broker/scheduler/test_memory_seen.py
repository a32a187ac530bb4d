"""Placement counts the memory processes really hold on a GPU (NVML), not only what
leases declare: an idle notebook's arrays and a process the broker does not know take
memory a new lease cannot have."""

from __future__ import annotations

import json
import os
import pwd

from broker_wire import wait_for
from scheduler_helpers import GIB, HIGH, LOW, Hub, of_type, only

from gpushare_ext.broker.hands.inventory import fixture_path
from gpushare_ext.broker.scheduler import core
from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, LeaseState, PreemptionLevel, Queued
from gpushare_ext.status_view import status_text


def _seen(hub: Hub, used: dict[int, int]) -> list[core.Action]:
    return hub.handle(
        core.DeviceMemorySeen(now=hub.now, device_index=0, used_by_pid=tuple(used.items()))
    )


def test_a_request_that_only_fits_in_memory_idle_notebooks_hold_waits_instead_of_failing():
    hub = Hub()  # one H200, 140 GiB
    ada, bo, cy = hub.open("ada"), hub.open("bo"), hub.open("cy")
    _seen(hub, {hub.pid_of(ada): 60 * GIB, hub.pid_of(bo): 60 * GIB})  # idle, no lease

    actions = hub.request(cy, "H1", priority=HIGH, memory=80 * GIB)

    assert not of_type(actions, core.GrantLease)
    assert hub.scheduler.leases["H1"].state == LeaseState.QUEUED
    assert hub.scheduler.unleased_memory("0") == 120 * GIB

    actions = _seen(hub, {hub.pid_of(ada): 60 * GIB})  # bo's notebook let its arrays go
    assert only(actions, core.GrantLease).lease_id == "H1"


def test_memory_a_process_without_a_lease_holds_is_counted_and_never_preempted():
    hub = Hub()
    ada = hub.open("ada")
    _seen(hub, {99_999: 100 * GIB})  # not a session of this broker's
    queued = only(hub.request(ada, "L1", memory=50 * GIB), core.NotifyQueued)
    assert "100 GiB of the GPU is held outside any lease" in queued.reason
    assert queued.waiting_for == ()  # no lease is in the way: nothing to preempt
    hub.release(ada, "L1")
    assert of_type(hub.request(ada, "L2", memory=30 * GIB), core.GrantLease)


def test_a_notebook_asking_for_memory_it_already_holds_is_not_asked_to_find_it_twice():
    hub = Hub()
    ada, bo = hub.open("ada"), hub.open("bo")
    hub.request(bo, "B1", memory=70 * GIB)
    _seen(hub, {hub.pid_of(ada): 60 * GIB, hub.pid_of(bo): 70 * GIB})

    # Ada's 60 GiB are her own cached arrays: a 60 GiB lease covers them.
    assert only(hub.request(ada, "A1", memory=60 * GIB), core.GrantLease).lease_id == "A1"
    assert hub.scheduler.unleased_memory("0") == 0


def test_what_a_leased_process_holds_beyond_its_lease_is_counted_too():
    hub = Hub()
    ada, bo = hub.open("ada"), hub.open("bo")
    hub.request(ada, "A1", memory=100 * GIB)
    _seen(hub, {hub.pid_of(ada): 110 * GIB})  # its context and a cache past the lease

    assert hub.scheduler.unleased_memory("0") == 10 * GIB
    assert not of_type(hub.request(bo, "B1", memory=35 * GIB), core.GrantLease)
    hub.release(bo, "B1")
    assert of_type(hub.request(bo, "B2", memory=25 * GIB), core.GrantLease)


def test_an_eviction_frees_what_was_seen_of_its_process_at_once():
    hub = Hub()
    low, high = hub.open("lo"), hub.open("hi")
    hub.request(low, "L1", priority=LOW, memory=100 * GIB)
    _seen(hub, {hub.pid_of(low): 101 * GIB})  # its lease and its CUDA context

    actions = hub.request(high, "H1", priority=HIGH, memory=60 * GIB)
    evict = [p for p in of_type(actions, core.PauseLease) if p.level == PreemptionLevel.EVICT]
    assert [p.lease_id for p in evict] == ["L1"]

    actions = hub.applied("L1", PreemptionLevel.EVICT)  # before the next NVML reading
    assert only(actions, core.GrantLease).lease_id == "H1"


def test_a_real_broker_shows_and_counts_memory_held_outside_leases(start_broker, tmp_path):
    # The simulated H200 with two processes NVML would show: this test's own process
    # (60 GiB, of which its lease will cover 40) and a program of no session (50 GiB).
    document = json.loads(fixture_path("h200").read_text())
    document["processes_outside_leases"] = [
        {"device": 0, "pid": os.getpid(), "used_mib": 60 * 1024},
        {"device": 0, "pid": 999_999, "used_mib": 50 * 1024},
    ]
    inventory = tmp_path / "h200-busy.json"
    inventory.write_text(json.dumps(document))
    running = start_broker(simulate=str(inventory))
    with BrokerClient(running.socket) as first, BrokerClient(running.socket) as second:
        assert isinstance(first.request_lease(priority=150, memory_bytes=40 * GIB), Granted)
        me = pwd.getpwuid(os.getuid()).pw_name
        seen = wait_for(
            lambda: first.status().devices[0].memory_outside_leases_mib or None, timeout=10
        )
        assert seen == {me: 20 * 1024, "other processes": 50 * 1024}

        # 40 GiB leased + 20 + 50 outside leases: 60 GiB more would not fit in 140.
        assert isinstance(second.request_lease(priority=150, memory_bytes=60 * GIB), Queued)

        text = status_text(first.status(), width=200)
        assert "other processes 50.0 GiB" in text and f"{me} 20.0 GiB" in text, text


def test_memory_seen_on_a_mig_instance_is_counted_on_that_instance_only():
    from scheduler_helpers import mig_devices

    hub = Hub(devices=mig_devices())  # 3g.71gb, 2g.35gb and 1g.18gb instances
    slots = {slot.mig_profile: slot for slot in hub.scheduler.slots.values()}
    big = slots["3g.71gb"]
    ada = hub.open("ada")
    hub.handle(
        core.DeviceMemorySeen(
            now=hub.now, device_index=0, used_by_pid=((99_999, 60 * GIB),), mig_uuid=big.mig_uuid
        )
    )
    assert hub.scheduler.unleased_memory(big.key) == 60 * GIB
    assert hub.scheduler.unleased_memory(slots["2g.35gb"].key) == 0

    # 40 GiB fits only the 3g instance by size, and 60 of its 69.8 GiB are held.
    queued = only(hub.request(ada, "A1", memory=40 * GIB), core.NotifyQueued)
    assert "60.0 GiB of the GPU is held outside any lease" in queued.reason
    # 20 GiB goes to the 2g instance, where nothing is held.
    grant = only(hub.request(ada, "A2", memory=20 * GIB), core.GrantLease)
    assert grant.placement.mig_uuid == slots["2g.35gb"].mig_uuid


def test_a_real_broker_counts_memory_held_on_a_mig_instance(start_broker, tmp_path):
    document = json.loads(fixture_path("h200-mig-mixed").read_text())
    running = start_broker(simulate="h200-mig-mixed")
    with BrokerClient(running.socket, client="cli") as looker:
        instance = looker.status().devices[0].info.instances[0]
    running.stop()
    document["processes_outside_leases"] = [
        {"device": 0, "pid": 999_999, "used_mib": 10 * 1024, "mig_uuid": instance.uuid}
    ]
    inventory = tmp_path / "mig-busy.json"
    inventory.write_text(json.dumps(document))
    running = start_broker(simulate=str(inventory))
    with BrokerClient(running.socket, client="cli") as looker:
        wait_for(lambda: looker.status().devices[0].memory_outside_leases_mib)
        assert looker.status().devices[0].memory_outside_leases_mib == {"other processes": 10240}
