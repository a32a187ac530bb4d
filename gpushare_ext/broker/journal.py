"""The broker's write-ahead journal (SQLite in WAL mode) and recovery after a crash.

Every lease grant, lease end and actuator step (gate, lock, evict) is written and
committed *before* it is acted on.  After a crash (even ``kill -9``) the restarted
broker reads the journal back: actuator steps that were applied and never undone are
undone (processes unlocked and restored), leases whose process still lives are offered
back to it when it reconnects, and leases of dead processes are closed.

The journal must not decide anything: it records and answers queries.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    pid INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    slot TEXT NOT NULL,
    priority INTEGER NOT NULL,
    memory_bytes INTEGER NOT NULL,
    sm_share REAL NOT NULL,
    capabilities TEXT NOT NULL,
    label TEXT NOT NULL,
    granted_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT
);
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
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    kind TEXT NOT NULL,
    lease_id TEXT,
    detail TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class JournaledLease:
    lease_id: str
    pid: int
    uid: int
    slot: str
    priority: int
    memory_bytes: int
    sm_share: float
    capabilities: dict
    label: str


@dataclass(frozen=True)
class JournaledActuation:
    id: int
    lease_id: str
    pid: int
    device_index: int
    level: int
    control_block: str


class Journal:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
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
        value = int(self.meta("next_lease", "1") or 1)
        self.set_meta("next_lease", str(value + 1))
        return value

    # ---- leases

    def lease_granted(self, lease: JournaledLease, at: float | None = None) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO leases VALUES(?,?,?,?,?,?,?,?,?,?,NULL,NULL)",
            (
                lease.lease_id,
                lease.pid,
                lease.uid,
                lease.slot,
                lease.priority,
                lease.memory_bytes,
                lease.sm_share,
                json.dumps(lease.capabilities),
                lease.label,
                at or time.time(),
            ),
        )

    def lease_ended(self, lease_id: str, reason: str, at: float | None = None) -> None:
        self._db.execute(
            "UPDATE leases SET ended_at=?, end_reason=? WHERE lease_id=? AND ended_at IS NULL",
            (at or time.time(), reason, lease_id),
        )

    def open_leases(self) -> list[JournaledLease]:
        rows = self._db.execute(
            "SELECT lease_id, pid, uid, slot, priority, memory_bytes, sm_share, capabilities, label "
            "FROM leases WHERE ended_at IS NULL ORDER BY granted_at"
        ).fetchall()
        return [
            JournaledLease(r[0], r[1], r[2], r[3], r[4], r[5], r[6], json.loads(r[7]), r[8])
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
        return int(cursor.lastrowid)

    def actuations_undone(self, lease_id: str) -> None:
        self._db.execute(
            "UPDATE actuations SET undone_at=? WHERE lease_id=? AND undone_at IS NULL",
            (time.time(), lease_id),
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
