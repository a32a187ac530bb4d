"""From client messages to scheduler events: one method per message type.

Each method checks what only the server can know (the peer's identity and rights, the
session's state on this connection), turns the message into a core event and posts it
on the :class:`~gpushare_ext.broker.edges.context.BrokerContext`'s event queue, which the
server feeds to the core; answers go out through the context's outbox, and journal
rows through its recorder.  A message that cannot be accepted raises
:class:`~gpushare_ext.protocol.ProtocolError` or the core's ``SchedulerError``, which the
connection loop answers with a typed error, and nothing changes.

Admins (root, or the policy's admin users and groups) may drain, cancel anyone's lease
and change the policy.  A new policy applies at once to everything that can change
while the broker runs; the reply names the ``[broker]`` settings that need a restart.

It must not touch sockets or actuators itself, nor the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import replace
from typing import Any

from gpushare_ext.broker.edges.chaos_mode import start_chaos
from gpushare_ext.broker.edges.context import BrokerContext, Reply
from gpushare_ext.broker.edges.history_view import history_for
from gpushare_ext.broker.edges.metrics import read_token_file
from gpushare_ext.broker.edges.recovery import placeholder_session
from gpushare_ext.broker.edges.views import OTHER_PROCESSES, display_user, snapshot
from gpushare_ext.broker.hands.chaos import ChaosError, ChaosSpec
from gpushare_ext.broker.hands.inventory import InventoryError, managed_devices
from gpushare_ext.broker.hands.peers import (
    Connection,
    claimed_pid_matches,
    descendant_named,
    descends_from,
    process_start_ticks,
)
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.settings import schema
from gpushare_ext.broker.settings.config import (
    BrokerConfig,
    load_config,
    parse_config,
    restart_needed,
)
from gpushare_ext.broker.settings.policy import PolicyError
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import (
    PROTOCOL_VERSION,
    Admin,
    AdminAction,
    AttachRanks,
    CellActivity,
    Chaos,
    ClientMessageUnion,
    ErrorCode,
    Heartbeat,
    Hello,
    HistoryReply,
    HistoryRequest,
    Ok,
    Park,
    ProtocolError,
    RegisterYieldFlag,
    Release,
    RequestLease,
    Restore,
    StateUpdate,
    StatusReply,
    StatusRequest,
    Unwatch,
    Watch,
    Welcome,
)


class Requests:
    """Handles every client message of one broker."""

    def __init__(self, ctx: BrokerContext) -> None:
        self.ctx = ctx
        self._session_counter = 0
        self._handlers: dict[type, Any] = {
            Hello: self.hello,
            RequestLease: self.request_lease,
            Release: self.release,
            Heartbeat: self.heartbeat,
            StatusRequest: self.status,
            Watch: self.watch,
            HistoryRequest: self.history,
            Unwatch: self.unwatch,
            RegisterYieldFlag: self.register_yield_flag,
            Admin: self.admin,
            CellActivity: self.cell_activity,
            Restore: self.restore,
            Park: self.park,
            AttachRanks: self.attach_ranks,
            Chaos: self.chaos,
        }

    def handle(self, conn: Connection, message: ClientMessageUnion) -> None:
        if conn.hello is None and not isinstance(message, Hello):
            raise ProtocolError(
                ErrorCode.OUT_OF_ORDER, "say hello first: the first message must be 'hello'"
            )
        self._handlers[type(message)](conn, message)

    # ---- the session

    def hello(self, conn: Connection, hello: Hello) -> None:
        ctx = self.ctx
        if conn.hello is not None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "hello was already said on this connection")
        if hello.version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION,
                f"protocol version {hello.version} is not supported; this broker speaks "
                f"version {PROTOCOL_VERSION} (upgrade gpushare-ext on one side)",
            )
        if not claimed_pid_matches(conn.pid, hello.pid):
            raise ProtocolError(
                ErrorCode.PERMISSION,
                f"hello names pid {hello.pid}, but the connecting process is pid {conn.pid}; "
                "identity comes from the socket, not from the message",
            )
        self._session_counter += 1
        session_id = f"S{self._session_counter}-{secrets.token_hex(3)}"
        block_path = ctx.sessions_dir / f"{session_id}.cb"
        try:
            block = ControlBlock.create(block_path, owner_uid=conn.uid, owner_gid=conn.gid)
        except OSError as exc:
            raise ProtocolError(
                ErrorCode.INTERNAL, f"cannot create the session's control block: {exc.strerror}"
            ) from None
        block.publish(gate_closed=False, state=None)
        conn.hello = hello
        conn.session_id = session_id
        conn.control_block = block
        ctx.connections[session_id] = conn
        ctx.events.post(
            core.SessionOpened(
                now=time.time(),
                session_id=session_id,
                identity=core.Identity(
                    uid=conn.uid,
                    gid=conn.gid,
                    pid=conn.pid,
                    user=conn.user,
                    groups=conn.groups,
                    start_ticks=conn.start_ticks,
                ),
                notebook=hello.notebook,
                reachable=tuple(hello.visible_devices)
                if hello.visible_devices is not None
                else None,
            )
        )
        # The welcome goes first: what reclaiming sets off (a resume, a pause again, a
        # grant) are notices about leases the session must know it holds.
        reclaimed = ctx.scheduler.reclaimable(session_id, list(hello.reclaim))
        ranks = self._reclaimable_ranks(conn, [g for g in hello.reclaim if g not in reclaimed])
        reclaimed += list(ranks)
        ctx.outbox.put(
            conn,
            Welcome(
                reply_to=hello.seq,
                version=PROTOCOL_VERSION,
                broker_pid=ctx.pid,
                mode=ctx.paths.mode,  # type: ignore[arg-type]
                session_id=session_id,
                uid=conn.uid,
                user=conn.user,
                is_admin=conn.is_admin,
                inventory=ctx.inventory.kind,
                inventory_description=ctx.inventory.description,
                control_block=str(block_path),
                reclaimed=reclaimed,
            ),
        )
        for lease_id in reclaimed:
            for member in ranks.get(lease_id, [lease_id]):
                ctx.events.post(
                    core.LeaseReclaimed(
                        now=time.time(), session_id=session_id, lease_id=member,
                        keep_process=lease_id in ranks,
                    )
                )  # fmt: skip
            ctx.record.note("reclaimed", lease_id, {"pid": conn.pid})
        if hello.client == "kernel":
            # A notebook that is back and does not name a lease of its process has let it
            # go (its cell ended while the broker was away): it must not hold others off
            # until the grace period ends.
            placeholder = placeholder_session(conn.pid)
            record = ctx.scheduler.sessions.get(placeholder)
            if record is not None and record.detached and record.identity.uid == conn.uid:
                ctx.events.post(
                    core.SessionClosed(
                        now=time.time(),
                        session_id=placeholder,
                        reason="its notebook reconnected without it",
                    )
                )

    def _reclaimable_ranks(self, conn: Connection, gangs: list[str]) -> dict[str, list[str]]:
        """Per gang named in a hello, its ranks' lease ids, when every rank waits to be
        reclaimed and runs in a process the connecting one started (of its user)."""
        found: dict[str, list[str]] = {}
        for gang in dict.fromkeys(gangs):
            ranks = self.ctx.scheduler.detached_ranks(gang)
            if ranks and all(
                rank.identity.pid == conn.pid
                or descends_from(rank.identity.pid, conn.pid, conn.uid)
                for rank in ranks
            ):
                found[gang] = [rank.lease_id for rank in ranks]
        return found

    def request_lease(self, conn: Connection, request: RequestLease) -> None:
        ctx = self.ctx
        if ctx.should_exit:
            raise ProtocolError(ErrorCode.UNAVAILABLE, "the broker is shutting down")
        lease_id = ctx.record.new_lease_id()
        ctx.events.post(
            core.LeaseRequested(
                now=time.time(),
                session_id=conn.session_id,  # type: ignore[arg-type]
                lease_id=lease_id,
                request=request,
            ),
            Reply(to=request.seq, lease_id=lease_id),
        )

    def release(self, conn: Connection, release: Release) -> None:
        lease = self.ctx.scheduler.lease_of(release.lease_id)
        if lease is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"there is no active lease {release.lease_id}"
            )
        # Another notebook of the same user may release it; other users may not.
        if lease.identity.uid != conn.uid and not conn.is_admin:
            raise ProtocolError(
                ErrorCode.PERMISSION, f"lease {release.lease_id} belongs to another user"
            )
        self.ctx.events.post(
            core.LeaseReleased(
                now=time.time(),
                session_id=lease.session_id,
                lease_id=release.lease_id,
                by_admin=lease.identity.uid != conn.uid,
            ),
            Reply(to=release.seq, conn=conn),
        )

    def attach_ranks(self, conn: Connection, message: AttachRanks) -> None:
        """A gang's worker processes started; the core moves its ranks onto them."""
        if conn.session_id is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "only a notebook session has gangs")
        pids = []
        for claimed in message.pids:
            pid = descendant_named(claimed, conn.pid, conn.uid)
            if pid is None:
                raise ProtocolError(
                    ErrorCode.PERMISSION,
                    f"process {claimed} is not one of yours started by this notebook",
                )
            pids.append(pid)
        ctx = self.ctx
        ctx.events.post(
            core.RanksAttached(
                now=time.time(),
                session_id=conn.session_id,
                gang=message.lease_id,
                pids=tuple((pid, process_start_ticks(pid)) for pid in pids),
            )
        )
        for member in ctx.scheduler.members(message.lease_id):
            ctx.record.lease(member)
        ctx.outbox.put(conn, Ok(reply_to=message.seq, detail=f"{len(message.pids)} ranks attached"))

    def cell_activity(self, conn: Connection, message: CellActivity) -> None:
        if conn.session_id is None:
            raise ProtocolError(ErrorCode.OUT_OF_ORDER, "only a notebook session has cells")
        self.ctx.events.post(
            core.SessionActivity(
                now=time.time(),
                session_id=conn.session_id,
                running=message.running,
                unparkable=message.unparkable,
                parkable_bytes=message.parkable_bytes,
            )
        )

    def restore(self, conn: Connection, message: Restore) -> None:
        # The core checks that the park is this session's (another's is "unknown").
        # Its answers (queued notices, the resume) are notices, not the reply: ok is.
        self.ctx.events.post(
            core.RestoreAsked(
                now=time.time(),
                session_id=conn.session_id or "",
                lease_id=message.lease_id,
                cancel=message.cancel,
            )
        )
        self.ctx.outbox.put(
            conn,
            Ok(reply_to=message.seq, detail="withdrawn" if message.cancel else "restore asked"),
        )

    def park(self, conn: Connection, message: Park) -> None:
        ctx = self.ctx
        record = ctx.scheduler.session_of_pid(message.pid)
        if record is not None and record.identity.uid != conn.uid and not conn.is_admin:
            raise ProtocolError(
                ErrorCode.PERMISSION,
                f"pid {message.pid} is another user's notebook; only an admin may park it",
            )
        owner = ctx.connections.get(ctx.scheduler.session_id_of_pid(message.pid) or "")
        block = owner.control_block if owner is not None else None
        if block is not None and block.ipc_imports:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"the notebook of pid {message.pid} cannot be parked: it opened another "
                "process's GPU memory (CUDA IPC), which a checkpoint cannot restore",
            )
        # The core parks it or says why not; the ok, naming what goes to the host, comes
        # with the park itself (effects), as the answers to a request for a lease do.
        ctx.events.post(
            core.ParkAsked(now=time.time(), pid=message.pid, by=conn.user),
            Reply(to=message.seq, conn=conn, park=True),
        )

    def chaos(self, conn: Connection, message: Chaos) -> None:
        """Admins: pause one process at random moments (``gpushare chaos``), or stop that."""
        ctx = self.ctx
        if not conn.is_admin:
            raise ProtocolError(
                ErrorCode.PERMISSION, f"only admins may start chaos mode; {conn.user} is not one"
            )
        running = ctx.chaos.pop(message.pid, None)
        if running is not None:
            running.stop()
        if message.stop:
            detail = running.describe() if running is not None else "no chaos for that pid"
            ctx.outbox.put(conn, Ok(reply_to=message.seq, detail=detail))
            return
        spec = ChaosSpec(
            pid=message.pid,
            every_ms=(message.every_ms[0], message.every_ms[1]),
            pause_ms=(message.pause_ms[0], message.pause_ms[1]),
            levels=tuple(sorted(set(message.levels))),
            duration_s=message.duration_s,
            seed=message.seed,
        )
        try:
            spec.check()
        except ChaosError as exc:
            raise ProtocolError(ErrorCode.INVALID, str(exc)) from None
        if ctx.scheduler.session_of_pid(message.pid) is None:
            # A session, not a lease yet: chaos waits for the process's next lease.
            raise ProtocolError(
                ErrorCode.INVALID, f"pid {message.pid} has no session with this broker"
            )
        runner = start_chaos(ctx, spec)
        ctx.record.note("chaos", None, {"by": conn.user, "spec": spec.describe()})
        ctx.outbox.put(conn, Ok(reply_to=message.seq, detail=runner.describe()))

    def heartbeat(self, conn: Connection, message: Heartbeat) -> None:
        self.ctx.outbox.put(conn, Ok(reply_to=message.seq))

    def status(self, conn: Connection, message: StatusRequest) -> None:
        self.ctx.outbox.put(
            conn, StatusReply(reply_to=message.seq, snapshot=snapshot(self.ctx, conn))
        )

    def history(self, conn: Connection, message: HistoryRequest) -> None:
        """The dashboard's last hour, anonymised as the snapshot is."""

        def seen_as(identity: core.Identity | None) -> str:
            return OTHER_PROCESSES if identity is None else display_user(ctx, identity, conn)

        ctx = self.ctx
        found = history_for(ctx, conn, message.device, seen_as)
        ctx.outbox.put(conn, HistoryReply(reply_to=message.seq, history=found))

    def watch(self, conn: Connection, message: Watch) -> None:
        if conn.watch_task is not None:
            conn.watch_task.cancel()
        conn.watch_task = asyncio.get_running_loop().create_task(
            self._watch(conn, message.interval_s)
        )
        self.ctx.outbox.put(conn, Ok(reply_to=message.seq, detail="watching"))

    def unwatch(self, conn: Connection, message: Unwatch) -> None:
        if conn.watch_task is not None:
            conn.watch_task.cancel()
            conn.watch_task = None
        self.ctx.outbox.put(conn, Ok(reply_to=message.seq))

    async def _watch(self, conn: Connection, interval: float) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while not conn.closed:
                self.ctx.outbox.put(conn, StateUpdate(snapshot=snapshot(self.ctx, conn)))
                with contextlib.suppress(ConnectionError):
                    await conn.writer.drain()
                await asyncio.sleep(interval)

    def register_yield_flag(self, conn: Connection, message: RegisterYieldFlag) -> None:
        ctx = self.ctx
        lease = ctx.scheduler.lease_of(message.lease_id)
        if lease is None or lease.session_id != conn.session_id:
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"lease {message.lease_id} is not yours or not active"
            )
        if ctx.inventory.kind != "nvml":
            raise ProtocolError(
                ErrorCode.NOT_SUPPORTED, "yield flags need a real GPU; this broker simulates one"
            )
        flag = (message.ipc_handle_hex, message.offset)
        ctx.yield_flags[message.lease_id] = flag
        if lease.slot in ctx.scheduler.slots:
            # Opened now, off the loop: a pause then only writes it.
            device_index = ctx.scheduler.slots[lease.slot].device_index
            ctx.tasks.spawn(ctx.ladder.open_yield_flag(device_index, flag))
        ctx.outbox.put(conn, Ok(reply_to=message.seq, detail="yield flag registered"))

    # ---- administration

    def admin(self, conn: Connection, message: Admin) -> None:
        if not conn.is_admin:
            raise ProtocolError(
                ErrorCode.PERMISSION,
                f"only admins may {message.action.value}; {conn.user} is not one",
            )
        if message.action in (AdminAction.DRAIN, AdminAction.UNDRAIN):
            detail = self._drain(conn, message)
        elif message.action == AdminAction.CANCEL:
            detail = self._cancel(message)
        elif message.action == AdminAction.SET_POLICY:
            if not message.policy_toml:
                raise ProtocolError(ErrorCode.INVALID, "set_policy needs policy_toml")
            detail = self._new_config(conn, self._parse(message.policy_toml, "the new policy"))
        else:
            detail = self._new_config(conn, self._reload())
        self.ctx.outbox.put(conn, Ok(reply_to=message.seq, detail=detail))

    def _drain(self, conn: Connection, message: Admin) -> str:
        if message.device is None:
            raise ProtocolError(ErrorCode.INVALID, "drain and undrain need a device index")
        drained = message.action == AdminAction.DRAIN
        self.ctx.events.post(
            core.DeviceDrained(now=time.time(), device_index=message.device, drained=drained),
            Reply(to=message.seq),
        )
        self.ctx.record.note(
            message.action.value, None, {"device": message.device, "by": conn.user}
        )
        return f"device {message.device} {message.action.value}ed"

    def _cancel(self, message: Admin) -> str:
        if message.lease_id is None:
            raise ProtocolError(ErrorCode.INVALID, "cancel needs a lease id")
        lease = self.ctx.scheduler.lease_of(message.lease_id)
        if lease is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_LEASE, f"there is no active lease {message.lease_id}"
            )
        self.ctx.events.post(
            core.LeaseReleased(
                now=time.time(), session_id=lease.session_id, lease_id=lease.lease_id, by_admin=True
            ),
            Reply(to=message.seq),
        )
        return f"lease {message.lease_id} cancelled"

    @staticmethod
    def _parse(text: str, source: str) -> BrokerConfig:
        try:
            return parse_config(text, source)
        except PolicyError as exc:
            raise ProtocolError(ErrorCode.INVALID, str(exc)) from None

    def _reload(self) -> BrokerConfig:
        path = self.ctx.config_path
        if path is None:
            raise ProtocolError(
                ErrorCode.INVALID,
                "this broker was started without a config file (--config), so there is "
                "nothing to reload; use set-policy FILE",
            )
        try:
            return load_config(path)
        except PolicyError as exc:
            raise ProtocolError(ErrorCode.INVALID, str(exc)) from None

    def _check_startable(self, new: BrokerConfig, later: list[str]) -> None:
        """Refuse a setting that only a restart applies if that restart would fail on it:
        the policy is then not applied at all, and the admin hears why now rather than
        from a broker that no longer starts."""

        def refuse(key: str, why: str) -> None:
            raise ProtocolError(
                ErrorCode.INVALID,
                f"broker.{key} = {getattr(new, key)!r} would stop the broker at its next "
                f"start: {why}; nothing was changed",
            )

        if "devices" in later:
            try:
                managed_devices(self.ctx.inventory.devices(), new.devices)
            except InventoryError as exc:
                refuse("devices", str(exc))
        if "metrics_token_file" in later and new.metrics_token_file:
            try:
                read_token_file(new.metrics_token_file)
            except PolicyError as exc:
                refuse("metrics_token_file", str(exc))

    def _new_config(self, conn: Connection, new: BrokerConfig) -> str:
        """Apply everything a running broker can change; name what needs a restart."""
        ctx = self.ctx
        running = ctx.config
        later = restart_needed(running, new)
        self._check_startable(new, later)
        # Settings only a restart changes keep their running values (some came from the
        # command line, which a new file does not override either).
        applied = replace(new, **{key: getattr(running, key) for key in schema.restart_keys()})
        self._apply(applied)
        ctx.record.note("policy", None, {"by": conn.user, "restart_needed": later})
        if later:
            return "policy updated; restart the broker to apply " + ", ".join(
                f"broker.{key}" for key in later
            )
        return "policy updated"

    def _apply(self, config: BrokerConfig) -> None:
        """A new policy and the ``[broker]`` settings that can change while running."""
        ctx = self.ctx
        ctx.config = config
        ctx.events.post(core.PolicyChanged(now=time.time(), policy=config.policy))
        ctx.ladder.lock_timeout_ms = config.lock_timeout_ms
        rate = config.max_requests_per_second
        for bucket in ctx.buckets.values():
            bucket.rate, bucket.burst = rate, rate * 2
        for conn in ctx.all_connections:
            conn.is_admin = config.policy.is_admin(conn.uid, conn.user, conn.groups)
