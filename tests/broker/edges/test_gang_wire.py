"""Gang leases through a real broker: one request on the wire, every rank in the reply,
the status and the journal, all ranks paused and resumed together, all released at once,
and kept across a broker killed with ``kill -9``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading

import pytest
from broker_wire import start_holder, status_of, wait_for
from support import launch_broker, run_as

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, Preempt, Queued, Refused, Resume

GIB = 1024**3


def test_a_gang_is_granted_every_rank_in_one_reply_and_released_as_one(broker):
    with BrokerClient(broker, notebook="ddp.ipynb") as client:
        granted = client.request_lease(priority=150, memory_bytes=20 * GIB, sm_share=0.25, ranks=4)

        assert isinstance(granted, Granted)
        assert [r.lease_id for r in granted.ranks] == [f"{granted.lease_id}.{k}" for k in range(4)]
        assert {r.placement.device_index for r in granted.ranks} == {0}
        leases = {lease.lease_id: lease for lease in client.status().leases}
        assert set(leases) == {r.lease_id for r in granted.ranks}
        assert {lease.state.value for lease in leases.values()} == {"running"}
        assert sum(lease.memory_bytes for lease in leases.values()) == 80 * GIB

        client.release(granted.lease_id)

        assert client.status().leases == []


def test_a_queued_gang_waits_as_one_request_and_is_refused_when_it_can_never_fit(broker):
    holder, held = start_holder(broker, priority=150, memory_gib=100)
    try:
        assert held["granted"]
        with BrokerClient(broker) as client:
            queued = client.request_lease(priority=150, memory_bytes=30 * GIB, ranks=2)
            assert isinstance(queued, Queued) and queued.position == 1
            views = [lease for lease in client.status().leases if lease.state.value == "queued"]
            assert sorted(v.lease_id for v in views) == [
                f"{queued.lease_id}.0",
                f"{queued.lease_id}.1",
            ]
            assert {v.position for v in views} == {1}

            refused = client.request_lease(priority=150, memory_bytes=100 * GIB, ranks=2)
            assert isinstance(refused, Refused)
            assert refused.message == (
                "2 ranks of 100 GiB can never run at once here: the matching devices and "
                "slices hold 1 at most"
            )
    finally:
        holder.kill()
        holder.wait(timeout=5)


def test_a_high_cell_pauses_every_rank_and_they_all_resume(broker):
    paused: set[str] = set()
    resumed: set[str] = set()
    both_paused, both_resumed = threading.Event(), threading.Event()

    def listen(message) -> None:
        if isinstance(message, Preempt):
            paused.add(message.lease_id)
            if len(paused) == 2:
                both_paused.set()
        elif isinstance(message, Resume):
            resumed.add(message.lease_id)
            if len(resumed) == 2:
                both_resumed.set()

    with BrokerClient(broker, notebook="train.ipynb") as trainer:
        trainer.add_listener(listen)
        gang = trainer.request_lease(priority=50, memory_bytes=10 * GIB, ranks=2)
        assert isinstance(gang, Granted)
        explorer, high = start_holder(broker, priority=250, memory_gib=8)
        try:
            assert high["granted"]
            assert both_paused.wait(timeout=5)
            assert paused == {r.lease_id for r in gang.ranks}
        finally:
            explorer.kill()
            explorer.wait(timeout=5)
        assert both_resumed.wait(timeout=5)
        assert resumed == paused
        states = {lease.lease_id: lease.state.value for lease in trainer.status().leases}
        assert states == {r.lease_id: "running" for r in gang.ranks}


def _killed_and_restarted(broker, client: BrokerClient):
    """The broker killed with ``kill -9`` under ``client``, and started again on its
    journal."""
    broker.process.send_signal(signal.SIGKILL)
    broker.process.wait(timeout=10)
    assert client.closed.wait(timeout=5)
    client.close()
    return launch_broker(directory=broker.directory, journal=broker.journal)


def test_a_gang_survives_a_broker_killed_with_kill_9_and_is_reclaimed_whole(tmp_path):
    broker = launch_broker()
    try:
        trainer = BrokerClient(broker.socket, notebook="ddp.ipynb")
        gang = trainer.request_lease(priority=150, memory_bytes=10 * GIB, ranks=3)
        assert isinstance(gang, Granted)
        members = [r.lease_id for r in gang.ranks]
        restarted = _killed_and_restarted(broker, trainer)
        try:
            with BrokerClient(restarted.socket, reclaim=members) as again:
                assert sorted(again.welcome.reclaimed) == sorted(members)
                states = {lease.lease_id: lease.state.value for lease in again.status().leases}
                assert states == dict.fromkeys(members, "running")
                again.release(gang.lease_id)  # the gang's own id ends every rank
                assert wait_for(lambda: status_of(restarted.socket).leases == [])
        finally:
            restarted.stop()
    finally:
        if broker.process.poll() is None:
            broker.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


def _reclaimed_by_another_pid(socket_path, lease_id: str) -> list[str]:
    with BrokerClient(socket_path, reclaim=[lease_id]) as client:
        return list(client.welcome.reclaimed)


def _sleepers(count: int) -> list:
    import subprocess
    import sys

    return [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        for _ in range(count)
    ]


def test_a_gangs_worker_processes_take_over_its_ranks_and_are_the_ones_paused(broker):
    from gpushare_ext.client import BrokerError
    from gpushare_ext.protocol import ErrorCode

    workers = _sleepers(2)
    try:
        with BrokerClient(broker, notebook="ddp.ipynb") as trainer:
            gang = trainer.request_lease(priority=50, memory_bytes=10 * GIB, ranks=2)
            assert isinstance(gang, Granted)
            pids = [w.pid for w in workers]

            with pytest.raises(BrokerError) as wrong_count:
                trainer.attach_ranks(gang.lease_id, pids[:1])
            assert wrong_count.value.code == ErrorCode.INVALID
            assert "has 2 ranks; 1 processes were named" in str(wrong_count.value)
            with pytest.raises(BrokerError) as not_a_child:
                trainer.attach_ranks(gang.lease_id, [pids[0], 1])
            assert not_a_child.value.code == ErrorCode.PERMISSION

            trainer.attach_ranks(gang.lease_id, pids)

            views = {lease.lease_id: lease for lease in trainer.status().leases}
            assert [views[r.lease_id].pid for r in gang.ranks] == pids
            explorer, high = start_holder(broker, priority=250, memory_gib=8)
            try:
                assert high["granted"]
                assert wait_for(
                    lambda: {lease.state.value for lease in status_of(broker).leases
                             if lease.lease_id in views} == {"paused"}
                )  # fmt: skip
                paused = [v for v in status_of(broker).leases if v.lease_id in views]
                assert sorted(v.pid for v in paused) == sorted(pids)
            finally:
                explorer.kill()
                explorer.wait(timeout=5)
    finally:
        for worker in workers:
            worker.kill()
            worker.wait(timeout=5)


def test_a_gang_run_by_worker_processes_is_reclaimed_by_its_notebook_after_kill_9(tmp_path):
    broker = launch_broker()
    workers = _sleepers(2)
    try:
        trainer = BrokerClient(broker.socket, notebook="ddp.ipynb")
        gang = trainer.request_lease(priority=150, memory_bytes=10 * GIB, ranks=2)
        assert isinstance(gang, Granted)
        trainer.attach_ranks(gang.lease_id, [w.pid for w in workers])
        restarted = _killed_and_restarted(broker, trainer)
        try:
            # Another process of the same user, not the workers' parent, gets nothing.
            assert run_as(None, _reclaimed_by_another_pid, restarted.socket, gang.lease_id) == []
            # The notebook names the gang, as it knows it; its ranks stay the workers'.
            with BrokerClient(restarted.socket, reclaim=[gang.lease_id]) as again:
                assert again.welcome.reclaimed == [gang.lease_id]
                views = {v.lease_id: v for v in again.status().leases}
                assert {k: (v.pid, v.state.value) for k, v in views.items()} == {
                    r.lease_id: (w.pid, "running") for r, w in zip(gang.ranks, workers, strict=True)
                }
                again.release(gang.lease_id)
                assert wait_for(lambda: status_of(restarted.socket).leases == [])
        finally:
            restarted.stop()
    finally:
        for worker in workers:
            worker.kill()
            worker.wait(timeout=5)
        if broker.process.poll() is None:
            broker.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


def _own_pid(pid: int) -> int:
    """The number ``pid`` has in its own PID namespace."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("NSpid:")).split()[-1])


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None, reason="a PID namespace needs root"
)
def test_workers_in_a_pid_namespace_of_their_own_are_named_by_their_own_numbers(broker):
    import subprocess
    import sys

    import psutil

    # Two workers in a namespace of their own, as in a container: they are 2 and 3 there.
    sleep = f"{sys.executable} -c 'import time; time.sleep(60)'"
    box = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", f"{sleep} & {sleep} & wait"])

    def pythons() -> list[int]:
        found = psutil.Process(box.pid).children(recursive=True)
        return sorted(p.pid for p in found if p.name().startswith("python"))

    try:
        workers = wait_for(lambda: pythons() if len(pythons()) == 2 else None)
        inside = [_own_pid(pid) for pid in workers]
        assert inside != workers  # the namespace numbers its processes its own way
        with BrokerClient(broker) as trainer:
            gang = trainer.request_lease(priority=150, memory_bytes=10 * GIB, ranks=2)
            trainer.attach_ranks(gang.lease_id, inside)

            views = {v.lease_id: v.pid for v in trainer.status().leases}
            assert [views[r.lease_id] for r in gang.ranks] == workers
    finally:
        for child in psutil.Process(box.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):  # gone with its parent
                child.kill()
        box.kill()
        box.wait(timeout=5)
