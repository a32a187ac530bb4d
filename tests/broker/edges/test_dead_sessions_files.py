"""What a ``kill -9``-ed notebook kernel leaves behind: nothing, once the broker looks.

Real brokers (``gpushare broker --simulate h200`` on private sockets) and real kernel
processes (a :class:`GpuSession` in a forked process holding a lease):

* a kernel killed while the broker runs loses its lease, and its control block goes
  from the broker's sessions directory, at once (its connection closes);
* so does one whose connection lives on in a child it forked, while it is not reaped
  yet (a zombie): the broker looks at the process, not only at the connection;
* a kernel killed while the broker is down leaves nothing to the next broker on the
  socket: the old sessions directory is removed, only live sessions have blocks in the
  new one, and the dead kernel's lease ends.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from contextlib import suppress
from pathlib import Path

from gpushare_ext.broker.edges.views import DETACHED_NOTE
from gpushare_ext.client import BrokerClient
from gpushare_ext.paths import SHM_DIR, sessions_prefix_for

GIB = 1024**3
_FORK = multiprocessing.get_context("fork")


def _kernel(socket_path: str, folder: str, fork_a_child: bool) -> None:
    """A notebook kernel: one lease held until it is killed.  ``fork_a_child``: a child
    of it (as a data loader's worker is) inherits its connection to the broker."""
    from gpushare_ext.runtime.session import GpuSession, LeaseOptions

    session = GpuSession(socket_path, notebook="killed.ipynb")
    handle = session.acquire(LeaseOptions(memory_bytes=GIB, timeout_s=30))
    if fork_a_child:
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        Path(folder, "child").write_text(str(child))
    Path(folder, "block").write_text(str(session.control_block.path))
    Path(folder, "lease").write_text(handle.lease_id)
    time.sleep(120)


def _start_kernel(socket_path: Path, folder: Path, fork_a_child: bool = False):
    process = _FORK.Process(target=_kernel, args=(str(socket_path), str(folder), fork_a_child))
    process.start()
    deadline = time.monotonic() + 30
    while not (folder / "lease").exists():
        assert process.is_alive() and time.monotonic() < deadline, "the kernel got no lease"
        time.sleep(0.02)
    return process, Path((folder / "block").read_text()), (folder / "lease").read_text()


def _leases(socket_path: Path) -> list[str]:
    with BrokerClient(socket_path, client="cli", connect_timeout=5) as client:
        return [lease.lease_id for lease in client.status().leases]


def _reclaimed(socket_path: Path) -> list[str]:
    """The leases whose notebooks are connected (none waits to be reclaimed)."""
    with BrokerClient(socket_path, client="cli", connect_timeout=5) as client:
        leases = client.status().leases
    return [lease.lease_id for lease in leases if DETACHED_NOTE not in lease.reason]


def _within(seconds: float, condition) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _state(pid: int) -> str:
    """The process's state letter in ``/proc`` (``Z``: a zombie)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rfind(")") + 2]


def _sessions_directories(socket_path: Path) -> list[Path]:
    prefix = sessions_prefix_for(socket_path)
    return sorted(SHM_DIR / name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def test_a_killed_kernel_loses_its_lease_and_its_control_block_at_once(start_broker, tmp_path):
    broker = start_broker()
    kernel, block, lease = _start_kernel(broker.socket, tmp_path)
    assert block.exists() and _leases(broker.socket) == [lease]

    os.kill(kernel.pid, signal.SIGKILL)
    kernel.join(timeout=10)

    assert _within(5, lambda: not block.exists()), f"{block} was left behind"
    assert _leases(broker.socket) == []


def test_a_killed_kernel_whose_child_keeps_its_connection_is_reclaimed_unreaped(
    start_broker, tmp_path
):
    broker = start_broker()
    kernel, block, _ = _start_kernel(broker.socket, tmp_path, fork_a_child=True)
    child = int((tmp_path / "child").read_text())
    try:
        os.kill(kernel.pid, signal.SIGKILL)  # and not reaped: a zombie, as a busy parent leaves it
        assert _within(5, lambda: _state(kernel.pid) == "Z")

        assert _within(5, lambda: not block.exists()), f"{block} was left behind"
        assert _leases(broker.socket) == []
        assert _state(kernel.pid) == "Z"  # its end was seen before anyone reaped it
    finally:
        with suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        kernel.join(timeout=10)


def test_a_kernel_killed_while_the_broker_is_down_leaves_nothing_to_the_next(
    start_broker, tmp_path
):
    broker = start_broker(config_toml="[broker]\nreclaim_grace_s = 60\n")
    (tmp_path / "dead").mkdir()
    (tmp_path / "live").mkdir()
    dead, dead_block, dead_lease = _start_kernel(broker.socket, tmp_path / "dead")
    live, _, live_lease = _start_kernel(broker.socket, tmp_path / "live")
    try:
        [old_directory] = _sessions_directories(broker.socket)
        assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(timeout=10)
        assert dead_block.exists()  # nobody was there to remove it

        broker.start()

        assert not old_directory.exists()
        [new_directory] = _sessions_directories(broker.socket)
        # The live kernel reconnects and reclaims its lease; the dead one's is ended.
        assert _within(15, lambda: _leases(broker.socket) == [live_lease]), _leases(broker.socket)
        assert _within(15, lambda: _reclaimed(broker.socket) == [live_lease])
        # The live kernel's block, once the broker saw the test's own status clients go.
        assert _within(5, lambda: len(os.listdir(new_directory)) == 1), os.listdir(new_directory)
        assert os.listdir(new_directory)[0].endswith(".cb")
        assert dead_lease != live_lease
    finally:
        live.kill()
        live.join(timeout=10)
