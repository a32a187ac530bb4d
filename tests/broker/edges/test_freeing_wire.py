"""Over the wire: a request that waits for memory to be freed is told how much."""

from __future__ import annotations

import threading

from scheduler_helpers import HIGH, LOW, Hub
from support import launch_broker

from gpushare_ext.broker.edges.views import _estimate_left
from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, PreemptionLevel, Queued

GIB = 1024**3


def test_a_high_request_waiting_for_an_eviction_hears_how_much_is_being_freed():
    broker = launch_broker()
    granted = threading.Event()
    try:
        with (
            BrokerClient(broker.socket, notebook="train.ipynb") as trainer,
            BrokerClient(broker.socket, notebook="explore.ipynb") as explorer,
        ):
            assert isinstance(trainer.request_lease(priority=50, memory_bytes=100 * GIB), Granted)
            explorer.add_listener(lambda m: granted.set() if isinstance(m, Granted) else None)
            answer = explorer.request_lease(priority=250, memory_bytes=100 * GIB)
            assert isinstance(answer, Queued), answer
            assert answer.freeing_bytes == 100 * GIB
            assert answer.reason.startswith("freeing 100 GiB: waiting for lower-priority")
            # The simulated GPU checkpoints nothing: no rate was timed, so no estimate.
            assert answer.estimate_s is None
            assert granted.wait(timeout=10)
    finally:
        broker.stop()


def test_the_panel_counts_a_freeing_estimate_down_and_drops_it_once_used_up():
    """A used-up estimate reads as "the holder's usual time is up" in the panel; memory
    being freed has no holder, so it is left out then (the reason still says what)."""
    hub = Hub()
    hub.scheduler.book.observe_freeing(100 * GIB, 5.0)  # 20 GiB/s measured before
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW, memory=100 * GIB)
    hub.request(explorer, "high", priority=HIGH, memory=100 * GIB)
    high = hub.scheduler.leases["high"]
    assert high.freeing_bytes == 100 * GIB and high.estimate_s == 5.0
    assert _estimate_left(high, hub.now + 2.0) == 3.0
    assert _estimate_left(high, hub.now + 6.0) is None
    hub.now += 6.0
    hub.applied("low", PreemptionLevel.EVICT)
    assert _estimate_left(high, hub.now) is None  # granted: no estimate at all
