"""The write-ahead journal, alone and across a real ``kill -9`` of the broker."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import threading

from broker_wire import start_holder, status_of, wait_for
from support import launch_broker, run_as

from gpushare_ext.broker.journal import Journal, JournaledLease
from gpushare_ext.protocol import Granted, Preempt
from gpushare_ext.runtime.client import BrokerClient

LOCK = 3


def _lease(lease_id: str, pid: int = 4242) -> JournaledLease:
    return JournaledLease(
        lease_id=lease_id, pid=pid, uid=1000, slot="0", priority=150, memory_bytes=8 << 30,
        sm_share=1.0, capabilities={"gate": True}, label="cell",
    )  # fmt: skip


def test_the_journal_is_sqlite_in_wal_mode(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite")
    try:
        assert journal._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        other = sqlite3.connect(tmp_path / "journal.sqlite")
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent
        other.close()
    finally:
        journal.close()


def test_the_journal_remembers_leases_actuations_and_numbers_across_reopening(tmp_path):
    path = tmp_path / "state" / "journal.sqlite"
    journal = Journal(path)
    assert [journal.next_lease_number() for _ in range(3)] == [1, 2, 3]
    journal.lease_granted(_lease("L1"))
    journal.lease_granted(_lease("L2"))
    journal.lease_ended("L2", "released")
    first = journal.actuation_applied("L1", 4242, 0, LOCK, "/run/x.cb")
    journal.actuation_applied("L1", 4242, 0, 4, "/run/x.cb")
    journal.actuation_undone(first)
    journal.note("reclaimable", "L1", {"pid": 4242})
    journal.close()

    reopened = Journal(path)
    try:
        assert reopened.next_lease_number() == 4
        assert reopened.open_leases() == [_lease("L1")]
        [pending] = reopened.pending_actuations()
        assert (pending.lease_id, pending.level, pending.control_block) == ("L1", 4, "/run/x.cb")
        reopened.actuations_undone("L1")
        assert reopened.pending_actuations() == []
        assert reopened.history()[-1][1:] == ("reclaimable", "L1", {"pid": 4242})
    finally:
        reopened.close()


def _rows(journal_path, query: str, *args) -> list[tuple]:
    db = sqlite3.connect(journal_path)
    try:
        return db.execute(query, args).fetchall()
    finally:
        db.close()


def _reclaim_from_another_pid(socket_path, lease_id: str) -> list[str]:
    with BrokerClient(socket_path, reclaim=[lease_id]) as client:
        return list(client.welcome.reclaimed)


def test_after_kill_9_the_restarted_broker_undoes_locks_and_live_clients_reclaim(tmp_path):
    broker = launch_broker()
    paused = threading.Event()
    trainer = BrokerClient(broker.socket, notebook="train.ipynb")  # this process: stays alive
    trainer.add_listener(lambda m: paused.set() if isinstance(m, Preempt) else None)
    low = trainer.request_lease(priority=50, label="training loop")
    assert isinstance(low, Granted)
    explorer, high = start_holder(broker.socket, priority=250)
    try:
        assert high["granted"]
        assert paused.wait(timeout=5)
        # The lock is applied (simulated) and recorded before anything else happens.
        assert wait_for(lambda: _lease_view(broker.socket, low.lease_id).preemption_level == LOCK)
        pending = "SELECT level FROM actuations WHERE lease_id=? AND undone_at IS NULL"
        assert _rows(broker.journal, pending, low.lease_id) == [(LOCK,)]

        broker.process.send_signal(signal.SIGKILL)
        broker.process.wait(timeout=10)
        explorer.kill()  # the high lease's process dies while no broker runs
        explorer.wait(timeout=5)
        assert trainer.closed.wait(timeout=5)
        open_leases = "SELECT lease_id FROM leases WHERE ended_at IS NULL ORDER BY lease_id"
        assert _rows(broker.journal, open_leases) == sorted([(low.lease_id,), (high["lease_id"],)])

        restarted = launch_broker(directory=broker.directory, journal=broker.journal)
        try:
            # Recovery undid the lock before serving anyone.
            assert _rows(broker.journal, pending, low.lease_id) == []
            assert "recovery: undoing level 3" in restarted.output()
            # The dead process's lease is closed; the live one's waits to be reclaimed.
            ended = _rows(
                broker.journal, "SELECT end_reason FROM leases WHERE lease_id=?", high["lease_id"]
            )
            assert ended == [("its process ended while the broker was down",)]
            assert _rows(broker.journal, open_leases) == [(low.lease_id,)]

            # Only the pid that held it may take it back.
            assert run_as(None, _reclaim_from_another_pid, restarted.socket, low.lease_id) == []
            with BrokerClient(restarted.socket, reclaim=[low.lease_id, high["lease_id"]]) as again:
                assert again.welcome.reclaimed == [low.lease_id]
                leases = {x.lease_id: x for x in again.status().leases}
                assert set(leases) == {low.lease_id}
                assert leases[low.lease_id].state.value == "running"
                assert leases[low.lease_id].preemption_level is None
                assert leases[low.lease_id].pid == os.getpid()
        finally:
            restarted.stop()
    finally:
        trainer.close()
        if explorer.poll() is None:
            explorer.kill()
        if broker.process.poll() is None:
            broker.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


def _lease_view(socket_path, lease_id):
    return next(x for x in status_of(socket_path).leases if x.lease_id == lease_id)
