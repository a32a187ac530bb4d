"""What stops this kernel process while the broker pauses it, set up as leases bind.

The session's control block (the broker's word: gate, state, level), the device gates
that hold the session stream at level 0, the launch shim that holds every framework's
launches while paused, and the yield flag preemptible kernels poll at levels 1 and 2.
A new broker's control block replaces the old one everywhere (the shim, a gang's
workers), and :meth:`ProcessHolds.safe_point` honours a pause between launches.

It must not talk to the broker but to register the yield flag through the client it is
given, and must not keep leases (the session does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from gpushare_ext.client import BrokerClient
from gpushare_ext.control_block import ControlBlock, ControlBlockError
from gpushare_ext.runtime import cell_lines, frameworks, interpose, parkable, preemptible
from gpushare_ext.runtime.gate import DeviceGate, GateRelay, open_device_gate
from gpushare_ext.runtime.leases import LeaseHandle, queue_is_bounded
from gpushare_ext.runtime.paused import asked_to_yield, cuda_blocked, wait_until_resumed


class ProcessHolds:
    """The control block this session follows and every hold that reads it."""

    def __init__(self) -> None:
        self.control_block: ControlBlock | None = None
        self.device_gate: DeviceGate | None = None
        self.gate_note = ""
        self.gates: dict[int, DeviceGate] = {}  # CUDA ordinal -> its gate
        self.yield_flag: Any = None  # the device flag instrumented kernels poll (levels 1-2)
        self.interposer: interpose.Attached | None = None  # holds launches while paused
        self.interposer_note = ""  # why it is not attached, once tried
        self._retired: list = []
        self._relays: set[GateRelay] = set()  # running gangs' workers map an older block

    def follow_block(self, path: str, simulated: bool) -> None:
        """A (new) broker's control block for this session: every hold follows it."""
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
            self.point_interposer(None)
            return
        self.point_interposer(self.control_block)
        for relay in list(self._relays):
            relay.follow(self.control_block)
        # Device gates are opened at the first grant: opening one starts CUDA, which must
        # wait until the lease has chosen the device.
        self.gate_note = "simulated GPU: launch points wait on the host gate" if simulated else ""

    def point_interposer(self, block: ControlBlock | None) -> None:
        """The launch interposer follows this session's current control block, and so
        does the note on long kernels the broker shows in status."""
        if self.interposer is not None:
            interpose.point_at(block.address() if block is not None else None)
        interpose.point_imports_at(block.address() if block is not None else None)
        parkable.serve_parks_at(block.address() if block is not None else None)
        preemptible.report_to(block.write_session_note if block is not None else None)

    def hold_on_device(
        self,
        handle: LeaseHandle,
        ordinal: int,
        client: BrokerClient | None,
        on_interrupt: Callable[[], object],
    ) -> None:
        """The lease is bound to CUDA device ``ordinal`` of a real GPU: quotas, its gate,
        the launch shim and the preemptible kernels' hooks follow it."""
        frameworks.install_quotas()
        if ordinal not in self.gates and self.control_block is not None:
            gate, self.gate_note = open_device_gate(self.control_block)
            if gate is not None:
                self.gates[ordinal] = gate
        self.device_gate = self.gates.get(ordinal)
        self._attach_interposer(handle)
        # Only work that can be paused needs a short queue (a high-band lease has
        # nobody above it to make room for).
        interpose.bound(queue_is_bounded(handle))
        self._connect_kernels(handle, client, on_interrupt)

    def _attach_interposer(self, handle: LeaseHandle) -> None:
        """Hold every framework's launches while paused (once per process, on a GPU)."""
        if self.interposer is not None or self.interposer_note or self.control_block is None:
            return
        try:
            self.interposer = interpose.attach(self.control_block.address())
        except interpose.InterposerError as exc:
            self.interposer_note = cell_lines.launches_not_held_words(exc)
            handle.note(self.interposer_note)
            if handle.output is not None:
                handle.output.show("gpushare-interposer", cell_lines.notice(self.interposer_note))
            return
        handle.note(self.interposer.describe())
        try:
            preemptible.install()
        except interpose.InterposerError as exc:  # a bad GPUSHARE_PREEMPTIBLE_US
            handle.note(str(exc))
            if handle.output is not None:
                handle.output.show("gpushare-preemptible", cell_lines.notice(str(exc)))

    def _connect_kernels(
        self, handle: LeaseHandle, client: BrokerClient | None, on_interrupt: Callable[[], object]
    ) -> None:
        """Give preemptible kernels the session's gate and yield flag, and tell the broker
        where the flag is (a CUDA IPC handle), so it can stop them at level 1 or 2."""
        try:
            from gpushare_ext.kernels import launch, yield_flags
        except ImportError:  # the kernel toolchain is optional
            return
        try:
            if self.yield_flag is None:
                self.yield_flag = yield_flags.YieldFlag()
                yield_flags.set_session_yield_flag(self.yield_flag)
            gate = self.device_gate
            launch.set_session_hooks(
                launch.LaunchHooks(
                    before_launch=gate.hold_here
                    if gate is not None
                    else launch.LaunchHooks.before_launch,
                    wait_for_resume=self._wait_for_resume,
                    pause_requested=self._asked_to_yield,
                    cuda_blocked=self._cuda_blocked,
                    on_interrupt=on_interrupt,
                )
            )
            assert handle.placement is not None and client is not None
            client.register_yield_flag(
                handle.lease_id, handle.placement.device_index, self.yield_flag.ipc_handle().hex()
            )
            handle.note("yield flag registered")
        except Exception as exc:  # no flag: the broker stops this session by locking it
            handle.note(f"no yield flag: {exc}")

    def _asked_to_yield(self) -> bool:
        return asked_to_yield(self.control_block)

    def _cuda_blocked(self) -> bool:
        return cuda_blocked(self.control_block)

    def _wait_for_resume(self, flag: Any, interrupted: Callable[[], bool]) -> None:
        wait_until_resumed(lambda: self.control_block, flag, interrupted)

    def protection(self) -> str:
        """How this session is stopped when paused, in a few words (for the pause notice)."""
        if self.interposer is not None:
            extra = preemptible.summary()
            return self.interposer.describe() + (f"; {extra}" if extra else "")
        return self.interposer_note or self.gate_note

    @contextlib.contextmanager
    def relaying_to_workers(self, block: ControlBlock | None) -> Iterator[None]:
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

    def let_go(self) -> None:
        """Nobody will write this block again: streams waiting on its gate (which the
        gates' close waits for) and held launches must go on."""
        if self.control_block is not None:
            self.control_block.release_locally("the session closed")
        for gate in self.gates.values():
            gate.close()
        self.gates = {}
        self.device_gate = None

    def close(self) -> None:
        self.point_interposer(None)
        if self.control_block is not None:
            self.control_block.close()
            self.control_block = None
