"""Parking with a real broker and real notebook kernels, on the simulated H200 (no GPU:
the simulated inventory shows the idle notebook's memory as NVML would, and its
checkpoint is the simulated actuators' twin, which hides that memory while it holds it).

An idle notebook holding 100 GiB is parked when a high-priority request needs the
memory; its next cell, a plain one, restores it first (one live line) and runs; a
restore that has to wait says so and can be interrupted, leaving the session parked.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator

import pytest
from runtime_helpers import BrokerProcess, NotebookKernel, short_tempdir, wait_for

from gpushare_ext.broker.hands.inventory import fixture_path
from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.protocol import Granted, Queued

pytestmark = pytest.mark.timeout(240)

GIB_MIB = 1024


def _inventory_with(pid: int, gib: int, *, restore_fails: bool = False) -> str:
    document = json.loads(fixture_path("h200").read_text())
    if restore_fails:  # as the driver fails the restore of a process that imported memory
        document["restore_fails"] = [pid]
    document["processes_outside_leases"] = [{"device": 0, "pid": pid, "used_mib": gib * GIB_MIB}]
    # The host of a busy hub (the test machine may be smaller than what is parked).
    document["host_memory"] = {"total_mib": 1024 * GIB_MIB, "available_mib": 900 * GIB_MIB}
    path = short_tempdir("gps-park-") / "h200-idle.json"
    path.write_text(json.dumps(document))
    return str(path)


def _idle_memory_seen(broker: BrokerProcess) -> None:
    wait_for(
        lambda: any(d.memory_outside_leases_mib for d in broker.status().devices),
        "the broker to read the idle notebook's memory",
        10,
    )


def _parks(broker: BrokerProcess) -> list:
    return [lease for lease in broker.leases() if lease.label == "parked idle session"]


@contextlib.contextmanager
def idle_notebook(
    name: str, first_cell: str, *, restore_fails: bool = False
) -> Iterator[tuple[BrokerProcess, NotebookKernel]]:
    """A real kernel that ran ``first_cell`` under a lease and now sits idle holding 100
    GiB, as the broker (on a simulated H200 whose NVML names it) has read; both stopped
    after."""
    kernel = NotebookKernel(name)
    broker: BrokerProcess | None = None
    try:
        kernel.ready()
        inventory = _inventory_with(kernel.pid, 100, restore_fails=restore_fails)
        broker = BrokerProcess(short_tempdir(), simulate=inventory).start()
        kernel.run(f"import os; os.environ['GPUSHARE_SOCKET'] = {str(broker.socket)!r}").ok()
        kernel.run("%load_ext gpushare_ext").ok()
        kernel.run(f"%%gpu mem=1GiB\n{first_cell}").ok()  # its session, idle after the cell
        _idle_memory_seen(broker)
        yield broker, kernel
    finally:
        kernel.shutdown()
        if broker is not None:
            broker.stop()


def test_an_idle_notebook_is_parked_for_a_request_and_its_next_plain_cell_restores_it():
    with idle_notebook("idle-notebook", "answer = 41") as (broker, kernel):
        granted = threading.Event()
        with BrokerClient(
            broker.socket,
            client="bench",
            listener=lambda m: granted.set() if isinstance(m, Granted) else None,
        ) as other:
            reply = other.request_lease(priority=250, memory_bytes=80 << 30, label="big")
            assert isinstance(reply, Queued)
            assert "parking idle sessions" in reply.reason
            assert granted.wait(15), broker.log_tail()
            [park] = _parks(broker)
            assert park.pid == kernel.pid and park.state == "evicted"

            # A plain cell: restored first, but the high lease holds 80 GiB: it waits,
            # visibly, and an interrupt withdraws it and leaves the notebook parked.
            waiting = kernel.submit("print(answer + 1)")
            waiting.wait_shown("waiting for the memory", timeout=20)
            kernel.interrupt()
            waiting.wait()
            assert "did not run" in waiting.shown_text(), waiting.describe()
            assert "42" not in waiting.final_text()
            assert _parks(broker) and _parks(broker)[0].state == "evicted"

            other.release(reply.lease_id)

        cell = kernel.run("print(answer + 1)").ok()
        shown = cell.shown_text()
        assert "gpushare: restoring 100 GiB parked" in shown, cell.describe()
        assert "gpushare: restored 100 GiB parked" in shown
        assert cell.final_text().strip().endswith("42")
        wait_for(lambda: not _parks(broker), "the park lease to be released", 10)
        kernel.run("%%gpu mem=1GiB\nprint(answer)").ok()  # no restore, no park left


def test_only_the_parked_session_may_restore_it(start_broker_for_parking):
    broker, _kernel, park_id = start_broker_for_parking
    with (
        BrokerClient(broker.socket, client="bench") as stranger,
        pytest.raises(BrokerError, match="no parked memory"),
    ):
        stranger.restore(park_id)
    assert _parks(broker)[0].state == "evicted"


@pytest.fixture
def start_broker_for_parking():
    """A notebook parked for a high request that is then released."""
    with idle_notebook("parked-notebook", "x = 1") as (broker, kernel):
        with BrokerClient(broker.socket, client="bench") as other:
            reply = other.request_lease(priority=250, memory_bytes=80 << 30)
            wait_for(lambda: _parks(broker) and _parks(broker)[0].state == "evicted", "a park", 15)
            other.release(reply.lease_id)
        yield broker, kernel, _parks(broker)[0].lease_id


def test_a_notebook_that_exits_while_parked_ends_its_park_and_nobody_else_notices(
    start_broker_for_parking,
):
    broker, kernel, _park_id = start_broker_for_parking
    with BrokerClient(broker.socket, client="bench") as other:
        kernel.kill()
        wait_for(lambda: not _parks(broker), "the park of the dead notebook to end", 15)
        reply = other.request_lease(priority=150, memory_bytes=8 << 30)
        assert isinstance(reply, Granted)  # the broker serves on, its memory is free
        other.release(reply.lease_id)


def test_a_broker_killed_while_a_notebook_is_parked_restores_it_when_it_starts_again(
    start_broker_for_parking,
):
    broker, kernel, _park_id = start_broker_for_parking
    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
    broker.start()  # the same journal: the park's actuator step is undone before serving
    wait_for(lambda: "recovery: undoing level 4" in broker.output(), "the park to be undone", 20)
    assert not _parks(broker)
    cell = kernel.run("print('after the restart', x)").ok()
    assert cell.final_text().strip().endswith("after the restart 1")
    assert "restoring" not in cell.shown_text()  # nothing is parked any more
    assert "was restored when the broker started again" in cell.shown_text()


def test_gpushare_park_parks_your_idle_notebook_and_refuses_with_one_line():
    import subprocess
    import sys

    with idle_notebook("to-park", "x = 2") as (broker, kernel):

        def park(*args: str) -> subprocess.CompletedProcess:
            command = [sys.executable, "-m", "gpushare_ext.cli", "park", "--socket"]
            return subprocess.run(
                [*command, str(broker.socket), *args], capture_output=True, text=True, timeout=30
            )

        done = park(str(kernel.pid))
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"parking pid {kernel.pid}: 100 GiB to the host")
        wait_for(lambda: _parks(broker) and _parks(broker)[0].state == "evicted", "the park", 10)
        again = park(str(kernel.pid))
        assert again.returncode == 1
        assert again.stderr.strip().endswith(f"the notebook of pid {kernel.pid} is parked already")
        assert "Traceback" not in again.stderr
        bad = park("nope")
        assert bad.returncode == 2 and "park needs a process id" in bad.stderr

        cell = kernel.run("print(x * 21)").ok()
        assert "gpushare: restored 100 GiB parked" in cell.shown_text()
        assert cell.final_text().strip().endswith("42")


def test_an_import_counted_after_the_last_cell_stops_the_park_before_anything_is_applied():
    from gpushare_ext.control_block import IPC_IMPORTS_OFFSET, ControlBlock

    with idle_notebook("late-importer", "x = 3") as (broker, kernel):
        path = (
            kernel.run(
                "from gpushare_ext.runtime.session import current_session\n"
                "print(current_session().control_block.path)"
            )
            .ok()
            .final_text()
            .strip()
        )
        # What the launch shim writes when the idle process opens another's memory.
        block = ControlBlock.open(path)
        block._write(IPC_IMPORTS_OFFSET, 1)
        block.close()

        with BrokerClient(broker.socket, client="bench") as other:
            with pytest.raises(BrokerError, match="cannot be parked: it opened another process"):
                other.park(kernel.pid)  # asked by hand, it is refused at once
            reply = other.request_lease(priority=250, memory_bytes=80 << 30)
            assert isinstance(reply, Queued)
            wait_for(
                lambda: "failed: it opened another process's GPU memory" in broker.output(),
                "the park to be refused",
                15,
            )
            assert not _parks(broker)  # the session was left alone, unlocked
            waiting = [v for v in broker.leases() if v.lease_id == reply.lease_id]
            assert waiting and "held outside any lease" in waiting[0].reason
        cell = kernel.run("print(x * 14)").ok()
        assert cell.final_text().strip().endswith("42")
        assert "restor" not in cell.shown_text()  # it never was parked


def test_a_failed_restore_says_what_was_lost_and_the_cell_does_not_run():
    with idle_notebook("lost", "x = 5", restore_fails=True) as (broker, kernel):
        with BrokerClient(broker.socket, client="cli") as admin:
            admin.park(kernel.pid)
        wait_for(lambda: _parks(broker) and _parks(broker)[0].state == "evicted", "the park", 10)

        cell = kernel.run("print('ran', x)").wait()
        error = cell.error
        assert error is not None and error["ename"] == "RestoreFailed", cell.describe()
        assert (
            "restore failed (cuCheckpointProcessRestore: CUDA_ERROR_INVALID_VALUE)"
            in (error["evalue"])
        )
        assert (
            "the 100 GiB of GPU memory this notebook held is lost; restart the kernel"
            in (error["evalue"])
        )
        assert "ran 5" not in cell.final_text()
        wait_for(lambda: not _parks(broker), "the failed park to end", 10)
        assert "could not undo level 4" in broker.output()  # and the journal notes it
