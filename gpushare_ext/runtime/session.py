"""The lease lifecycle of notebook cells: ask, wait (visibly), bind, run, release.

One :class:`GpuSession` per kernel process.  It connects to the broker (starting the
embedded per-user broker when no broker answers), keeps the session's control block
mapped, and for each ``%%gpu`` cell:

1. asks for a lease and, while queued, keeps one live line in the cell's output:
   ``queued: position 2, waiting for user-3f2a (priority high) -- 4 s``;
   the wait can be interrupted (the request is withdrawn) and can time out;
2. binds the device (:mod:`binding`), sets the memory quota (:mod:`memory`) and the
   gate (:mod:`gate`), then runs the cell;
3. shows the broker's notices in the output area of the cell they concern, each once
   and on one line: a priority the policy lowered, "paused for a higher-priority
   session" (at the rung that holds it) and "resumed", a lease revoked;
4. releases the lease when the cell ends, whatever the ending (error, interrupt).

If the broker restarts, the session reconnects and reclaims its leases.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpushare_ext.client import BrokerClient, BrokerError, BrokerUnavailable
from gpushare_ext.control_block import ControlBlock, ControlBlockError
from gpushare_ext.lease_state import ACTIVE, STOPPED, IllegalMove, LeaseState, check_move
from gpushare_ext.paths import SYSTEM_SOCKET, default_socket_path
from gpushare_ext.protocol import (
    LEVEL_NAMES,
    MAX_RANKS,
    PRIORITY_CLASSES,
    BrokerMessage,
    Capabilities,
    Error,
    ErrorCode,
    Granted,
    Parked,
    Placement,
    Preempt,
    PreemptionLevel,
    Queued,
    RankPlacement,
    Refused,
    Released,
    RequestLease,
    Resume,
    Revoked,
    SliceWish,
    applied_level,
    describe_priority,
    priority_value,
    split_member_id,
)
from gpushare_ext.runtime import binding, interpose, memory, preemptible
from gpushare_ext.runtime.cell_lines import PauseRecord, kernel_words, receipt_line
from gpushare_ext.runtime.cell_output import CellOutput
from gpushare_ext.runtime.embedded import broker_answers, ensure_embedded_broker
from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.runtime.gate import GateRelay
from gpushare_ext.runtime.parked import ParkedMemory
from gpushare_ext.units import format_size, priority_band

OPEN_STATES = ACTIVE  # what a reconnect reclaims: queued, running, paused, evicted
RECONNECT_DEADLINE_S = 120.0
OVERDUE_AFTER_S = 5.0  # past the estimate this long, the queue line says so instead
PAUSE_WATCH_S = 0.02  # how often a paused session looks for a Ctrl-C (see let_go_for_interrupt)
# How long a Ctrl-C while paused waits for the broker to let the process go (an unlock
# takes milliseconds; a restore of evicted memory about a second per 5 GiB).
LET_GO_WAIT_S = 30.0


class LeaseRefused(SessionError):
    """The broker refused the request (policy, impossible size, bad device)."""


class LeaseTimeout(SessionError, TimeoutError):
    """No grant within the cell's timeout; the request was withdrawn."""


class RankRequestError(SessionError, ValueError):
    """A gang asked for in a way that cannot work (the number of ranks, say)."""


@dataclass(frozen=True, kw_only=True)
class LeaseOptions:
    """What a cell asks for; ``%gpuconfig`` changes the session's defaults."""

    priority: int = priority_value("normal")
    memory_bytes: int | None = None
    device: str = "auto"
    timeout_s: float | None = None
    slice: SliceWish = SliceWish.AUTO
    sm_share: float = 1.0
    instrumented_only: bool = False
    ranks: int = 1  # more than one: a gang, one slice per worker process (run_gang)

    def request(self, capabilities: Capabilities, label: str = "") -> RequestLease:
        """What goes to the broker: the one request struct, sent and handed to its core
        unchanged (the timeout is the session's own business)."""
        return RequestLease(
            priority=self.priority,
            memory_bytes=self.memory_bytes,
            slice=self.slice,
            device=self.device,
            sm_share=self.sm_share,
            capabilities=capabilities,
            label=label[:256],
            ranks=self.ranks,
        )


# ------------------------------------------------------------------ leases


@dataclass(eq=False)
class LeaseHandle:
    lease_id: str
    options: LeaseOptions
    output: CellOutput | None
    state: LeaseState = LeaseState.QUEUED
    bound: bool = False  # the process is bound to the placement (after a grant)
    placement: Placement | None = None
    granted_priority: int | None = None  # what the broker granted (a policy may lower it)
    ranks: list[RankPlacement] = field(default_factory=list)  # a gang's, once granted
    queued: Queued | None = None
    queued_at: float = 0.0  # monotonic time of the last queue notice (its estimate's start)
    notice_said: bool = False  # the policy's word on the request was shown
    refusal: str = ""
    revoked: str = ""
    paused_since: float | None = None
    pauses_s: list[float] = field(default_factory=list)  # each pause's length, in order
    pause_log: list[PauseRecord] = field(default_factory=list)  # for the cell's receipt
    asked_at: float = field(default_factory=time.monotonic)
    granted_at: float | None = None  # monotonic, the first grant
    kernels_at_grant: dict[str, int] = field(default_factory=dict)
    pause_text: str = "gpushare: paused for a higher-priority session"
    events: list[tuple[float, str]] = field(default_factory=list)
    changed: threading.Event = field(default_factory=threading.Event)
    display_key: str = field(default_factory=lambda: f"gpushare-{uuid.uuid4().hex[:12]}")

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))

    def move(self, state: LeaseState) -> bool:
        """Go to ``state`` if the state table allows it; otherwise keep the state, note
        why, and say False (a notice that came after the lease ended, say)."""
        try:
            self.state = check_move(self.lease_id, self.state, state)
        except IllegalMove as refused:
            self.note(f"ignored: {refused.message}")
            return False
        return True


def estimate_text(handle: LeaseHandle, waited_s: float, now: float | None = None) -> str:
    """The broker's estimate counted down since it came, and said against the cell's
    timeout when the wait would outlast it ("" without an estimate)."""
    queued = handle.queued
    if queued is None or not queued.estimate_s:
        return ""
    since = (time.monotonic() if now is None else now) - handle.queued_at
    left = max(0.0, queued.estimate_s - since)
    overdue = since - queued.estimate_s
    if overdue >= OVERDUE_AFTER_S:
        # "Any moment now" for ever would be a promise the holder is not keeping.
        return f", the holder's usual time ran out {overdue:.0f} s ago"
    if left < 1.0:
        return ", any moment now"
    timeout = handle.options.timeout_s
    if timeout is not None and left > timeout - waited_s:
        return (
            f", about {left:.0f} s left, more than the {max(0.0, timeout - waited_s):.0f} s "
            "before the timeout"
        )
    return f", about {left:.0f} s left"


def queue_line(handle: LeaseHandle, waited_s: float) -> str:
    queued = handle.queued
    if queued is None:
        return f"queued -- {waited_s:.0f} s"
    holder = queued.waiting_for or "earlier requests"
    priority = (
        f" (priority {describe_priority(queued.holder_priority)})"
        if queued.holder_priority is not None
        else ""
    )
    estimate = estimate_text(handle, waited_s)
    return (
        f"queued: position {queued.position}, waiting for {holder}{priority}{estimate} -- "
        f"{waited_s:.0f} s ({queued.reason}; interrupt the kernel to withdraw)"
    )


def _times(count: int) -> str:
    return "once" if count == 1 else "twice" if count == 2 else f"{count} times"


def resumed_words(pauses_s: list[float]) -> str:
    """How a cell's pauses read when the last one ends: every one counted, none lost."""
    if len(pauses_s) == 1:
        return f"resumed after {pauses_s[0]:.2f} s"
    shown = ", ".join(f"{p:.1f}" for p in pauses_s[-5:])
    earlier = "..., " if len(pauses_s) > 5 else ""
    return (
        f"resumed; paused {_times(len(pauses_s))} in this cell ({earlier}{shown} s; "
        f"{sum(pauses_s):.1f} s in all)"
    )


def state_after_preempt(current: LeaseState, level: PreemptionLevel) -> LeaseState:
    """Where a pause notice takes a handle.  A running lease asked for level 4 is paused
    first, as the broker's core has it, and evicted once the checkpoint is done (a
    paused lease asked for level 4); the state table has no running -> evicted."""
    if level == PreemptionLevel.EVICT and current in STOPPED:
        return LeaseState.EVICTED
    return LeaseState.PAUSED


def pause_line(preempt: Preempt, simulated: bool, how: str) -> str:
    """The cell's line for a pause: the rung that holds it, and the one the broker asked
    for where that differs (a simulated GPU only gates), as ``gpushare status`` says."""
    asked = preempt.level
    applied = applied_level(asked, simulated)
    rung = f"at ladder level {int(applied)}, {LEVEL_NAMES[applied]}"
    if applied != asked:
        rung += (
            f" (level {int(asked)}, {LEVEL_NAMES[asked]}, was asked; "
            "a simulated GPU is gated, not locked)"
        )
    line = f"gpushare: paused for a higher-priority session ({preempt.for_user}) {rung}"
    return f"{line}; {how}" if how else line


class GpuSession:
    """This kernel process's connection to the broker and its leases."""

    def __init__(self, socket_path: str | Path | None = None, *, notebook: str = "") -> None:
        self._explicit_socket = Path(socket_path) if socket_path else None
        self.notebook = notebook or os.environ.get("JPY_SESSION_NAME", "")
        self.defaults = LeaseOptions()
        self.client: BrokerClient | None = None
        self.control_block: ControlBlock | None = None
        self.device_gate = None
        self.gate_note = ""
        self.leases: dict[str, LeaseHandle] = {}
        self.announcements: list[str] = []
        self.started_embedded = False
        self._lock = threading.RLock()
        self._reconnecting = threading.Event()
        self._client_token: object = None  # which connection's loss matters (the live one's)
        self._generation = 0  # connections made so far: which one answered a request
        self._connected_path: Path | None = None
        self._early: dict[str, list[BrokerMessage]] = {}  # notices that beat their lease handle
        self._closed = False
        self.simulated = False
        self.yield_flag = None  # the device flag instrumented kernels poll (levels 1-2)
        self.gates: dict[int, object] = {}  # CUDA ordinal -> DeviceGate
        self.interposer: interpose.Attached | None = None  # holds launches while paused
        self.interposer_note = ""  # why it is not attached, once tried
        self._retired: list = []
        self._relays: set[GateRelay] = set()  # running gangs' workers map an older block
        self.parked: ParkedMemory | None = None  # the broker parked this idle session
        self._pause_watch: threading.Thread | None = None  # Ctrl-C while paused: see there

    # ---- connection

    @property
    def socket_path(self) -> Path:
        return self._explicit_socket or default_socket_path()

    def connect(self) -> BrokerClient:
        """The live connection, made (and every earlier lease reclaimed) if there is none.

        The only place a connection is made: a cell asking for a lease and the reconnect
        thread both come here, so a process never holds two connections, and a lease
        granted on the new connection is never mistaken for one lost in a restart.
        """
        with self._lock:
            if self.client is not None and not self.client.closed.is_set():
                return self.client
            return self._connect(path=self._connected_path)

    def _connect(self, path: Path | None = None) -> BrokerClient:
        # A reconnect goes back to the broker it knew: while a system broker restarts its
        # socket is briefly gone, and starting an embedded one then would lose the leases.
        path = path or self.socket_path
        uses_system = path == SYSTEM_SOCKET or (self._explicit_socket is not None)
        if not broker_answers(path) and not uses_system and "GPUSHARE_SOCKET" not in os.environ:
            path, started = ensure_embedded_broker(path)
            if started and not self.started_embedded:
                self.started_embedded = True
                self.announcements.append(
                    f"gpushare: no system broker found; started your embedded broker on {path} "
                    "(it serves all your notebooks on this host)"
                )
        earlier = [h for h in self.leases.values() if h.state in OPEN_STATES]
        token = object()
        client = BrokerClient(
            path,
            client="kernel",
            notebook=self.notebook,
            reclaim=[h.lease_id for h in earlier],
            listener=lambda message: self._on_message(message, token),
            visible_devices=binding.visible_gpus(),
        )
        self._client_token = token
        self._generation += 1
        self.client = client
        self._connected_path = path
        self.simulated = client.welcome.inventory == "simulated"
        self._open_control_block(client.welcome.control_block)
        for handle in earlier:
            self._settle_reclaim(handle, handle.lease_id in client.welcome.reclaimed)
        if self.parked is not None:
            # A broker that starts restores every process its journal held: nothing of
            # this session is parked any more.
            self.parked.done.set()
            self.parked = None
        if client.closed.is_set() and not self._closed:
            self._broker_lost(client.close_reason)  # lost before its listener counted
        return client

    def _settle_reclaim(self, handle: LeaseHandle, reclaimed: bool) -> None:
        """After a reconnect: a lease the new broker gave back, or one it did not keep."""
        if reclaimed:
            handle.note("reclaimed after a broker restart")
            return
        if handle.state == LeaseState.QUEUED:
            handle.revoked = (
                "the broker restarted and did not keep this request; run the cell again"
            )
        else:
            handle.revoked = "the broker restarted and did not give the lease back"
        handle.move(LeaseState.REVOKED)
        handle.changed.set()
        self._say_revoked(handle, f"gpushare: {handle.revoked}")

    def _open_control_block(self, path: str) -> None:
        if self.control_block is not None:
            # A GPU may still have the old page registered: keep it mapped, just unused.
            self._retired.append((self.control_block, dict(self.gates)))
        self.gates = {}
        self.device_gate = None
        try:
            self.control_block = ControlBlock.open(path)
        except ControlBlockError as exc:
            self.control_block = None
            self.gate_note = f"no control block ({exc}): the session cannot be gated"
            self._point_interposer(None)
            return
        self._point_interposer(self.control_block)
        for relay in list(self._relays):
            relay.follow(self.control_block)
        # Device gates are opened at the first grant: opening one starts CUDA, which must
        # wait until the lease has chosen the device.
        self.gate_note = (
            "simulated GPU: launch points wait on the host gate" if self.simulated else ""
        )

    def _point_interposer(self, block: ControlBlock | None) -> None:
        """The launch interposer follows this session's current control block, and so
        does the note on long kernels the broker shows in status."""
        if self.interposer is not None:
            interpose.point_at(block.address() if block is not None else None)
        interpose.point_imports_at(block.address() if block is not None else None)
        preemptible.report_to(block.write_session_note if block is not None else None)

    def _attach_interposer(self, handle: LeaseHandle) -> None:
        """Hold every framework's launches while paused (once per process, on a GPU)."""
        if self.interposer is not None or self.interposer_note or self.control_block is None:
            return
        try:
            self.interposer = interpose.attach(self.control_block.address())
        except interpose.InterposerError as exc:
            self.interposer_note = (
                f"launches are not held on the host ({exc}); the checkpoint lock pauses "
                "this session, after the work it has queued"
            )
            handle.note(self.interposer_note)
            if handle.output is not None:
                handle.output.show("gpushare-interposer", f"gpushare: {self.interposer_note}")
            return
        handle.note(self.interposer.describe())
        try:
            preemptible.install()
        except interpose.InterposerError as exc:  # a bad GPUSHARE_PREEMPTIBLE_US
            handle.note(str(exc))
            if handle.output is not None:
                handle.output.show("gpushare-preemptible", f"gpushare: {exc}")

    def protection(self) -> str:
        """How this session is stopped when paused, in a few words (for the pause notice)."""
        if self.interposer is not None:
            extra = preemptible.summary()
            return self.interposer.describe() + (f"; {extra}" if extra else "")
        return self.interposer_note or self.gate_note

    def close(self) -> None:
        self._closed = True
        for handle in list(self.leases.values()):
            with contextlib.suppress(BrokerError):
                self.release(handle)
        if self.control_block is not None:
            # Nobody will write this block again: streams waiting on its gate (which the
            # gates' close below waits for) and held launches must go on.
            self.control_block.release_locally("the session closed")
        for gate in self.gates.values():
            gate.close()
        self.gates = {}
        self.device_gate = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self._point_interposer(None)
        if self.control_block is not None:
            self.control_block.close()
            self.control_block = None

    # ---- notices from the broker (listener thread)

    def _on_message(self, message: BrokerMessage, token: object = None) -> None:
        if (
            isinstance(message, Error)
            and message.code == ErrorCode.UNAVAILABLE
            and message.reply_to == 0
        ):
            if token is self._client_token and not self._closed:
                self._broker_lost(message.message)
            return
        if isinstance(message, Parked):
            self.parked = ParkedMemory.from_notice(message)
            return
        lease_id = getattr(message, "lease_id", None)
        if not lease_id:
            return
        park = self.parked
        if park is not None and lease_id == park.lease_id:
            self._park_notice(park, message)
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
        self._apply_notice(handle, message)

    def _park_notice(self, park: ParkedMemory, message: BrokerMessage) -> None:
        """How the restore of this session's parked memory goes."""
        if isinstance(message, Queued):
            park.queued = message
        elif isinstance(message, Resume):
            park.done.set()
        elif isinstance(message, Revoked) and not park.asked:
            # An admin cancelled the park: the broker restored it on the way out.
            self.forget_park(park)
            park.done.set()
        elif isinstance(message, Revoked):
            park.failed = message.reason
            park.done.set()
        elif isinstance(message, Released):
            # Ended without a restore: the park failed (nothing was moved), or an admin
            # cancelled it (which restores it).  Either way the memory is on the GPU.
            if not park.asked:
                self.forget_park(park)
            park.done.set()
        park.changed.set()

    def forget_park(self, park: ParkedMemory) -> None:
        if self.parked is park:
            self.parked = None

    def cell_activity(self, running: bool) -> None:
        """Tell the broker a cell started or ended (a cell never waits for it), and
        whether this process may be parked."""
        client = self.client
        if client is None or client.closed.is_set():
            return
        with contextlib.suppress(BrokerError, BrokerUnavailable):
            client.cell_activity(running, self.why_not_parkable())

    def why_not_parkable(self) -> str:
        """Why the broker must not checkpoint this process ("" if it may): on the H200 a
        process that opened another process's GPU memory is checkpointed and then cannot
        be restored, and only the launch shim sees such imports."""
        if self.simulated:
            return ""  # nothing is checkpointed on a simulated GPU
        imports = interpose.ipc_imports()
        if imports is None:
            return (
                "started without the launch shim, so whether it opened another process's "
                "GPU memory (which a checkpoint cannot restore) is not known"
            )
        if imports:
            return (
                f"it opened another process's GPU memory ({imports} CUDA IPC import(s)), "
                "which a checkpoint cannot restore"
            )
        return ""

    def _broker_lost(self, why: str) -> None:
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
                if handle.output is not None:
                    handle.output.show(
                        handle.display_key + "-pause",
                        "gpushare: the broker went away while this cell was paused; it runs "
                        "on, and the broker decides again when it is back",
                    )
        self._start_reconnect()

    @staticmethod
    def _say_grant_notice(handle: LeaseHandle, answer: Granted | Queued) -> None:
        """What the policy changed in the request (a priority it lowered): one line, once,
        as soon as the broker says it, whether the request waits first or not."""
        if not answer.notice or handle.notice_said:
            return
        handle.notice_said = True
        handle.note(answer.notice)
        if handle.output is not None:
            handle.output.show(handle.display_key + "-notice", f"gpushare: {answer.notice}")

    @staticmethod
    def _say_revoked(handle: LeaseHandle, text: str) -> None:
        """A line for a lease taken away.  A request still waiting gets none: the error
        its cell ends with says the same, and two lines would tell one thing twice."""
        if handle.output is not None and handle.placement is not None:
            handle.output.show(handle.display_key + "-revoked", text)

    def _apply_notice(self, handle: LeaseHandle, message: BrokerMessage) -> None:
        if isinstance(message, Granted):
            if handle.granted_at is None:
                handle.granted_at = time.monotonic()
                handle.kernels_at_grant = preemptible.counts()
            handle.placement = message.placement
            handle.granted_priority = message.priority
            handle.ranks = list(message.ranks)
            handle.move(LeaseState.RUNNING)
            handle.note("granted")
            self._say_grant_notice(handle, message)
        elif isinstance(message, Queued):
            handle.queued = message
            handle.queued_at = time.monotonic()
            self._say_grant_notice(handle, message)
            handle.note(f"queued at position {message.position}")
        elif isinstance(message, Refused):
            handle.refusal = message.message
            handle.move(LeaseState.REFUSED)
        elif isinstance(message, Preempt):
            if not handle.move(state_after_preempt(handle.state, message.level)):
                handle.changed.set()
                return
            self._watch_interrupts_while_paused()
            handle.paused_since = time.time()
            handle.pause_log.append(
                PauseRecord(message.for_user, applied_level(message.level, self.simulated))
            )
            handle.note(f"paused at level {int(message.level)} for {message.for_user}")
            handle.pause_text = pause_line(message, self.simulated, self.protection())
            if handle.output is not None:
                before = (
                    f" (paused {_times(len(handle.pauses_s))} before)" if handle.pauses_s else ""
                )
                handle.output.show(
                    handle.display_key + "-pause", handle.pause_text + before + " ..."
                )
        elif isinstance(message, Resume):
            if not handle.move(LeaseState.RUNNING):
                handle.changed.set()
                return
            open_pause = (
                handle.pause_log[-1]
                if handle.pause_log and handle.pause_log[-1].seconds is None
                else None
            )
            if not message.note:
                handle.pauses_s.append(message.paused_s)
                if open_pause is not None:
                    open_pause.seconds = message.paused_s
            elif open_pause is not None:  # the pause never took effect
                handle.pause_log.pop()
            text = (
                f"gpushare: {message.note}"
                if message.note
                else f"{handle.pause_text}; {resumed_words(handle.pauses_s)}"
            )
            handle.note(text)
            if handle.output is not None:
                handle.output.show(handle.display_key + "-pause", text)
        elif isinstance(message, Revoked):
            handle.revoked = message.reason
            was_paused = handle.state in (LeaseState.PAUSED, LeaseState.EVICTED)
            handle.move(LeaseState.REVOKED)
            if was_paused and handle.output is not None:
                # The live pause line would say "paused ..." for ever: it becomes the
                # revocation, so the cell shows one true line, not two.
                handle.output.show(
                    handle.display_key + "-pause",
                    f"gpushare: lease revoked while paused: {message.reason}; the cell goes "
                    "on without a lease",
                )
            else:
                self._say_revoked(
                    handle,
                    f"gpushare: lease revoked: {message.reason}; the cell goes on without a lease",
                )
        elif isinstance(message, Released):
            handle.move(LeaseState.RELEASED)
        handle.changed.set()

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
            while time.monotonic() < deadline and not self._closed:
                time.sleep(0.5)
                try:
                    self.connect()
                except Exception:  # any failure: the broker is not back yet
                    continue
                return
            self._give_up(deadline_s)
        finally:
            self._reconnecting.clear()

    def _give_up(self, waited_s: float) -> None:
        """The broker did not come back: requests fail clearly, running cells run on."""
        if self._closed:
            return
        where = self._connected_path or self.socket_path
        for handle in list(self.leases.values()):
            if handle.state not in OPEN_STATES:
                continue
            queued = handle.state == LeaseState.QUEUED
            handle.revoked = (
                f"the broker on {where} went away and was not back within {waited_s:g} s"
                + ("; the request is withdrawn" if queued else "; this cell runs on unmanaged")
            )
            handle.move(LeaseState.REVOKED)
            handle.changed.set()
            self._say_revoked(handle, f"gpushare: {handle.revoked}")

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
            yield_flag=self.yield_flag is not None or will_have_flag,
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
        """Ask for a lease and wait for it, showing the queue; raises on refusal/timeout."""
        try:
            self.connect()
        except BrokerUnavailable:
            if self._connected_path is None:
                raise  # never had a broker: nothing to wait for
        if output is not None:
            for line in self.announcements:
                output.show("gpushare-announce", line)
            self.announcements.clear()
        request = options.request(self.capabilities(options, in_workers=not bind), label)
        requested_at = time.monotonic()
        while True:
            reply, generation = self._request(request, output)
            if isinstance(reply, Refused):
                raise LeaseRefused(f"gpushare: request refused: {reply.message}")
            handle = LeaseHandle(lease_id=reply.lease_id, options=options, output=output)
            handle.asked_at = requested_at
            if isinstance(reply, Granted):
                handle.granted_at = time.monotonic()
                handle.kernels_at_grant = preemptible.counts()
                handle.placement = reply.placement
                handle.granted_priority = reply.priority
                handle.ranks = list(reply.ranks)
                handle.move(LeaseState.RUNNING)
            else:
                handle.queued = reply
                handle.queued_at = time.monotonic()
            with self._lock:
                # A reconnect between the answer and here did not know this lease, so
                # the new broker may have let it go: ask again rather than wait for ever.
                if generation != self._generation:
                    continue
                self.leases[reply.lease_id] = handle
                early = self._early.pop(reply.lease_id, [])
            break
        self._say_grant_notice(handle, reply)
        for message in early:
            self._apply_notice(handle, message)
        asked_at = time.monotonic()
        try:
            self._wait_for_grant(handle)
        except BaseException as exc:
            if handle.output is not None and handle.placement is None:
                # The live queue line must not stay "queued ... interrupt to withdraw".
                why = "interrupted" if isinstance(exc, KeyboardInterrupt) else "not granted"
                if isinstance(exc, LeaseTimeout):
                    why = "timed out"
                handle.output.show(
                    handle.display_key,
                    f"gpushare: request withdrawn after {time.monotonic() - asked_at:.0f} s "
                    f"in the queue ({why})",
                )
            self.leases.pop(handle.lease_id, None)
            current = self.client  # a reconnect may have moved the request to a new one
            if current is not None and not current.closed.is_set():
                with contextlib.suppress(BrokerError):
                    current.release(handle.lease_id)
            raise
        if bind:  # worker processes (run_gang) bind themselves, not this kernel
            self._bind(handle)
        return handle

    def _request(
        self, request: RequestLease, output: CellOutput | None
    ) -> tuple[Granted | Queued | Refused, int]:
        """Send the request; if the broker is restarting, wait for it (visibly) and ask again.

        Returns the answer and the generation of the connection that gave it.
        """
        deadline = time.monotonic() + RECONNECT_DEADLINE_S
        while True:
            try:
                with self._lock:
                    client = self.connect()
                    generation = self._generation
                return client.ask_for_lease(request), generation
            except BrokerUnavailable:
                # Never connected: there is no broker to wait for, say so at once.
                left = deadline - time.monotonic()
                if self._connected_path is None or left <= 0:
                    raise
                self._wait_for_connection(output, left)

    def _wait_for_connection(
        self, output: CellOutput | None, timeout_s: float = RECONNECT_DEADLINE_S
    ) -> BrokerClient:
        """Reconnect now, showing one live line while the broker is away."""
        started = time.monotonic()
        key = f"gpushare-reconnect-{uuid.uuid4().hex[:8]}"
        while True:
            try:
                client = self.connect()
            except BrokerUnavailable as exc:
                waited = time.monotonic() - started
                if waited >= timeout_s:
                    raise BrokerUnavailable(
                        f"{exc}; gave up after {waited:.0f} s of reconnecting"
                    ) from None
                if output is not None:
                    output.show(
                        key, f"gpushare: the broker went away; reconnecting -- {waited:.0f} s"
                    )
                time.sleep(0.5)
                continue
            if output is not None and time.monotonic() - started > 0.5:
                output.show(key, "gpushare: reconnected to the broker")
            return client

    def _wait_for_grant(self, handle: LeaseHandle) -> None:
        started = time.monotonic()
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
                raise LeaseTimeout(
                    f"gpushare: no GPU within {timeout:g} s (still at position {position}); "
                    "the request was withdrawn and the cell did not run"
                )
            if handle.output is not None and (
                waited - last_shown >= 1.0 or handle.changed.is_set()
            ):
                line = queue_line(handle, waited)
                if self._reconnecting.is_set():
                    line = (
                        f"queued -- {waited:.0f} s; the broker went away, reconnecting "
                        "(interrupt the kernel to withdraw)"
                    )
                handle.output.show(handle.display_key, line)
                last_shown = waited
            handle.changed.clear()
            handle.changed.wait(0.1)  # short waits keep Ctrl-C responsive
        if handle.state == LeaseState.REFUSED:
            raise LeaseRefused(f"gpushare: request refused: {handle.refusal}")
        if handle.state == LeaseState.REVOKED:
            raise LeaseRefused(f"gpushare: request revoked: {handle.revoked}")
        if handle.output is not None and handle.queued is not None:
            handle.output.show(
                handle.display_key,
                f"gpushare: granted after {time.monotonic() - started:.1f} s in the queue",
            )

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
            memory.install_cupy_quota()
            memory.install_numba_quota()
            if applied.ordinal not in self.gates and self.control_block is not None:
                from gpushare_ext.runtime.gate import open_device_gate

                gate, self.gate_note = open_device_gate(self.control_block)
                if gate is not None:
                    self.gates[applied.ordinal] = gate
            self.device_gate = self.gates.get(applied.ordinal)
            self._attach_interposer(handle)
            # Only work that can be paused needs a short queue (a high-band lease has
            # nobody above it to make room for).
            interpose.bound(queue_is_bounded(handle))
            self._connect_kernels(handle)
        memory.apply_quota(placement.memory_bytes)
        handle.bound = True  # a pause that came meanwhile stands: the state is the broker's

    def _connect_kernels(self, handle: LeaseHandle) -> None:
        """Give preemptible kernels the session's gate and yield flag, and tell the broker
        where the flag is (a CUDA IPC handle), so it can stop them at level 1 or 2."""
        try:
            from gpushare_ext.kernels import launch
        except ImportError:  # the kernel toolchain is optional
            return
        try:
            if self.yield_flag is None:
                self.yield_flag = launch.YieldFlag()
                launch.set_session_yield_flag(self.yield_flag)
            gate = self.device_gate
            launch.set_session_hooks(
                launch.LaunchHooks(
                    before_launch=gate.hold_here
                    if gate is not None
                    else launch.LaunchHooks.before_launch,
                    wait_for_resume=self._wait_for_resume,
                    pause_requested=self._asked_to_yield,
                    cuda_blocked=self._cuda_blocked,
                    on_interrupt=self.let_go_for_interrupt,
                )
            )
            assert handle.placement is not None and self.client is not None
            self.client.register_yield_flag(
                handle.lease_id, handle.placement.device_index, self.yield_flag.ipc_handle().hex()
            )
            handle.note("yield flag registered")
        except Exception as exc:  # no flag: the broker stops this session by locking it
            handle.note(f"no yield flag: {exc}")

    def _asked_to_yield(self) -> bool:
        return asked_to_yield(self.control_block)

    def _cuda_blocked(self) -> bool:
        return cuda_blocked(self.control_block)

    # ---- Ctrl-C while paused

    def _watch_interrupts_while_paused(self) -> None:
        """From the first pause on, a thread watches for Ctrl-C while the broker holds
        this session paused (see :meth:`let_go_for_interrupt`).  It is needed because at
        the lock level the kernel's main thread may sit inside a CUDA call that returns
        only once the process is unlocked: Python's own handler would never run."""
        if self._pause_watch is not None or interpose.watch_interrupts() is None:
            return
        self._pause_watch = threading.Thread(
            target=self._pause_watch_loop, name="gpushare-pause-watch", daemon=True
        )
        self._pause_watch.start()

    def _pause_watch_loop(self) -> None:
        # It reads the control block itself (a word of shared memory): the notice of a
        # pause may come before the broker has published the pause in the block.
        seen: int | None = None
        while not self._closed:
            time.sleep(PAUSE_WATCH_S)
            block = self.control_block
            if block is None or block.closed or not block.paused:
                seen = None
                continue
            # The shim's handler goes in front again each time: Python code may have set
            # its own meanwhile (ipykernel at each cell, the launch hook for a launch).
            counted = interpose.watch_interrupts()
            if seen is None:
                seen = counted
            elif counted != seen:
                self.let_go_for_interrupt()
                seen = None

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
            if handle.output is not None:
                handle.output.show(
                    handle.display_key + "-pause",
                    "gpushare: interrupted while paused; the lease is given up so that "
                    "this cell can stop",
                )
            with contextlib.suppress(BrokerError, BrokerUnavailable, OSError):
                self.release(handle)
        return block.wait_running(timeout=wait_s)

    def _wait_for_resume(self, flag: Any, interrupted: Callable[[], bool]) -> None:
        wait_until_resumed(lambda: self.control_block, flag, interrupted)

    def release(self, handle: LeaseHandle) -> None:
        self.leases.pop(handle.lease_id, None)
        if not self.leases:
            memory.apply_quota(None)
        client = self.client
        if client is None or client.closed.is_set():
            return
        try:
            client.release(handle.lease_id)
        except BrokerError as exc:
            if exc.code != ErrorCode.UNKNOWN_LEASE:
                raise

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
            self._say_receipt(handle)

    @staticmethod
    def _say_receipt(handle: LeaseHandle) -> None:
        """The cell's last line: what its lease went through (only for a lease that was
        granted; a request that never was ends with its own error)."""
        if handle.output is None or handle.granted_at is None:
            return
        if handle.state == LeaseState.REVOKED:
            return  # the revocation's line is the lease's last word
        now = time.monotonic()
        handle.output.show(
            handle.display_key + "-receipt",
            receipt_line(
                queued_s=handle.granted_at - handle.asked_at,
                ran_s=now - handle.granted_at,
                pauses=handle.pause_log,
                kernels=kernel_words(handle.kernels_at_grant, preemptible.counts()),
            ),
        )

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
            with self._relaying_to_workers(block):
                return run_ranks(
                    target, *args, placements=placements, port=port, backend=backend,
                    on_started=lambda pids: self._attach_ranks(handle, pids),
                    control_block=str(block.path) if block is not None else None,
                    payload=payload, **kwargs,
                )  # fmt: skip
        finally:
            self.release(handle)

    @contextlib.contextmanager
    def _relaying_to_workers(self, block: ControlBlock | None) -> Iterator[None]:
        """While a gang runs, the block its workers map follows this session's current
        one: after a broker restart the gate still reaches them."""
        if block is None:
            yield
            return
        relay = GateRelay(block)
        self._relays.add(relay)
        try:
            if self.control_block is not block:  # a restart between the start and here
                relay.follow(self.control_block)
            yield
        finally:
            self._relays.discard(relay)
            relay.close()

    def _attach_ranks(self, handle: LeaseHandle, pids: list[int]) -> None:
        """Name a gang's worker processes to the broker, so that a pause stops them (and
        not this kernel).  While the gang is being paused the broker says to wait: try
        again once it runs."""
        deadline = time.monotonic() + RECONNECT_DEADLINE_S
        while True:
            client = self.client
            if client is None or client.closed.is_set():
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
        """Honour a preemption here.  Returns False if ``timeout`` passed while held.

        * While the broker holds this session paused, wait on the host.  On a GPU the
          lock is what stops the process; a loop that keeps calling CUDA competes with
          the lock's drain, and waiting here, outside CUDA, lets it take hold at once.
        * While the gate is closed, queue a wait on the session stream (GPU), or wait on
          the host (simulated GPU).
        """
        block = self.control_block
        if block is not None and block.paused and not block.wait_running(timeout):
            return False
        if self.device_gate is not None:
            self.device_gate.hold_here()
            return True
        if block is not None:
            return block.wait_open(timeout)
        return True

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
    "LeaseOptions",
    "LeaseRefused",
    "LeaseTimeout",
    "current_session",
    "safe_point",
]


def queue_is_bounded(handle: LeaseHandle) -> bool:
    """Whether the lease's work in flight is kept short: below the high band someone may
    pause it.  The priority the broker granted counts, not the one asked for: a "high"
    request the policy lowered can be paused like any other."""
    granted = handle.granted_priority
    if granted is None:
        granted = handle.options.priority
    return priority_band(granted) < priority_band(PRIORITY_CLASSES["high"])


def asked_to_yield(block: ControlBlock | None) -> bool:
    """The broker's control block asks the session to stop its kernels (a pause at the
    yield level or above). It is read on the host, so the session knows before the
    broker's own write of the yield flag has reached the GPU."""
    if block is None or block.closed or not block.paused:
        return False
    level = block.level
    return level is not None and level >= int(PreemptionLevel.YIELD)


def cuda_blocked(block: ControlBlock | None) -> bool:
    """The broker locks (or has evicted) this process: a CUDA call would block until it
    lets go, so waits must stay on the host meanwhile."""
    if block is None or block.closed or not block.paused:
        return False
    level = block.level
    return level is not None and level >= int(PreemptionLevel.LOCK)


def wait_until_resumed(
    block_of: Callable[[], ControlBlock | None],
    flag: Any,
    interrupted: Callable[[], bool] = lambda: False,
) -> None:
    """After a yield: wait until neither the control block nor the flag holds the launch,
    or until ``interrupted()`` (Ctrl-C).  The only thing waited for is the broker's word
    in the block, and every way the broker can go ends it: a resume, the lease ending (the
    state word goes to 0), the broker gone (the session opens the block itself), the
    session closed.  A flag still raised once nothing asks to yield is the session's own
    (the broker lowers its before it publishes), so it is lowered here."""
    delay = 1e-4
    while not interrupted():
        block = block_of()
        if not asked_to_yield(block):
            if flag.read() == 0:
                return
            if block is None or not block.paused:
                flag.set(0)
                return
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)
