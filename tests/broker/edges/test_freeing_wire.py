"""Over the wire: a request that waits for memory to be freed is told how much."""

from __future__ import annotations

import threading

from support import launch_broker

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, Queued

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
