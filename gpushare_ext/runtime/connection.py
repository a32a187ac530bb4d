"""This kernel process's one connection to the broker, kept alive across broker restarts.

It finds the broker (starting the embedded per-user broker when none answers), says
hello with the leases to reclaim, sends a lease request and waits (visibly, and no
longer than the cell's timeout) while the broker is away, and runs the thread that
reconnects after the broker went away.  What the broker says about leases goes to the
session through :class:`ConnectionOwner`; the broker's reading thread is the client's
(``gpushare_ext.client``).

It must not keep or change leases, hold the process, or word a line itself: the session
does the first two, :mod:`cell_lines` the last.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path
from typing import Protocol

from gpushare_ext.client import BrokerClient, BrokerUnavailable
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
        threading.Thread(
            target=self._reconnect_loop, name="gpushare-reconnect", daemon=True
        ).start()

    def _reconnect_loop(self, deadline_s: float = RECONNECT_DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        try:
            while time.monotonic() < deadline and not self.closed:
                time.sleep(0.5)
                try:
                    self.connect()
                except Exception:  # any failure: the broker is not back yet
                    continue
                return
            if not self.closed:
                self._owner.gave_up(deadline_s, self.connected_path or self.socket_path)
        finally:
            self._reconnecting.clear()

    def ask_for_lease(
        self,
        request: RequestLease,
        output: CellOutput | None,
        *,
        timeout_s: float | None = None,
    ) -> tuple[Granted | Queued | Refused, int]:
        """Send the request; if the broker is restarting, wait for it (visibly) and ask again.

        The wait ends at the cell's ``timeout_s`` (a :class:`LeaseTimeout`, as a wait in
        the queue would), or after :data:`RECONNECT_DEADLINE_S` without one.  Returns the
        answer and the generation of the connection that gave it.
        """
        patience = RECONNECT_DEADLINE_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + min(patience, RECONNECT_DEADLINE_S)
        while True:
            try:
                with self._lock:
                    client = self.connect()
                    generation = self.generation
                return client.ask_for_lease(request), generation
            except BrokerUnavailable:
                # Never connected: there is no broker to wait for, say so at once.
                if self.connected_path is None:
                    raise
                self._wait_for_connection(
                    output, deadline - time.monotonic(), cell_timeout_s=timeout_s
                )

    def _wait_for_connection(
        self,
        output: CellOutput | None,
        timeout_s: float = RECONNECT_DEADLINE_S,
        *,
        cell_timeout_s: float | None = None,
    ) -> BrokerClient:
        """Reconnect now, showing one live line while the broker is away.

        The line never stays "reconnecting" once the cell stops waiting: an interrupt, the
        cell's timeout (``cell_timeout_s``, raised as :class:`LeaseTimeout`) or the end of
        ``timeout_s`` turn it into the wait's last word.
        """
        started = time.monotonic()
        key = f"gpushare-reconnect-{uuid.uuid4().hex[:8]}"
        shown = ""
        # The cell's timeout ends the wait when it comes before the longest a wait lasts.
        cell_limit_s = (
            cell_timeout_s
            if cell_timeout_s is not None and cell_timeout_s <= RECONNECT_DEADLINE_S
            else None
        )

        def show(text: str) -> None:
            nonlocal shown
            if output is not None and text != shown:
                output.show(key, text)
                shown = text

        try:
            while True:
                try:
                    client = self.connect()
                except BrokerUnavailable as exc:
                    waited = time.monotonic() - started
                    if waited >= timeout_s:
                        why = "timed out" if cell_limit_s is not None else "gave up"
                        if shown:
                            show(cell_lines.reconnect_abandoned_line(waited, why))
                        if cell_limit_s is not None:
                            raise LeaseTimeout(
                                cell_lines.broker_away_timed_out_words(
                                    cell_limit_s, self.connected_path or self.socket_path
                                )
                            ) from None
                        raise BrokerUnavailable(
                            f"{exc}; gave up after {waited:.0f} s of reconnecting"
                        ) from None
                    show(cell_lines.reconnecting_line(waited))
                    # Short sleeps: the cell's timeout is kept to a fraction of a second.
                    time.sleep(min(0.5, max(0.01, timeout_s - waited)))
                    continue
                if shown:
                    show(cell_lines.RECONNECTED)
                return client
        except KeyboardInterrupt:
            if shown:
                show(cell_lines.reconnect_abandoned_line(time.monotonic() - started, "interrupted"))
            raise

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
