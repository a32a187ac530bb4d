"""The suite never meets the host's own gpushare: on a GPU host where a system broker
serves ``/run/gpushare/broker.sock`` (where an admin runs the tests), the tests that look
for a broker as a user's kernel does still find their own, and the hub test skips before
it installs anything.

A listening socket stands where the host's broker would serve and counts every connect
(a bare connect already tells a listener the caller's pid, uid and gid); the trust tests,
the status and embedded-broker tests and the hub test then run in a child pytest, as
``make test`` runs them.  Needs root (it makes ``/run/gpushare``); skipped where the host
really has a broker there, which it must not touch.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import is_root

from gpushare_ext.paths import SYSTEM_RUNTIME_DIR, SYSTEM_SOCKET

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not is_root(), reason="makes /run/gpushare: needs root"),
    pytest.mark.skipif(
        SYSTEM_SOCKET.exists(), reason=f"the host's own {SYSTEM_SOCKET} is there: left alone"
    ),
]


@pytest.fixture
def stand_in_system_broker():
    """A socket listening on /run/gpushare/broker.sock; yields the list of connects seen."""
    made_dir = not SYSTEM_RUNTIME_DIR.exists()
    SYSTEM_RUNTIME_DIR.mkdir(mode=0o755, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(SYSTEM_SOCKET))
    os.chmod(SYSTEM_SOCKET, 0o666)  # as a system broker's: every user may connect
    listener.listen(64)
    listener.settimeout(0.2)
    seen: list[str] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            credentials = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            pid = int.from_bytes(credentials[:4], "little")
            seen.append(f"pid {pid}")
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
        SYSTEM_SOCKET.unlink(missing_ok=True)
        if made_dir:
            shutil.rmtree(SYSTEM_RUNTIME_DIR, ignore_errors=True)


def test_tests_that_look_for_a_broker_never_reach_the_hosts_system_broker(
    stand_in_system_broker,
):
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs",
         "tests/broker/edges/test_trust.py", "tests/cli/test_status_without_broker.py",
         "tests/runtime/test_runtime_broker_lifecycle.py", "tests/hub/test_hub_e2e.py"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    took = time.monotonic() - started
    report = child.stdout[-4000:] + child.stderr[-2000:]

    assert child.returncode == 0, report
    assert stand_in_system_broker == [], report  # not even a bare connect
    # The hub test skips first thing, before its install (150 s when it came last).
    assert "the host's own system broker has /run/gpushare/broker.sock" in child.stdout, report
    print(f"the child suite took {took:.0f} s")
