"""The broker daemon: an asyncio Unix-socket server around the pure scheduler core.

It reads top to bottom like uvicorn's server: :meth:`Broker.startup` (journal
recovery, socket), :meth:`Broker.main_loop` (clients, a 1 Hz tick that reaps dead
processes, samples devices and feeds the memory watchdog), :meth:`Broker.shutdown`
(stop accepting, tell clients, undo every actuator, close).  Signal handlers only set
flags; a second SIGINT/SIGTERM forces the exit.

It owns no policy.  For each client message it checks identity and permissions,
turns the message into a core event, and carries out the core's actions: journal
first, then the actuators, then the messages to clients.  Identity (uid, gid, pid)
comes from SO_PEERCRED, never from a message.  A user sees and acts on its own
sessions only (others appear as ``user-xxxx``); admins (root, or a configured
group/user) can do everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import hashlib
import logging
import os
import pwd
import secrets
import signal
import socket
import stat
import struct
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

from gpushare_ext.broker import core
from gpushare_ext.broker.actuators import (
    ActuatorError,
    Ladder,
    SimulatedProcessControl,
    Target,
    open_process_control,
    pid_alive,
)
from gpushare_ext.broker.config import BrokerConfig, parse_config
from gpushare_ext.broker.inventory import MIB, InventoryBackend, SimulatedInventory
from gpushare_ext.broker.journal import Journal, JournaledLease
from gpushare_ext.broker.metrics import BrokerMetrics
from gpushare_ext.broker.policy import PolicyError
from gpushare_ext.paths import BrokerPaths
from gpushare_ext.protocol import (
    PROTOCOL_VERSION,
    Admin,
    AdminAction,
    BrokerMessage,
    Capabilities,
    DeviceView,
    Error,
    ErrorCode,
    FrameReader,
    Granted,
    Heartbeat,
    Hello,
    LeaseState,
    LeaseView,
    Ok,
    Preempt,
    PreemptionLevel,
    ProtocolError,
    Queued,
    Refused,
    RegisterYieldFlag,
    Release,
    Released,
    RequestLease,
    Resume,
    Revoked,
    Snapshot,
    StateUpdate,
    StatusReply,
    StatusRequest,
    Unwatch,
    Watch,
    Welcome,
    decode_client_message,
    encode_frame,
    peek_seq,
    priority_class,
)
from gpushare_ext.runtime.control import ControlBlock, SessionState

log = logging.getLogger("gpushare.broker")

_UCRED = struct.Struct("3i")
HISTORY_POINTS = 60


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def user_and_groups(uid: int, gid: int) -> tuple[str, tuple[str, ...]]:
    try:
        entry = pwd.getpwuid(uid)
        name = entry.pw_name
        gids = os.getgrouplist(name, gid)
    except KeyError:
        return f"uid{uid}", ()
    names = []
    for g in gids:
        with contextlib.suppress(KeyError):
            names.append(grp.getgrgid(g).gr_name)
    return name, tuple(names)


class TokenBucket:
    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False


@dataclass(eq=False, kw_only=True)
class Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    pid: int
    uid: int
    gid: int
    user: str
    groups: tuple[str, ...]
    is_admin: bool
    session_id: str | None = None
    hello: Hello | None = None
    control_block: ControlBlock | None = None
    watch_task: asyncio.Task | None = None
    yield_flags: dict[str, tuple[int, str, int]] = field(default_factory=dict)
    closed: bool = False


class Broker:
    def __init__(
        self,
        config: BrokerConfig,
        paths: BrokerPaths,
        inventory: InventoryBackend,
        *,
        inventory_note: str | None = None,
    ) -> None:
        self.config = config
        self.paths = paths
        self.inventory = inventory
        self.inventory_note = inventory_note
        self.devices = [
            d for d in inventory.devices() if config.devices is None or d.index in config.devices
        ]
        if not self.devices:
            raise RuntimeError(
                f"none of the devices {config.devices} exists here "
                f"(the inventory has {[d.index for d in inventory.devices()]})"
            )
        self.scheduler = core.Scheduler(self.devices, config.policy)
        self.metrics = BrokerMetrics()
        self.control = open_process_control(inventory.kind, [d.index for d in self.devices])
        self.ladder = Ladder(self.control, lock_timeout_ms=config.lock_timeout_ms)
        self.journal = Journal(config.journal or paths.journal)
        self.connections: dict[str, Connection] = {}  # session id -> connection
        self.all_connections: set[Connection] = set()
        self.per_uid_connections: dict[int, int] = {}
        self.buckets: dict[int, TokenBucket] = {}
        self.drained: set[int] = set()
        self.notes: dict[str, str] = {}  # lease id -> actuator note for status
        self.history: dict[int, deque[int]] = {
            d.index: deque(maxlen=HISTORY_POINTS) for d in self.devices
        }
        self.readings = {r.index: r for r in inventory.readings() if r.index in self.history}
        self.reclaimable: dict[str, JournaledLease] = {}
        self.yield_flags: dict[str, tuple[str, int]] = {}  # lease id -> (handle, offset)
        self.salt = ""
        self.started = time.time()
        self.should_exit = False
        self.force_exit = False
        self._server: asyncio.AbstractServer | None = None
        self._session_counter = 0
        self._stopped = asyncio.Event()
        self.node = config.node_name or os.uname().nodename

    # ------------------------------------------------------------ lifecycle

    async def serve(self) -> None:
        await self.startup()
        try:
            await self.main_loop()
        finally:
            await self.shutdown()

    async def startup(self) -> None:
        self._recover()
        self._prepare_directories()
        self._server = await asyncio.start_unix_server(
            self._client_connected, path=str(self.paths.socket), limit=1 << 20, backlog=1024
        )  # a hub's kernels reconnect all at once after a restart: 100 (the default) is short
        os.chmod(self.paths.socket, 0o666 if self.paths.mode == "system" else 0o600)
        if self.paths.mode == "system" and self.config.socket_group:
            gid = grp.getgrnam(self.config.socket_group).gr_gid
            os.chown(self.paths.socket, 0, gid)
            os.chmod(self.paths.socket, 0o660)
        if self.config.metrics_port:
            self.metrics.serve(self.config.metrics_port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.handle_exit, sig)
        log.info(
            "broker %s mode on %s; %s; journal %s",
            self.paths.mode,
            self.paths.socket,
            self.inventory.description,
            self.journal.path,
        )

    def handle_exit(self, sig: int | None = None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        self._stopped.set()

    async def main_loop(self) -> None:
        while not self.should_exit:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), timeout=1.0)
            if self.should_exit:
                break
            self._tick()

    async def shutdown(self) -> None:
        log.info("broker shutting down")
        if self._server is not None:
            self._server.close()
        # Leave no process locked: undo every actuator, keep the leases in the journal
        # so that sessions can reclaim them from the next broker.
        for lease in list(self.scheduler.active_leases()):
            level = lease.applied_level if lease.applied_level is not None else lease.pending_level
            target = self._target(lease.lease_id, lease.identity.pid, lease.slot)
            if target is not None:
                try:
                    await asyncio.wait_for(
                        self.ladder.undo(target, level), timeout=0 if self.force_exit else 10
                    )
                    self.journal.actuations_undone(lease.lease_id)
                except (ActuatorError, asyncio.TimeoutError) as exc:
                    log.warning("could not undo preemption of %s: %s", lease.lease_id, exc)
        for conn in list(self.all_connections):
            with contextlib.suppress(Exception):
                self._send(
                    conn, Error(code=ErrorCode.UNAVAILABLE, message="the broker is shutting down")
                )
            conn.writer.close()
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(
                    self._server.wait_closed(), timeout=0.5 if self.force_exit else 3
                )
        for conn in list(self.all_connections):
            if conn.control_block is not None:
                conn.control_block.close()
                with contextlib.suppress(OSError):
                    conn.control_block.path.unlink()
        with contextlib.suppress(OSError):
            self.paths.socket.unlink()
        self.metrics.close()
        self.control.close()
        self.journal.close()
        self.inventory.close()

    def _prepare_directories(self) -> None:
        runtime = self.paths.runtime_dir
        runtime.mkdir(parents=True, exist_ok=True)
        os.chmod(runtime, 0o755 if self.paths.mode == "system" else 0o700)
        self.paths.sessions_dir.mkdir(parents=True, exist_ok=True)
        if self.paths.sessions_dir.stat().st_uid != os.geteuid():
            raise RuntimeError(f"{self.paths.sessions_dir} belongs to another user")
        # Others may traverse to their own 0600 block but not list anyone's.
        os.chmod(self.paths.sessions_dir, 0o711 if self.paths.mode == "system" else 0o700)
        for stale in self.paths.sessions_dir.glob("*.cb"):
            with contextlib.suppress(OSError):
                stale.unlink()
        if self.paths.socket.exists() or self.paths.socket.is_symlink():
            mode = self.paths.socket.lstat().st_mode
            if not stat.S_ISSOCK(mode):
                raise RuntimeError(f"{self.paths.socket} exists and is not a socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.paths.socket))
            except OSError:
                self.paths.socket.unlink()  # left over by a dead broker
            else:
                probe.close()
                raise RuntimeError(f"another broker already serves {self.paths.socket}")

    def _recover(self) -> None:
        """After a crash: undo applied actuators, keep leases of live processes reclaimable."""
        self.salt = self.journal.meta("salt") or secrets.token_hex(8)
        self.journal.set_meta("salt", self.salt)
        for step in self.journal.pending_actuations():
            log.warning(
                "recovery: undoing level %s on pid %s (lease %s)",
                step.level,
                step.pid,
                step.lease_id,
            )
            try:
                self.ladder.undo_blocking(step.pid, step.device_index, step.level)
            except ActuatorError as exc:
                log.error(
                    "recovery could not undo level %s on pid %s: %s", step.level, step.pid, exc
                )
            self.journal.actuation_undone(step.id)
        for lease in self.journal.open_leases():
            if pid_alive(lease.pid) and lease.slot in self.scheduler.slots:
                self.reclaimable[lease.lease_id] = lease
                self.journal.note("reclaimable", lease.lease_id, {"pid": lease.pid})
            else:
                self.journal.lease_ended(
                    lease.lease_id, "its process ended while the broker was down"
                )
        self._reclaim_deadline = time.monotonic() + self.config.reclaim_grace_s

    # ------------------------------------------------------------ periodic work

    def _tick(self) -> None:
        now = time.time()
        for conn in list(self.connections.values()):
            if not pid_alive(conn.pid):
                self._session_gone(conn, "its process ended")
        if self.reclaimable and time.monotonic() > self._reclaim_deadline:
            for lease_id in list(self.reclaimable):
                self.journal.lease_ended(lease_id, "not reclaimed after the broker restarted")
                del self.reclaimable[lease_id]
        if isinstance(self.inventory, SimulatedInventory):
            for device in self.devices:
                used, busy = 0, False
                for lease in self.scheduler.active_leases():
                    slot = self.scheduler.slots.get(lease.slot or "")
                    if slot is None or slot.device_index != device.index:
                        continue
                    if lease.state in (LeaseState.RUNNING, LeaseState.PAUSED):
                        used += lease.memory_bytes // MIB
                    busy = busy or lease.state == LeaseState.RUNNING
                self.inventory.set_usage(device.index, used, busy)
        try:
            readings = self.inventory.readings()
        except Exception as exc:  # NVML can fail transiently; keep serving
            log.warning("device readings failed: %s", exc)
            readings = []
        for reading in readings:
            if reading.index not in self.history:
                continue  # a GPU this broker does not manage
            self.readings[reading.index] = reading
            self.history[reading.index].append(reading.utilization_pct)
            if self.inventory.kind == "nvml":
                for process in reading.processes:
                    self._dispatch(
                        core.MemoryObserved(
                            now=now, pid=process.pid, used_bytes=process.used_mib * MIB
                        )
                    )
        self._dispatch(core.Tick(now=now))
        # Gauges follow the snapshot once a second: scrapers are slower than that, and a
        # snapshot per event would put its cost on every request.
        self.metrics.refresh(self._snapshot(None))

    # ------------------------------------------------------------ connections

    async def _client_connected(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, gid = peer_credentials(sock)
        user, groups = user_and_groups(uid, gid)
        count = self.per_uid_connections.get(uid, 0)
        if count >= self.config.max_connections_per_uid and uid != 0:
            writer.write(
                encode_frame(
                    Error(
                        code=ErrorCode.RATE_LIMITED,
                        message=f"too many connections from {user} (limit {self.config.max_connections_per_uid})",
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
            is_admin=self.config.policy.is_admin(uid, user, groups),
        )
        self.all_connections.add(conn)
        frames = FrameReader()
        try:
            while not self.should_exit:
                data = await reader.read(65536)
                if not data:
                    if frames.pending:
                        self._send(
                            conn,
                            Error(
                                code=ErrorCode.MALFORMED,
                                message="truncated frame: the connection closed mid-message",
                            ),
                        )
                    break
                frames.feed(data)
                while True:
                    try:
                        body = frames.next_body()
                    except ProtocolError as exc:
                        self._send_error(conn, 0, exc.code, exc.message)
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
        self.all_connections.discard(conn)
        self.per_uid_connections[conn.uid] = max(0, self.per_uid_connections.get(conn.uid, 1) - 1)
        if conn.watch_task is not None:
            conn.watch_task.cancel()
        if conn.session_id is not None and self.should_exit:
            # The broker is stopping, not the session: its leases stay open in the journal
            # so that the session reclaims them from the next broker (Hello.reclaim).
            self.connections.pop(conn.session_id, None)
            conn.session_id = None
            if conn.control_block is not None:
                conn.control_block.close()
                with contextlib.suppress(OSError):
                    conn.control_block.path.unlink()
                conn.control_block = None
        elif conn.session_id is not None:
            self._session_gone(conn, "its connection closed")
        with contextlib.suppress(Exception):
            conn.writer.close()

    def _session_gone(self, conn: Connection, reason: str) -> None:
        session_id = conn.session_id
        if session_id is None or session_id not in self.connections:
            return
        del self.connections[session_id]
        self._dispatch(core.SessionClosed(now=time.time(), session_id=session_id, reason=reason))
        if conn.control_block is not None:
            conn.control_block.close()
            with contextlib.suppress(OSError):
                conn.control_block.path.unlink()
            conn.control_block = None
        conn.session_id = None
        if not conn.closed:
            with contextlib.suppress(Exception):
                conn.writer.close()

    def _send(self, conn: Connection, message: BrokerMessage) -> None:
        if conn.closed and not isinstance(message, Error):
            return
        try:
            conn.writer.write(encode_frame(message))
        except (ConnectionError, RuntimeError, ProtocolError) as exc:
            log.debug("send to pid %s failed: %s", conn.pid, exc)

    def _send_error(self, conn: Connection, reply_to: int, code: ErrorCode, message: str) -> None:
        self.metrics.errors.labels(code.value).inc()
        self._send(conn, Error(reply_to=reply_to, code=code, message=message))

    # ------------------------------------------------------------ messages

    def _handle_body(self, conn: Connection, body: bytes) -> None:
        bucket = self.buckets.setdefault(
            conn.uid,
            TokenBucket(
                self.config.max_requests_per_second, self.config.max_requests_per_second * 2
            ),
        )
        if conn.uid != 0 and not bucket.take():
            self._send_error(
                conn,
                peek_seq(body),
                ErrorCode.RATE_LIMITED,
                f"too many requests from {conn.user}; the limit is "
                f"{self.config.max_requests_per_second:g} per second",
            )
            return
        try:
            message = decode_client_message(body)
        except ProtocolError as exc:
            self._send_error(conn, peek_seq(body), exc.code, exc.message)
            return
        self.metrics.requests.labels(type(message).__struct_config__.tag).inc()
        try:
            self._handle_message(conn, message)
        except ProtocolError as exc:
            self._send_error(conn, message.seq, exc.code, exc.message)
        except core.SchedulerError as exc:
            self._send_error(conn, message.seq, exc.code, exc.message)

    def _handle_message(self, conn: Connection, message) -> None:
        if isinstance(message, Hello):
            self._on_hello(conn, message)
            return
        if conn.hello is None:
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER, "say hello first: the first message must be 'hello'"
            )
        if isinstance(message, RequestLease):
            self._on_request(conn, message)
        elif isinstance(message, Release):
            self._on_release(conn, message)
        elif isinstance(message, Heartbeat):
            self._send(conn, Ok(reply_to=message.seq))
        elif isinstance(message, StatusRequest):
            self._send(conn, StatusReply(reply_to=message.seq, snapshot=self.snapshot_for(conn)))
        elif isinstance(message, Watch):
            if conn.watch_task is not None:
                conn.watch_task.cancel()
            conn.watch_task = asyncio.get_running_loop().create_task(
                self._watch(conn, message.interval_s)
            )
            self._send(conn, Ok(reply_to=message.seq, detail="watching"))
        elif isinstance(message, Unwatch):
            if conn.watch_task is not None:
                conn.watch_task.cancel()
                conn.watch_task = None
            self._send(conn, Ok(reply_to=message.seq))
        elif isinstance(message, RegisterYieldFlag):
            self._on_register_flag(conn, message)
        elif isinstance(message, Admin):
            self._on_admin(conn, message)
        else:  # pragma: no cover - the decoder admits nothing else
            raise ProtocolError(
                ErrorCode.UNKNOWN_MESSAGE, f"unhandled message {type(message).__name__}"
            )

    def _on_hello(self, conn: Connection, hello: Hello) -> None:
        if conn.hello is not None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "hello was already said on this connection")
        if hello.version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION,
                f"protocol version {hello.version} is not supported; this broker speaks "
                f"version {PROTOCOL_VERSION} (upgrade gpushare-ext on one side)",
            )
        conn.hello = hello
        self._session_counter += 1
        session_id = f"S{self._session_counter}-{secrets.token_hex(3)}"
        conn.session_id = session_id
        block_path = self.paths.sessions_dir / f"{session_id}.cb"
        conn.control_block = ControlBlock.create(block_path, owner_uid=conn.uid, owner_gid=conn.gid)
        conn.control_block.publish(gate_closed=False, state=SessionState.IDLE)
        self.connections[session_id] = conn
        self._dispatch(
            core.SessionOpened(
                now=time.time(),
                session_id=session_id,
                identity=core.Identity(
                    uid=conn.uid, gid=conn.gid, pid=conn.pid, user=conn.user, groups=conn.groups
                ),
                notebook=hello.notebook,
            )
        )
        reclaimed = []
        for lease_id in hello.reclaim:
            record = self.reclaimable.get(lease_id)
            if record is None or record.pid != conn.pid or record.uid != conn.uid:
                continue
            del self.reclaimable[lease_id]
            self._dispatch(
                core.LeaseReclaimed(
                    now=time.time(),
                    session_id=session_id,
                    lease_id=lease_id,
                    priority=record.priority,
                    memory_bytes=record.memory_bytes,
                    slot=record.slot,
                    sm_share=record.sm_share,
                    capabilities=msgspec.convert(record.capabilities, Capabilities),
                    label=record.label,
                )
            )
            reclaimed.append(lease_id)
        self._send(
            conn,
            Welcome(
                reply_to=hello.seq,
                version=PROTOCOL_VERSION,
                broker_pid=os.getpid(),
                mode=self.paths.mode,  # type: ignore[arg-type]
                session_id=session_id,
                uid=conn.uid,
                user=conn.user,
                is_admin=conn.is_admin,
                inventory=self.inventory.kind,
                inventory_description=self.inventory.description,
                control_block=str(block_path),
                reclaimed=reclaimed,
            ),
        )

    def _on_request(self, conn: Connection, request: RequestLease) -> None:
        if self.should_exit:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "the broker is shutting down")
        lease_id = f"L{self.journal.next_lease_number()}"
        actions = self._dispatch(
            core.LeaseRequested(
                now=time.time(),
                session_id=conn.session_id,  # type: ignore[arg-type]
                lease_id=lease_id,
                priority=request.priority,
                memory_bytes=request.memory_bytes,
                slice=request.slice,
                device=request.device,
                sm_share=request.sm_share,
                capabilities=request.capabilities,
                label=request.label,
            ),
            reply_to=request.seq,
            reply_lease=lease_id,
        )
        del actions

    def _on_release(self, conn: Connection, release: Release) -> None:
        lease = self.scheduler.lease_of(release.lease_id)
        if lease is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"there is no active lease {release.lease_id}"
            )
        if lease.session_id != conn.session_id:
            if lease.identity.uid != conn.uid and not conn.is_admin:
                raise ProtocolError(
                    ErrorCode.PERMISSION, f"lease {release.lease_id} belongs to another user"
                )
            if not conn.is_admin and lease.identity.uid == conn.uid:
                # Another notebook of the same user: allowed, it is their own lease.
                pass
        by_admin = lease.identity.uid != conn.uid
        self._dispatch(
            core.LeaseReleased(
                now=time.time(),
                session_id=lease.session_id,
                lease_id=release.lease_id,
                by_admin=by_admin,
            ),
            reply_to=release.seq,
            reply_conn=conn,
        )

    def _on_register_flag(self, conn: Connection, message: RegisterYieldFlag) -> None:
        lease = self.scheduler.lease_of(message.lease_id)
        if lease is None or lease.session_id != conn.session_id:
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"lease {message.lease_id} is not yours or not active"
            )
        if self.inventory.kind != "nvml":
            raise ProtocolError(
                ErrorCode.NOT_SUPPORTED, "yield flags need a real GPU; this broker simulates one"
            )
        self.yield_flags[message.lease_id] = (message.ipc_handle_hex, message.offset)
        self._send(conn, Ok(reply_to=message.seq, detail="yield flag registered"))

    def _on_admin(self, conn: Connection, message: Admin) -> None:
        if not conn.is_admin:
            raise ProtocolError(
                ErrorCode.PERMISSION,
                f"only admins may {message.action.value}; {conn.user} is not one",
            )
        now = time.time()
        if message.action in (AdminAction.DRAIN, AdminAction.UNDRAIN):
            if message.device is None:
                raise ProtocolError(ErrorCode.INVALID, "drain and undrain need a device index")
            self._dispatch(
                core.DeviceDrained(
                    now=now,
                    device_index=message.device,
                    drained=message.action == AdminAction.DRAIN,
                ),
                reply_to=message.seq,
            )
            self.journal.note(
                message.action.value, None, {"device": message.device, "by": conn.user}
            )
            self._send(
                conn,
                Ok(
                    reply_to=message.seq, detail=f"device {message.device} {message.action.value}ed"
                ),
            )
        elif message.action == AdminAction.CANCEL:
            if message.lease_id is None:
                raise ProtocolError(ErrorCode.INVALID, "cancel needs a lease id")
            lease = self.scheduler.lease_of(message.lease_id)
            if lease is None:
                raise ProtocolError(
                    ErrorCode.UNKNOWN_LEASE, f"there is no active lease {message.lease_id}"
                )
            self._dispatch(
                core.LeaseReleased(
                    now=now, session_id=lease.session_id, lease_id=lease.lease_id, by_admin=True
                ),
                reply_to=message.seq,
            )
            self._send(conn, Ok(reply_to=message.seq, detail=f"lease {message.lease_id} cancelled"))
        elif message.action in (AdminAction.SET_POLICY, AdminAction.RELOAD_POLICY):
            if message.action == AdminAction.SET_POLICY:
                if not message.policy_toml:
                    raise ProtocolError(ErrorCode.INVALID, "set_policy needs policy_toml")
                text = message.policy_toml
            else:
                if self.paths.config is None or not self.paths.config.exists():
                    raise ProtocolError(
                        ErrorCode.INVALID, "this broker has no config file to reload"
                    )
                text = self.paths.config.read_text()
            try:
                policy = parse_config(text, "policy").policy
            except PolicyError as exc:
                raise ProtocolError(ErrorCode.INVALID, str(exc)) from None
            self._dispatch(core.PolicyChanged(now=now, policy=policy), reply_to=message.seq)
            self.journal.note("policy", None, {"by": conn.user})
            self._send(conn, Ok(reply_to=message.seq, detail="policy updated"))

    async def _watch(self, conn: Connection, interval: float) -> None:
        try:
            while not conn.closed:
                self._send(conn, StateUpdate(snapshot=self.snapshot_for(conn)))
                with contextlib.suppress(ConnectionError):
                    await conn.writer.drain()
                await asyncio.sleep(interval)
        except asyncio.CancelledError:
            pass

    # ------------------------------------------------------------ core <-> world

    def _dispatch(
        self,
        event,
        *,
        reply_to: int = 0,
        reply_lease: str | None = None,
        reply_conn: Connection | None = None,
    ) -> list:
        """Feed one event to the core and carry out its actions (journal first)."""
        actions = self.scheduler.handle(event)
        for action in actions:
            direct = reply_to if getattr(action, "lease_id", None) == reply_lease else 0
            self._carry_out(action, direct, reply_conn, reply_to)
        return actions

    def _carry_out(
        self, action, direct_reply: int, reply_conn: Connection | None, reply_to: int
    ) -> None:
        conn = self.connections.get(getattr(action, "session_id", ""))
        if isinstance(action, core.Grant):
            lease = self.scheduler.lease_of(action.lease_id)
            assert lease is not None
            self.journal.lease_granted(
                JournaledLease(
                    lease_id=action.lease_id,
                    pid=lease.identity.pid,
                    uid=lease.identity.uid,
                    slot=lease.slot or "",
                    priority=action.priority,
                    memory_bytes=lease.memory_bytes,
                    sm_share=lease.sm_share,
                    capabilities=msgspec.to_builtins(lease.capabilities),
                    label=lease.label,
                )
            )
            self.metrics.observe_grant(action.priority, lease.waited_s)
            if conn is not None:
                if conn.control_block is not None:
                    conn.control_block.publish(gate_closed=False, state=SessionState.RUNNING)
                self._send(
                    conn,
                    Granted(
                        reply_to=direct_reply,
                        lease_id=action.lease_id,
                        placement=action.placement,
                        priority=action.priority,
                        notice=action.notice,
                    ),
                )
        elif isinstance(action, core.NotifyQueued):
            if conn is not None:
                holders = [self.scheduler.lease_of(lid) for lid in action.waiting_for]
                names = sorted(
                    {self._display_user(h.identity, conn) for h in holders if h is not None}
                )
                if conn.control_block is not None:
                    conn.control_block.publish(
                        gate_closed=False, state=SessionState.QUEUED, reason=action.reason
                    )
                self._send(
                    conn,
                    Queued(
                        reply_to=direct_reply,
                        lease_id=action.lease_id,
                        position=action.position,
                        waiting_for=", ".join(names) if names else "earlier requests",
                        holder_priority=action.holder_priority,
                        estimate_s=action.estimate_s,
                        reason=action.reason,
                    ),
                )
        elif isinstance(action, core.Refuse):
            if conn is not None:
                self._send(
                    conn,
                    Refused(
                        reply_to=direct_reply,
                        lease_id=action.lease_id,
                        code=action.code,
                        message=action.message,
                    ),
                )
        elif isinstance(action, core.Preempt):
            self.journal.actuation_applied(
                action.lease_id,
                action.pid,
                action.device_index,
                int(action.level),
                str(conn.control_block.path) if conn and conn.control_block else "",
            )
            self.metrics.observe_preemption(int(action.level))
            for_lease = self.scheduler.lease_of(action.for_lease) if action.for_lease else None
            if conn is not None:
                for_user = (
                    self._display_user(for_lease.identity, conn) if for_lease else "the broker"
                )
                self._send(
                    conn,
                    Preempt(
                        lease_id=action.lease_id,
                        level=action.level,
                        reason=action.reason,
                        for_user=for_user,
                    ),
                )
            lease = self.scheduler.lease_of(action.lease_id)
            already = lease.applied_level if lease else None
            target = self._target(action.lease_id, action.pid, lease.slot if lease else None)
            asyncio.get_running_loop().create_task(self._apply_preemption(target, action, already))
        elif isinstance(action, core.ResumeLease):
            target = self._target(
                action.lease_id, action.pid, None, device_index=action.device_index
            )
            asyncio.get_running_loop().create_task(
                self._undo_preemption(target, action.undo_level, resume=action)
            )
        elif isinstance(action, core.Revoke):
            if conn is not None:
                self._send(conn, Revoked(lease_id=action.lease_id, reason=action.reason))
        elif isinstance(action, core.LeaseEnded):
            self.journal.lease_ended(action.lease_id, action.reason)
            self.yield_flags.pop(action.lease_id, None)
            if action.undo_level is not None and action.device_index is not None:
                target = self._target(
                    action.lease_id, action.pid, None, device_index=action.device_index
                )
                if target is not None and conn is None:
                    target.control_block = None
                asyncio.get_running_loop().create_task(
                    self._undo_preemption(target, action.undo_level)
                )
            elif conn is not None and conn.control_block is not None:
                conn.control_block.publish(gate_closed=False, state=SessionState.IDLE)
            target_conn = reply_conn if reply_conn is not None else conn
            if target_conn is not None:
                self._send(
                    target_conn,
                    Released(
                        reply_to=reply_to if reply_conn is not None else 0,
                        lease_id=action.lease_id,
                        held_s=action.held_s,
                    ),
                )

    def _target(
        self, lease_id: str, pid: int, slot: str | None, device_index: int | None = None
    ) -> Target:
        lease = self.scheduler.lease_of(lease_id)
        session = self.connections.get(lease.session_id) if lease else None
        if device_index is None:
            key = slot or (lease.slot if lease else None)
            device_index = self.scheduler.slots[key].device_index if key else 0
        return Target(
            lease_id=lease_id,
            pid=pid,
            device_index=device_index,
            control_block=session.control_block if session else None,
            yield_flag=self.yield_flags.get(lease_id),
        )

    async def _apply_preemption(self, target: Target, action: core.Preempt, already) -> None:
        try:
            note = await self.ladder.apply(target, action.level, action.reason, already)
        except ActuatorError as exc:
            self.metrics.observe_preemption(int(action.level), failed=True)
            self.notes[action.lease_id] = (
                f"level {int(action.level)} not supported: {exc}"
                if exc.not_supported
                else f"level {int(action.level)} failed: {exc}"
            )
            log.warning(
                "preemption of %s at level %s failed: %s", action.lease_id, int(action.level), exc
            )
            if action.level == PreemptionLevel.EVICT and self.ladder.is_locked(target.pid):
                pass  # the lock held: it stays paused, only its memory stays on the device
            else:
                # Whatever was applied (the gate) is undone: it keeps running, time-sliced.
                with contextlib.suppress(ActuatorError):
                    await self.ladder.undo(target, None)
                self.journal.actuations_undone(action.lease_id)
            self._dispatch(
                core.PreemptionFailed(
                    now=time.time(), lease_id=action.lease_id, level=action.level, reason=str(exc)
                )
            )
            conn = self.connections.get(action.session_id)
            if conn is not None and action.level != PreemptionLevel.EVICT:
                self._send(
                    conn,
                    Resume(
                        lease_id=action.lease_id,
                        paused_s=0.0,
                        note=f"could not be paused ({exc}); it runs beside the other session",
                    ),
                )
            return
        if note:
            self.notes[action.lease_id] = note
        self._dispatch(
            core.PreemptionApplied(now=time.time(), lease_id=action.lease_id, level=action.level)
        )

    async def _undo_preemption(
        self, target: Target, level, resume: core.ResumeLease | None = None
    ) -> None:
        try:
            await self.ladder.undo(target, level)
            self.journal.actuations_undone(target.lease_id)
        except ActuatorError as exc:
            log.error("could not undo level %s for %s: %s", level, target.lease_id, exc)
            self.notes[target.lease_id] = f"resume failed: {exc}"
        if resume is not None:
            self.notes.pop(target.lease_id, None)
            conn = self.connections.get(resume.session_id)
            if conn is not None:
                self._send(conn, Resume(lease_id=resume.lease_id, paused_s=resume.paused_s))

    # ------------------------------------------------------------ views

    def anonymous_name(self, uid: int) -> str:
        digest = hashlib.sha256(f"{self.salt}:{uid}".encode()).hexdigest()
        return f"user-{digest[:4]}"

    def _display_user(self, identity: core.Identity, viewer: Connection | None) -> str:
        if viewer is None or viewer.is_admin or viewer.uid == identity.uid:
            return identity.user
        return self.anonymous_name(identity.uid)

    def snapshot_for(self, conn: Connection | None) -> Snapshot:
        return self._snapshot(conn)

    def _snapshot(self, viewer: Connection | None) -> Snapshot:
        now = time.time()
        scheduler = self.scheduler
        leases: list[LeaseView] = []
        queue_counts = {"low": 0, "normal": 0, "high": 0}
        queued_positions = {}
        position = 0
        for lease in scheduler.queue():
            if lease.state == LeaseState.QUEUED:
                position += 1
                queued_positions[lease.lease_id] = position
                queue_counts[priority_class(lease.base_priority)] += 1
        for lease in sorted(scheduler.active_leases(), key=lambda item: item.arrival):
            own = viewer is not None and viewer.uid == lease.identity.uid
            detailed = viewer is None or own or viewer.is_admin
            slot = scheduler.slots.get(lease.slot or "")
            session = scheduler.sessions.get(lease.session_id)
            reason = lease.reason
            note = self.notes.get(lease.lease_id)
            if note:
                reason = f"{reason} ({note})" if reason else note
            leases.append(
                LeaseView(
                    lease_id=lease.lease_id,
                    user=self._display_user(lease.identity, viewer),
                    own=own,
                    priority=lease.base_priority,
                    state=lease.state,
                    device_index=slot.device_index if slot else None,
                    mig_uuid=slot.mig_uuid if slot else None,
                    memory_bytes=lease.memory_bytes,
                    sm_share=lease.sm_share,
                    since_s=round(now - lease.state_since, 3),
                    waited_s=round(
                        lease.waited_s if lease.granted_at else now - lease.requested_at, 3
                    ),
                    position=queued_positions.get(lease.lease_id),
                    reason=reason,
                    label=lease.label if detailed else "",
                    pid=lease.identity.pid if detailed else None,
                    notebook=(session.notebook if session else "") if detailed else "",
                    preemption_level=int(
                        lease.applied_level
                        if lease.applied_level is not None
                        else lease.pending_level
                    )
                    if (lease.applied_level is not None or lease.pending_level is not None)
                    else None,
                )
            )
        devices = []
        for device in self.devices:
            reading = self.readings.get(device.index)
            leased = 0
            holders = []
            for lease in scheduler.active_leases():
                slot = scheduler.slots.get(lease.slot or "")
                if slot is None or slot.device_index != device.index:
                    continue
                if lease.state in (LeaseState.RUNNING, LeaseState.PAUSED):
                    leased += lease.memory_bytes
                    holders.append(lease.lease_id)
            devices.append(
                DeviceView(
                    info=device,
                    drained=device.index in scheduler.drained,
                    memory_used_mib=reading.memory_used_mib if reading else 0,
                    memory_leased_mib=leased // MIB,
                    utilization_pct=reading.utilization_pct if reading else 0,
                    utilization_history=list(self.history.get(device.index, ())),
                    holders=holders,
                )
            )
        notes = []
        if self.inventory.kind == "simulated":
            notes.append(self.inventory.description)
            if self.inventory_note:
                notes.append(self.inventory_note)
        if isinstance(self.control, SimulatedProcessControl):
            notes.append(
                "simulated GPU: preemption gates the session's launch points; no process is locked"
            )
        for lease in scheduler.active_leases():
            if not lease.lockable:
                notes.append(
                    f"lease {lease.lease_id} cannot be paused (checkpoint lock unsupported, e.g. an MPS client): it time-slices"
                )
        return Snapshot(
            host=os.uname().nodename,
            node=self.node,
            broker_pid=os.getpid(),
            mode=self.paths.mode,
            inventory=self.inventory.kind,
            inventory_description=self.inventory.description,
            time=now,
            you=viewer.user if viewer else "",
            is_admin=bool(viewer and viewer.is_admin),
            devices=devices,
            leases=leases,
            queue_by_priority=queue_counts,
            notes=notes,
        )


async def run_broker(
    config: BrokerConfig, paths: BrokerPaths, inventory: InventoryBackend, note: str | None
) -> None:
    broker = Broker(config, paths, inventory, inventory_note=note)
    await broker.serve()
