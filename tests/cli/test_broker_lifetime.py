"""`gpushare broker --exit-when-idle`: the embedded broker's lifetime.

A broker started with it keeps running while a notebook session is connected and exits
that long after the last one left, saying so in its log; the embedded broker a ``%%gpu``
cell starts is started that way.  A real broker process on the simulated H200 inventory
(no GPU here).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpushare_ext.broker.edges.launch import BrokerProcess
from gpushare_ext.client import BrokerClient
from gpushare_ext.runtime import embedded


def _start(folder: Path, idle: str) -> BrokerProcess:
    return BrokerProcess(
        folder, journal=folder / "journal.db", extra_args=("--exit-when-idle", idle)
    ).start()


def test_the_broker_stays_while_a_session_is_there_and_exits_after_the_last_left():
    folder = Path(tempfile.mkdtemp(prefix="gps-idle-", dir="/tmp"))
    broker = _start(folder, "2s")
    assert broker.process is not None
    try:
        with BrokerClient(broker.socket):
            time.sleep(3.5)  # past the idle time: a session is there
            assert broker.alive()
        left = time.monotonic()
        broker.process.wait(timeout=15)
        took = time.monotonic() - left
    finally:
        if broker.alive():
            broker.process.kill()
    log = broker.output()
    assert broker.process.returncode == 0, log
    # Idle time counts from the last tick (once a second) that saw the session: 2 s less
    # up to one tick after the client left, at the earliest.
    assert 1.0 <= took <= 6, (took, log)
    assert "no notebook session for 2.0 s: exiting (--exit-when-idle); the next %%gpu" in log
    assert not (folder / "broker.sock").exists()  # nothing left behind


def test_a_bad_duration_is_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200",
         "--exit-when-idle", "soon"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpushare: --exit-when-idle 'soon': 'soon' is not a duration (examples: 30s, 5m, 1h, none)"
    ]


def test_the_embedded_broker_is_started_with_its_lifetime(monkeypatch):
    runtime = Path(tempfile.mkdtemp(prefix="gps-embedded-", dir="/tmp"))
    monkeypatch.setenv("GPUSHARE_INVENTORY", "h200")
    socket, started = embedded.ensure_embedded_broker(runtime / "broker.sock")
    assert started
    with BrokerClient(socket) as client:
        pid = client.welcome.broker_pid
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--exit-when-idle" in command
        assert command[command.index(b"--exit-when-idle") + 1] == b"10m"
    finally:
        subprocess.run(["kill", str(pid)], check=False)
