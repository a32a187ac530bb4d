"""A request waiting for memory to be freed for it hears how much, and how long that takes
at the rate evictions went at so far."""

from __future__ import annotations

from scheduler_helpers import GIB, HIGH, LOW, Hub, only

from gpushare_ext.broker.scheduler import core
from gpushare_ext.protocol import PreemptionLevel

EVICT = PreemptionLevel.EVICT


def _evict_for_a_high_request(hub: Hub, low: str, high: str) -> core.NotifyQueued:
    trainer, explorer = hub.open(f"trainer-{low}"), hub.open(f"explorer-{high}")
    hub.request(trainer, low, priority=LOW, memory=100 * GIB)
    return only(hub.request(explorer, high, priority=HIGH, memory=100 * GIB), core.NotifyQueued)


def test_the_wait_says_how_much_is_freed_and_the_estimate_follows_the_measured_rate():
    hub = Hub()
    first = _evict_for_a_high_request(hub, "low1", "high1")
    assert first.freeing_bytes == 100 * GIB
    assert first.reason.startswith("freeing 100 GiB: waiting for lower-priority sessions")
    assert first.estimate_s is None  # nothing timed yet: no guess

    hub.now += 5.0  # the checkpoint took 5 s: 20 GiB/s
    assert only(hub.applied("low1", EVICT), core.GrantLease).lease_id == "high1"
    assert hub.scheduler.book.freeing_rate == 100 * GIB / 5.0

    for session in list(hub.scheduler.sessions):
        for lease_id in list(hub.scheduler.sessions[session].leases):
            hub.release(session, lease_id)
    second = _evict_for_a_high_request(hub, "low2", "high2")
    assert second.freeing_bytes == 100 * GIB
    assert second.estimate_s == 5.0  # 100 GiB at the 20 GiB/s measured


def test_an_eviction_confirmed_at_once_is_not_timed():
    """A simulated GPU checkpoints nothing: its instant confirmations say nothing of a rate."""
    hub = Hub()
    _evict_for_a_high_request(hub, "low", "high")
    hub.applied("low", EVICT)
    assert hub.scheduler.book.freeing_rate is None


def test_once_granted_or_given_up_a_request_no_longer_says_it_is_freeing_memory():
    hub = Hub()
    _evict_for_a_high_request(hub, "low", "high")
    hub.now += 2.0
    hub.applied("low", EVICT)
    assert hub.scheduler.leases["high"].freeing_bytes == 0

    failing = Hub()
    _evict_for_a_high_request(failing, "low", "high")
    failing.failed("low", EVICT, "cuCheckpointProcessCheckpoint: CUDA_ERROR_NOT_SUPPORTED")
    assert failing.scheduler.leases["high"].freeing_bytes == 0
