"""Checkpoints of the journal's write-ahead log, mostly on a thread of their own.

SQLite's automatic checkpoint runs inside whichever commit takes the WAL past its
limit: on the broker's event loop, where its copying and fsyncs (about 16 ms with a
thousand leases coming and going each second) hold up every client at once.  The
journal turns it off while a :class:`WalCheckpointer` runs instead:

1. On a daemon thread, with a connection of its own, ten times a second: a PASSIVE
   checkpoint, which waits for no reader and no writer, copies what the WAL gained
   into the database and syncs both (the sqlite3 module lets go of the GIL meanwhile,
   so the loop goes on committing; small syncs hold up the loop's writes to the same
   file system less than a large one).
2. SQLite starts the WAL anew only at a commit that finds all of it copied: after a
   pass during which nothing was committed, by itself.  On a host so busy that that
   never happens the WAL grows, and once it is past ``limit_bytes`` the thread makes a
   few more passes (each copies what came during the one before) and then asks the
   loop (``call_soon``, between two of its callbacks) for ``finish``: a PASSIVE
   checkpoint on the journal's own connection.  Nothing commits while it runs, so it
   copies the WAL to its end, and the next commit starts the WAL anew.  That is the
   one step on the loop: two short syncs, every ``limit_bytes`` of commits.

The WAL stays within about ``limit_bytes``, and its blocks are written over rather
than added to (on ext4, a write that makes a file grow waits for a sync of it under
way in another thread).

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

EVERY_S = 0.1  # a pass this often (a journal that was not written costs nothing)
LIMIT_BYTES = 64 * 1024 * 1024  # a WAL this long is copied to its end by the loop
TAIL_PASSES = 2  # quick passes before the loop's step, so that it copies little
WAL_FRAME_HEADER = 24  # bytes before each page in the WAL file


class WalCheckpointer:
    """Checkpoints the SQLite database at ``path`` until :meth:`stop`.

    ``finish`` is the step that lets the WAL start anew, run on the journal's own
    thread through ``call_soon`` (the event loop's ``call_soon_threadsafe``)."""

    def __init__(
        self,
        path: Path,
        finish: Callable[[], None],
        call_soon: Callable[[Callable[[], None]], object],
        *,
        every_s: float = EVERY_S,
        limit_bytes: int = LIMIT_BYTES,
    ) -> None:
        self.path = path
        self.every_s = every_s
        self.limit_bytes = limit_bytes
        self.loop_steps = 0  # times the loop's step ran, for tests and a curious admin
        self._frame_bytes = 4096 + WAL_FRAME_HEADER
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
        self._frame_bytes = int(self._db.execute("PRAGMA page_size").fetchone()[0])
        self._frame_bytes += WAL_FRAME_HEADER
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpushare-wal-checkpoint")
        # A daemon: a broker that dies without stopping it must not hang at exit.
        self._thread.daemon = True
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Let the pass under way finish, then end the thread and close its connection.
        Called on the loop: a thread waiting for the loop's step gives up on it."""
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

    def _to_the_end(self) -> None:
        """The thread's last passes, then the loop's step, waited for."""
        for _ in range(TAIL_PASSES):
            self._passive()
        self._finished.clear()
        if self._stop.is_set():
            return  # after the clear: a stop() from now on sets it again
        try:
            self._call_soon(self._finish_on_loop)
        except RuntimeError:  # the loop is closed: the journal's close does the rest
            return
        # The thread's next passes must not overlap the loop's step: both would copy.
        self._finished.wait()
        if not self._stop.is_set():
            self.loop_steps += 1

    def _finish_on_loop(self) -> None:
        try:
            if not self._stop.is_set():
                self._finish()
        except sqlite3.Error as exc:
            log.warning("checkpoint of the journal %s failed: %s", self.path, exc)
        finally:
            self._finished.set()

    def _passive(self) -> int:
        """A PASSIVE checkpoint; the WAL's length in bytes when it began."""
        assert self._db is not None, "the thread runs only between start() and stop()"
        _, frames, _ = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return max(0, int(frames)) * self._frame_bytes

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if self._passive() > self.limit_bytes:
                    self._to_the_end()
            except sqlite3.Error as exc:
                # The next pass tries again; saying so once is enough.
                if not self._failed:
                    log.warning("checkpoint of the journal %s failed: %s", self.path, exc)
                self._failed = True
            else:
                self._failed = False
