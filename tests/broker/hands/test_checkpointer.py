"""The journal's WAL checkpoints off the event loop: bounded, complete, stopped at close.

A stand-in for the event loop (a list of callbacks the test runs between commits)
decides when the loop's step runs, so that nothing here depends on timing; one test
runs a real asyncio loop in a child process and kills it with ``kill -9``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from broker_wire import wait_for

import gpushare_ext
from gpushare_ext.broker.hands.journal import Journal, JournaledLease

ROUNDS = 8
MAX_FRAMES_PER_COMMIT = 8  # one lease row: its table, two indexes, a page split at worst
FRAME_BYTES = 4096 + 24  # a page and its frame header
SQLITE_AUTOCHECKPOINT_PAGES = 1000  # SQLite's default


def _lease(lease_id: str) -> JournaledLease:
    return JournaledLease(lease_id=lease_id, pid=4242, uid=1000, label="cell " * 20)


def _wal(journal: Journal) -> Path:
    return journal.path.with_name(journal.path.name + "-wal")


def test_the_loops_steps_keep_the_wal_to_the_commits_between_two_and_lose_none(tmp_path):
    journal = Journal(tmp_path / "state" / "journal.sqlite")
    pending: list[Callable[[], None]] = []
    journal.checkpoint_in_background(pending.append, every_s=0.001, limit_bytes=0)
    try:
        # Commits never pause but for the loop's step, as on a busy host: only that
        # step lets the WAL start anew.
        per_round, since_step, written = [], 0, 0
        deadline = time.monotonic() + 120
        while len(per_round) < ROUNDS:
            written += 1
            since_step += 1
            journal.lease_recorded(_lease(f"L{written}"))
            if pending:  # the loop's turn, between two commits
                pending.pop(0)()
                per_round.append(since_step)
                since_step = 0
            assert time.monotonic() < deadline, f"only {len(per_round)} steps in 120 s"
        longest = max([*per_round, since_step])
        assert _wal(journal).stat().st_size <= 32 + longest * MAX_FRAMES_PER_COMMIT * FRAME_BYTES
        assert len(journal.open_leases()) == written
    finally:
        journal.close()


def test_the_loop_is_asked_for_its_step_only_once_the_wal_is_past_the_limit(tmp_path):
    journal = Journal(tmp_path / "state" / "journal.sqlite")
    pending: list[Callable[[], None]] = []
    limit = 1024 * 1024
    journal.checkpoint_in_background(pending.append, every_s=0.001, limit_bytes=limit)
    try:
        written = 0
        deadline = time.monotonic() + 120
        while not pending:
            written += 1
            journal.lease_recorded(_lease(f"L{written}"))
            assert time.monotonic() < deadline, "the loop was never asked for its step"
        assert _wal(journal).stat().st_size > limit
    finally:
        journal.close()


def test_while_a_checkpointer_runs_no_commit_checkpoints(tmp_path):
    # No round comes (an hour apart): had SQLite's own checkpoint stayed on, a commit
    # would have copied the WAL back every 1,000 pages and the next started it anew.
    journal = Journal(tmp_path / "state" / "journal.sqlite")
    journal.checkpoint_in_background(lambda step: None, every_s=3600)
    try:
        for i in range(3000):
            journal.lease_recorded(_lease(f"L{i}"))
        assert _wal(journal).stat().st_size > 2 * SQLITE_AUTOCHECKPOINT_PAGES * FRAME_BYTES
    finally:
        journal.close()


def test_closing_the_journal_stops_a_round_that_waits_for_the_loop(tmp_path):
    path = tmp_path / "state" / "journal.sqlite"
    journal = Journal(path)
    pending: list[Callable[[], None]] = []
    checkpointer = journal.checkpoint_in_background(pending.append, every_s=0.001, limit_bytes=0)
    journal.lease_recorded(_lease("L1"))
    assert wait_for(lambda: pending), "the round did not ask for the loop's step"
    assert checkpointer.running

    journal.close()  # the loop never ran the step: close must not wait for it

    assert not checkpointer.running
    assert "gpushare-wal-checkpoint" not in {t.name for t in threading.enumerate()}
    pending.pop()()  # a step the loop runs after the close does nothing
    assert not _wal(journal).exists() or _wal(journal).stat().st_size == 0
    reopened = Journal(path)
    try:
        assert [lease.lease_id for lease in reopened.open_leases()] == ["L1"]
    finally:
        reopened.close()


CHILD = """
import asyncio, sys
from gpushare_ext.broker.hands.journal import Journal, JournaledLease

async def main():
    journal = Journal(sys.argv[1])
    loop = asyncio.get_running_loop()
    checkpointer = journal.checkpoint_in_background(
        loop.call_soon_threadsafe, every_s=0.005, limit_bytes=0
    )
    n = 0
    while True:
        n += 1
        journal.lease_recorded(JournaledLease(lease_id=f"L{n}", pid=4242, uid=1000))
        if n % 50 == 0:
            print(n, checkpointer.loop_steps, flush=True)  # L1..Ln are committed
        await asyncio.sleep(0)

asyncio.run(main())
"""


def test_every_commit_reported_survives_kill_9_while_checkpoints_run(tmp_path):
    path = tmp_path / "state" / "journal.sqlite"
    root = str(Path(gpushare_ext.__file__).parent.parent)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"},
    )
    committed = 0
    try:
        assert child.stdout is not None
        for line in child.stdout:
            committed, steps = (int(word) for word in line.split())
            if steps >= 3 and committed >= 1000:
                break
        child.send_signal(signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)
    assert committed >= 1000, "the child stopped before it had written enough"

    reopened = Journal(path)
    try:
        kept = {lease.lease_id for lease in reopened.open_leases()}
    finally:
        reopened.close()
    missing = [f"L{n}" for n in range(1, committed + 1) if f"L{n}" not in kept]
    assert missing == []
