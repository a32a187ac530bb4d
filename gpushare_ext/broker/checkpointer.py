"""Checkpoints of the journal's write-ahead log, mostly on a thread of their own.

SQLite's automatic checkpoint runs inside whichever commit takes the WAL past its
limit: on the broker's event loop, where its copying and fsyncs (about 16 ms with a
thousand leases coming and going each second) hold up every client at once.  The
journal turns it off while a :class:`WalCheckpointer` runs, and each round of it goes:

1. On a daemon thread, with a connection of its own, ten times a round: a PASSIVE
   checkpoint, which waits for no reader and no writer, copies what the WAL gained
   into the database and syncs both (the sqlite3 module lets go of the GIL meanwhile,
   so the loop goes on committing; small syncs hold up the loop's writes to the same
   file less than a large one).  At the round's end a few more, each copying what
   came during the one before, so that little is left.
2. On the event loop (``call_soon``, between two of its callbacks): ``finish``, a
   PASSIVE checkpoint on the journal's own connection.  Nothing commits while it runs,
   so it copies the WAL to its end, and the next commit starts the WAL anew.

Without step 2 the WAL would only start anew when commits happened to pause for as
long as a checkpoint takes, which on a busy host they never do: it would grow for as
long as the load lasts, and on this kind of file system a file that grows while
another thread syncs it makes the writes to it wait too.  With it the WAL is about one
round of commits long, and its blocks are written over rather than added to.

Durability is the journal's, unchanged: a commit is in the WAL before it returns, so a
``kill -9`` loses nothing, and a checkpoint moves committed pages, it never decides
which are.  This module must not write journal rows, and its thread must never block
the loop: it waits for the loop, not the other way round.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("gpushare.broker")

EVERY_S = 1.0  # a round this often (a journal that was not written costs nothing)
PASSES_PER_ROUND = 10
TAIL_PASSES = 2  # quick passes at a round's end, so that the loop's step copies little


class WalCheckpointer:
    """Runs rounds of checkpoints of the SQLite database at ``path`` until :meth:`stop`.

    ``finish`` is the round's last step, run on the journal's own thread through
    ``call_soon`` (the event loop's ``call_soon_threadsafe``)."""

    def __init__(
        self,
        path: Path,
        finish: Callable[[], None],
        call_soon: Callable[[Callable[[], None]], object],
        *,
        every_s: float = EVERY_S,
    ) -> None:
        self.path = path
        self.every_s = every_s
        self.rounds = 0  # finished rounds, for tests and a curious admin
        self._finish = finish
        self._call_soon = call_soon
        self._db: sqlite3.Connection | None = None
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed = False

    def start(self) -> None:
        """Open the checkpoint connection and start the thread."""
        self._db = self._connect()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpushare-wal-checkpoint")
        # A daemon: a broker that dies without stopping it must not hang at exit.
        self._thread.daemon = True
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Let the thread's step under way finish, then end it and close its connection.
        Called on the loop: a round waiting for the loop's step gives up on it."""
        self._stop.set()
        self._finished.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the journal's checkpoint thread did not stop in %gs", timeout)
                return  # its connection stays its own: closing it under a running step is unsafe
            self._thread = None
        if self._db is not None:
            self._db.close()
            self._db = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the thread

    def _round(self) -> None:
        """A round's end: the thread's last passes, then the loop's step, waited for."""
        for _ in range(1 + TAIL_PASSES):
            self._passive()
        self._finished.clear()
        if self._stop.is_set():
            return  # after the clear: a stop() from now on sets it again
        try:
            self._call_soon(self._finish_on_loop)
        except RuntimeError:  # the loop is closed: the journal's close does the rest
            return
        # The next round's passes must not overlap the loop's step: both would copy.
        self._finished.wait()
        self.rounds += 1

    def _finish_on_loop(self) -> None:
        try:
            if not self._stop.is_set():
                self._finish()
        except sqlite3.Error as exc:
            log.warning("checkpoint of the journal %s failed: %s", self.path, exc)
        finally:
            self._finished.set()

    def _passive(self) -> None:
        db = self._db if self._db is not None else self._connect()
        try:
            db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        finally:
            if db is not self._db:
                db.close()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)

    def _run(self) -> None:
        passes = 0
        while not self._stop.wait(self.every_s / PASSES_PER_ROUND):
            passes += 1
            try:
                if passes % PASSES_PER_ROUND:
                    self._passive()
                else:
                    self._round()
            except sqlite3.Error as exc:
                # The next round tries again; saying so once is enough.
                if not self._failed:
                    log.warning("checkpoint of the journal %s failed: %s", self.path, exc)
                self._failed = True
            else:
                self._failed = False
