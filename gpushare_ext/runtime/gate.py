"""Level 0 of the ladder inside the kernel process: the gate at the launch points it owns.

On a GPU, the control block's page is registered with ``cuMemHostRegister`` and every
safe point enqueues ``cuStreamWaitValue32(gate == 0)`` on the session's stream: when the
broker closes the gate, work queued behind the wait does not start, and no SM is used
while it waits (measured: released 22 us after the host write).  The session stream is
a CuPy stream made current for the cell, so CuPy work and Numba kernels given
``gpushare_ext.stream()`` queue behind the gate.

A wait is enqueued only while the gate is closed: the broker closes it for levels
0-2, and keeps it open when it locks the process (a lock waits for queued work to
drain, and work held behind a closed gate would never drain).

Without a GPU (simulated broker) a safe point blocks the calling thread on the host
while the gate is closed -- the same contract, enforced on the CPU.

A gang's workers map the control block the session had when they started
(:class:`GateRelay` carries a new broker's word to them after a restart).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from gpushare_ext.control_block import GATE_OFFSET, SIZE, ControlBlock
from gpushare_ext.runtime import cell_lines
from gpushare_ext.runtime.errors import SessionError

_REGISTERED: set[int] = set()  # host pages registered with CUDA (once per process)


class GateError(SessionError):
    """The device gate could not be set up; the session falls back to the host gate."""


class DeviceGate:
    """The gate word as seen by the GPU, and the session stream that waits on it."""

    def __init__(self, block: ControlBlock) -> None:
        import cupy
        from cuda.bindings import driver as cu

        self._cu = cu
        self.block = block
        self._host_address = block.address()
        cupy.cuda.Device().use()  # make sure the current device's context exists
        if self._host_address not in _REGISTERED:
            # Portable: one registration serves every GPU this session moves to.
            flags = cu.CU_MEMHOSTREGISTER_DEVICEMAP | cu.CU_MEMHOSTREGISTER_PORTABLE
            (err,) = cu.cuMemHostRegister(self._host_address, SIZE, flags)
            if err != cu.CUresult.CUDA_SUCCESS:
                raise GateError(f"cuMemHostRegister of the control block failed: {err}")
            _REGISTERED.add(self._host_address)
        err, device_pointer = cu.cuMemHostGetDevicePointer(self._host_address, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise GateError(f"cuMemHostGetDevicePointer failed: {err}")
        self._gate_address = int(device_pointer) + GATE_OFFSET
        self.stream = cupy.cuda.Stream(non_blocking=True)

    def hold_here(self, stream: Any | None = None, *, always: bool = False) -> None:
        """Enqueue 'wait until the gate is open' on ``stream`` (default: the session stream).

        Only while the gate is closed (a host read of the word): an open gate costs the
        stream nothing, and a wait queued on every step would keep the GPU's front end
        polling host memory.  A gate that closes just after the check is honoured at the
        next launch point.  ``always`` enqueues regardless (tests, the cell's start).
        """
        if not always and not self.block.gate_closed:
            return
        cu = self._cu
        target = self.stream if stream is None else stream
        handle = target.ptr if hasattr(target, "ptr") else int(target)
        (err,) = cu.cuStreamWaitValue32(
            handle, self._gate_address, 0, cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        )
        if err != cu.CUresult.CUDA_SUCCESS:
            raise GateError(f"cuStreamWaitValue32 failed: {err}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.synchronize()
        if self._host_address in _REGISTERED:
            _REGISTERED.discard(self._host_address)
            with contextlib.suppress(Exception):
                self._cu.cuMemHostUnregister(self._host_address)


def open_device_gate(block: ControlBlock) -> tuple[DeviceGate | None, str]:
    """A device gate if CuPy and a GPU are usable here, else None and the reason."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return None, "CuPy is not installed: the gate holds launches on the host only"
    try:
        return DeviceGate(block), "device gate: cuStreamWaitValue32 on the session stream"
    except Exception as exc:  # CUDA errors come in many types; any means "no device gate"
        return None, cell_lines.no_device_gate_words(exc)


RELAY_POLL_S = 0.001  # how late a relayed gate may close: one poll, next to a ~1 ms pause


class GateRelay:
    """Keeps the control block a gang's workers follow in step with the session's own.

    The workers map the block the session had when the gang started: their launch shim
    holds launches on its gate word.  A broker that restarts gives the session a new
    block, and the old one is then written by nobody, so from :meth:`follow` on a thread
    copies every change of the new block (gate, state, level, reason) into the old one,
    and carries the workers' count of GPU memory imports back.  No thread runs until a
    restart happened.  It must not write into the block it follows from except that
    count: the rest of that block is the broker's.
    """

    def __init__(self, followed: ControlBlock, poll_s: float = RELAY_POLL_S) -> None:
        self.followed = followed
        self._poll_s = poll_s
        self._source: ControlBlock | None = None
        self._epoch = 0  # bumped by every follow(): a new source is copied at once
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def follow(self, source: ControlBlock | None) -> None:
        """From now on the broker writes ``source`` (None: no block, nothing to copy)."""
        with self._lock:
            self._source = None if source is self.followed else source
            self._epoch += 1
            if self._source is not None and self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(
                    target=self._relay, name="gpushare-gate-relay", daemon=True
                )
                self._thread.start()

    def _relay(self) -> None:
        copied: tuple[int, int] | None = None  # (epoch, generation) last copied
        imports = self.followed.ipc_imports
        while not self._stop.wait(self._poll_s):
            with self._lock:
                source = self._source
                if source is None or source.closed:
                    continue
                seen = (self._epoch, source.generation)
                if seen != copied:
                    self.followed.publish_as(source)
                    copied = seen
                now = self.followed.ipc_imports
                source.add_ipc_imports((now - imports) & 0xFFFFFFFF)
                imports = now

    def close(self) -> None:
        """Stop relaying (the gang ended); the blocks stay as they are."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
