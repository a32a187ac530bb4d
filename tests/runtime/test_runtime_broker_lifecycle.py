"""Where the broker comes from and what happens when it goes away, seen from notebooks.

* With no broker on the user's socket, the first ``%%gpu`` cell starts the embedded
  per-user broker and says so once; the user's other kernels share it.
* When the broker restarts (same socket, same journal), a cell holding a lease keeps
  running: the session reconnects and reclaims its lease.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal

import pytest
from runtime_helpers import BrokerProcess, short_tempdir, wait_for

from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.protocol import LeaseState

STARTED = "started your embedded broker"
BROKER_PID_CELL = (
    "import gpushare_ext\n"
    "print('broker_pid', gpushare_ext.current_session().client.welcome.broker_pid)"
)


def _process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"
    except OSError:
        return True


@pytest.fixture
def user_without_broker():
    """A user environment where no broker answers: a fresh XDG_RUNTIME_DIR, no GPUSHARE_SOCKET.

    Yields ``(env, socket_path)``; stops whatever embedded broker the test started.
    """
    home = short_tempdir("gps-xdg-")
    env = dict(os.environ)
    env.pop("GPUSHARE_SOCKET", None)
    env.update(
        XDG_RUNTIME_DIR=str(home),
        XDG_STATE_HOME=str(home / "state"),  # the embedded broker's journal
        GPUSHARE_INVENTORY="h200",  # the embedded broker simulates the shipped H200
    )
    socket_path = home / "gpushare" / "broker.sock"
    yield env, socket_path
    pid = None
    with (
        contextlib.suppress(BrokerError, OSError),
        BrokerClient(socket_path, client="cli", connect_timeout=2) as client,
    ):
        pid = client.status().broker_pid
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: _process_gone(pid), "the embedded broker to exit", 15)
    shutil.rmtree(home, ignore_errors=True)


def test_the_first_gpu_cell_starts_the_embedded_broker_and_other_kernels_share_it(
    user_without_broker, kernels
):
    env, socket_path = user_without_broker
    first, second = kernels(2, env=env)
    for kernel in (first, second):
        kernel.run("%load_ext gpushare_ext").ok()
    assert not socket_path.exists()

    # both kernels' first cells at the same moment: one broker, one announcement
    cells = [kernel.submit("%%gpu\nprint('ran')") for kernel in (first, second)]
    for cell in cells:
        cell.ok(60)
        assert "ran" in cell.final_text()

    announcements = [cell for cell in cells if STARTED in cell.final_text()]
    assert len(announcements) == 1, "\n".join(cell.describe() for cell in cells)
    line = next(line for line in announcements[0].final_text().splitlines() if STARTED in line)
    assert line == (
        f"gpushare: no system broker found; started your embedded broker on {socket_path} "
        "(it serves all your notebooks on this host)"
    )
    again = [kernel.run("%%gpu\nprint('again')").ok() for kernel in (first, second)]
    assert all(STARTED not in cell.final_text() for cell in again), "said more than once"

    with BrokerClient(socket_path, client="cli") as client:
        snapshot = client.status()
    assert snapshot.mode == "user" and snapshot.inventory == "simulated"
    pids = {
        int(kernel.run(BROKER_PID_CELL).ok().stdout_value("broker_pid"))
        for kernel in (first, second)
    }
    assert pids == {snapshot.broker_pid}
    assert snapshot.broker_pid not in (first.pid, second.pid)

    # it is detached: it outlives the kernel that started it
    starter = first if announcements[0] is cells[0] else second
    other = second if starter is first else first
    starter.shutdown()
    assert "still" in other.run("%%gpu\nprint('still served')").ok().final_text()
    with BrokerClient(socket_path, client="cli") as client:
        assert client.status().broker_pid == snapshot.broker_pid


@pytest.mark.parametrize(
    "how",
    [
        pytest.param(signal.SIGTERM, id="graceful-restart"),
        pytest.param(signal.SIGKILL, id="after-a-crash"),
    ],
)
def test_a_running_cell_survives_a_broker_restart_and_keeps_its_lease(
    how, extra_broker, kernels, monkeypatch, tmp_path
):
    broker: BrokerProcess = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    stop = tmp_path / "stop"
    cell = kernel.submit(
        "%%gpu priority=normal\n"
        "import os, time, gpushare_ext\n"
        "steps = 0\n"
        "print('looping', flush=True)\n"
        "deadline = time.time() + 120\n"
        f"while not os.path.exists({str(stop)!r}) and time.time() < deadline:\n"
        "    gpushare_ext.safe_point()\n"
        "    steps += 1\n"
        "    time.sleep(0.01)\n"
        "print('steps', steps)\n"
    )
    cell.wait_shown("looping")
    (lease,) = broker.leases_of(kernel.pid)

    assert broker.stop(how) == (0 if how == signal.SIGTERM else -how), broker.log_tail()
    broker.start()  # same socket, same journal

    def reclaimed():
        shown = cell.shown_text()
        assert "revoked" not in shown and "did not give the lease back" not in shown, (
            f"the lease was lost over the restart\n{cell.describe()}\n{broker.log_tail()}"
        )
        with contextlib.suppress(BrokerError):
            return [
                view
                for view in broker.leases_of(kernel.pid)
                if view.lease_id == lease.lease_id and view.state == LeaseState.RUNNING
            ]
        return None

    wait_for(reclaimed, f"the kernel to reclaim {lease.lease_id} from the new broker", 30)
    stop.touch()
    cell.ok(30)
    shown = cell.shown_text()
    assert "revoked" not in shown and "did not give the lease back" not in shown, cell.describe()
    assert int(cell.stdout_value("steps")) > 0
    wait_for(lambda: not broker.leases_of(kernel.pid), "the lease to be released after the cell")
    # and the kernel keeps working with the new broker
    assert "after" in kernel.run("%%gpu\nprint('after restart')").ok().final_text()
