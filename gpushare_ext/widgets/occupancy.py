"""The live GPU occupancy widget for notebooks (anywidget): one class, one JS file, one CSS file.

The whole Python↔JS contract is two synced traits: ``snapshot`` (the JSON form of
:class:`gpushare_ext.protocol.Snapshot`) and ``error`` (a sentence when no broker can be
reached).  ``occupancy.js`` draws them; it is the same view the JupyterLab panel uses.

Updates come from the broker's watch stream on a daemon thread, so the kernel never
blocks and the picture keeps moving while a cell runs.  ipykernel 7 resolves a message's
parent header from context variables; the thread therefore runs inside a copy of the
context of the cell that started the widget, so its comm messages carry that cell's
parent.  ``close()`` stops the thread and the broker connection.

This module must not decide anything about leases: it only shows what the broker says.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from pathlib import Path

import anywidget
import msgspec
import traitlets

from gpushare_ext.paths import how_a_broker_starts
from gpushare_ext.protocol import Error, Snapshot, StateUpdate, snapshot_to_builtins

_HERE = Path(__file__).parent

#: Seconds between reconnection attempts when the broker is unreachable or went away.
RETRY_S = 2.0


class OccupancyWidget(anywidget.AnyWidget):
    """Per GPU: MIG layout or profiles, memory per user, utilisation, holders; the queue.

    ``OccupancyWidget(socket_path)`` starts following the broker at once; pass
    ``follow=False`` to fill ``snapshot`` yourself (e.g. from ``gpushare status --json``).
    """

    _esm = _HERE / "occupancy.js"
    _css = _HERE / "occupancy.css"

    snapshot = traitlets.Dict().tag(sync=True)
    error = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        interval_s: float = 1.0,
        follow: bool = True,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)
        self.socket_path = socket_path
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if follow:
            self.start()

    @property
    def following(self) -> bool:
        """True while the background thread follows the broker."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Follow the broker's watch stream on a daemon thread (idempotent)."""
        if self.following:
            return
        self._stop.clear()
        context = contextvars.copy_context()  # carries the starting cell's parent header
        self._thread = threading.Thread(
            target=context.run,
            args=(self._follow,),
            name="gpushare-occupancy-widget",
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout: float = 3.0) -> None:
        """Stop following; returns once the thread and its broker connection are gone."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def close(self) -> None:
        """Stop following and close the widget (its view disappears from the notebook)."""
        self.stop()
        super().close()

    def _repr_mimebundle_(self, **kwargs: object) -> tuple[dict, dict]:
        """The live view, and for a frontend without widgets (a saved notebook, a
        terminal, nbconvert) the text table of ``gpushare status`` in place of a repr."""
        bundle = super()._repr_mimebundle_(**kwargs) or {}
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        return {**data, "text/plain": self.as_text()}, metadata

    def as_text(self) -> str:
        """What the widget shows, as ``gpushare status`` prints it."""
        from gpushare_ext.status_view import status_text

        if self.error:
            return f"gpushare: {self.error}"
        snapshot = self.snapshot
        if not snapshot:  # just made: its thread has not heard from the broker yet
            from gpushare_ext.client import BrokerClient, BrokerError

            try:
                with BrokerClient(self.socket_path, client="widget", connect_timeout=3) as client:
                    return status_text(client.status())
            except BrokerError as exc:
                return f"gpushare: {exc.message}"
        return status_text(msgspec.convert(snapshot, Snapshot))

    def show(self, snapshot: Snapshot) -> None:
        """Draw ``snapshot`` now (what the follower thread does for every update)."""
        data = snapshot_to_builtins(snapshot)
        with self.hold_sync():
            self.error = ""
            self.snapshot = data

    # ---- the follower thread

    def _follow(self) -> None:
        from gpushare_ext.client import BrokerClient, BrokerError
        from gpushare_ext.paths import default_socket_path

        while not self._stop.is_set():
            path = Path(self.socket_path) if self.socket_path else default_socket_path()
            try:
                client = BrokerClient(path, client="widget")
            except BrokerError as exc:
                self._unavailable(path, exc.message)
                self._stop.wait(RETRY_S)
                continue
            updates: queue.Queue = queue.Queue()

            def listener(message: object, updates: queue.Queue = updates) -> None:
                if isinstance(message, StateUpdate | Error):
                    updates.put(message)

            client.add_listener(listener)
            try:
                self.show(client.status())
                client.watch(self.interval_s)
                self._pump(updates, client.closed)
                if not self._stop.is_set():
                    self._unavailable(path, client.close_reason or "the broker went away")
            except BrokerError as exc:
                self._unavailable(path, exc.message)
            finally:
                client.remove_listener(listener)
                with contextlib.suppress(Exception):
                    client.close()
            self._stop.wait(RETRY_S)

    def _pump(self, updates: queue.Queue, closed: threading.Event) -> None:
        """Show every state update until stopped or the connection ends."""
        while not self._stop.is_set() and not closed.is_set():
            try:
                message = updates.get(timeout=0.25)
            except queue.Empty:
                continue
            if isinstance(message, StateUpdate):
                self.show(message.snapshot)
            elif isinstance(message, Error) and closed.is_set():
                return

    def _unavailable(self, path: Path, reason: str) -> None:
        self.error = (
            f"No GPU broker reachable at {path}: {reason}. {how_a_broker_starts(path)}; "
            f"this view looks again every {RETRY_S:g} s."
        )
