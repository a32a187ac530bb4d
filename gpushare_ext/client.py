"""Clients of the broker: a thread-based one for notebook kernels and the CLI, an asyncio one
for the Jupyter server extension.

Both speak :mod:`gpushare_ext.protocol`, through one core of plain functions (the hello,
the requests they share, reading frames and answers, the errors a connect ends in, the
pauses of a retry), each face doing its own I/O around it: threads and blocking sockets
for one, asyncio streams for the other.  Replies are matched to requests by ``seq``;
notices the broker sends on its own (grants after queueing, preemptions, resumes,
state updates) go to listeners.  Neither client decides anything: the session layer
(:mod:`gpushare_ext.runtime.session`) does.

Before a client says anything it makes sure the peer is a broker it may trust: the
socket's directory and the socket must belong to root or to this user (or to
``GPUSHARE_BROKER_USER``) and nobody else may write there, and the process listening
must run as one of those (``SO_PEERCRED``).  Otherwise it raises
:class:`UntrustedBroker` naming the path and its owner, and sends nothing: no pid, no
notebook name, no cell label reaches another user.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from gpushare_ext.errors import GpushareError
from gpushare_ext.paths import default_socket_path, trusted_broker_uids
from gpushare_ext.protocol import (
    PROTOCOL_VERSION,
    Admin,
    AdminAction,
    AttachRanks,
    BrokerMessage,
    Capabilities,
    CellActivity,
    Chaos,
    ClientMessage,
    Error,
    ErrorCode,
    FrameReader,
    GpuHistory,
    Granted,
    Heartbeat,
    Hello,
    HistoryReply,
    HistoryRequest,
    Ok,
    Park,
    PreemptionLevel,
    ProtocolError,
    Queued,
    Refused,
    RegisterYieldFlag,
    Release,
    Released,
    RequestLease,
    Restore,
    SliceWish,
    Snapshot,
    StateUpdate,
    StatusReply,
    StatusRequest,
    Unwatch,
    Watch,
    Welcome,
    decode_broker_message,
    encode_frame,
)
from gpushare_ext.safe_fs import (
    PathMissing,
    UnsafePathError,
    check_socket,
    describe_owner,
    describe_trusted,
)


class BrokerError(GpushareError):
    """The broker refused something, or cannot be reached.  ``code`` is an ErrorCode."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message

    def in_cell(self) -> str:
        return f"gpushare: {self.message}"


class BrokerUnavailable(BrokerError):
    """No broker to talk to now: the socket is missing or refuses, or the connection
    dropped.  ``no_socket``: there was no socket file at all (a broker that restarts
    leaves one, or makes its new one within moments)."""

    def __init__(self, message: str, *, no_socket: bool = False) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)
        self.no_socket = no_socket


class BrokerNoAnswer(BrokerError):
    """A request went out on a live connection and no answer came in time.  Unlike
    :class:`BrokerUnavailable`, the broker may still act on it (and answer later), so
    whoever sent it must not simply send it again."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.UNAVAILABLE, message)


class UntrustedBroker(BrokerError):
    """The socket, its directory or the process behind it belongs to someone we do not trust."""

    def __init__(self, message: str) -> None:
        super().__init__(ErrorCode.PERMISSION, message)


Listener = Callable[[BrokerMessage], None]
_UCRED = struct.Struct("3i")
_TRUST_HINT = (
    "refusing to talk to a broker there (another user may be trying to intercept your "
    "sessions; remove it, or set GPUSHARE_SOCKET)"
)


def trusted_socket_path(path: Path) -> Path:
    """``path`` resolved, once its directory and the socket itself check out as trusted."""
    try:
        return check_socket(path, trusted=trusted_broker_uids(), hint=_TRUST_HINT)
    except (PathMissing, FileNotFoundError):
        raise BrokerUnavailable(
            f"no broker is listening on {path} (no such file)", no_socket=True
        ) from None
    except UnsafePathError as exc:
        raise UntrustedBroker(f"{exc}") from None


def check_peer(sock: socket.socket, path: Path) -> None:
    """Refuse a listener that runs as anyone but root, this user or the broker's account."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _gid = _UCRED.unpack(raw)
    trusted = trusted_broker_uids()
    if uid not in trusted:
        raise UntrustedBroker(
            f"the process listening on {path} (pid {pid}) runs as {describe_owner(uid)}, "
            f"not as {describe_trusted(trusted)}: {_TRUST_HINT}"
        )


def expect(reply: BrokerMessage, kind: object, path: Path) -> None:
    """A reply of another type than the request calls for: not a broker we know."""
    if not isinstance(reply, kind):  # type: ignore[arg-type]
        members = getattr(kind, "__args__", (kind,))
        wanted = " or ".join(getattr(member, "__name__", str(member)) for member in members)
        raise BrokerError(
            ErrorCode.MALFORMED,
            f"the peer on {path} answered {type(reply).__name__} where a gpushare broker "
            f"answers {wanted}",
        )


# ---- the core both faces share: the messages they build and how they read what comes
# back, with no I/O of its own (each face connects, sends and receives in its own way)


def hello(
    client: str,
    *,
    kernel_id: str = "",
    notebook: str = "",
    reclaim: list[str] | None = None,
    visible_devices: list[str] | None = None,
) -> Hello:
    """A connection's first message: who this process is, and the leases it reclaims."""
    return Hello(
        version=PROTOCOL_VERSION,
        pid=os.getpid(),
        client=client,  # type: ignore[arg-type]
        kernel_id=kernel_id,
        notebook=notebook,
        reclaim=list(reclaim or []),
        visible_devices=visible_devices,
    )


def nobody_listening(path: Path, exc: OSError, *, no_socket: bool = False) -> BrokerUnavailable:
    """A connect to ``path`` that found no socket file there, or nobody accepting."""
    return BrokerUnavailable(
        f"no broker is listening on {path} ({exc.strerror})", no_socket=no_socket
    )


def cannot_connect(path: Path, exc: BaseException) -> BrokerUnavailable:
    """A connect to ``path`` that failed in any other way."""
    return BrokerUnavailable(f"cannot connect to {path}: {exc}")


def next_message(frames: FrameReader) -> BrokerMessage | None:
    """The next whole message among the bytes fed to ``frames``; None until one is in."""
    body = frames.next_body()
    return None if body is None else decode_broker_message(body)


def answer(reply: BrokerMessage) -> BrokerMessage:
    """``reply``, unless the broker answered with an error: then that error, raised."""
    if isinstance(reply, Error):
        raise BrokerError(reply.code, reply.message)
    return reply


def admin_request(
    action: AdminAction | str,
    *,
    device: int | None = None,
    lease_id: str | None = None,
    policy_toml: str | None = None,
) -> Admin:
    return Admin(
        action=AdminAction(action), device=device, lease_id=lease_id, policy_toml=policy_toml
    )


def snapshot_in(reply: BrokerMessage, path: Path) -> Snapshot:
    """The snapshot a status request's answer carries."""
    expect(reply, StatusReply, path)
    return reply.snapshot  # type: ignore[attr-defined]


def history_in(reply: BrokerMessage, path: Path) -> GpuHistory:
    """The history a history request's answer carries."""
    expect(reply, HistoryReply, path)
    return reply.history  # type: ignore[attr-defined]


def detail_in(reply: BrokerMessage) -> str:
    """The one-line answer to an admin request ("" where it has none)."""
    return getattr(reply, "detail", "")


def doubling_pauses(first: float, most: float) -> Iterator[float]:
    """The pauses of a retry with backoff: ``first``, then twice the last, up to ``most``
    (a caller whose many peers retry at once adds jitter to each)."""
    pause = first
    while True:
        yield pause
        pause = min(pause * 2, most)


class BrokerClient:
    """A blocking client with a reader thread; safe to call from any thread."""

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        client: str = "kernel",
        kernel_id: str = "",
        notebook: str = "",
        reclaim: list[str] | None = None,
        connect_timeout: float = 5.0,
        listener: Listener | None = None,
        visible_devices: list[str] | None = None,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        resolved = trusted_socket_path(self.socket_path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(connect_timeout)
        try:
            self._sock.connect(str(resolved))
            check_peer(self._sock, self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self._sock.close()
            raise nobody_listening(
                self.socket_path, exc, no_socket=isinstance(exc, FileNotFoundError)
            ) from None
        except UntrustedBroker:
            self._sock.close()
            raise
        except OSError as exc:
            self._sock.close()
            raise cannot_connect(self.socket_path, exc) from None
        self._sock.settimeout(None)
        self._seq = itertools.count(1)
        self._pending: dict[int, Future] = {}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.closed = threading.Event()
        self.close_reason = ""
        if listener is not None:
            # Registered before the first byte is read: notices the broker sends right
            # after its welcome (a reclaimed request granted at once) must not be lost.
            self._listeners.append(listener)
        self._reader = threading.Thread(
            target=self._read_loop, name="gpushare-broker-reader", daemon=True
        )
        self._reader.start()
        try:
            welcome = self._call(
                hello(
                    client,
                    kernel_id=kernel_id,
                    notebook=notebook,
                    reclaim=reclaim,
                    visible_devices=visible_devices,
                ),
                timeout=connect_timeout,
            )
            expect(welcome, Welcome, self.socket_path)
        except BaseException:
            self.close()
            raise
        self.welcome: Welcome = welcome  # type: ignore[assignment]

    # ---- plumbing

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _read_loop(self) -> None:
        frames = FrameReader()
        try:
            while True:
                data = self._sock.recv(65536)
                if not data:
                    self.close_reason = "the broker closed the connection"
                    break
                frames.feed(data)
                while (message := next_message(frames)) is not None:
                    self._deliver(message)
        except (OSError, ProtocolError) as exc:
            self.close_reason = f"connection to the broker lost: {exc}"
        finally:
            self.closed.set()
            with self._lock:
                pending = list(self._pending.values())
                self._pending.clear()
                listeners = list(self._listeners)
            for future in pending:
                if not future.done():
                    future.set_exception(
                        BrokerUnavailable(self.close_reason or "connection closed")
                    )
            for listener in listeners:
                with contextlib.suppress(Exception):
                    listener(
                        Error(
                            code=ErrorCode.UNAVAILABLE,
                            message=self.close_reason or "connection closed",
                        )
                    )

    def _deliver(self, message: BrokerMessage) -> None:
        future = None
        if message.reply_to:
            with self._lock:
                future = self._pending.pop(message.reply_to, None)
        if future is not None and not future.done():
            future.set_result(message)
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            with contextlib.suppress(Exception):
                listener(message)

    def _send(self, message: ClientMessage) -> None:
        data = encode_frame(message)
        with self._send_lock:
            try:
                self._sock.sendall(data)
            except OSError as exc:
                raise BrokerUnavailable(f"cannot send to the broker: {exc}") from None

    def _call(self, message: ClientMessage, timeout: float | None = 10.0) -> BrokerMessage:
        if self.closed.is_set():
            raise BrokerUnavailable(self.close_reason or "not connected to the broker")
        message.seq = next(self._seq)
        future: Future = Future()
        with self._lock:
            self._pending[message.seq] = future
        self._send(message)
        try:
            reply = future.result(timeout=timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(message.seq, None)
            raise BrokerNoAnswer(f"the broker did not answer within {timeout:g} s") from None
        return answer(reply)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self.closed.wait(timeout=2)

    def __enter__(self) -> BrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- requests

    def request_lease(
        self,
        *,
        priority: int,
        memory_bytes: int | None = None,
        slice: SliceWish = SliceWish.AUTO,
        device: str = "auto",
        sm_share: float = 1.0,
        capabilities: Capabilities | None = None,
        label: str = "",
        ranks: int = 1,
    ) -> Granted | Queued | Refused:
        """Ask for a lease (``ranks`` > 1: a gang, one slice per rank); the first answer
        is a grant, a queue notice or a refusal."""
        return self.ask_for_lease(
            RequestLease(
                priority=priority,
                memory_bytes=memory_bytes,
                slice=slice,
                device=device,
                sm_share=sm_share,
                capabilities=capabilities or Capabilities(),
                label=label[:256],
                ranks=ranks,
            )
        )

    def ask_for_lease(self, request: RequestLease) -> Granted | Queued | Refused:
        """Send ``request`` as it is (the struct the broker's core will see)."""
        reply = self._call(request)
        expect(reply, Granted | Queued | Refused, self.socket_path)
        return reply  # type: ignore[return-value]

    def attach_ranks(self, lease_id: str, pids: list[int]) -> Ok:
        """Name the worker processes that run gang ``lease_id``'s ranks, in rank order."""
        reply = self._call(AttachRanks(lease_id=lease_id, pids=pids))
        expect(reply, Ok, self.socket_path)
        return reply  # type: ignore[return-value]

    def release(self, lease_id: str) -> Released:
        reply = self._call(Release(lease_id=lease_id))
        expect(reply, Released, self.socket_path)
        return reply  # type: ignore[return-value]

    def heartbeat(self) -> None:
        self._call(Heartbeat())

    def cell_activity(self, running: bool, unparkable: str = "", parkable_bytes: int = 0) -> None:
        """Tell the broker a cell started or ended, why this process must not be parked
        ("" if it may be) and how much memory its shim can park itself; it does not
        answer (a cell must not wait for it)."""
        message = CellActivity(
            running=running, unparkable=unparkable[:256], parkable_bytes=max(0, parkable_bytes)
        )
        message.seq = next(self._seq)
        self._send(message)

    def park(self, pid: int) -> str:
        """Park the idle notebook of ``pid`` now; the broker's one-line answer."""
        reply = self._call(Park(pid=pid))
        expect(reply, Ok, self.socket_path)
        return reply.detail  # type: ignore[attr-defined]

    def chaos(
        self,
        pid: int,
        *,
        every_ms: tuple[float, float] = (5.0, 50.0),
        pause_ms: tuple[float, float] = (1.0, 20.0),
        levels: tuple[int, ...] = (0, 1, 3),
        duration_s: float | None = None,
        seed: int = 0,
        stop: bool = False,
    ) -> str:
        """Admins: pause the session of ``pid`` at random moments (or ``stop``); the
        broker's one-line answer."""
        reply = self._call(
            Chaos(
                pid=pid, every_ms=tuple(every_ms), pause_ms=tuple(pause_ms),
                levels=tuple(PreemptionLevel(level) for level in levels), duration_s=duration_s,
                seed=seed, stop=stop,
            )
        )  # fmt: skip
        expect(reply, Ok, self.socket_path)
        return reply.detail  # type: ignore[attr-defined]

    def restore(self, lease_id: str, *, cancel: bool = False) -> None:
        """Ask for this session's parked memory back (``cancel``: stop waiting for it)."""
        reply = self._call(Restore(lease_id=lease_id, cancel=cancel))
        expect(reply, Ok, self.socket_path)

    def status(self) -> Snapshot:
        return snapshot_in(self._call(StatusRequest()), self.socket_path)

    def history(self, device: int | None = None) -> GpuHistory:
        """The last hour of every GPU (or of ``device``), as the dashboard draws it."""
        return history_in(self._call(HistoryRequest(device=device)), self.socket_path)

    def watch(self, interval_s: float = 1.0) -> None:
        """Start the stream of StateUpdate notices (delivered to listeners)."""
        self._call(Watch(interval_s=interval_s))

    def unwatch(self) -> None:
        self._call(Unwatch())

    def register_yield_flag(
        self, lease_id: str, device_index: int, handle_hex: str, offset: int = 0
    ) -> None:
        self._call(
            RegisterYieldFlag(
                lease_id=lease_id,
                device_index=device_index,
                ipc_handle_hex=handle_hex,
                offset=offset,
            )
        )

    def admin(
        self,
        action: AdminAction | str,
        *,
        device: int | None = None,
        lease_id: str | None = None,
        policy_toml: str | None = None,
    ) -> str:
        request = admin_request(action, device=device, lease_id=lease_id, policy_toml=policy_toml)
        return detail_in(self._call(request))


#: How long a connect that nobody answers (a socket there, no broker behind it yet) is
#: tried again: a broker restarting listens again within this; a gone one is said soon.
_REFUSED_RETRY_S = 1.0
#: The pauses between connects while the broker's queue of connections is full.
_BACKLOG_PAUSE_FIRST_S = 0.01
_BACKLOG_PAUSE_MOST_S = 0.25


def _connected(writer: asyncio.StreamWriter) -> bool:
    sock = writer.get_extra_info("socket")
    try:
        sock.getpeername()
    except OSError:
        return False
    return True


class AsyncBrokerClient:
    """The asyncio twin, for the Jupyter server extension (one connection per use)."""

    def __init__(self, socket_path: str | Path | None = None, *, client: str = "server") -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        self.client = client
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._frames = FrameReader()
        self._seq = itertools.count(1)
        self.welcome: Welcome | None = None

    async def connect(self, timeout: float = 5.0) -> Welcome:
        resolved = trusted_socket_path(self.socket_path)
        await self._open(resolved, timeout)
        try:
            check_peer(self._writer.get_extra_info("socket"), self.socket_path)
            reply = await asyncio.wait_for(
                self._call(hello(self.client)),
                timeout,
            )
        except asyncio.TimeoutError:
            await self.close()
            raise BrokerUnavailable(
                f"the peer on {self.socket_path} did not answer within {timeout:g} s"
            ) from None
        except BaseException:
            await self.close()
            raise
        expect(reply, Welcome, self.socket_path)
        self.welcome = reply  # type: ignore[assignment]
        return reply  # type: ignore[return-value]

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
            self._writer = None

    async def _open(self, resolved: Path, timeout: float) -> None:
        """Connect, retrying with backoff while the broker's queue of connections is full
        (a hub's panels all reconnect after a restart) or, briefly, while nobody listens
        on a socket that is there (the broker restarting); BrokerUnavailable otherwise.

        A full queue does not fail the way it should: a Unix socket's connect answers
        EAGAIN, which asyncio takes for "in progress" and then reports as connected. So
        the peer is asked for: a socket that has none was never connected."""
        deadline = time.monotonic() + timeout
        refused_until = time.monotonic() + min(timeout, _REFUSED_RETRY_S)
        pauses = doubling_pauses(_BACKLOG_PAUSE_FIRST_S, _BACKLOG_PAUSE_MOST_S)
        while True:
            backoff = next(pauses)
            remaining = deadline - time.monotonic()
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(str(resolved)), max(remaining, 0.001)
                )
            except FileNotFoundError as exc:
                raise nobody_listening(self.socket_path, exc) from None
            except ConnectionRefusedError as exc:
                if time.monotonic() + backoff >= refused_until:
                    raise nobody_listening(self.socket_path, exc) from None
            except BlockingIOError:
                pass  # the queue is full: try again
            except (OSError, asyncio.TimeoutError) as exc:
                raise cannot_connect(self.socket_path, exc) from None
            else:
                if _connected(writer):
                    self._reader, self._writer = reader, writer
                    return
                writer.close()
            if time.monotonic() + backoff >= deadline:
                raise BrokerUnavailable(
                    f"cannot connect to {self.socket_path}: the broker accepted no "
                    f"connection within {timeout:g} s (too many at once)"
                )
            await asyncio.sleep(backoff)

    async def __aenter__(self) -> AsyncBrokerClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _next_message(self) -> BrokerMessage:
        assert self._reader is not None
        while True:
            message = next_message(self._frames)
            if message is not None:
                return message
            data = await self._reader.read(65536)
            if not data:
                raise BrokerUnavailable("the broker closed the connection")
            self._frames.feed(data)

    async def _call(self, message: ClientMessage) -> BrokerMessage:
        if self._writer is None:
            raise BrokerUnavailable("not connected")
        message.seq = next(self._seq)
        self._writer.write(encode_frame(message))
        await self._writer.drain()
        while True:
            reply = await self._next_message()
            if reply.reply_to == message.seq:
                return answer(reply)

    async def status(self) -> Snapshot:
        return snapshot_in(await self._call(StatusRequest()), self.socket_path)

    async def history(self, device: int | None = None) -> GpuHistory:
        return history_in(await self._call(HistoryRequest(device=device)), self.socket_path)

    async def watch(self, interval_s: float = 1.0) -> AsyncIterator[Snapshot]:
        await self._call(Watch(interval_s=interval_s))
        while True:
            message = await self._next_message()
            if isinstance(message, StateUpdate):
                yield message.snapshot

    async def admin(
        self,
        action: AdminAction | str,
        *,
        device: int | None = None,
        lease_id: str | None = None,
        policy_toml: str | None = None,
    ) -> str:
        request = admin_request(action, device=device, lease_id=lease_id, policy_toml=policy_toml)
        return detail_in(await self._call(request))
