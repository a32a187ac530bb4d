"""The write-ahead journal, alone and across a real ``kill -9`` of the broker."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
from dataclasses import replace

from broker_wire import start_holder, status_of, wait_for
from support import launch_broker, run_as

from gpushare_ext.broker.hands.journal import LEASE_NUMBER_BLOCK, Journal, JournaledLease
from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, LeaseState, Preempt

LOCK = 3


def _lease(lease_id: str, pid: int = 4242, state: str = "running") -> JournaledLease:
    return JournaledLease(
        lease_id=lease_id, pid=pid, uid=1000, gid=100, start_ticks=777, state=state,
        slot="0" if state != "queued" else None, priority=150, memory_bytes=8 << 30,
        sm_share=1.0, capabilities={"gate": True}, label="cell", requested_at=1000.0,
        granted_at=1001.0 if state != "queued" else None,
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


def test_lease_numbers_are_never_handed_out_twice_even_when_the_broker_dies(tmp_path):
    path = tmp_path / "state" / "journal.sqlite"
    crashed = Journal(path)  # never closed: as after kill -9
    before = [crashed.next_lease_number() for _ in range(LEASE_NUMBER_BLOCK + 3)]
    after_crash = Journal(path)
    try:
        later = [after_crash.next_lease_number() for _ in range(3)]
        assert min(later) > max(before)
        assert later == [
            LEASE_NUMBER_BLOCK * 2 + 1,
            LEASE_NUMBER_BLOCK * 2 + 2,
            LEASE_NUMBER_BLOCK * 2 + 3,
        ]
    finally:
        after_crash.close()
        crashed._db.close()
    with contextlib.closing(Journal(path)) as reopened:  # closed cleanly: no gap
        assert reopened.next_lease_number() == max(later) + 1


def test_the_journal_remembers_leases_actuations_and_numbers_across_reopening(tmp_path):
    path = tmp_path / "state" / "journal.sqlite"
    journal = Journal(path)
    assert [journal.next_lease_number() for _ in range(3)] == [1, 2, 3]
    journal.lease_recorded(_lease("L1"))
    journal.lease_recorded(_lease("L2"))
    journal.lease_ended("L2", "released")
    journal.lease_recorded(_lease("L3", state="queued"))
    journal.lease_state("L1", "paused", level=LOCK, paused_for="L9", reason="for L9")
    first = journal.actuation_applied("L1", 4242, 0, LOCK, "/run/x.cb")
    journal.actuation_applied("L1", 4242, 0, 4, "/run/x.cb")
    journal.actuation_undone(first)
    journal.note("reclaimable", "L1", {"pid": 4242})
    journal.close()

    reopened = Journal(path)
    try:
        assert reopened.next_lease_number() == 4
        paused = replace(_lease("L1"), state="paused", level=LOCK, paused_for="L9", reason="for L9")
        assert reopened.open_leases() == [paused, _lease("L3", state="queued")]
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
        # The lock is recorded and applied (simulated: status names the gate that holds
        # the session there) before anything else happens.
        pending = "SELECT level FROM actuations WHERE lease_id=? AND undone_at IS NULL"
        assert wait_for(lambda: _rows(broker.journal, pending, low.lease_id) == [(LOCK,)])
        assert wait_for(
            lambda: (
                _lease_view(broker.socket, low.lease_id).state == LeaseState.PAUSED
                and _lease_view(broker.socket, low.lease_id).preemption_level == 0
            )
        )

        broker.process.send_signal(signal.SIGKILL)
        broker.process.wait(timeout=10)
        explorer.kill()  # the high lease's process dies while no broker runs
        explorer.wait(timeout=5)
        assert trainer.closed.wait(timeout=5)
        open_leases = "SELECT lease_id FROM lease_records WHERE ended_at IS NULL ORDER BY lease_id"
        assert _rows(broker.journal, open_leases) == sorted([(low.lease_id,), (high["lease_id"],)])

        restarted = launch_broker(directory=broker.directory, journal=broker.journal)
        try:
            # Recovery undid the lock before serving anyone.
            assert _rows(broker.journal, pending, low.lease_id) == []
            assert "recovery: undoing level 3" in restarted.output()
            # The dead process's lease is closed; the live one's waits to be reclaimed.
            ended = _rows(
                broker.journal,
                "SELECT end_reason FROM lease_records WHERE lease_id=?",
                high["lease_id"],
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


# ------------------------------------------------------------------ privacy and size


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_broker_makes_its_state_directory_private_and_its_journal_unreadable_to_others():
    """Cell labels, notebook names and the anonymisation salt are the broker's alone."""
    broker = launch_broker(journal=None)
    state = broker.directory / "state" / "deeper"
    restarted = None
    try:
        broker.stop()
        restarted = launch_broker(directory=broker.directory, journal=state / "journal.sqlite")
        with BrokerClient(restarted.socket, notebook="secret.ipynb") as client:
            assert isinstance(client.request_lease(priority=150, label="%%gpu private"), Granted)
        assert _mode(broker.directory / "state") == 0o700
        assert _mode(state) == 0o700
        for name in ("journal.sqlite", "journal.sqlite-wal", "journal.sqlite-shm"):
            if (state / name).exists():
                assert _mode(state / name) == 0o600, name
    finally:
        if restarted is not None:
            restarted.stop()
        shutil.rmtree(broker.directory, ignore_errors=True)


def test_a_journal_left_readable_by_an_earlier_version_is_made_private(tmp_path):
    path = tmp_path / "journal.sqlite"
    sqlite3.connect(path).close()
    path.chmod(0o644)
    Journal(path).close()
    assert _mode(path) == 0o600


def test_a_journal_in_a_directory_others_can_write_is_refused_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    try:
        Journal(shared / "journal.sqlite")
    except RuntimeError as exc:
        message = str(exc)
    else:
        raise AssertionError("a journal in a world-writable directory was accepted")
    assert "\n" not in message
    assert str(shared) in message and "written by other users" in message
    assert not (shared / "journal.sqlite").exists()


def test_a_broker_with_an_unwritable_journal_path_says_so_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    result = subprocess.run(
        [
            sys.executable, "-m", "gpushare_ext.cli", "broker", "--simulate", "h200",
            "--socket", str(tmp_path / "b.sock"), "--journal", str(blocker / "journal.sqlite"),
        ],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("gpushare: cannot use the journal"), result.stderr
    assert "Traceback" not in result.stderr


def test_an_open_lease_of_a_version_1_journal_is_carried_over(tmp_path):
    path = tmp_path / "journal.sqlite"
    old = sqlite3.connect(path)
    old.executescript(
        "CREATE TABLE leases (lease_id TEXT PRIMARY KEY, pid INTEGER NOT NULL, uid INTEGER "
        "NOT NULL, slot TEXT NOT NULL, priority INTEGER NOT NULL, memory_bytes INTEGER NOT "
        "NULL, sm_share REAL NOT NULL, capabilities TEXT NOT NULL, label TEXT NOT NULL, "
        "granted_at REAL NOT NULL, ended_at REAL, end_reason TEXT);"
        "INSERT INTO leases VALUES('L7', 4242, 1000, '0', 150, 8, 1.0, '{}', 'old', 5.0, NULL, NULL);"
        "INSERT INTO leases VALUES('L8', 4242, 1000, '0', 150, 8, 1.0, '{}', 'gone', 5.0, 6.0, 'released');"
    )
    old.commit()
    old.close()
    journal = Journal(path)
    try:
        [lease] = journal.open_leases()
        assert (lease.lease_id, lease.state, lease.slot, lease.label) == (
            "L7",
            "running",
            "0",
            "old",
        )
    finally:
        journal.close()


def test_pruning_forgets_what_no_recovery_needs_and_keeps_open_leases(tmp_path, monkeypatch):
    import gpushare_ext.broker.hands.journal as journal_module

    monkeypatch.setattr(journal_module, "MAX_ENDED_LEASES", 50)
    monkeypatch.setattr(journal_module, "MAX_HISTORY_ROWS", 50)
    journal = Journal(tmp_path / "journal.sqlite")
    try:
        journal.lease_recorded(_lease("open"))
        step = journal.actuation_applied("open", 4242, 0, LOCK, "")
        for n in range(500):
            journal.lease_recorded(_lease(f"L{n}"))
            journal.lease_ended(f"L{n}", "released")
            undone = journal.actuation_applied(f"L{n}", 4242, 0, LOCK, "")
            journal.actuation_undone(undone)
            journal.note("grant", f"L{n}", {"n": n})
        assert journal.prune(keep_s=3600) > 0
        counts = journal.row_counts()
        assert counts == {"lease_records": 51, "actuations": 1, "history": 50}
        assert [lease.lease_id for lease in journal.open_leases()] == ["open"]
        assert [p.id for p in journal.pending_actuations()] == [step]
        # Age counts as well as number: with no time kept, every ended lease goes.
        journal.prune(keep_s=0)
        assert journal.row_counts()["lease_records"] == 1
    finally:
        journal.close()
