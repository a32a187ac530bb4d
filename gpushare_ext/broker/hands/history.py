"""The last hour of each GPU, sampled every few seconds, kept across a broker restart.

What it is for: the dashboard's time series.  Every :data:`SAMPLE_EVERY_S` seconds the
broker's tick records one :class:`Sample` per GPU (utilisation, the queue waiting for it,
and the memory each user holds there: in leases, outside leases, parked on the host);
:class:`History` keeps the last :data:`~gpushare_ext.broker.hands.timeline.KEEP_S` seconds of
them in memory and in a :class:`HistoryStore`, an SQLite file of its own beside the
journal, which also keeps the timeline's spans (it is the timeline's
:class:`~gpushare_ext.broker.hands.timeline.SpanStore`).  A new broker on the same file starts
with the hour the last one left.

Samples and spans hold uids and names as they are; what a viewer may see of them
(``user-xxxx``, labels only for their owner) is decided where they leave the broker,
in :mod:`gpushare_ext.broker.edges.history_view`.

What it must not do: decide anything, read a clock (times are passed in), read broker
state, or grow: older than the window is forgotten in memory and deleted on disk, and
a device keeps at most :data:`MAX_SAMPLES` samples.  A store that cannot be written is
given up with a warning: the history is for people to look at, never a reason for the
broker to stop.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gpushare_ext.broker.hands.timeline import KEEP_S, Pause, Span
from gpushare_ext.broker.scheduler.core import Identity
from gpushare_ext.safe_fs import UnsafePathError, open_private_file

__all__ = [
    "MAX_SAMPLES",
    "SAMPLE_EVERY_S",
    "History",
    "HistoryStore",
    "Holding",
    "HoldingKind",
    "Sample",
    "history_path",
]

log = logging.getLogger("gpushare.broker")

SAMPLE_EVERY_S = 5.0  # 720 points an hour: finer than a chart 1400 px wide can show
MAX_SAMPLES = int(KEEP_S / SAMPLE_EVERY_S) + 60  # a bound even if the clock jumps back
PRUNE_EVERY_S = 60.0
OTHER_PROCESSES_UID = -1  # memory of processes that belong to no session

HoldingKind = Literal["leased", "outside", "parked"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS samples (
    at REAL NOT NULL,
    device INTEGER NOT NULL,
    utilization INTEGER NOT NULL,
    queued INTEGER NOT NULL,
    memory TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_at ON samples(at);
CREATE TABLE IF NOT EXISTS spans (
    lease_id TEXT NOT NULL,
    device INTEGER NOT NULL,
    start REAL NOT NULL,
    uid INTEGER NOT NULL,
    user TEXT NOT NULL,
    priority INTEGER NOT NULL,
    label TEXT NOT NULL,
    ended REAL,
    pauses TEXT NOT NULL,
    PRIMARY KEY (lease_id, device, start)
);
CREATE INDEX IF NOT EXISTS spans_ended ON spans(ended);
"""


@dataclass(frozen=True)
class Holding:
    """Memory one user holds on a GPU, of one kind, in MiB."""

    uid: int  # OTHER_PROCESSES_UID: processes of no session
    user: str
    kind: HoldingKind
    mib: int


@dataclass(frozen=True)
class Sample:
    at: float
    device_index: int
    utilization_pct: int
    queued: int  # requests waiting that this GPU could serve
    memory: tuple[Holding, ...] = ()


def history_path(journal: Path) -> Path:
    """The history's file: beside the journal, in the broker's private directory."""
    return journal.with_name(f"{journal.stem}-history.sqlite")


def _memory_json(memory: tuple[Holding, ...]) -> str:
    return json.dumps([[h.uid, h.user, h.kind, h.mib] for h in memory])


def _memory_of(text: str) -> tuple[Holding, ...]:
    return tuple(
        Holding(int(uid), str(user), kind, int(mib)) for uid, user, kind, mib in json.loads(text)
    )


class HistoryStore:
    """The SQLite file of the history: samples and spans, nothing older than ``keep_s``."""

    def __init__(self, path: Path, keep_s: float = KEEP_S) -> None:
        self.path = path
        self.keep_s = keep_s
        self._db: sqlite3.Connection | None = None
        try:
            os.close(open_private_file(path, os.O_RDWR | os.O_CREAT))
            db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            self._db = db
        except (UnsafePathError, sqlite3.Error) as exc:
            log.warning("the GPU history is kept in memory only: %s: %s", path, exc)

    def _run(self, statement: str, args: tuple = ()) -> list[tuple]:
        if self._db is None:
            return []
        try:
            return self._db.execute(statement, args).fetchall()
        except sqlite3.Error as exc:
            self._given_up(exc)
            return []

    def _write_many(self, statement: str, rows: list[tuple]) -> None:
        """``statement`` for each row, in one transaction: one sync, not one per row."""
        if self._db is None or not rows:
            return
        try:
            with self._db:  # commits, or rolls back on an error
                self._db.execute("BEGIN")
                self._db.executemany(statement, rows)
        except sqlite3.Error as exc:
            self._given_up(exc)

    def _given_up(self, exc: sqlite3.Error) -> None:
        log.warning("the GPU history is kept in memory only from now on: %s", exc)
        self.close()

    def close(self) -> None:
        if self._db is not None:
            db, self._db = self._db, None
            try:
                db.close()
            except sqlite3.Error as exc:  # pragma: no cover - closing a broken file
                log.warning("closing the GPU history %s: %s", self.path, exc)

    # ---- samples

    def samples_recorded(self, samples: list[Sample]) -> None:
        rows = [
            (s.at, s.device_index, s.utilization_pct, s.queued, _memory_json(s.memory))
            for s in samples
        ]
        self._write_many(
            "INSERT INTO samples(at, device, utilization, queued, memory) VALUES(?,?,?,?,?)", rows
        )

    def load_samples(self, since: float) -> list[Sample]:
        rows = self._run(
            "SELECT at, device, utilization, queued, memory FROM samples WHERE at >= ? ORDER BY at",
            (since,),
        )
        return [Sample(r[0], r[1], r[2], r[3], _memory_of(r[4])) for r in rows]

    # ---- spans (the timeline's store)

    def spans_changed(self, spans: list[Span]) -> None:
        """Spans as they are now, in one transaction."""
        rows = [
            (
                span.lease_id,
                span.device_index,
                span.start,
                span.identity.uid,
                span.identity.user,
                span.priority,
                span.label,
                span.end,
                json.dumps([[p.start, p.end, p.level] for p in span.pauses]),
            )
            for span in spans
        ]
        self._write_many(
            "INSERT OR REPLACE INTO spans(lease_id, device, start, uid, user, priority, label, "
            "ended, pauses) VALUES(?,?,?,?,?,?,?,?,?)",
            rows,
        )

    def load_spans(self, since: float) -> list[Span]:
        rows = self._run(
            "SELECT lease_id, device, start, uid, user, priority, label, ended, pauses "
            "FROM spans WHERE ended IS NULL OR ended >= ? ORDER BY start",
            (since,),
        )
        return [
            Span(
                lease_id=r[0],
                identity=Identity(uid=r[3], gid=0, pid=0, user=r[4]),
                priority=r[5],
                device_index=r[1],
                start=r[2],
                end=r[7],
                pauses=[Pause(start, level, end) for start, end, level in json.loads(r[8])],
                label=r[6],
            )
            for r in rows
        ]

    def prune(self, now: float) -> None:
        cutoff = now - self.keep_s
        self._run("DELETE FROM samples WHERE at < ?", (cutoff,))
        self._run("DELETE FROM spans WHERE ended IS NOT NULL AND ended < ?", (cutoff,))


class History:
    """The samples of the last ``keep_s`` seconds, per device, in memory and in ``store``."""

    def __init__(
        self,
        store: HistoryStore | None = None,
        *,
        every_s: float = SAMPLE_EVERY_S,
        keep_s: float = KEEP_S,
        now: float = 0.0,
    ) -> None:
        self.every_s = every_s
        self.keep_s = keep_s
        self.store = store
        self._samples: dict[int, deque[Sample]] = {}
        self._last_at = float("-inf")
        self._next_prune = now + PRUNE_EVERY_S
        if store is not None:
            for sample in store.load_samples(now - keep_s):
                self._keep(sample)

    def _keep(self, sample: Sample) -> None:
        kept = self._samples.setdefault(sample.device_index, deque(maxlen=MAX_SAMPLES))
        kept.append(sample)
        self._last_at = max(self._last_at, sample.at)

    def due(self, now: float) -> bool:
        """Whether the tick at ``now`` should take a sample (a clock set back counts as due)."""
        return now >= self._last_at + self.every_s or now < self._last_at

    def record(self, samples: list[Sample], now: float) -> None:
        """One sample per device, taken at ``now``."""
        for sample in samples:
            self._keep(sample)
        self._last_at = now
        if self.store is not None:
            self.store.samples_recorded(samples)
            if now >= self._next_prune:
                self._next_prune = now + PRUNE_EVERY_S
                self.store.prune(now)

    def samples(self, device_index: int, now: float) -> list[Sample]:
        """The samples of one device in the last ``keep_s`` seconds, oldest first."""
        kept = self._samples.get(device_index)
        if not kept:
            return []
        since = now - self.keep_s
        while kept and kept[0].at < since:
            kept.popleft()
        return list(kept)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
