"""The broker's write-ahead journal (SQLite in WAL mode) and what recovery reads back.

Every lease is written when it is first queued or granted, again at each change of
state (paused, evicted, resumed) and when it ends; every actuator step (gate, lock,
evict) is written and committed *before* it is acted on.  After a restart (even after
``kill -9``) the broker reads the journal back: actuator steps that were applied and
never undone are undone (processes unlocked and restored), open leases whose process
still lives come back in the state they had and wait for their session to reconnect,
and leases of dead processes are closed.

The journal is private to the broker: its directory is created 0700 and the database
0600 (it holds cell labels, notebook names and the salt that anonymises users), and a
directory another user could write is refused.  Ended leases, undone actuations and
history are pruned (:meth:`Journal.prune`), so it stays small on a busy host.

A broker checkpoints the WAL mostly on a thread of its own
(:meth:`Journal.checkpoint_in_background`, :mod:`~gpushare_ext.broker.hands.checkpointer`):
SQLite's automatic checkpoint would copy and sync inside whichever commit crossed its
limit, on the event loop.  Commits are unchanged by it: each is in the WAL when it
returns.

The journal must not decide anything: it records and answers queries.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.broker.hands.checkpointer import EVERY_S, LIMIT_BYTES, WalCheckpointer
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.safe_fs import UnsafePathError, open_private_file, trusted_directory

SCHEMA_VERSION = "2"
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lease_records (
    lease_id TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    start_ticks INTEGER,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    state TEXT NOT NULL,
    slot TEXT,
    priority INTEGER NOT NULL,
    memory_bytes INTEGER NOT NULL,
    sm_share REAL NOT NULL,
    slice TEXT NOT NULL,
    device TEXT NOT NULL,
    capabilities TEXT NOT NULL,
    label TEXT NOT NULL,
    requested_at REAL NOT NULL,
    granted_at REAL,
    aging_bonus REAL NOT NULL DEFAULT 0,
    level INTEGER,
    paused_for TEXT NOT NULL DEFAULT '',
    reason TEXT NOT NULL DEFAULT '',
    ended_at REAL,
    end_reason TEXT
);
CREATE INDEX IF NOT EXISTS lease_records_open ON lease_records(ended_at);
CREATE TABLE IF NOT EXISTS actuations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    lease_id TEXT NOT NULL,
    pid INTEGER NOT NULL,
    device_index INTEGER NOT NULL,
    level INTEGER NOT NULL,
    control_block TEXT NOT NULL,
    applied_at REAL NOT NULL,
    undone_at REAL
);
CREATE INDEX IF NOT EXISTS actuations_pending ON actuations(undone_at);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    lease_id TEXT,
    detail TEXT NOT NULL
);
"""
_LEASE_COLUMNS = (
    "lease_id, pid, start_ticks, uid, gid, state, slot, priority, memory_bytes, sm_share, "
    "slice, device, capabilities, label, requested_at, granted_at, aging_bonus, level, "
    "paused_for, reason"
)
# What a busy host keeps at most, whatever the retention time says.
MAX_ENDED_LEASES = 20_000
MAX_HISTORY_ROWS = 20_000
LEASE_NUMBER_BLOCK = 64  # lease numbers reserved per commit (a crash skips the rest)


class JournalError(DaemonError, RuntimeError):
    """The journal cannot be opened or written; the message names the path."""


@dataclass(frozen=True, kw_only=True)
class JournaledLease:
    lease_id: str
    pid: int
    uid: int
    gid: int = 0
    start_ticks: int | None = None  # when the process started (so a reused pid is not it)
    state: LeaseState = LeaseState.RUNNING  # queued, running, paused or evicted
    slot: str | None = None
    priority: int = 150
    memory_bytes: int = 0
    sm_share: float = 1.0
    slice: str = "auto"
    device: str = "auto"
    capabilities: dict | None = None
    label: str = ""
    requested_at: float = 0.0
    granted_at: float | None = None
    aging_bonus: float = 0.0
    level: int | None = None
    paused_for: str = ""
    reason: str = ""


@dataclass(frozen=True)
class JournaledActuation:
    id: int
    lease_id: str
    pid: int
    device_index: int
    level: int
    control_block: str


def _prepare(path: Path) -> None:
    """A private directory for the journal, and a database file only the broker reads."""
    try:
        trusted_directory(
            path.parent,
            trusted={os.geteuid()},
            create_mode=0o700,
            hint="the journal holds users' cell labels; choose a directory only the broker "
            "can write",
        )
        for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            flags = os.O_RDWR | (os.O_CREAT if name == path else 0)
            if name != path and not name.exists():
                continue
            os.close(open_private_file(name, flags))
    except UnsafePathError as exc:
        raise JournalError(f"cannot use the journal {path}: {exc}") from None


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_absolute():
            self.path = Path.cwd() / self.path
        _prepare(self.path)
        try:
            self._db = sqlite3.connect(
                str(self.path), isolation_level=None, check_same_thread=False
            )
            # Must come before the first table exists; later runs keep what it was.
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(SCHEMA)
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"cannot use the journal {self.path}: {exc}") from None
        self._checkpointer: WalCheckpointer | None = None
        self._next_lease = 0  # the next number of the block reserved; none yet
        self._reserved_until = 0

    def _migrate(self) -> None:
        """Journals of version 1 kept running leases in ``leases``: carry the open ones over."""
        tables = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master")}
        if "leases" in tables:
            rows = self._db.execute(
                "SELECT lease_id, pid, uid, slot, priority, memory_bytes, sm_share, "
                "capabilities, label, granted_at FROM leases WHERE ended_at IS NULL"
            ).fetchall()
            for r in rows:
                self._db.execute(
                    "INSERT OR IGNORE INTO lease_records(lease_id, pid, uid, gid, state, slot, "
                    "priority, memory_bytes, sm_share, slice, device, capabilities, label, "
                    "requested_at, granted_at) VALUES(?,?,?,0,'running',?,?,?,?,'auto','auto',?,?,?,?)",
                    (r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[9]),
                )
            self._db.execute("DROP TABLE leases")
        self.set_meta("schema", SCHEMA_VERSION)

    def checkpoint_in_background(
        self,
        call_soon: Callable[[Callable[[], None]], object],
        *,
        every_s: float = EVERY_S,
        limit_bytes: int = LIMIT_BYTES,
    ) -> WalCheckpointer:
        """Checkpoint the WAL on a thread from now on, never inside a commit, but for a
        short step each ``limit_bytes`` of WAL that ``call_soon`` (the event loop's
        ``call_soon_threadsafe``) runs on this journal's thread.  ``close`` stops it."""
        if self._checkpointer is None:
            checkpointer = WalCheckpointer(
                self.path,
                self._finish_checkpoint,
                call_soon,
                every_s=every_s,
                limit_bytes=limit_bytes,
            )
            try:
                self._db.execute("PRAGMA wal_autocheckpoint=0")
                checkpointer.start()
            except sqlite3.Error as exc:
                raise JournalError(f"cannot checkpoint the journal {self.path}: {exc}") from None
            self._checkpointer = checkpointer
        return self._checkpointer

    def _finish_checkpoint(self) -> None:
        if self._checkpointer is not None:  # not once the journal is closed
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.stop()
            self._checkpointer = None
        with contextlib.suppress(sqlite3.Error):
            if self._next_lease < self._reserved_until:
                self.set_meta("next_lease", str(self._next_lease))
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self._db.close()

    # ---- meta

    def meta(self, key: str, default: str | None = None) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else default

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )

    def next_lease_number(self) -> int:
        """A lease number never handed out before, even across a crash.

        Numbers are reserved ``LEASE_NUMBER_BLOCK`` at a time (one commit per block,
        not one per request: a busy host asks for a thousand a second); ``close``
        writes back the exact next one, so only a crash skips the rest of a block."""
        if self._next_lease >= self._reserved_until:
            start = max(self._next_lease, int(self.meta("next_lease", "1") or 1))
            self._reserved_until = start + LEASE_NUMBER_BLOCK
            self.set_meta("next_lease", str(self._reserved_until))
            self._next_lease = start
        value = self._next_lease
        self._next_lease += 1
        return value

    # ---- leases

    def lease_recorded(self, lease: JournaledLease) -> None:
        """A lease as it is now (queued or granted): written before the client hears of it."""
        self._db.execute(
            f"INSERT OR REPLACE INTO lease_records({_LEASE_COLUMNS}) "
            "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                lease.lease_id,
                lease.pid,
                lease.start_ticks,
                lease.uid,
                lease.gid,
                lease.state,
                lease.slot,
                lease.priority,
                lease.memory_bytes,
                lease.sm_share,
                lease.slice,
                lease.device,
                json.dumps(lease.capabilities or {}),
                lease.label,
                lease.requested_at or time.time(),
                lease.granted_at,
                lease.aging_bonus,
                lease.level,
                lease.paused_for,
                lease.reason,
            ),
        )

    def lease_state(
        self,
        lease_id: str,
        state: LeaseState,
        *,
        level: int | None = None,
        paused_for: str = "",
        reason: str = "",
        aging_bonus: float | None = None,
    ) -> None:
        """An open lease paused, evicted or resumed."""
        self._db.execute(
            "UPDATE lease_records SET state=?, level=?, paused_for=?, reason=?, "
            "aging_bonus=COALESCE(?, aging_bonus) WHERE lease_id=? AND ended_at IS NULL",
            (state, level, paused_for, reason, aging_bonus, lease_id),
        )

    def lease_ended(self, lease_id: str, reason: str, at: float | None = None) -> None:
        self._db.execute(
            "UPDATE lease_records SET ended_at=?, end_reason=? "
            "WHERE lease_id=? AND ended_at IS NULL",
            (at or time.time(), reason, lease_id),
        )

    def open_leases(self) -> list[JournaledLease]:
        """Every lease not ended, in the order it was asked for."""
        rows = self._db.execute(
            f"SELECT {_LEASE_COLUMNS} FROM lease_records WHERE ended_at IS NULL "
            "ORDER BY requested_at, rowid"
        ).fetchall()
        return [
            JournaledLease(
                lease_id=r[0],
                pid=r[1],
                start_ticks=r[2],
                uid=r[3],
                gid=r[4],
                state=LeaseState(r[5]),
                slot=r[6],
                priority=r[7],
                memory_bytes=r[8],
                sm_share=r[9],
                slice=r[10],
                device=r[11],
                capabilities=json.loads(r[12]),
                label=r[13],
                requested_at=r[14],
                granted_at=r[15],
                aging_bonus=r[16],
                level=r[17],
                paused_for=r[18],
                reason=r[19],
            )
            for r in rows
        ]

    # ---- actuations

    def actuation_applied(
        self, lease_id: str, pid: int, device_index: int, level: int, control_block: str
    ) -> int:
        cursor = self._db.execute(
            "INSERT INTO actuations(lease_id, pid, device_index, level, control_block, applied_at) "
            "VALUES(?,?,?,?,?,?)",
            (lease_id, pid, device_index, level, control_block, time.time()),
        )
        return int(cursor.lastrowid or 0)

    def actuations_undone(self, lease_id: str, up_to: int | None = None) -> None:
        """Every step applied to the lease (up to actuation ``up_to``) is undone."""
        self._db.execute(
            "UPDATE actuations SET undone_at=? WHERE lease_id=? AND undone_at IS NULL "
            "AND id <= COALESCE(?, id)",
            (time.time(), lease_id, up_to),
        )

    def actuation_undone(self, actuation_id: int) -> None:
        self._db.execute(
            "UPDATE actuations SET undone_at=? WHERE id=? AND undone_at IS NULL",
            (time.time(), actuation_id),
        )

    def pending_actuations(self) -> list[JournaledActuation]:
        rows = self._db.execute(
            "SELECT id, lease_id, pid, device_index, level, control_block FROM actuations "
            "WHERE undone_at IS NULL ORDER BY id"
        ).fetchall()
        return [JournaledActuation(*r) for r in rows]

    # ---- history (for status and post-mortems)

    def note(self, kind: str, lease_id: str | None, detail: dict) -> None:
        self._db.execute(
            "INSERT INTO history(at, kind, lease_id, detail) VALUES(?,?,?,?)",
            (time.time(), kind, lease_id, json.dumps(detail)),
        )

    def history(self, limit: int = 100) -> list[tuple[float, str, str | None, dict]]:
        rows = self._db.execute(
            "SELECT at, kind, lease_id, detail FROM history ORDER BY id DESC LIMIT ?", (limit,)
        ).fetchall()
        return [(r[0], r[1], r[2], json.loads(r[3])) for r in reversed(rows)]

    # ---- housekeeping

    def prune(self, keep_s: float, now: float | None = None) -> int:
        """Forget what no recovery needs: ended leases and history older than ``keep_s``
        (and beyond the row caps), undone actuations.  Returns the rows deleted."""
        cutoff = (now or time.time()) - keep_s
        deleted = 0
        self._db.execute("BEGIN")
        try:
            for statement, args in (
                (
                    "DELETE FROM lease_records WHERE ended_at IS NOT NULL AND ended_at < ?",
                    (cutoff,),
                ),
                (
                    "DELETE FROM lease_records WHERE lease_id IN (SELECT lease_id FROM "
                    "lease_records WHERE ended_at IS NOT NULL ORDER BY ended_at DESC "
                    "LIMIT -1 OFFSET ?)",
                    (MAX_ENDED_LEASES,),
                ),
                ("DELETE FROM actuations WHERE undone_at IS NOT NULL", ()),
                ("DELETE FROM history WHERE at < ?", (cutoff,)),
                (
                    "DELETE FROM history WHERE id <= (SELECT MAX(id) FROM history) - ?",
                    (MAX_HISTORY_ROWS,),
                ),
            ):
                deleted += self._db.execute(statement, args).rowcount
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        if deleted:
            self._db.execute("PRAGMA incremental_vacuum")
        return deleted

    def row_counts(self) -> dict[str, int]:
        """Rows per table (for the soak benchmark and an admin's look)."""
        return {
            table: int(self._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
            for table in ("lease_records", "actuations", "history")
        }
