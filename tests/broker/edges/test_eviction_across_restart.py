"""An evicted lease stays off the device across a broker restart, crash or clean stop.

A low session holds 100 GiB of the simulated H200 (143,771 MiB); a high one asks for 100
GiB, so the low one is evicted and the high one runs.  Whatever ends the broker, the
device never holds more than it has once the sessions are back, and the low session
runs again once the high one is done.
"""

from __future__ import annotations

import multiprocessing
import shutil
import signal
import sqlite3
import time
from pathlib import Path

from broker_wire import status_of, wait_for
from support import launch_broker

from gpushare_ext.broker.edges.views import DETACHED_NOTE
from gpushare_ext.protocol import LeaseState, priority_value
from gpushare_ext.runtime.session import GpuSession

GIB = 1024**3
EVICT = 4


def _hold(socket: str, priority: str, stop: str) -> None:
    """A notebook kernel holding 100 GiB until ``stop`` exists (it reconnects by itself)."""
    session = GpuSession(socket, notebook=f"{priority}.ipynb")
    session.acquire(
        session.merged(priority=priority_value(priority), memory_bytes=100 * GIB, timeout_s=60)
    )
    while not Path(stop).exists():
        session.safe_point()
        time.sleep(0.01)
    session.close()


def _back(socket: Path) -> list[LeaseState]:
    """The states of the leases once every one is reclaimed and none is being stopped."""
    leases = status_of(socket).leases
    if any(DETACHED_NOTE in lease.reason for lease in leases):
        return []
    return sorted(lease.state for lease in leases)


def _by_state(socket: Path) -> tuple[list[LeaseState], int, int]:
    snapshot = status_of(socket)
    device = snapshot.devices[0]
    states = sorted(lease.state for lease in snapshot.leases)
    return states, device.memory_leased_mib, device.info.memory_total_mib


def _pending(journal: Path) -> list[tuple]:
    db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
    try:
        return db.execute("SELECT level FROM actuations WHERE undone_at IS NULL").fetchall()
    finally:
        db.close()


def _evicted_beside_a_high_one(how_it_ends: signal.Signals) -> None:
    broker = launch_broker()
    fork = multiprocessing.get_context("fork")
    low_done, high_done = broker.directory / "low-done", broker.directory / "high-done"
    low = fork.Process(target=_hold, args=(str(broker.socket), "low", str(low_done)))
    high = fork.Process(target=_hold, args=(str(broker.socket), "high", str(high_done)))
    restarted = None
    try:
        low.start()
        assert wait_for(lambda: _by_state(broker.socket)[0] == [LeaseState.RUNNING], timeout=20)
        high.start()
        one_each = sorted([LeaseState.RUNNING, LeaseState.EVICTED])
        assert wait_for(lambda: _by_state(broker.socket)[0] == one_each, timeout=20)
        broker.process.send_signal(how_it_ends)
        broker.process.wait(timeout=20)

        restarted = launch_broker(directory=broker.directory, journal=broker.journal)
        states, leased, total = _by_state(restarted.socket)
        if how_it_ends == signal.SIGKILL:  # a clean stop put the memory back: it is there
            assert leased <= total, (states, leased, total)
        # Both sessions reconnect and take their leases back; the device stays within
        # what it has, the low lease off it.
        assert wait_for(lambda: _back(restarted.socket) == one_each, timeout=20), status_of(
            restarted.socket
        ).leases
        states, leased, total = _by_state(restarted.socket)
        assert leased <= total, (states, leased, total)
        assert (EVICT,) in _pending(broker.journal)

        high_done.touch()  # the high session is done: the low one runs again
        assert wait_for(
            lambda: _by_state(restarted.socket)[0] == [LeaseState.RUNNING], timeout=20
        ), status_of(restarted.socket).leases
        assert wait_for(lambda: _pending(broker.journal) == [], timeout=10)
    finally:
        low_done.touch()
        high_done.touch()
        for process in (low, high):
            if process.pid is not None:
                process.join(15)
                if process.is_alive():
                    process.kill()
        for running in (restarted, broker):
            if running is not None and running.process.poll() is None:
                running.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


def test_after_a_kill_9_an_evicted_lease_stays_evicted_until_there_is_room():
    """Recovery keeps the eviction in force rather than putting 100 GiB back beside the
    lease it was evicted for."""
    _evicted_beside_a_high_one(signal.SIGKILL)


def test_after_a_clean_stop_an_evicted_lease_is_evicted_again_when_its_session_is_back():
    """A clean stop undoes every stop, the eviction too; the session that comes back
    paused onto a device that cannot hold it is evicted again."""
    _evicted_beside_a_high_one(signal.SIGTERM)
