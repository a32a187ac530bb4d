"""The broker daemon: an asyncio Unix-socket server around the pure scheduler core.

It reads top to bottom like uvicorn's server: :meth:`Broker.startup` (safe places for
the socket and control blocks, journal recovery, the socket), :meth:`Broker.main_loop`
(clients, and a 1 Hz tick that reaps dead processes and detached leases, samples
devices, feeds the memory watchdog, prunes the journal and sets the gauges from counts
of the leases), :meth:`Broker.shutdown` (stop accepting, let ladder steps finish, undo
every actuator, tell clients, close).  The journal's WAL is checkpointed on a thread
of its own from the end of startup on (:mod:`~gpushare_ext.broker.hands.checkpointer`).
Signal handlers only set flags; a second SIGINT/SIGTERM forces the exit.

This module is the lifecycle and the connection loop only.  Messages become events in
:mod:`~gpushare_ext.broker.edges.requests`, the core's actions are carried out by
:mod:`~gpushare_ext.broker.edges.effects`, the status snapshot is drawn by
:mod:`~gpushare_ext.broker.edges.views`, and the file-system places come from
:mod:`~gpushare_ext.broker.edges.places`.  Those edges see a
:class:`~gpushare_ext.broker.edges.context.BrokerContext`, never this class: the messages
they put in its outbox are written to sockets by :meth:`Broker.send`, and the events
they post on its queue are fed to the core by :meth:`Broker.dispatch`, the one caller
of ``Scheduler.handle``.  It owns no policy.  Identity (uid, gid, pid) comes
from ``SO_PEERCRED``, never from a message.

Whatever a client sends, the connection loop answers with a typed error and goes on:
a frame it cannot even parse, a handler that fails (logged in one line), an answer
that would be too large.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from collections import deque
from pathlib import Path

from gpushare_ext.broker.edges.context import NO_REPLY, BrokerContext, Reply
from gpushare_ext.broker.edges.effects import Effects
from gpushare_ext.broker.edges.history_view import close_history, record_tick
from gpushare_ext.broker.edges.metrics import BrokerMetrics, read_token_file
from gpushare_ext.broker.edges.places import (
    LISTEN_BACKLOG,
    bind_socket,
    prepare_sessions_directory,
    prepare_socket_directory,
    remove_sessions_directory,
)
from gpushare_ext.broker.edges.records import Recorder
from gpushare_ext.broker.edges.recovery import recover, same_process
from gpushare_ext.broker.edges.requests import Requests
from gpushare_ext.broker.edges.views import Tally, tally
from gpushare_ext.broker.hands.actuators import (
    ActuatorError,
    Ladder,
    SimulatedProcessControl,
    open_process_control,
)
from gpushare_ext.broker.hands.history import History, HistoryStore, history_path
from gpushare_ext.broker.hands.inventory import (
    MIB,
    InventoryBackend,
    InventoryError,
    SimulatedInventory,
    managed_devices,
)
from gpushare_ext.broker.hands.journal import Journal
from gpushare_ext.broker.hands.peers import (
    Connection,
    TokenBucket,
    peer_credentials,
    process_ended,
    process_start_ticks,
    user_and_groups,
)
from gpushare_ext.broker.hands.timeline import Timeline
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.parking import HostMemory
from gpushare_ext.broker.settings.config import BrokerConfig
from gpushare_ext.broker.settings.policy import PolicyError
from gpushare_ext.devices import DeviceReading
from gpushare_ext.paths import BrokerPaths
from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import (
    BrokerMessage,
    Error,
    ErrorCode,
    FrameReader,
    ProtocolError,
    decode_client_message,
    encode_frame,
    peek_seq,
)
from gpushare_ext.units import format_duration

log = logging.getLogger("gpushare.broker")

HISTORY_POINTS = 60
PRUNE_EVERY_S = 30.0
MAX_ERROR_TEXT = 1000  # an error echoing what a client sent stays far below the frame limit


class Broker:
    """The daemon: its lifecycle, its connections, and the one feeder of the core."""

    def __init__(
        self,
        config: BrokerConfig,
        paths: BrokerPaths,
        inventory: InventoryBackend,
        *,
        inventory_note: str | None = None,
        config_path: Path | None = None,
        exit_when_idle_s: float | None = None,
    ) -> None:
        # Seconds with no notebook session and no lease after which the broker exits
        # (the embedded broker's lifetime; None: it runs until stopped).
        self.exit_when_idle_s = exit_when_idle_s
        self._idle_since = time.monotonic()
        try:
            devices = managed_devices(inventory.devices(), config.devices)
        except InventoryError as exc:
            raise RuntimeError(str(exc)) from None
        metrics = BrokerMetrics()
        simulated = inventory if isinstance(inventory, SimulatedInventory) else None
        control = open_process_control(
            inventory.kind,
            [d.index for d in devices],
            simulated.restore_fails if simulated else frozenset(),
            simulated.lock_drain_s if simulated else 0.0,
        )
        scheduler = core.Scheduler(
            devices, config.policy, simulated_control=control.kind == "simulated"
        )
        self.core = scheduler  # the server alone feeds it events; the edges read a view
        journal = Journal(config.journal or paths.journal)
        # The last hour of each GPU (the dashboard's), in a file beside the journal.
        gpu_history = History(HistoryStore(history_path(journal.path)), now=time.time())
        history: dict[int, deque[int]] = {d.index: deque(maxlen=HISTORY_POINTS) for d in devices}
        self.ctx = ctx = BrokerContext(
            config=config,
            config_path=config_path,
            paths=paths,
            inventory=inventory,
            inventory_note=inventory_note,
            devices=devices,
            scheduler=scheduler,
            control=control,
            ladder=Ladder(control, lock_timeout_ms=config.lock_timeout_ms),
            journal=journal,
            record=Recorder(journal),
            metrics=metrics,
            pid=os.getpid(),
            node=config.node_name or os.uname().nodename,
            sessions_dir=paths.socket.parent,
            history=history,
            gpu_history=gpu_history,
            timeline=Timeline(store=gpu_history.store, now=time.time()),
            readings={r.index: r for r in inventory.readings() if r.index in history},
        )
        self.effects = Effects(ctx)
        self.requests = Requests(ctx)
        ctx.outbox.attach(self.send)
        ctx.events.attach(self.dispatch)
        self.per_uid_connections: dict[int, int] = {}
        self._prepared_sessions: Path | None = None  # made by this start (removed if it fails)
        self.started = time.time()
        self.force_exit = False
        self._server: asyncio.AbstractServer | None = None
        self._stopped = asyncio.Event()
        self._reclaim_deadline = 0.0
        self._next_prune = 0.0

    # ------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        await self.startup()
        try:
            await self.main_loop()
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        os.umask(0o077)  # what the broker creates is its own unless it says otherwise
        prepare_socket_directory(self.ctx.paths)
        listener = bind_socket(self.ctx.paths, self.ctx.config.socket_group)
        try:
            await self._start_on(listener)
        except BaseException:
            # A start that fails half way leaves nothing behind: no socket that answers
            # nobody (a system broker's is open to every user), no sessions directory.
            if self._server is not None:
                self._server.close()  # it owns the listener from its start on
            else:
                listener.close()
            if self._prepared_sessions is not None:
                remove_sessions_directory(self.ctx.paths, self._prepared_sessions)
            with contextlib.suppress(OSError):
                self.ctx.paths.socket.unlink()
            self.ctx.metrics.close()
            raise

    async def _start_on(self, listener: socket.socket) -> None:
        self.ctx.sessions_dir = self._prepared_sessions = prepare_sessions_directory(self.ctx.paths)
        self.ctx.salt = self.ctx.journal.meta("salt") or secrets.token_hex(8)
        self.ctx.journal.set_meta("salt", self.ctx.salt)
        recover(self.ctx)
        # From here on no commit waits for a checkpoint of the whole WAL.
        self.ctx.journal.checkpoint_in_background(asyncio.get_running_loop().call_soon_threadsafe)
        self._reclaim_deadline = time.monotonic() + self.ctx.config.reclaim_grace_s
        self._server = await asyncio.start_unix_server(
            self._client_connected, sock=listener, limit=1 << 20, backlog=LISTEN_BACKLOG
        )
        if self.ctx.config.metrics_port:
            self._serve_metrics()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.handle_exit, sig)
        log.info(
            "broker %s mode on %s; %s; journal %s",
            self.ctx.paths.mode,
            self.ctx.paths.socket,
            self.ctx.inventory.description,
            self.ctx.journal.path,
        )

    def _serve_metrics(self) -> None:
        token = None
        try:
            if self.ctx.config.metrics_token_file:
                token = read_token_file(self.ctx.config.metrics_token_file)
            self.ctx.metrics.serve(
                self.ctx.config.metrics_port,  # type: ignore[arg-type]
                self.ctx.config.metrics_address,
                token,
            )
        except PolicyError as exc:
            raise RuntimeError(str(exc)) from None
        except OSError as exc:
            raise RuntimeError(
                f"cannot serve metrics on {self.ctx.config.metrics_address}:"
                f"{self.ctx.config.metrics_port}: {exc.strerror or exc}"
            ) from None

    def handle_exit(self, sig: int | None = None) -> None:
        if self.ctx.should_exit:
            self.force_exit = True
        self.ctx.should_exit = True
        self._stopped.set()

    async def main_loop(self) -> None:
        while not self.ctx.should_exit:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), timeout=1.0)
            if self.ctx.should_exit:
                break
            self._tick()

    async def shutdown(self) -> None:
        log.info("broker shutting down")
        if self._server is not None:
            self._server.close()
        for runner in list(self.ctx.chaos.values()):
            runner.stop()  # each lets its process go before the drain below returns
        # Ladder steps under way finish first: an unlock must not overtake its lock.
        await self.ctx.tasks.drain(timeout=0.5 if self.force_exit else 10)
        # Leave no process locked: undo every actuator, keep the leases (and the state
        # they were in) in the journal so that sessions reclaim them from the next broker.
        for lease in list(self.ctx.scheduler.active_leases()):
            level = lease.stop.in_force
            if level is None and not self.ctx.ladder.is_locked(lease.identity.pid):
                continue
            target = self.ctx.target(lease.lease_id, lease.identity.pid, lease.slot)
            try:
                await asyncio.wait_for(
                    self.ctx.ladder.undo(target, level), timeout=0 if self.force_exit else 10
                )
                self.ctx.record.undone(lease.lease_id)
            except (ActuatorError, asyncio.TimeoutError) as exc:
                log.warning("could not undo preemption of %s: %s", lease.lease_id, exc)
        for conn in list(self.ctx.all_connections):
            with contextlib.suppress(Exception):
                self.send(
                    conn, Error(code=ErrorCode.UNAVAILABLE, message="the broker is shutting down")
                )
            conn.writer.close()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._server.wait_closed(), timeout=0.5 if self.force_exit else 3
                )
        for conn in list(self.ctx.all_connections):
            if conn.control_block is not None:
                conn.control_block.close()
        remove_sessions_directory(self.ctx.paths, self.ctx.sessions_dir)
        with contextlib.suppress(OSError):
            self.ctx.paths.socket.unlink()
        self.ctx.metrics.close()
        self.ctx.control.close()
        self.ctx.journal.close()
        close_history(self.ctx)
        self.ctx.inventory.close()

    # ------------------------------------------------------------ periodic work

    def _exit_if_idle_long(self) -> None:
        """With ``exit_when_idle_s``: stop once no session and no lease has been there for
        that long (watchers such as a panel do not count: they start nothing)."""
        if self.exit_when_idle_s is None:
            return
        if self.ctx.connections or self.ctx.scheduler.active_leases():
            self._idle_since = time.monotonic()
            return
        if time.monotonic() - self._idle_since >= self.exit_when_idle_s:
            log.info(
                "no notebook session for %s: exiting (--exit-when-idle); the next %%%%gpu "
                "cell starts a broker again",
                format_duration(self.exit_when_idle_s),
            )
            self.handle_exit()

    def _tick(self) -> None:
        self._exit_if_idle_long()
        now = time.time()
        alive: dict[int, bool] = {}  # sessions of one process: one look at it
        for conn in list(self.ctx.connections.values()):
            # Its connection may outlive it (a child it forked holds it open): the
            # process itself is looked at, a zombie counting as ended.
            if conn.pid not in alive:
                alive[conn.pid] = not process_ended(conn.pid, conn.start_ticks)
            if not alive[conn.pid]:
                self._session_gone(conn, "its process ended")
        self._reap_detached(now)
        counts: Tally | None = None  # the leases as they are now, once counted
        if isinstance(self.ctx.inventory, SimulatedInventory):
            counts = self._feed_simulated_usage()
        try:
            readings = self.ctx.inventory.readings()
        except Exception as exc:  # NVML can fail transiently; keep serving
            log.warning("device readings failed: %s", exc)
            readings = []
        for reading in readings:
            if reading.index not in self.ctx.history:
                continue  # a GPU this broker does not manage
            self.ctx.readings[reading.index] = reading
            self.ctx.history[reading.index].append(reading.utilization_pct)
            if self.ctx.inventory.kind == "nvml":
                self._observe_processes(reading, now)
                counts = None
            elif reading.processes:  # a simulated document's processes outside leases
                self._observe_outside_leases(reading, now)
                counts = None
        reading = self.ctx.inventory.host_memory()
        host = (
            HostMemory(available_bytes=reading.available_bytes, total_bytes=reading.total_bytes)
            if reading is not None
            else None
        )
        if self.dispatch(core.Tick(now=now, host=host)):
            counts = None  # the tick moved leases: they are counted again below
        record_tick(self.ctx, now)
        if time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + PRUNE_EVERY_S
            self.ctx.journal.prune(self.ctx.config.journal_keep_hours * 3600.0, now)
            self.ctx.ladder.forget_idle()
        # Gauges follow the leases once a second: scrapers are slower than that.  Counts,
        # not a snapshot: a view of every lease would stall the loop as the host fills.
        if counts is None:
            counts = tally(self.ctx)
        self.ctx.metrics.refresh(counts.by_state, counts.queued, counts.device_memory(self.ctx))

    def _observe_processes(self, reading: DeviceReading, now: float) -> None:
        """NVML's per-process memory to the core: each process against its leases' quota,
        and what every process holds on a whole GPU, leased or not, for placement."""
        for process in reading.processes:
            self.dispatch(
                core.MemoryObserved(now=now, pid=process.pid, used_bytes=process.used_mib * MIB)
            )
        self._observe_outside_leases(reading, now)

    def _observe_outside_leases(self, reading: DeviceReading, now: float) -> None:
        """What every process holds on a whole GPU, or on each MIG instance, leased or
        not, for placement: one reading per slot (an instance with none is empty)."""
        device = next((d for d in self.ctx.devices if d.index == reading.index), None)
        slots: dict[str | None, list[tuple[int, int]]] = {}
        if device is not None and device.mig_enabled:
            slots = {instance.uuid: [] for instance in device.instances}
        else:
            slots = {None: []}
        for process in reading.processes:
            if process.mig_uuid in slots:
                slots[process.mig_uuid].append((process.pid, process.used_mib * MIB))
        for mig_uuid, used in slots.items():
            self.dispatch(
                core.DeviceMemorySeen(
                    now=now, device_index=reading.index, used_by_pid=tuple(used), mig_uuid=mig_uuid
                )
            )

    def _reap_detached(self, now: float) -> None:
        """Restored leases end when their process dies or the grace period is over."""
        expired = time.monotonic() > self._reclaim_deadline
        for session_id, record in list(self.ctx.scheduler.sessions.items()):
            if not record.detached:
                continue
            identity = record.identity
            if not same_process(identity.pid, identity.start_ticks):
                reason = "its process ended before it reconnected"
            elif expired:
                reason = "not reclaimed after the broker restarted"
            else:
                continue
            with contextlib.suppress(core.SchedulerError):
                self.dispatch(core.SessionClosed(now=now, session_id=session_id, reason=reason))

    def _feed_simulated_usage(self) -> Tally:
        """The simulated devices show what their leases hold; returns the leases counted."""
        assert isinstance(self.ctx.inventory, SimulatedInventory)
        counts = tally(self.ctx)
        if isinstance(self.ctx.control, SimulatedProcessControl):  # the twin of a checkpoint
            self.ctx.inventory.set_checkpointed(self.ctx.control.checkpointed())
        for device in self.ctx.devices:
            self.ctx.inventory.set_usage(
                device.index, counts.leased_mib[device.index], device.index in counts.busy
            )
        return counts

    # ------------------------------------------------------------ connections

    async def _client_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        pid, uid, gid = peer_credentials(writer.get_extra_info("socket"))
        user, groups = user_and_groups(uid, gid)
        count = self.per_uid_connections.get(uid, 0)
        if count >= self.ctx.config.max_connections_per_uid and uid != 0:
            limit = self.ctx.config.max_connections_per_uid
            writer.write(
                encode_frame(
                    Error(
                        code=ErrorCode.RATE_LIMITED,
                        message=f"too many connections from {user} (limit {limit})",
                    )
                )
            )
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            writer.close()
            return
        self.per_uid_connections[uid] = count + 1
        conn = Connection(
            reader=reader,
            writer=writer,
            pid=pid,
            uid=uid,
            gid=gid,
            user=user,
            groups=groups,
            is_admin=self.ctx.config.policy.is_admin(uid, user, groups),
            start_ticks=process_start_ticks(pid),
        )
        self.ctx.all_connections.add(conn)
        frames = FrameReader()
        try:
            while not self.ctx.should_exit:
                data = await reader.read(65536)
                if not data:
                    if frames.pending:
                        self.send_error(
                            conn, 0, ErrorCode.MALFORMED,
                            "truncated frame: the connection closed mid-message",
                        )  # fmt: skip
                    break
                frames.feed(data)
                while True:
                    try:
                        body = frames.next_body()
                    except ProtocolError as exc:
                        self.send_error(conn, 0, exc.code, exc.message)
                        raise ConnectionAbortedError from None  # cannot resynchronise
                    if body is None:
                        break
                    self._handle_body(conn, body)
                with contextlib.suppress(ConnectionError):
                    await writer.drain()
        except (ConnectionError, ConnectionAbortedError):
            pass
        finally:
            self._connection_lost(conn)

    def _connection_lost(self, conn: Connection) -> None:
        if conn.closed:
            return
        conn.closed = True
        self.ctx.all_connections.discard(conn)
        self.per_uid_connections[conn.uid] = max(0, self.per_uid_connections.get(conn.uid, 1) - 1)
        if conn.watch_task is not None:
            conn.watch_task.cancel()
        if conn.session_id is not None and self.ctx.should_exit:
            # The broker is stopping, not the session: its leases stay open in the journal
            # so that the session reclaims them from the next broker (Hello.reclaim).
            self.ctx.connections.pop(conn.session_id, None)
            conn.session_id = None
            if conn.control_block is not None:
                conn.control_block.close()
                conn.control_block = None
        elif conn.session_id is not None:
            self._session_gone(conn, "its connection closed")
        with contextlib.suppress(Exception):
            conn.writer.close()

    def _session_gone(self, conn: Connection, reason: str) -> None:
        session_id = conn.session_id
        if session_id is None or session_id not in self.ctx.connections:
            return
        del self.ctx.connections[session_id]
        self.dispatch(core.SessionClosed(now=time.time(), session_id=session_id, reason=reason))
        if conn.control_block is not None:
            conn.control_block.close()
            with contextlib.suppress(OSError):
                conn.control_block.path.unlink()
            conn.control_block = None
        conn.session_id = None
        if not conn.closed:
            with contextlib.suppress(Exception):
                conn.writer.close()

    def send(self, conn: Connection, message: BrokerMessage) -> None:
        """Write one message to its connection (the context's outbox ends here)."""
        if conn.closed and not isinstance(message, Error):
            return
        try:
            frame = encode_frame(message)
        except ProtocolError as exc:
            # Too large to send (a status of an enormous host, say): answer that instead
            # of leaving the client waiting for ever.
            log.warning("reply to pid %s not sent: %s", conn.pid, exc.message)
            frame = encode_frame(
                Error(
                    reply_to=message.reply_to,
                    code=ErrorCode.INTERNAL,
                    message=f"the answer could not be sent: {exc.message}",
                )
            )
        try:
            conn.writer.write(frame)
        except (ConnectionError, RuntimeError) as exc:
            log.debug("send to pid %s failed: %s", conn.pid, exc)

    def send_error(self, conn: Connection, reply_to: int, code: ErrorCode, message: str) -> None:
        self.ctx.metrics.errors.labels(code.value).inc()
        if len(message) > MAX_ERROR_TEXT:
            message = message[: MAX_ERROR_TEXT - 3] + "..."
        self.send(conn, Error(reply_to=reply_to, code=code, message=message))

    def _handle_body(self, conn: Connection, body: bytes) -> None:
        bucket = self.ctx.buckets.get(conn.uid)
        if bucket is None:
            rate = self.ctx.config.max_requests_per_second
            bucket = self.ctx.buckets[conn.uid] = TokenBucket(rate, rate * 2)
        if conn.uid != 0 and not bucket.take():
            self.send_error(
                conn,
                peek_seq(body),
                ErrorCode.RATE_LIMITED,
                f"too many requests from {conn.user}; the limit is "
                f"{self.ctx.config.max_requests_per_second:g} per second",
            )
            return
        try:
            message = decode_client_message(body)
        except ProtocolError as exc:
            self.send_error(conn, peek_seq(body), exc.code, exc.message)
            return
        self.ctx.metrics.requests.labels(type(message).__struct_config__.tag).inc()
        try:
            self.requests.handle(conn, message)
        except (ProtocolError, core.SchedulerError) as exc:
            self.send_error(conn, message.seq, exc.code, exc.message)
        except Exception as exc:
            # A bug must cost one answer, not the connection or the broker.
            log.error(
                "internal error on a %s message from pid %s: %s: %s",
                type(message).__struct_config__.tag,
                conn.pid,
                type(exc).__name__,
                plain_text(str(exc), SENTENCE_LIMIT),  # it may quote what the client sent
            )
            self.send_error(
                conn, message.seq, ErrorCode.INTERNAL, f"internal error ({type(exc).__name__})"
            )

    # ------------------------------------------------------------ core <-> world

    def dispatch(self, event: core.Event, reply: Reply = NO_REPLY) -> list[core.Action]:
        """Feed one event to the core and carry out its actions (journal first): the
        server's own events, and those the edges post on the context's queue."""
        actions = self.core.handle(event)
        for action in actions:
            self.effects.carry_out(action, reply)
        return actions


async def run_broker(
    config: BrokerConfig,
    paths: BrokerPaths,
    inventory: InventoryBackend,
    note: str | None,
    config_path: Path | None = None,
    exit_when_idle_s: float | None = None,
) -> None:
    broker = Broker(
        config, paths, inventory, inventory_note=note, config_path=config_path,
        exit_when_idle_s=exit_when_idle_s,
    )  # fmt: skip
    await broker.serve()
