"""The preemption ladder's actuators: how the broker actually stops and resumes a session.

Each level is one method pair behind :class:`ProcessControl`:

* level 0 *gate*: the broker closes the gate word in the session's control block
  (host memory the session's streams wait on); always applied first, undone last;
* levels 1-2 *yield/abort*: the session's device yield flag, opened by CUDA IPC handle
  and written with ``cuStreamWriteValue32`` on a high-priority stream;
* level 3 *lock*: ``cuCheckpointProcessLock`` -- the process's CUDA calls block once
  in-flight work drained;
* level 4 *evict*: ``cuCheckpointProcessCheckpoint`` moves its device memory to the host;
  undo is ``Restore`` then ``Unlock``.

GPU calls can block for 100+ ms while work drains, so :class:`CudaProcessControl` runs
them in one small worker process per GPU (spawned, holding its own CUDA context); the
broker's event loop awaits them without blocking.  :class:`SimulatedProcessControl` is
the no-GPU twin: it applies the gate (which is real: the runtime's launch points wait
on it) and records levels 1-4 without touching any process, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gpushare_ext.broker.errors import DaemonError
from gpushare_ext.broker.hands import park_service
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.protocol import PreemptionLevel

log = logging.getLogger("gpushare.broker")


class ActuatorError(DaemonError):
    """A ladder step failed.  ``not_supported`` distinguishes "cannot here" from "went wrong"."""

    def __init__(self, message: str, *, not_supported: bool = False) -> None:
        super().__init__(message)
        self.not_supported = not_supported


@dataclass(kw_only=True)
class Target:
    """What a preemption acts on."""

    lease_id: str
    pid: int
    device_index: int
    control_block: ControlBlock | None
    yield_flag: tuple[str, int] | None = None  # (IPC handle hex, offset) if registered
    # An eviction of only this much, which the session's shim parks itself (0: all it
    # holds, the rest by checkpoint).
    park_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Applied:
    """What :meth:`Ladder.apply` did: the level it applied (the lock where a yield or an
    abort was asked of a process with no yield flag) and a note for status."""

    level: PreemptionLevel
    held_by: PreemptionLevel  # the rung that really holds it (a simulated GPU's gate)
    note: str


class ProcessControl(Protocol):
    """Levels 1-4 for one kind of host.  All methods may block; call them off the event loop."""

    kind: str

    def open_yield_flag(self, device_index: int, handle_hex: str, offset: int) -> None: ...

    def write_yield_flag(
        self, device_index: int, handle_hex: str, offset: int, value: int
    ) -> None: ...

    def lock(self, pid: int, device_index: int, timeout_ms: int) -> None: ...

    def unlock(self, pid: int, device_index: int) -> None: ...

    def checkpoint(self, pid: int, device_index: int) -> None: ...

    def restore(self, pid: int, device_index: int) -> None: ...

    def close(self) -> None: ...


def pid_alive(pid: int) -> bool:
    """Whether a process exists (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SimulatedProcessControl:
    """No GPU: levels 1-4 are recorded, not performed.  The gate (level 0) still works.

    ``restore_fails`` names processes whose restore fails as the H200's driver fails it
    for a process that imported another's memory (``CUDA_ERROR_INVALID_VALUE``, the
    process left locked), so the broker's answer to a lost restore can be shown
    without a GPU.  ``lock_drain_s`` is how long each lock takes, as a real lock waits
    for the work already queued to drain."""

    kind = "simulated"

    def __init__(
        self, restore_fails: frozenset[int] = frozenset(), lock_drain_s: float = 0.0
    ) -> None:
        self.applied: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        self.restore_fails = restore_fails
        self.lock_drain_s = lock_drain_s

    def _mark(self, pid: int, what: str, on: bool) -> None:
        with self._lock:
            steps = self.applied.setdefault(pid, set())
            (steps.add if on else steps.discard)(what)

    def open_yield_flag(self, device_index: int, handle_hex: str, offset: int) -> None:
        raise ActuatorError("no GPU: yield flags exist only on a real device", not_supported=True)

    def write_yield_flag(self, device_index: int, handle_hex: str, offset: int, value: int) -> None:
        raise ActuatorError("no GPU: yield flags exist only on a real device", not_supported=True)

    def lock(self, pid: int, device_index: int, timeout_ms: int) -> None:
        if not pid_alive(pid):
            raise ActuatorError(f"process {pid} is gone")
        if self.lock_drain_s:
            time.sleep(self.lock_drain_s)  # the ladder runs it off the event loop
        self._mark(pid, "lock", True)

    def unlock(self, pid: int, device_index: int) -> None:
        self._mark(pid, "lock", False)

    def checkpoint(self, pid: int, device_index: int) -> None:
        if not pid_alive(pid):
            raise ActuatorError(f"process {pid} is gone")
        self._mark(pid, "checkpoint", True)

    def restore(self, pid: int, device_index: int) -> None:
        if pid in self.restore_fails:
            raise ActuatorError("cuCheckpointProcessRestore: CUDA_ERROR_INVALID_VALUE")
        self._mark(pid, "checkpoint", False)

    def checkpointed(self) -> frozenset[int]:
        """The processes whose memory a (simulated) checkpoint holds on the host now."""
        with self._lock:
            return frozenset(pid for pid, steps in self.applied.items() if "checkpoint" in steps)

    def close(self) -> None:
        return None


# ------------------------------------------------------------------ CUDA worker


def _cuda_worker(device_index: int, conn) -> None:  # pragma: no cover - runs on a GPU host
    """One per GPU: serve (op, args) requests with the CUDA driver API until told to stop."""
    from cuda.bindings import driver as cu

    def check(result, what: str):
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            name = cu.cuGetErrorName(err)[1]
            text = name.decode() if isinstance(name, bytes) else str(name)
            raise RuntimeError(f"{what}: {text}")
        return result[1:] if isinstance(result, tuple) and len(result) > 1 else None

    check(cu.cuInit(0), "cuInit")
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return
        try:
            if op == "stop":
                conn.send(("ok", None))
                return
            if op == "lock":
                pid, timeout_ms = args
                lock_args = cu.CUcheckpointLockArgs()
                lock_args.timeoutMs = timeout_ms
                check(cu.cuCheckpointProcessLock(pid, lock_args), "cuCheckpointProcessLock")
            elif op == "unlock":
                check(cu.cuCheckpointProcessUnlock(args[0], None), "cuCheckpointProcessUnlock")
            elif op == "checkpoint":
                check(
                    cu.cuCheckpointProcessCheckpoint(args[0], None), "cuCheckpointProcessCheckpoint"
                )
            elif op == "restore":
                check(cu.cuCheckpointProcessRestore(args[0], None), "cuCheckpointProcessRestore")
            elif op == "state":
                (value,) = check(
                    cu.cuCheckpointProcessGetState(args[0]), "cuCheckpointProcessGetState"
                )
                conn.send(("ok", int(value)))
                continue
            elif op in ("flag", "open"):
                from gpushare_ext.kernels.yield_flags import (
                    open_yield_flag_from_handle,
                    write_yield_flag_from_handle,
                )

                handle_hex, offset, *value = args
                if offset:
                    raise RuntimeError(
                        "yield flags are registered at the start of their allocation"
                    )
                if op == "open":
                    open_yield_flag_from_handle(bytes.fromhex(handle_hex), device_index)
                else:
                    write_yield_flag_from_handle(bytes.fromhex(handle_hex), value[0], device_index)
            else:
                raise RuntimeError(f"unknown operation {op}")
            conn.send(("ok", None))
        except Exception as exc:  # report every failure to the broker, keep serving
            conn.send(("error", str(exc)))


class CudaProcessControl:
    """Levels 1-4 through the CUDA driver's checkpoint API, one worker process per GPU."""

    kind = "cuda"

    def __init__(self, device_indices: list[int]) -> None:
        # Worker N must open GPU N as NVML numbers it: PCI bus order, every GPU visible.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        context = multiprocessing.get_context("spawn")
        self._workers: dict[int, tuple] = {}
        for index in device_indices:
            parent, child = context.Pipe()
            process = context.Process(
                target=_cuda_worker,
                args=(index, child),
                name=f"gpushare-actuator-{index}",
                daemon=True,
            )
            process.start()
            child.close()
            self._workers[index] = (process, parent, threading.Lock())

    def _call(self, device_index: int, op: str, *args):
        if device_index not in self._workers:
            raise ActuatorError(f"this broker does not manage GPU {device_index}")
        process, conn, lock = self._workers[device_index]
        with lock:
            if not process.is_alive():
                raise ActuatorError(f"the actuator for GPU {device_index} died")
            conn.send((op, args))
            status, value = conn.recv()
        if status != "ok":
            not_supported = "NOT_SUPPORTED" in value or "NOT_PERMITTED" in value
            raise ActuatorError(value, not_supported=not_supported)
        return value

    def open_yield_flag(self, device_index: int, handle_hex: str, offset: int) -> None:
        self._call(device_index, "open", handle_hex, offset)

    def write_yield_flag(self, device_index: int, handle_hex: str, offset: int, value: int) -> None:
        self._call(device_index, "flag", handle_hex, offset, value)

    def lock(self, pid: int, device_index: int, timeout_ms: int) -> None:
        self._call(device_index, "lock", pid, timeout_ms)

    def unlock(self, pid: int, device_index: int) -> None:
        self._call(device_index, "unlock", pid)

    def checkpoint(self, pid: int, device_index: int) -> None:
        self._call(device_index, "checkpoint", pid)

    def restore(self, pid: int, device_index: int) -> None:
        self._call(device_index, "restore", pid)

    def process_state(self, pid: int, device_index: int = 0) -> int:
        return int(self._call(device_index, "state", pid))

    def close(self) -> None:
        for process, conn, lock in self._workers.values():
            try:
                with lock:
                    conn.send(("stop", ()))
                    conn.recv()
            except (OSError, EOFError):
                pass
            process.join(timeout=2)
            if process.is_alive():
                process.kill()


# ------------------------------------------------------------------ the ladder


def _stop_note(target: Target, level: PreemptionLevel, locked: bool, simulated: bool) -> str:
    """What stopped ``target``, for status (a simulated GPU gates every level)."""
    if simulated and level != PreemptionLevel.GATE:
        return "simulated GPU: the process was gated, not locked"
    return "stopped by: " + ", ".join(_what_stopped(target, level, locked))


def _what_stopped(target: Target, level: PreemptionLevel, locked: bool) -> list[str]:
    """The rungs of the ladder applied to ``target``, cheapest first (for status)."""
    applied = []
    if target.control_block is not None:
        applied.append("launches held")  # the launch shim and gpushare kernels read it
    if target.yield_flag is not None and level >= PreemptionLevel.YIELD:
        applied.append("yield flag")  # preemptible kernels in flight leave the GPU
    if locked:
        applied.append("process lock")
    if level == PreemptionLevel.EVICT and not target.park_bytes:
        applied.append("checkpoint to host")
    return applied or ["nothing (no way to stop it)"]


class Ladder:
    """Applies and undoes ladder levels on a :class:`Target`, in order, off the event loop.

    Steps for one process are serialised (a lock must not overtake its unlock).
    """

    def __init__(self, control: ProcessControl, *, lock_timeout_ms: int = 5000) -> None:
        self.control = control
        self.lock_timeout_ms = lock_timeout_ms
        self._per_pid: dict[int, asyncio.Lock] = {}
        self._locked: set[int] = set()  # what was actually applied, whatever level was asked
        self._checkpointed: set[int] = set()
        # Bytes each process's launch shim parked itself (its parkable memory), to be
        # brought back when it resumes.
        self._memory_parked: dict[int, int] = {}
        # Flags opened ahead (the actuator keeps them open): a session registers its one
        # flag again with every lease, and that need not cross to the actuator each time.
        self._flags_opened: set[tuple[int, str]] = set()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def is_locked(self, pid: int) -> bool:
        return pid in self._locked

    async def open_yield_flag(self, device_index: int, flag: tuple[str, int]) -> bool:
        """Open a newly registered yield flag ahead of any pause: the first pause of a
        session otherwise pays for it, and the first in the actuator's life for its CUDA
        context too (235-300 ms on an H200, which a waiting grant would not wait out).
        False if it could not be opened (the pause that writes it says why)."""
        handle, offset = flag
        if (device_index, handle) in self._flags_opened:
            return True
        try:
            await self._run(self.control.open_yield_flag, device_index, handle, offset)
        except ActuatorError as exc:
            log.debug("yield flag not opened ahead: %s", exc)
            return False
        self._flags_opened.add((device_index, handle))
        return True

    def _serial(self, pid: int) -> asyncio.Lock:
        return self._per_pid.setdefault(pid, asyncio.Lock())

    def forget_idle(self) -> None:
        """Drop the per-process locks nobody holds or waits for (pids come and go)."""
        for pid, lock in list(self._per_pid.items()):
            if (
                not lock.locked()
                and pid not in self._locked
                and pid not in self._checkpointed
                and pid not in self._memory_parked
            ):
                del self._per_pid[pid]

    async def apply(
        self, target: Target, level: PreemptionLevel, reason: str, state: LeaseState
    ) -> Applied:
        """Stop ``target`` at ``level`` (levels below it too); its control block says
        ``state`` (the state the stop results in, as the core said).  Returns the level
        applied, which is the lock where a yield or an abort was asked and no yield flag
        is registered (on a simulated GPU too: it records the lock, and only the gate
        holds), and a note for status."""
        async with self._serial(target.pid):
            needs_lock = level >= PreemptionLevel.LOCK or (
                level in (PreemptionLevel.YIELD, PreemptionLevel.ABORT)
                and target.yield_flag is None
            )
            simulated = self.control.kind == "simulated"
            if target.control_block is not None:
                # A lock waits until the work already queued has run, gate waits included:
                # a closed gate would hold that work for ever.  So the gate closes only
                # where nothing is locked (levels 0-2, or a simulated GPU).
                target.control_block.publish(
                    gate_closed=simulated or not needs_lock,
                    state=state,
                    level=int(level),
                    reason=reason,
                )
            notes = await self._raise_yield_flag(target, level, simulated)
            if level == PreemptionLevel.EVICT and target.pid not in self._locked:
                notes += await self._park_memory(target)
            if needs_lock and target.pid not in self._locked:
                await self._run(
                    self.control.lock, target.pid, target.device_index, self.lock_timeout_ms
                )
                self._locked.add(target.pid)
            if (
                level == PreemptionLevel.EVICT
                and target.pid not in self._checkpointed
                and not self._parked_enough(target)
            ):
                await self._run(self.control.checkpoint, target.pid, target.device_index)
                self._checkpointed.add(target.pid)
            notes.append(_stop_note(target, level, needs_lock, simulated))
            said = target.control_block.session_note if target.control_block is not None else ""
            if said:
                notes.append(f"the session says: {said}")
            applied = max(level, PreemptionLevel.LOCK) if needs_lock else level
            held_by = PreemptionLevel.GATE if simulated else applied
            return Applied(level=applied, held_by=held_by, note="; ".join(notes))

    async def _raise_yield_flag(
        self, target: Target, level: PreemptionLevel, simulated: bool
    ) -> list[str]:
        """Write ``level`` into the session's yield flag where it asks kernels to leave
        (a yield or an abort, or under a lock); the notes for status."""
        flag_level = level in (PreemptionLevel.YIELD, PreemptionLevel.ABORT)
        if not flag_level and not (level >= PreemptionLevel.LOCK and target.yield_flag):
            return []
        if target.yield_flag is not None:
            handle, offset = target.yield_flag
            await self._run(
                self.control.write_yield_flag, target.device_index, handle, offset, int(level)
            )
            return []
        if flag_level and not simulated:
            # Kernels already in flight would not stop: the lock is what stops them.
            return ["no yield flag registered: locked instead"]
        return []

    async def _park_memory(self, target: Target) -> list[str]:
        """Have the session's shim park its parkable memory, at the link's speed and in
        the process, while it can still make CUDA calls: before the lock.  The note."""
        if target.control_block is None:
            return []
        answer = await self._run(park_service.park, target.control_block, target.park_bytes)
        if answer is None:
            return []
        self._memory_parked[target.pid] = answer.moved_bytes
        return [answer.describe("parked")]

    def _parked_enough(self, target: Target) -> bool:
        """Whether the session's shim parked all of a partial eviction (then no checkpoint
        follows: it would move the whole process)."""
        parked = self._memory_parked.get(target.pid, 0)
        return target.park_bytes > 0 and parked >= target.park_bytes

    async def undo(
        self,
        target: Target,
        level: PreemptionLevel | None,
        *,
        lease_ended: bool = False,
        unless: Callable[[], bool] | None = None,
    ) -> bool:
        """Resume ``target`` from ``level``: restore, unlock, clear the flag, open the gate.
        The state word then says running, or no lease at all where the lease ended (the
        launch shim runs long kernels preemptibly only inside a lease).  ``unless()`` is
        asked once this process's earlier steps are done: if it says yes, nothing is
        undone (someone else now holds the process paused) and the answer is False."""
        after = None if lease_ended else LeaseState.RUNNING
        async with self._serial(target.pid):
            if unless is not None and unless():
                return False
            alive = pid_alive(target.pid)
            checkpointed = target.pid in self._checkpointed
            locked = target.pid in self._locked
            parked = self._memory_parked.pop(target.pid, None)
            self._checkpointed.discard(target.pid)
            self._locked.discard(target.pid)
            if alive and (level is not None or locked):
                failure: ActuatorError | None = None
                if checkpointed:
                    try:
                        await self._run(self.control.restore, target.pid, target.device_index)
                    except ActuatorError as exc:
                        failure = exc  # still unlock below: a locked process helps nobody
                if locked:
                    await self._run(self.control.unlock, target.pid, target.device_index)
                if parked is not None and target.control_block is not None:
                    # After the unlock: the session's shim makes CUDA calls to map it back.
                    # Unanswered in time, its first launch or copy brings it back anyway.
                    answer = await self._run(park_service.restore, target.control_block, parked)
                    if answer is not None and not answer.complete:
                        log.info("restore of %s: %s", target.lease_id, answer.describe("restored"))
                if target.yield_flag is not None:
                    handle, offset = target.yield_flag
                    # The flag's owner may have freed it; the gate below opens regardless.
                    with contextlib.suppress(ActuatorError):
                        await self._run(
                            self.control.write_yield_flag, target.device_index, handle, offset, 0
                        )
                if failure is not None:
                    if target.control_block is not None:
                        target.control_block.publish(gate_closed=False, state=after)
                    raise failure
            if target.control_block is not None:
                target.control_block.publish(gate_closed=False, state=after)
            return True

    def keep_eviction(self, pid: int) -> None:
        """Crash recovery: a process an earlier broker evicted stays so under this one
        (checkpointed and locked), to be restored by the usual undo when it resumes or
        its lease ends."""
        self._checkpointed.add(pid)
        self._locked.add(pid)

    def undo_blocking(self, pid: int, device_index: int, level: int) -> None:
        """Crash recovery (no event loop yet): undo what the journal says was applied."""
        if not pid_alive(pid):
            return
        if level >= PreemptionLevel.EVICT:
            # Not checkpointed after all (the crash came first): the unlock is what matters.
            with contextlib.suppress(ActuatorError):
                self.control.restore(pid, device_index)
        if level >= PreemptionLevel.YIELD:  # a yield without a flag escalates to a lock
            with contextlib.suppress(ActuatorError):  # not locked: the crash came before
                self.control.unlock(pid, device_index)


def open_process_control(
    inventory_kind: str,
    device_indices: list[int],
    restore_fails: frozenset[int] = frozenset(),
    lock_drain_s: float = 0.0,
) -> ProcessControl:
    if inventory_kind == "nvml":
        return CudaProcessControl(device_indices)
    return SimulatedProcessControl(restore_fails, lock_drain_s)
