"""This kernel process's one connection to the broker, kept alive across broker restarts.

It finds the broker (starting the embedded per-user broker when none answers), says
hello with the leases to reclaim, sends a lease request, and runs the one thread that
reconnects (with backoff) while the broker is away.  A cell that needs the broker
meanwhile -- a first connection, a hello, a request whose connection dies before its
answer -- waits for that thread, looking every :data:`WAIT_STEP_S`: visibly ("the
broker is restarting"), interruptibly, and no longer than the cell's timeout or
:data:`RECONNECT_DEADLINE_S`.  What the broker says about leases goes to the session
through :class:`ConnectionOwner`; the broker's reading thread is the client's
(``gpushare_ext.client``).

It must not keep or change leases, hold the process, or word a line itself: the session
does the first two, :mod:`cell_lines` the last.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import NoReturn, Protocol

from gpushare_ext.client import (
    BrokerClient,
    BrokerError,
    BrokerNoAnswer,
    BrokerUnavailable,
    doubling_pauses,
)
from gpushare_ext.paths import default_socket_path, system_socket
from gpushare_ext.protocol import (
    BrokerMessage,
    Error,
    ErrorCode,
    Granted,
    Queued,
    Refused,
    RequestLease,
)
from gpushare_ext.runtime import binding, cell_lines
from gpushare_ext.runtime.cell_output import CellOutput
from gpushare_ext.runtime.embedded import broker_answers, ensure_embedded_broker
from gpushare_ext.runtime.leases import LeaseHandle, LeaseTimeout

RECONNECT_DEADLINE_S = 120.0
#: How long a session that never reached a broker waits for a socket that is not there:
#: a broker that restarts makes its new socket within moments, and a cell with no broker
#: at all is told so soon.
NO_SOCKET_GRACE_S = 1.0
#: The reconnect's first pause and its longest (doubling in between).
BACKOFF_FIRST_S = 0.05
BACKOFF_MOST_S = 1.0
#: How often a cell waiting for the broker looks: its Ctrl-C and timeout keep to this.
WAIT_STEP_S = 0.1


def broker_away(exc: BrokerError) -> bool:
    """Whether ``exc`` says no broker is there to answer now (it is restarting) rather
    than what a broker answered: a socket missing or refusing, a connection dropped or
    never welcomed, a broker saying it is stopping.  A refusal, a peer that is not
    trusted or a version mismatch are answers, and are said at once."""
    return exc.code == ErrorCode.UNAVAILABLE


class _WaitLine:
    """The one live line of a cell waiting for the broker (none without an output)."""

    def __init__(self, output: CellOutput | None) -> None:
        self._output = output
        self._key = f"gpushare-reconnect-{uuid.uuid4().hex[:8]}"
        self._shown = ""
        self._since = time.monotonic()

    def waited(self) -> float:
        return time.monotonic() - self._since

    def show(self, text: str, only_if_shown: bool = False) -> None:
        """Show ``text`` in place of the line (``only_if_shown``: a last word, said only
        where the line was shown at all)."""
        if self._output is None or text == self._shown or (only_if_shown and not self._shown):
            return
        self._output.show(self._key, text)
        self._shown = text


class ConnectionOwner(Protocol):
    """What the connection tells the session (the listener thread calls the last three)."""

    def open_leases(self) -> list[LeaseHandle]:
        """The leases a new connection reclaims."""

    def connected(self, client: BrokerClient, earlier: list[LeaseHandle]) -> None:
        """A connection was made; ``earlier`` were asked back in its hello."""

    def on_message(self, message: BrokerMessage) -> None:
        """A notice or answer from the broker, other than the connection's loss."""

    def broker_lost(self, why: str) -> None:
        """The live connection is gone; a reconnect starts right after."""

    def gave_up(self, waited_s: float, where: Path) -> None:
        """The broker on ``where`` did not come back within ``waited_s``."""


class BrokerConnection:
    """The live :class:`BrokerClient`, made only here, and made again after a loss."""

    def __init__(
        self,
        owner: ConnectionOwner,
        lock: threading.RLock,
        socket_path: str | Path | None = None,
        *,
        notebook: str = "",
    ) -> None:
        self._owner = owner
        self._lock = lock  # the session's: a connection is made while no notice is applied
        self._explicit_socket = Path(socket_path) if socket_path else None
        self.notebook = notebook
        self.client: BrokerClient | None = None
        self.announcements: list[str] = []
        self.started_embedded = False
        self.closed = False
        self.generation = 0  # connections made so far: which one answered a request
        self.connected_path: Path | None = None
        self._reconnecting = threading.Event()
        self._client_token: object = None  # which connection's loss matters (the live one's)
        # Why the reconnect thread's last attempt failed (None: it has not failed).
        self.last_failure: BrokerError | None = None

    @property
    def socket_path(self) -> Path:
        return self._explicit_socket or default_socket_path()

    @property
    def reconnecting(self) -> bool:
        return self._reconnecting.is_set()

    def connect(self) -> BrokerClient:
        """The live connection, made (and every earlier lease reclaimed) if there is none.

        The only place a connection is made: a cell asking for a lease and the reconnect
        thread both come here, so a process never holds two connections, and a lease
        granted on the new connection is never mistaken for one lost in a restart.
        """
        with self._lock:
            if self.client is not None and not self.client.closed.is_set():
                return self.client
            return self._connect(path=self.connected_path)

    def _connect(self, path: Path | None = None) -> BrokerClient:
        # A reconnect goes back to the broker it knew: while a system broker restarts its
        # socket is briefly gone, and starting an embedded one then would lose the leases.
        path = path or self.socket_path
        uses_system = path == system_socket() or (self._explicit_socket is not None)
        if not broker_answers(path) and not uses_system and "GPUSHARE_SOCKET" not in os.environ:
            path, started = ensure_embedded_broker(path)
            if started and not self.started_embedded:
                self.started_embedded = True
                self.announcements.append(cell_lines.embedded_broker_started(path))
        earlier = self._owner.open_leases()
        token = object()
        client = BrokerClient(
            path,
            client="kernel",
            notebook=self.notebook,
            reclaim=[h.lease_id for h in earlier],
            listener=lambda message: self._listen(message, token),
            visible_devices=binding.visible_gpus(),
        )
        self._client_token = token
        self.generation += 1
        self.client = client
        self.connected_path = path
        self._owner.connected(client, earlier)
        if client.closed.is_set() and not self.closed:
            self._lost(client.close_reason)  # lost before its listener counted
        return client

    def _listen(self, message: BrokerMessage, token: object) -> None:
        if (
            isinstance(message, Error)
            and message.code == ErrorCode.UNAVAILABLE
            and message.reply_to == 0
        ):
            if token is self._client_token and not self.closed:
                self._lost(message.message)
            return
        self._owner.on_message(message)

    def _lost(self, why: str) -> None:
        self._owner.broker_lost(why)
        self._start_reconnect()

    def _start_reconnect(self) -> None:
        if self._reconnecting.is_set():
            return
        self._reconnecting.set()
        self.last_failure = None  # what an earlier reconnect met is no news about this one
        threading.Thread(
            target=self._reconnect_loop, name="gpushare-reconnect", daemon=True
        ).start()

    def _reconnect_loop(self, deadline_s: float = RECONNECT_DEADLINE_S) -> None:
        try:
            connected = self._keep_reconnecting(deadline_s)
        finally:
            self._reconnecting.clear()
        client = self.client
        if connected and client is not None and client.closed.is_set() and not self.closed:
            # Lost again while this thread was ending: that loss (told to the session
            # already) found a reconnect under way and started none.
            self._start_reconnect()

    def _keep_reconnecting(self, deadline_s: float) -> bool:
        """Try until connected (True) or there is nothing to wait for any more."""
        started = time.monotonic()
        deadline = started + deadline_s
        pauses = doubling_pauses(BACKOFF_FIRST_S, BACKOFF_MOST_S)
        while not self.closed:
            if self._try_to_connect(time.monotonic() - started):
                return self.last_failure is None
            now = time.monotonic()
            if now >= deadline:
                self._owner.gave_up(deadline_s, self.connected_path or self.socket_path)
                return False
            # Backoff with jitter: a hub's kernels, all cut off at once, do not all knock
            # at the same moment while the new broker starts.
            time.sleep(min(next(pauses) * random.uniform(0.75, 1.25), deadline - now))
        return False

    def _try_to_connect(self, tried_for_s: float) -> bool:
        """One attempt of the reconnect thread; True when it is over: connected, or there
        is nothing to wait for (a session that never reached a broker finds no socket
        after :data:`NO_SOCKET_GRACE_S`, or a broker that answers with a refusal)."""
        try:
            client = self.connect()
        except BrokerError as exc:
            self.last_failure = exc
            if self.connected_path is not None:
                return False  # its leases wait for this broker: keep trying
            if not broker_away(exc):
                return True
            return bool(getattr(exc, "no_socket", False)) and tried_for_s >= NO_SOCKET_GRACE_S
        except Exception as exc:  # any other failure: the broker is not back yet
            self.last_failure = BrokerUnavailable(f"cannot reach the broker: {exc}")
            return False
        if client.closed.is_set():
            return False  # lost again right after its welcome: the next attempt follows
        self.last_failure = None
        return True

    def reach(
        self,
        output: CellOutput | None,
        *,
        timeout_s: float | None = None,
        started: float | None = None,
        stale: BrokerClient | None = None,
    ) -> BrokerClient:
        """The live connection; while the broker is restarting, wait for it and say so.

        The wait is bounded: by the cell's ``timeout_s`` counted from ``started`` (then
        :class:`LeaseTimeout`), and by :data:`RECONNECT_DEADLINE_S` (then
        :class:`BrokerUnavailable`).  ``stale``: a connection that is closing (its broker
        said it is stopping), never the answer.  A broker that is not there and never was
        (no socket, no earlier connection) is said at once, after
        :data:`NO_SOCKET_GRACE_S` at most.
        """
        started = time.monotonic() if started is None else started
        client = self.live_client()
        if client is not None and client is not stale:
            return client
        failure: BrokerError = BrokerUnavailable("the broker went away")
        if not self.reconnecting and client is None:
            try:
                return self.connect()
            except BrokerError as exc:
                if not broker_away(exc):
                    raise
                failure = exc
        return self._wait_for_connection(
            output, started=started, timeout_s=timeout_s, failure=failure, stale=stale
        )

    def ask_for_lease(
        self,
        request: RequestLease,
        output: CellOutput | None,
        *,
        timeout_s: float | None = None,
        started: float | None = None,
    ) -> tuple[Granted | Queued | Refused, int]:
        """Send the request; if the broker is restarting, wait for it (visibly) and ask again.

        The wait ends at the cell's ``timeout_s`` counted from ``started`` (a
        :class:`LeaseTimeout`, as a wait in the queue would), or after
        :data:`RECONNECT_DEADLINE_S` without one.  Returns the answer and the generation
        of the connection that gave it.

        Asking again is safe: a request whose connection died before its answer may
        have been journaled (or granted) by the broker that died, which then restores it
        as its process's, waiting to be named; the new connection's hello does not name
        it, so the new broker ends it (``its notebook reconnected without it``).  A
        request that went out on a live connection and got no answer in time
        (:class:`BrokerNoAnswer`) is never sent again: that broker may still grant it.
        """
        started = time.monotonic() if started is None else started
        stale: BrokerClient | None = None
        while True:
            client = self.reach(output, timeout_s=timeout_s, started=started, stale=stale)
            with self._lock:
                if client is not self.client:
                    continue  # a reconnect came between: ask on the newest connection
                generation = self.generation
            try:
                return client.ask_for_lease(request), generation
            except BrokerNoAnswer:
                raise
            except BrokerError as exc:
                if not broker_away(exc):
                    raise
                # The connection dropped, or its broker is stopping and made nothing of
                # the request (it closes the connection soon): wait for the next one.
                stale = client

    def _wait_for_connection(
        self,
        output: CellOutput | None,
        *,
        started: float,
        timeout_s: float | None,
        failure: BrokerError,
        stale: BrokerClient | None = None,
    ) -> BrokerClient:
        """Wait for the reconnect thread's connection, showing one live line meanwhile.

        The cell only looks, every :data:`WAIT_STEP_S`: it never blocks in a connect, so
        a Ctrl-C and its timeout are kept to a fraction of a second.  The line never
        stays "reconnecting" once the cell stops waiting: an interrupt, the cell's
        timeout or the end of :data:`RECONNECT_DEADLINE_S` turn it into the wait's last
        word.
        """
        waiting_from = time.monotonic()
        cell_deadline = math.inf if timeout_s is None else started + timeout_s
        deadline = min(cell_deadline, waiting_from + RECONNECT_DEADLINE_S)
        line = _WaitLine(output)
        seen_reconnect = False
        try:
            while True:
                client = self.live_client()
                if client is not None and client is not stale:
                    line.show(cell_lines.RECONNECTED, only_if_shown=True)
                    return client
                if client is None and not self.reconnecting:
                    if seen_reconnect or self.closed:
                        client = self.live_client()  # it may have just connected
                        if client is not None and client is not stale:
                            continue
                        # The reconnect ended without a connection (it gave up, or
                        # found no broker that ever was): so does the wait.
                        line.show(
                            cell_lines.reconnect_abandoned_line(line.waited(), "gave up"), True
                        )
                        raise self.last_failure or failure
                    self._start_reconnect()
                seen_reconnect = seen_reconnect or self.reconnecting
                failure = self.last_failure or failure
                if not broker_away(failure):
                    line.show(cell_lines.reconnect_abandoned_line(line.waited(), "refused"), True)
                    raise failure
                now = time.monotonic()
                if now >= deadline:
                    self._stop_waiting(line, failure, timed_out=cell_deadline <= deadline,
                                       timeout_s=timeout_s)  # fmt: skip
                # A session that never reached a broker and finds no socket may be one
                # with no broker at all: it says nothing until a broker shows signs of life.
                if self.connected_path is not None or not getattr(failure, "no_socket", False):
                    line.show(cell_lines.reconnecting_line(now - waiting_from))
                time.sleep(min(WAIT_STEP_S, max(0.01, deadline - now)))
        except KeyboardInterrupt:
            line.show(cell_lines.reconnect_abandoned_line(line.waited(), "interrupted"), True)
            raise

    def _stop_waiting(
        self, line: _WaitLine, failure: BrokerError, *, timed_out: bool, timeout_s: float | None
    ) -> NoReturn:
        waited = line.waited()
        line.show(
            cell_lines.reconnect_abandoned_line(waited, "timed out" if timed_out else "gave up"),
            only_if_shown=True,
        )
        if timed_out and timeout_s is not None:
            raise LeaseTimeout(
                cell_lines.broker_away_timed_out_words(
                    timeout_s, self.connected_path or self.socket_path
                )
            ) from None
        raise BrokerUnavailable(f"{failure}; gave up after {waited:.0f} s of reconnecting")

    def live_client(self) -> BrokerClient | None:
        """The client while it is connected; None while reconnecting or closed."""
        client = self.client
        if client is None or client.closed.is_set():
            return None
        return client

    def close(self) -> None:
        self.closed = True
        if self.client is not None:
            self.client.close()
            self.client = None
