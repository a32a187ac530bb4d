"""A session's long kernels run as they are while nobody could preempt it.

The core tells each session with a lease on a GPU whether another live session may ask
for a higher band there (:mod:`gpushare_ext.broker.scheduler.rivals`); the broker writes that into
the session's control block, where the launch shim reads it before each long launch.
The property that it is always right after every event is in ``test_core_properties``;
here: the cases by name, and the word in a real broker's control blocks.
"""

from __future__ import annotations

import time

from scheduler_helpers import GIB, HIGH, LOW, NORMAL, Hub, h200_devices, of_type

from gpushare_ext.broker.scheduler import core
from gpushare_ext.client import BrokerClient
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import Granted


def _told(actions: list[core.Action]) -> dict[str, bool]:
    return {a.session_id: a.unrivalled for a in of_type(actions, core.RivalryChanged)}


def test_a_lone_session_is_unrivalled_and_a_higher_one_arriving_makes_it_ready():
    hub = Hub()
    ada = hub.open("ada")
    hub.request(ada, "L1", priority=LOW, memory=10 * GIB)
    assert hub.scheduler.rivals.told(ada) is True
    # A notebook opens: before its first request it may ask for the default (normal),
    # which preempts a low lease, so the low session must be ready to stop.
    bo = hub.open("bo")
    assert hub.scheduler.rivals.told(ada) is False
    # It asks for low itself: nobody above ada's band is left.
    told = _told(hub.request(bo, "B1", priority=LOW, memory=10 * GIB))
    assert told.get(ada) is True
    # A high request from it: ready again (before the pause lands).
    told = _told(hub.request(bo, "B2", priority=HIGH, memory=10 * GIB))
    assert told.get(ada) is False
    told = _told(hub.close(bo))
    assert told.get(ada) is True


def test_equal_and_lower_bands_are_no_rivals():
    hub = Hub()
    ada, bo, cy = hub.open("ada"), hub.open("bo"), hub.open("cy")
    hub.request(ada, "A", priority=HIGH, memory=10 * GIB)
    hub.request(bo, "B", priority=HIGH, memory=10 * GIB)
    hub.request(cy, "C", priority=NORMAL, memory=10 * GIB)
    assert hub.scheduler.rivals.told(ada) is True
    assert hub.scheduler.rivals.told(bo) is True


def test_a_session_that_cannot_reach_the_gpu_is_no_rival():
    devices = h200_devices(2)
    hub = Hub(devices=devices)
    ada = hub.open("ada")
    hub.request(ada, "A", priority=LOW, memory=10 * GIB, device="0")
    elsewhere = hub.open("bo", reachable=(devices[1].uuid,))
    hub.request(elsewhere, "B", priority=HIGH, memory=10 * GIB)
    assert hub.scheduler.rivals.told(ada) is True
    hub.open("cy")  # sees every GPU, may ask for normal
    assert hub.scheduler.rivals.told(ada) is False


def test_a_session_that_names_the_gpu_by_its_host_index_is_a_rival():
    # NVIDIA_VISIBLE_DEVICES=0 (a host index, as on a plain GPU host): that GPU is reachable.
    hub = Hub(devices=h200_devices(2))
    ada = hub.open("ada")
    hub.request(ada, "A", priority=LOW, memory=10 * GIB, device="0")
    hub.open("bo", reachable=("1",))
    assert hub.scheduler.rivals.told(ada) is True
    hub.open("cy", reachable=("0",))
    assert hub.scheduler.rivals.told(ada) is False


def test_the_broker_writes_the_word_the_shim_reads(start_broker):
    socket = start_broker(simulate="h200").socket
    with BrokerClient(socket) as low:
        granted = low.request_lease(priority=LOW, memory_bytes=GIB)
        assert isinstance(granted, Granted)
        block = ControlBlock.open(low.welcome.control_block)
        try:
            assert block.unrivalled  # alone on the host: long kernels run as they are
            with BrokerClient(socket) as other:
                deadline = time.monotonic() + 5
                while block.unrivalled and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert not block.unrivalled  # a session that may ask for normal
                other.request_lease(priority=LOW, memory_bytes=GIB)
                deadline = time.monotonic() + 5
                while not block.unrivalled and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert block.unrivalled  # it asked for low: no rival after all
        finally:
            block.close()


def test_chaos_mode_is_a_rival_while_it_lasts():
    hub = Hub()
    ada = hub.open("ada")
    hub.request(ada, "A", priority=HIGH, memory=10 * GIB)
    assert hub.scheduler.rivals.told(ada) is True  # nobody above high
    pid = hub.pid_of(ada)
    told = _told(hub.handle(core.ChaosChanged(now=hub.now, pid=pid, on=True)))
    assert told == {ada: False}  # an admin's chaos may pause it at any moment
    told = _told(hub.handle(core.ChaosChanged(now=hub.now, pid=pid, on=False)))
    assert told == {ada: True}


def test_a_higher_request_still_waiting_is_a_rival_after_its_session_asks_lower():
    # bo's normal request waits for GPU 0 (drained) while ada's low lease runs there;
    # bo's next request is low, but the one waiting still preempts ada once it may be
    # placed: ada's kernels must stay ready to stop meanwhile.
    hub = Hub(devices=h200_devices(2))
    ada, bo = hub.open("ada"), hub.open("bo")
    hub.request(ada, "A", priority=LOW, memory=10 * GIB, device="0")
    hub.drain(0)
    hub.request(bo, "waits", priority=NORMAL, memory=10 * GIB, device="0")
    assert hub.state("waits") == core.LeaseState.QUEUED
    hub.request(bo, "B", priority=LOW, memory=10 * GIB, device="1")
    assert hub.scheduler.rivals.told(ada) is False
    stops = of_type(hub.drain(0, drained=False), core.PauseLease)
    assert [stop.lease_id for stop in stops] == ["A"]  # it was a rival indeed
    # Placed, it waits no more: bo may ask only for low again, which preempts nobody.
    assert hub.scheduler.rivals.told(ada) is True
