"""The lease lifecycle of notebook cells: ask, wait (visibly), bind, run, release.

One :class:`GpuSession` per kernel process.  Through its :class:`BrokerConnection` it
reaches the broker (starting the embedded per-user broker when no broker answers), and
through its :class:`ProcessHolds` it follows the session's control block.  For each
``%%gpu`` cell it:

1. asks for a lease and, while queued, keeps one live line in the cell's output:
   ``queued: position 2, waiting for user-3f2a (priority high) -- 4 s``;
   the wait can be interrupted (the request is withdrawn) and can time out;
2. binds the device (:mod:`binding`), sets the memory quota (:mod:`memory`) and the
   gate (:mod:`gate`), then runs the cell;
3. shows the broker's notices in the output area of the cell they concern, each once
   and on one line (:mod:`notices`; every line is worded in :mod:`cell_lines`);
4. releases the lease when the cell ends, whatever the ending (error, interrupt).

If the broker restarts, the session reconnects and reclaims its leases.  A parked
session's restore (:mod:`parking`) and a gang's workers (:mod:`ranks`) go through it.

It must not word what a cell shows (``cell_lines``), speak the wire itself (the
connection's client does) or import :mod:`parking` (which imports it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from gpushare_ext.client import BrokerClient, BrokerError, BrokerUnavailable
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import STOPPED, LeaseState
from gpushare_ext.protocol import (
    MAX_RANKS,
    BrokerMessage,
    Capabilities,
    ErrorCode,
    Granted,
    Parked,
    Placement,
    Refused,
    priority_value,
    split_member_id,
)
from gpushare_ext.runtime import binding, cell_lines, interpose, memory, parkable
from gpushare_ext.runtime.cell_output import CellOutput
from gpushare_ext.runtime.connection import RECONNECT_DEADLINE_S, BrokerConnection
from gpushare_ext.runtime.gate import DeviceGate
from gpushare_ext.runtime.holds import ProcessHolds
from gpushare_ext.runtime.leases import (
    OPEN_STATES,
    LeaseHandle,
    LeaseOptions,
    LeaseRefused,
    LeaseTimeout,
    RankRequestError,
)
from gpushare_ext.runtime.notices import (
    apply_notice,
    record_grant,
    record_queued,
    revoke,
    say_grant_notice,
    say_receipt,
)
from gpushare_ext.runtime.parked import ParkedMemory, why_not_parkable
from gpushare_ext.runtime.paused import PauseWatch
from gpushare_ext.units import format_size

# How long a Ctrl-C while paused waits for the broker to let the process go (an unlock
# takes milliseconds; a restore of evicted memory about a second per 5 GiB).
LET_GO_WAIT_S = 30.0


class GpuSession:
    """This kernel process's leases, its connection to the broker and its holds."""

    def __init__(self, socket_path: str | Path | None = None, *, notebook: str = "") -> None:
        self.notebook = notebook or os.environ.get("JPY_SESSION_NAME", "")
        self.defaults = LeaseOptions()
        self.leases: dict[str, LeaseHandle] = {}
        self.simulated = False
        self._lock = threading.RLock()
        self.connection = BrokerConnection(self, self._lock, socket_path, notebook=self.notebook)
        self.holds = ProcessHolds()
        self._early: dict[str, list[BrokerMessage]] = {}  # notices that beat their lease handle
        self.parked: ParkedMemory | None = None  # the broker parked this idle session
        # A park a restarted broker restored while no cell ran: the next cell says so.
        self.park_restored_by_restart: ParkedMemory | None = None
        self._pause_watch = PauseWatch(
            lambda: self.control_block, lambda: self.connection.closed, self.let_go_for_interrupt
        )

    # ---- the connection and the holds, as the rest of the package reads them

    @property
    def socket_path(self) -> Path:
        return self.connection.socket_path

    @property
    def client(self) -> BrokerClient | None:
        return self.connection.client

    @property
    def started_embedded(self) -> bool:
        return self.connection.started_embedded

    @property
    def control_block(self) -> ControlBlock | None:
        return self.holds.control_block

    @property
    def device_gate(self) -> DeviceGate | None:
        return self.holds.device_gate

    def connect(self) -> BrokerClient:
        """The live connection, made (and every earlier lease reclaimed) if there is none."""
        return self.connection.connect()

    def protection(self) -> str:
        """How this session is stopped when paused, in a few words (for the pause notice)."""
        return self.holds.protection()

    def close(self) -> None:
        self.connection.closed = True
        for handle in list(self.leases.values()):
            with contextlib.suppress(BrokerError):
                self.release(handle)
        self.holds.let_go()
        self.connection.close()
        self.holds.close()

    # ---- what the connection tells (ConnectionOwner)

    def open_leases(self) -> list[LeaseHandle]:
        return [h for h in self.leases.values() if h.state in OPEN_STATES]

    def connected(self, client: BrokerClient, earlier: list[LeaseHandle]) -> None:
        self.simulated = client.welcome.inventory == "simulated"
        self.holds.follow_block(client.welcome.control_block, self.simulated)
        for handle in earlier:
            self._settle_reclaim(handle, handle.lease_id in client.welcome.reclaimed)
        if self.parked is not None:
            # A broker that starts restores every process its journal held: nothing of
            # this session is parked any more.
            self.parked.done.set()
            self.park_restored_by_restart = self.parked
            self.parked = None

    def _settle_reclaim(self, handle: LeaseHandle, reclaimed: bool) -> None:
        """After a reconnect: a lease the new broker gave back, or one it did not keep."""
        if reclaimed:
            handle.note("reclaimed after a broker restart")
            return
        revoke(handle, cell_lines.not_reclaimed_words(handle.state == LeaseState.QUEUED))

    def on_message(self, message: BrokerMessage) -> None:
        if isinstance(message, Parked):
            self.parked = ParkedMemory.from_notice(message)
            return
        lease_id = getattr(message, "lease_id", None)
        if not lease_id:
            return
        park = self.parked
        if park is not None and lease_id == park.lease_id:
            park.follow(message, forget=lambda: self.forget_park(park))
            return
        with self._lock:
            handle = self.leases.get(lease_id)
            membership = split_member_id(lease_id)
            if handle is None and membership is not None:  # a rank's notice: its gang's
                handle = self.leases.get(membership[0])
            if handle is None:
                if message.reply_to == 0 and len(self._early) < 256:
                    self._early.setdefault(lease_id, []).append(message)
                return
        apply_notice(handle, message, self)

    def broker_lost(self, why: str) -> None:
        """The connection is gone (the broker stopped or crashed): nobody may hold us now.

        The control block of the lost broker is opened here, so neither a stream waiting
        on its gate nor a loop in :meth:`safe_point` stays held by a broker that is no
        more; the next broker decides again once the session is back.
        """
        block = self.control_block
        if block is not None:
            block.release_locally("the broker went away")
        for handle in list(self.leases.values()):
            if handle.state in STOPPED:
                handle.move(LeaseState.RUNNING)
                handle.paused_since = None
                handle.note("the broker went away while paused: running on")
                handle.show("-pause", cell_lines.BROKER_LEFT_WHILE_PAUSED)

    def gave_up(self, waited_s: float, where: Path) -> None:
        """The broker did not come back: requests fail clearly, running cells run on."""
        for handle in list(self.leases.values()):
            if handle.state not in OPEN_STATES:
                continue
            queued = handle.state == LeaseState.QUEUED
            revoke(handle, cell_lines.broker_gone_words(where, waited_s, queued))

    # ---- a parked session

    def forget_park(self, park: ParkedMemory) -> None:
        if self.parked is park:
            self.parked = None

    def cell_activity(self, running: bool) -> None:
        """Tell the broker a cell started or ended (a cell never waits for it), and
        whether this process may be parked."""
        client = self.connection.live_client()
        if client is None:
            return
        with contextlib.suppress(BrokerError, BrokerUnavailable):
            client.cell_activity(
                running, why_not_parkable(self.simulated), parkable.resident_bytes()
            )

    # ---- leases

    def merged(self, **overrides) -> LeaseOptions:
        values = {k: v for k, v in overrides.items() if v is not None}
        return replace(self.defaults, **values)

    def capabilities(self, options: LeaseOptions, *, in_workers: bool = False) -> Capabilities:
        mps = bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) or os.path.exists(
            "/tmp/nvidia-mps/control"
        )
        # A first lease has no flag yet: it is made and registered right after the grant
        # (a preemption that comes before that is escalated to the lock by the broker).
        will_have_flag = options.instrumented_only and not self.simulated
        if options.ranks > 1 or in_workers:
            # The work runs in worker processes (run_gang): the broker locks each one.
            # They follow this session's gate too when they inherit the launch shim,
            # which is what holds them under MPS, where the lock does not work.
            gate = self.control_block is not None and interpose.preloaded_here()
            return Capabilities(gate=gate, lockable=not mps)
        return Capabilities(
            gate=self.control_block is not None,
            yield_flag=self.holds.yield_flag is not None or will_have_flag,
            instrumented_only=options.instrumented_only,
            lockable=not mps,
        )

    def acquire(
        self,
        options: LeaseOptions,
        *,
        output: CellOutput | None = None,
        label: str = "",
        bind: bool = True,
    ) -> LeaseHandle:
        """Ask for a lease and wait for it, showing the queue; raises on refusal/timeout.

        The cell's timeout counts from here: a wait for a restarting broker is part of it.
        """
        started = time.monotonic()
        # Connected first (waiting while the broker restarts), so that the request says
        # what this connection's control block lets the broker do.
        self.connection.reach(output, timeout_s=options.timeout_s, started=started)
        if output is not None:
            for line in self.connection.announcements:
                output.show("gpushare-announce", line)
            self.connection.announcements.clear()
        request = options.request(self.capabilities(options, in_workers=not bind), label)
        handle = self._ask(request, options, output, started)
        asked_at = time.monotonic()
        try:
            self._wait_for_grant(handle)
        except BaseException as exc:
            self._withdraw(handle, exc, waited_s=time.monotonic() - asked_at)
            raise
        if bind:  # worker processes (run_gang) bind themselves, not this kernel
            self._bind(handle)
        return handle

    def _ask(
        self, request: Any, options: LeaseOptions, output: CellOutput | None, started: float
    ) -> LeaseHandle:
        """The handle of the broker's answer, with the notices that came before it."""
        while True:
            reply, generation = self.connection.ask_for_lease(
                request, output, timeout_s=options.timeout_s, started=started
            )
            if isinstance(reply, Refused):
                raise LeaseRefused(cell_lines.refused_words(reply.message))
            handle = LeaseHandle(lease_id=reply.lease_id, options=options, output=output)
            handle.asked_at = started
            if isinstance(reply, Granted):
                record_grant(handle, reply)
            else:
                record_queued(handle, reply)
            with self._lock:
                # A reconnect between the answer and here did not know this lease, so
                # the new broker may have let it go: ask again rather than wait for ever.
                if generation != self.connection.generation:
                    continue
                self.leases[reply.lease_id] = handle
                early = self._early.pop(reply.lease_id, [])
            break
        say_grant_notice(handle, reply)
        for message in early:
            apply_notice(handle, message, self)
        return handle

    def _withdraw(self, handle: LeaseHandle, exc: BaseException, waited_s: float) -> None:
        """No grant came (an interrupt, the timeout, a refusal): the request goes."""
        if handle.placement is None:
            # The live queue line must not stay "queued ... interrupt to withdraw".
            why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "not granted"
            if isinstance(exc, LeaseTimeout):
                why = "timed out"
            handle.show("", cell_lines.withdrawn_line(waited_s, why))
        self.leases.pop(handle.lease_id, None)
        current = self.connection.live_client()  # a reconnect may have moved the request
        if current is not None:
            with contextlib.suppress(BrokerError):
                current.release(handle.lease_id)

    def _wait_for_grant(self, handle: LeaseHandle) -> None:
        started = handle.asked_at  # the timeout counts a wait for the broker's return too
        last_shown = -1.0
        timeout = handle.options.timeout_s
        # Granted is when a placement came, whatever followed it: a grant may be paused
        # again (or the broker go away) before this loop looks.
        while handle.placement is None and handle.state not in (
            LeaseState.REFUSED,
            LeaseState.REVOKED,
        ):
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                position = handle.queued.position if handle.queued else "?"
                raise LeaseTimeout(cell_lines.timed_out_words(timeout, position))
            if handle.output is not None and (
                waited - last_shown >= 1.0 or handle.changed.is_set()
            ):
                handle.show("", self._queue_line(handle, waited))
                last_shown = waited
            handle.changed.clear()
            handle.changed.wait(0.1)  # short waits keep Ctrl-C responsive
        if handle.state == LeaseState.REFUSED:
            raise LeaseRefused(cell_lines.refused_words(handle.refusal))
        if handle.state == LeaseState.REVOKED:
            raise LeaseRefused(cell_lines.request_revoked_words(handle.revoked))
        if handle.queued is not None:
            handle.show("", cell_lines.granted_line(time.monotonic() - started))

    def _queue_line(self, handle: LeaseHandle, waited_s: float) -> str:
        if self.connection.reconnecting:
            return cell_lines.queue_line_reconnecting(waited_s)
        estimate = cell_lines.estimate_text(
            handle.queued,
            since_notice_s=time.monotonic() - handle.queued_at,
            waited_s=waited_s,
            timeout_s=handle.options.timeout_s,
        )
        return cell_lines.queue_line(handle.queued, waited_s, estimate)

    def _bind(self, handle: LeaseHandle) -> None:
        placement = handle.placement
        assert placement is not None
        try:
            applied = binding.bind(placement, simulated=self.simulated)
        except binding.BindingError:
            self.release(handle)
            raise
        handle.note(applied.how)
        if not self.simulated:
            self.holds.hold_on_device(
                handle, applied.ordinal, self.client, self.let_go_for_interrupt
            )
        memory.apply_quota(placement.memory_bytes)
        handle.bound = True  # a pause that came meanwhile stands: the state is the broker's

    # ---- Ctrl-C while paused

    def watch_interrupts_while_paused(self) -> None:
        """From the first pause on, a thread watches for Ctrl-C while the broker holds
        this session paused (see :meth:`let_go_for_interrupt`)."""
        self._pause_watch.start()

    def let_go_for_interrupt(self, wait_s: float = LET_GO_WAIT_S) -> bool:
        """Ctrl-C while the broker holds this session paused: the interrupted cell is
        ending, so its leases end now.  The broker then unlocks the process (or restores
        it) and opens the gate, so whatever the cell was blocked in returns and the
        KeyboardInterrupt reaches the user.  Waits up to ``wait_s`` for that; True if the
        session runs again."""
        block = self.control_block
        if block is None or not block.paused:
            return True
        with self._lock:
            handles = [h for h in self.leases.values() if h.state in OPEN_STATES]
        for handle in handles:
            handle.note("Ctrl-C while paused: the lease was given up")
            handle.show("-pause", cell_lines.INTERRUPTED_WHILE_PAUSED)
            with contextlib.suppress(BrokerError, BrokerUnavailable, OSError):
                self.release(handle)
        return block.wait_running(timeout=wait_s)

    def release(self, handle: LeaseHandle) -> None:
        self.leases.pop(handle.lease_id, None)
        if not self.leases:
            memory.apply_quota(None)
        try:
            client = self.connection.live_client()
            if client is not None:
                client.release(handle.lease_id)
        except BrokerError as exc:
            if exc.code != ErrorCode.UNKNOWN_LEASE:
                raise
        finally:
            if not self.leases:
                # Outside a lease nobody can pause this session: a short queue would only
                # slow its unmarked cells down.  After the broker heard of the release:
                # a Ctrl-C while locked lets go from here, and the lock ends only then.
                interpose.bound(False)

    def release_all(self) -> list[str]:
        released = []
        for handle in list(self.leases.values()):
            self.release(handle)
            released.append(handle.lease_id)
        return released

    @contextlib.contextmanager
    def lease(
        self, *, output: CellOutput | None = None, label: str = "", **overrides
    ) -> Iterator[LeaseHandle]:
        """``with session.lease(priority="high", memory_bytes=...) as handle:`` -- a scoped lease."""
        if "priority" in overrides and overrides["priority"] is not None:
            overrides["priority"] = priority_value(overrides["priority"])
        handle = self.acquire(self.merged(**overrides), output=output, label=label)
        try:
            self.safe_point()
            if self.device_gate is not None:
                with self.device_gate.stream:
                    yield handle
                    self.device_gate.stream.synchronize()
            else:
                yield handle
        finally:
            self.release(handle)
            say_receipt(handle)

    # ---- a gang

    def run_gang(
        self,
        target: Any,
        *args: Any,
        ranks: int,
        output: CellOutput | None = None,
        label: str = "",
        port: int | None = None,
        backend: str | None = None,
        lease_options: dict | None = None,
        **kwargs: Any,
    ) -> list:
        """Run ``target`` (a function, or a cell's source) in ``ranks`` worker processes,
        each bound to its own slice of one gang lease, with ``torch.distributed`` set up
        between them; return each rank's result.  Waits (visibly) for the whole gang,
        and releases it when the ranks end, whatever the ending."""
        from gpushare_ext.runtime.ranks import build_payload, run_ranks

        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
            raise RankRequestError(
                f"gpushare: ranks must be a whole number from 1 to {MAX_RANKS}, not {ranks!r}"
            )
        payload = build_payload(target, args, kwargs, ranks)  # bad input: before any request
        overrides = dict(lease_options or {})
        if overrides.get("priority") is not None:
            overrides["priority"] = priority_value(overrides["priority"])
        options = self.merged(**overrides, ranks=ranks)
        handle = self.acquire(options, output=output, label=label, bind=False)
        try:
            placements: list[Placement | None] = [r.placement for r in handle.ranks] or [
                handle.placement
            ]
            if self.simulated:
                # No GPU here: the inventory is simulated, so the ranks run on the CPU.
                placements = [None] * len(placements)
            block = self.control_block
            with self.holds.relaying_to_workers(block):
                return run_ranks(
                    target, *args, placements=placements, port=port, backend=backend,
                    on_started=lambda pids: self._attach_ranks(handle, pids),
                    control_block=str(block.path) if block is not None else None,
                    payload=payload, **kwargs,
                )  # fmt: skip
        finally:
            self.release(handle)

    def _attach_ranks(self, handle: LeaseHandle, pids: list[int]) -> None:
        """Name a gang's worker processes to the broker, so that a pause stops them (and
        not this kernel).  While the gang is being paused the broker says to wait: try
        again once it runs."""
        deadline = time.monotonic() + RECONNECT_DEADLINE_S
        while True:
            client = self.connection.live_client()
            if client is None:
                return  # reconnecting: the pause then reaches the kernel's session only
            try:
                client.attach_ranks(handle.lease_id, pids)
                handle.note(f"ranks attached to processes {pids}")
                return
            except BrokerError as exc:
                if exc.code != ErrorCode.OUT_OF_ORDER or time.monotonic() > deadline:
                    raise
            handle.changed.clear()
            handle.changed.wait(0.2)

    # ---- inside a running cell

    def safe_point(self, timeout: float | None = None) -> bool:
        """Honour a preemption here.  Returns False if ``timeout`` passed while held."""
        return self.holds.safe_point(timeout)

    def describe(self) -> str:
        lines = []
        for handle in self.leases.values():
            where = "?"
            if handle.placement is not None:
                where = f"GPU {handle.placement.device_index}"
                if handle.placement.mig_uuid:
                    where += f" ({handle.placement.mig_profile} {handle.placement.mig_uuid})"
                where += f", {format_size(handle.placement.memory_bytes)}"
            granted_only = handle.state == LeaseState.RUNNING and not handle.bound
            state = "granted" if granted_only else handle.state.value
            lines.append(f"{handle.lease_id}: {state} on {where}")
        return "\n".join(lines) or "no lease held"


_session: GpuSession | None = None
_session_lock = threading.Lock()


def current_session() -> GpuSession:
    global _session
    with _session_lock:
        if _session is None:
            _session = GpuSession()
        return _session


def existing_session() -> GpuSession | None:
    """The session if one was made (a %%gpu cell ran), without making one."""
    return _session


def reset_session() -> None:
    global _session
    with _session_lock:
        if _session is not None:
            _session.close()
        _session = None


def safe_point(timeout: float | None = None) -> bool:
    """Public: a point where this session may be held while a higher-priority one runs."""
    if _session is None:
        return True
    return _session.safe_point(timeout)


__all__ = [
    "BrokerUnavailable",
    "CellOutput",
    "GpuSession",
    "LeaseHandle",
    "LeaseOptions",
    "LeaseRefused",
    "LeaseTimeout",
    "RankRequestError",
    "current_session",
    "existing_session",
    "reset_session",
    "safe_point",
]
