"""Reproduction of the soak's "memory over capacity": after a ``kill -9``, a lease that
was evicted for another comes back holding its memory on the device beside the lease it
was evicted for, and stays so once both sessions reconnected.

Run from the repository root: ``.venv/bin/python
benchmarks/results/2026-12-07-cpu-crash-soak/repro_evicted_lease_restored_on_the_device.py``

A low session holds 100 GiB of the simulated H200 (143,771 MiB); a high one asks for 100
GiB, so the low one is evicted (level 4) and the high one granted.  The broker is killed
with SIGKILL and started again.  Recovery undoes the pending level-4 step
(gpushare_ext/broker/recovery.py:44-53, ``undo_applied_actuators``) and restores the
evicted lease as *paused*, holding its memory on the device
(gpushare_ext/broker/admission.py:357-358, ``_restored_lease``), beside the running high
lease: 200 GiB leased on the device, and nothing evicts it again.  What it printed
(2026-12-07, commits 9500820 and 28a797b)::

    before the kill: L1 evicted 100 GiB, L2 running 100 GiB; leased 102400 MiB
    journal: L1 evicted, L2 running; pending actuation: L1 level 4
    right after the restart: L1 paused 100 GiB, L2 running 100 GiB; leased 204800 MiB
    3 s later (both reconnected): the same, leased 204800 MiB of 143771 MiB
"""

import multiprocessing
import signal
import sqlite3
import tempfile
import time
from pathlib import Path

from gpushare_ext.broker.edges.launch import BrokerProcess
from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import priority_value
from gpushare_ext.runtime.session import GpuSession

GIB = 1024**3


def hold(socket: str, priority: str, stop: str) -> None:
    session = GpuSession(socket, notebook=f"{priority}.ipynb")
    options = session.merged(
        priority=priority_value(priority), memory_bytes=100 * GIB, timeout_s=30
    )
    session.acquire(options)
    while not Path(stop).exists():
        session.safe_point()
        time.sleep(0.01)
    session.close()


def status(socket: Path) -> str:
    with BrokerClient(socket, client="cli", connect_timeout=5) as client:
        snapshot = client.status()
    leases = ", ".join(
        f"{lease.lease_id} {lease.state.value} {lease.memory_bytes // GIB} GiB"
        for lease in snapshot.leases
    )
    device = snapshot.devices[0]
    return f"{leases}; leased {device.memory_leased_mib} MiB of {device.info.memory_total_mib} MiB"


def main() -> None:
    directory = Path(tempfile.mkdtemp(prefix="gps-repro-", dir="/tmp"))
    broker = BrokerProcess(directory).start()
    stop = directory / "stop"
    fork = multiprocessing.get_context("fork")
    low = fork.Process(target=hold, args=(str(broker.socket), "low", str(stop)))
    low.start()
    time.sleep(2)
    high = fork.Process(target=hold, args=(str(broker.socket), "high", str(stop)))
    high.start()
    time.sleep(3)
    try:
        print("before the kill:", status(broker.socket))
        broker.stop(signal.SIGKILL)
        db = sqlite3.connect(f"file:{broker.journal_path}?mode=ro", uri=True)
        print(
            "journal:",
            db.execute(
                "SELECT lease_id, state FROM lease_records WHERE ended_at IS NULL"
            ).fetchall(),
        )
        print(
            "pending actuations:",
            db.execute("SELECT lease_id, level FROM actuations WHERE undone_at IS NULL").fetchall(),
        )
        db.close()
        broker.start()
        print("right after the restart:", status(broker.socket))
        time.sleep(3)
        print("3 s later:", status(broker.socket))
    finally:
        stop.touch()
        low.join(10)
        high.join(10)
        broker.stop()


if __name__ == "__main__":
    main()
