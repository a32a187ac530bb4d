"""Transactional launch of preemptible kernels: resume, restart or snapshot.

What it is for: running one kernel launch as a *transaction* on the current CuPy stream
(or a given one) through the CUDA driver API (``cuModuleLoadData`` of the transformed
PTX, ``cuLaunchKernel``), so that a yield, an abort, a Ctrl-C or an error never leaves a
notebook's arrays half updated by a non-idempotent kernel:

* *resume*: the kernel yields between logical blocks; the launch is continued from the
  progress record's counter (all-or-nothing blocks, see ``transform.py``).
* *restart* (idempotent kernels only): an abort mid-block throws away the logical
  blocks in flight and the launch goes on from the lowest of them.
* *snapshot*: the write-set (buffers the analysis says the kernel writes, as actually
  passed) is copied device-to-device before the first launch; an abort, Ctrl-C or error
  restores it. Yields between blocks still resume.

Where the variant saves state (``saved_state.plan_save``: no shared or local memory, no
barriers, no warp collectives), an abort is not undone at all: every stopped thread
saved its live registers, and the next slice reloads them and goes on, so an abort
keeps all the work done, whatever the kernel's idempotence. A snapshot is still taken
for what Ctrl-C must roll back.

The mode comes from the classification (idempotent -> resume, otherwise snapshot) and
can be forced; :func:`decide_launch` holds that rule for every caller, the launch
shim's launches too (idempotent -> restart there, see its docstring).
:class:`LaunchTransaction` is one launch (plan, snapshot, slices, roll back); the
runtime's :class:`LaunchHooks` are passed to it (``before_launch`` with the
stream handle before every launch, e.g. to enqueue ``cuStreamWaitValue32`` on the gate;
``wait_for_resume`` after a yield), by default the ones the session registered with
:func:`set_session_hooks`.

The pieces it stands on have homes of their own: the driver calls in
:mod:`~gpushare_ext.kernels.driver`, the yield flag in
:mod:`~gpushare_ext.kernels.yield_flags`, the arguments in
:mod:`~gpushare_ext.kernels.arguments`, the progress record and the chunk size in
:mod:`~gpushare_ext.kernels.progress`.

What it must not do: decide *when* to preempt (the broker does) or import CuPy/CUDA at
module import time (CPU-only machines import this module).
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import gpushare_ext.kernels.driver as driver
import gpushare_ext.kernels.progress as progress
import gpushare_ext.kernels.yield_flags as yield_flags
from gpushare_ext.kernels.arguments import BoundArgs, bind_arguments, dim3
from gpushare_ext.kernels.classification import classify_launch
from gpushare_ext.kernels.ptx import KernelError
from gpushare_ext.kernels.report import Classification, Idempotence
from gpushare_ext.kernels.rewrite import NO_BLOCK, PROGRESS_RECORD_BYTES
from gpushare_ext.kernels.transform import PreemptibleKernel
from gpushare_ext.kernels.yield_flags import YieldFlag, resume_without_owner

__all__ = [
    "FINISH_BOUND_US",
    "LaunchDecision",
    "LaunchHooks",
    "LaunchMode",
    "LaunchReport",
    "LaunchShape",
    "LaunchTransaction",
    "decide_launch",
    "launch_kernel",
    "session_hooks",
    "set_session_hooks",
]


def _no_gate(stream_handle: int) -> None:
    """Nothing to hold before a launch (no session gate)."""


def _never() -> bool:
    return False


def _nothing(exempt: bool) -> None:
    """No host-side hold to be exempt from (no launch shim)."""


@dataclass(frozen=True)
class LaunchHooks:
    """What the runtime adds around a transactional launch. ``before_launch(stream)``
    runs before every launch and relaunch (the session's gate enqueues its wait there);
    ``wait_for_resume(flag, interrupted)`` runs after a yield or an abort and returns
    when the launch may go on, or as soon as ``interrupted()`` says yes; it must only
    wait for something its owner (the broker) will end; ``pause_requested()`` is asked
    while a slice runs (about once a millisecond), and when it says yes the launch raises
    its own yield flag.

    Why that: the broker raises the flag from its own CUDA context, and on a
    time-sliced GPU that write waits for a time slice of its own while the kernel it
    should stop keeps running. The session's host thread sees the broker's control
    block change at once, and its write goes out in the kernel's own context.

    ``interrupted()`` says a Ctrl-C came (the launch shim's hook notes it rather than
    raising it): the launch then ends whole at once, rolled back where it has a snapshot,
    else finished without pausing, with ``exempt_from_hold(True)`` so the shim does not
    hold those last launches either.  ``on_interrupt()`` runs first, once: the session
    gives up its lease there if the broker holds it paused, so that nothing it needs (a
    locked process, a closed gate) stays held.  ``cuda_blocked()`` says the broker locks
    the process: a CUDA call would block until it lets go, so the wait for a running
    slice polls on the host meanwhile, where a Ctrl-C can still be noticed."""

    before_launch: Callable[[int], None] = _no_gate
    wait_for_resume: Callable[[YieldFlag, Callable[[], bool]], None] = resume_without_owner
    pause_requested: Callable[[], bool] = _never
    interrupted: Callable[[], bool] = _never
    exempt_from_hold: Callable[[bool], None] = _nothing
    cuda_blocked: Callable[[], bool] = _never
    on_interrupt: Callable[[], object] = _never


_session_hooks = LaunchHooks()


def set_session_hooks(hooks: LaunchHooks) -> None:
    """The runtime's session registers its gate here (used where a launch is given none)."""
    global _session_hooks
    _session_hooks = hooks


def session_hooks() -> LaunchHooks:
    return _session_hooks


class LaunchMode(str, Enum):
    RESUME = "resume"
    RESTART = "restart"
    SNAPSHOT = "snapshot"
    OFF = "off"  # the original kernel, not instrumented


class _Interrupted(KernelError):
    """Ctrl-C during a launch that has a snapshot: roll it back (never leaves the
    transaction: :meth:`LaunchTransaction.run` catches it)."""

    def __init__(self) -> None:
        super().__init__("interrupted", "Ctrl-C: the launch is rolled back", step="launch")


@dataclass
class LaunchReport:
    """What happened in one transactional launch (``kernel.last_launch``)."""

    kernel: str
    mode: LaunchMode
    classification: Classification
    logical_blocks: int
    persistent_blocks: int
    launches: int = 0
    yields: int = 0
    aborts: int = 0
    fenced_accesses: int = 0
    snapshot_bytes: int = 0
    restored: bool = False
    first_yield_ns: int | None = None
    last_exit_ns: int | None = None
    # Per slice that met the raised flag: (its first block's start, the first block's
    # sight of the flag, the last block's exit), %globaltimer ns; the GPU's own measure
    # of each stop (a slice that began after the flag rose is told apart by its start).
    stops_ns: list[tuple[int, int, int]] = field(default_factory=list)
    chunk: int = 1  # logical blocks claimed per atomic
    saves: int = 0  # aborts whose threads saved their state (nothing to undo)
    interrupted: str = ""  # Ctrl-C ended it: "rolled back" (untouched) or "finished"
    gpu_ns: int = 0  # the slices' GPU time, each from its first block start to its last exit
    notes: list[str] = field(default_factory=list)


#: Launches at least this long (microseconds per launch, as the launch shim timed them)
#: get a snapshot even when idempotent, so that a Ctrl-C rolls one back at once instead
#: of waiting for the rest of it to run.
FINISH_BOUND_US = 250_000


@dataclass(frozen=True)
class LaunchDecision:
    """How one launch runs, decided once before it starts: the classification of the
    kernel with the buffers as passed, and the mode that follows from it (or was forced)."""

    classification: Classification
    mode: LaunchMode


def decide_launch(
    kernel: Any,
    extents: dict[str, tuple[int, int]],
    mode: LaunchMode | str | None = None,
    *,
    preemptible: bool = True,
    for_shim: bool = False,
    longest_us: float | None = None,
) -> LaunchDecision:
    """Classify the launch with these buffers and choose its mode, the one rule for every
    launch: ``off`` when it is not to be preemptible, else ``mode`` when forced (restart
    only for an idempotent launch), else snapshot for a launch that is not idempotent, and
    for an idempotent one resume (restart ``for_shim``) or, where its kernel's launches
    took ``longest_us`` of at least ``FINISH_BOUND_US``, snapshot.

    ``for_shim``: a launch the launch shim took from a framework. It is stopped by abort
    checks at back-edges, not only between logical blocks, so an idempotent launch
    restarts where a plain one resumes; and the shim has the original kernel to fall
    back on, so a launch the analysis cannot tell about gets ``off`` (run as it is)
    where a plain one gets a snapshot of every buffer it may write."""
    classification = classify_launch(kernel.report, extents)
    if not preemptible or mode in (LaunchMode.OFF, "off"):
        return LaunchDecision(classification, LaunchMode.OFF)
    if mode is not None:
        return LaunchDecision(classification, _forced_mode(kernel, classification, mode))
    verdict = classification.verdict
    if verdict is Idempotence.UNKNOWN and for_shim:
        return LaunchDecision(classification, LaunchMode.OFF)
    if verdict is not Idempotence.IDEMPOTENT:
        return LaunchDecision(classification, LaunchMode.SNAPSHOT)
    if longest_us is not None and longest_us >= FINISH_BOUND_US:
        return LaunchDecision(classification, LaunchMode.SNAPSHOT)
    return LaunchDecision(classification, LaunchMode.RESTART if for_shim else LaunchMode.RESUME)


def _forced_mode(kernel: Any, cls: Classification, forced: LaunchMode | str) -> LaunchMode:
    mode = LaunchMode(forced)
    if mode is LaunchMode.RESTART and cls.verdict is not Idempotence.IDEMPOTENT:
        raise KernelError(
            "not-idempotent",
            f"restart mode needs an idempotent kernel; {kernel.entry.name} is "
            f"{cls.verdict.value}: {cls.reasons[0] if cls.reasons else ''}",
            step="launch",
        )
    return mode


def launch_kernel(
    kernel: Any,
    grid: Any,
    block: Any,
    args: Sequence[Any],
    *,
    stream: Any = None,
    shared_mem: int = 0,
    mode: LaunchMode | str | None = None,
    fence: bool = False,
    abort_checks: bool | None = None,
    sm_share: float | None = None,
    max_blocks: int | None = None,
    yield_flag: Any = None,
    preempt_at: Sequence[int] = (),
    abort_at: Sequence[int] = (),
    preemptible: bool = True,
    sync: bool = True,
    chunk: int | None = None,
    chunk_target_us: float | None = None,
    bound: BoundArgs | None = None,
    max_aborts: int | None = None,
    hooks: LaunchHooks | None = None,
    decision: LaunchDecision | None = None,
) -> LaunchReport:
    """Run one launch as a transaction (:class:`LaunchTransaction`). See the module
    docstring for the modes.

    ``max_aborts``: after this many aborts that are undone (restart or rollback) the
    launch goes on without back-edge checks (yields between logical blocks only), so a
    launch whose logical blocks are longer than the gaps between preemptions still
    finishes instead of being aborted for ever. Aborts that save the threads' state keep
    all progress and are never bounded.

    ``bound``: the arguments already packed (a launch taken from another framework by
    the launch shim: raw parameter bytes and buffer extents); ``args`` is then unused.

    ``preempt_at``: logical block ids at which the launch is cut and resumed (a
    deterministic yield); ``abort_at``: ids at which a run is stopped and undone (restart or
    rollback) before the launch runs to the end. Both are for tests and benchmarks.

    ``chunk``: logical blocks a persistent block claims at once (forced; default: chosen
    from the measured time per logical block, see :func:`~gpushare_ext.kernels.progress.choose_chunk`);
    ``chunk_target_us``: the wall time a chunk should take (default ``CHUNK_TARGET_US``).

    ``hooks``: the gate and the wait for resume (default: :func:`session_hooks`).

    ``decision``: the classification and mode the caller already decided for these
    arguments (:func:`decide_launch`, or a policy of its own); ``mode`` and
    ``preemptible`` are then not looked at, and the launch is not classified again.
    """
    if bound is None:
        kernel = kernel.bind(args)
        bound = bind_arguments(kernel, args)
    hooks = hooks or session_hooks()
    g = dim3(grid)
    b = dim3(block)
    total = g[0] * g[1] * g[2]
    if total >= NO_BLOCK:
        raise KernelError(
            "grid-too-large", f"{total} blocks exceed the 32-bit logical id", step="launch"
        )
    sh = driver.stream_handle(stream)
    ctx = driver.ensure_context()
    if decision is None:
        decision = decide_launch(kernel, bound.extents, mode, preemptible=preemptible)
    cls, chosen = decision.classification, decision.mode
    if chosen is LaunchMode.OFF:
        return _run_unmodified(kernel, g, b, shared_mem, sh, bound, cls, ctx, sync, "", hooks)
    use_abort = (
        abort_checks
        if abort_checks is not None
        else (chosen is not LaunchMode.RESUME and bool(kernel.report.loops))
    )
    try:
        variant: PreemptibleKernel = kernel.preemptible(abort_checks=use_abort, fence=fence)
    except KernelError as exc:
        # Not transformable (grid sync, early exit before a barrier ...): run it as is.
        note = f"not instrumented: {exc.message}"
        return _run_unmodified(kernel, g, b, shared_mem, sh, bound, cls, ctx, sync, note, hooks)
    shape = LaunchShape(g, b, shared_mem, sh, ctx)
    tx = LaunchTransaction(
        kernel, variant, shape, bound, cls, chosen, yield_flags.as_flag(yield_flag), hooks,
        fence=fence, max_aborts=max_aborts,
    )  # fmt: skip
    tx.plan(sm_share=sm_share, max_blocks=max_blocks, chunk=chunk, chunk_target_us=chunk_target_us)
    return tx.run(preempt_at=preempt_at, abort_at=abort_at, fixed_chunk=chunk is not None)


def _run_unmodified(
    kernel: Any,
    g: tuple[int, int, int],
    b: tuple[int, int, int],
    shared_mem: int,
    sh: int,
    bound: BoundArgs,
    cls: Classification,
    ctx: Any,
    sync: bool,
    note: str,
    hooks: LaunchHooks,
) -> LaunchReport:
    """The original kernel, one launch, not preemptible (mode ``off`` or untransformable)."""
    fn = driver.modules.function(kernel.ptx, kernel.entry.name, ctx)
    driver.launch_raw(fn, g, b, shared_mem, sh, bound.values, hooks.before_launch)
    total = g[0] * g[1] * g[2]
    out = LaunchReport(kernel.entry.name, LaunchMode.OFF, cls, total, total, launches=1)
    if note:
        out.notes.append(note)
    kernel.last_launch = out
    if sync:
        driver.wait_for_stream(sh)
    return out


@dataclass(frozen=True)
class LaunchShape:
    """Where and how big: the original grid and block, dynamic shared memory, the
    stream handle and the context."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    stream: int
    context: Any

    @property
    def logical_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def threads_per_block(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]


class LaunchTransaction:
    """One launch of a preemptible variant as a transaction: :meth:`plan` (persistent
    grid, chunk, record, snapshot set, save area), then :meth:`run` (slices until every
    logical block is done; each yield waits for resume, each abort is saved, restarted
    or rolled back), and on Ctrl-C or an error :meth:`abandon` (stop the kernel, drain,
    roll back what a snapshot covers).

    The gate and the wait for resume are the ``hooks`` it is given, not module state.
    """

    def __init__(
        self,
        kernel: Any,
        variant: PreemptibleKernel,
        shape: LaunchShape,
        bound: BoundArgs,
        classification: Classification,
        mode: LaunchMode,
        flag: YieldFlag,
        hooks: LaunchHooks,
        *,
        fence: bool = False,
        max_aborts: int | None = None,
    ) -> None:
        self.kernel = kernel
        self.variant = variant
        self.shape = shape
        self.bound = bound
        self.cls = classification
        self.mode = mode
        self.flag = flag
        self.hooks = hooks
        self.fence = fence
        self.max_aborts = max_aborts
        self.fn: Any = None
        self.persistent = 1
        self.chunk = 1
        self.times_key: tuple = ()
        self.out: LaunchReport | None = None
        self.record: Any = None
        self.save_area: Any = None
        self.snapshots: list[tuple[int, Any, int]] = []  # (address, copy, nbytes)
        self.slot: progress.PinnedSlot | None = None
        self.drained = True  # False while a slice may run or a record copy is in flight
        self._head: list[bytes] = []
        self._tail: list[bytes] = []
        self._raised = False  # this launch raised its own flag (pause_requested)
        self._finishing = False  # Ctrl-C came and there is no snapshot: run to the end
        self._let_go_done = False  # on_interrupt ran (the session gave up a paused lease)

    # -- plan --------------------------------------------------------------------------

    def plan(
        self,
        *,
        sm_share: float | None = None,
        max_blocks: int | None = None,
        chunk: int | None = None,
        chunk_target_us: float | None = None,
    ) -> None:
        """Persistent grid (the SM share, else what fits on the device at once), chunk,
        progress record, save area, and the parameters every slice shares."""
        import cupy

        shape, variant = self.shape, self.variant
        name = self.kernel.entry.name
        self.fn = driver.modules.function(variant.ptx, name, shape.context)
        sms = driver.DeviceFacts.sm_count(shape.context)
        per_sm = driver.modules.blocks_per_sm(self.fn, shape.threads_per_block, shape.shared_mem)
        if per_sm < 1:
            raise KernelError("does-not-fit", "the block does not fit on one SM", step="launch")
        k_blocks = sms * int(per_sm)
        if sm_share is not None:
            k_blocks = max(1, int(sm_share * sms))
        if max_blocks is not None:
            k_blocks = max(1, min(k_blocks, int(max_blocks)))
        total = shape.logical_blocks
        self.persistent = max(1, min(k_blocks, total))
        self.times_key = (variant.ptx, name, shape.grid, shape.block, shape.shared_mem,
                          self.persistent)  # fmt: skip
        if chunk is not None:
            size = max(1, int(chunk))
        else:
            size = progress.choose_chunk(
                total, self.persistent, progress.BlockTimes.get(self.times_key), chunk_target_us
            )
        self.chunk = progress.fit_chunk(size, total, self.persistent)
        # The record: from CuPy's pool without a memset (its header is written before
        # every slice; the fence scratch area after it is never read).
        self.record = cupy.empty(PROGRESS_RECORD_BYTES, dtype=cupy.uint8)
        out = LaunchReport(name, self.mode, self.cls, total, self.persistent, chunk=self.chunk)
        self.out = out
        if variant.options.abort_checks:
            out.notes.append("flag checks at loop back-edges (abort mode)")
            if variant.saves_state:
                out.notes.append(
                    f"an abort saves {len(variant.saved_registers)} registers per thread"
                )
            elif variant.save_refusal:
                out.notes.append(f"aborts are undone: {variant.save_refusal}")
        self._pack_parameters()

    def _pack_parameters(self) -> None:
        import cupy

        g = self.shape.grid
        self._head = [
            *self.bound.values,
            struct.pack("<Q", int(self.record.data.ptr)),
            struct.pack("<Q", self.flag.device_ptr),
            struct.pack("<I", g[0]),
            struct.pack("<I", g[1]),
            struct.pack("<I", g[2]),
        ]
        tail = [struct.pack("<I", self.chunk)]
        if self.variant.saves_state:
            threads = self.persistent * self.shape.threads_per_block
            stride = 8 * threads
            self.save_area = cupy.empty(self.variant.save_cells * stride, dtype=cupy.uint8)
            ptr = int(self.save_area.data.ptr)
            # Only the tags must start clear: a cell is read only under a set tag.
            cupy.cuda.runtime.memsetAsync(ptr, 0, stride, self.shape.stream)
            tail += [struct.pack("<Q", ptr), struct.pack("<Q", stride)]
        for p in self.variant.fenced_params:
            addr, n = self.bound.extents.get(p, (0, 0))
            tail += [struct.pack("<Q", addr), struct.pack("<Q", n)]
        self._tail = tail

    def _write_set(self) -> list[str]:
        report = self.kernel.report
        if report.classification.verdict is Idempotence.UNKNOWN:
            assert self.out is not None
            self.out.notes.append("unknown kernel: every array argument is snapshotted")
            return list(self.bound.extents)
        return [p for p in report.write_set if p in self.bound.extents]

    # -- snapshot and roll back --------------------------------------------------------

    def take_snapshot(self) -> None:
        """Copy the write-set as passed (device to device, on the launch stream)."""
        import cupy

        assert self.out is not None
        for p in self._write_set():
            addr, n = self.bound.extents[p]
            if n == 0:
                continue
            try:
                copy = cupy.empty(n, dtype=cupy.uint8)
            except cupy.cuda.memory.OutOfMemoryError:
                if self.cls.verdict is not Idempotence.IDEMPOTENT:
                    raise
                # Idempotent: the snapshot was only for Ctrl-C; without the memory for it a
                # Ctrl-C finishes the launch instead of rolling it back.
                self.snapshots.clear()
                self.out.snapshot_bytes = 0
                self.mode = self.out.mode = LaunchMode.RESTART
                self.out.notes.append("no memory for a snapshot: restart mode")
                return
            cupy.cuda.runtime.memcpyAsync(copy.data.ptr, addr, n, 3, self.shape.stream)
            self.snapshots.append((addr, copy, n))
            self.out.snapshot_bytes += n

    def roll_back(self) -> None:
        import cupy

        assert self.out is not None
        for addr, copy, n in self.snapshots:
            cupy.cuda.runtime.memcpyAsync(addr, copy.data.ptr, n, 3, self.shape.stream)
        self.out.restored = True

    def undo(self) -> None:
        """An abort that did not save state: put the buffers back as before the launch."""
        assert self.out is not None
        if self.mode is LaunchMode.SNAPSHOT:
            self.roll_back()
        elif self.mode is LaunchMode.RESUME and self.cls.verdict is not Idempotence.IDEMPOTENT:
            raise KernelError(
                "cannot-undo",
                f"{self.kernel.entry.name} was stopped mid-block in resume mode but is "
                f"{self.cls.verdict.value}; use snapshot mode",
                step="launch",
            )
        self.out.aborts += 1

    # -- slices ------------------------------------------------------------------------

    def write_record(self, start_block: int) -> None:
        assert self.slot is not None
        self.drained = False
        self.slot.write_header(int(self.record.data.ptr), start_block, self.shape.stream)

    def run_slice(self, stop: int) -> dict[str, int]:
        """One launch of the persistent grid over ids ``[record start, stop)``; waits for
        it and returns the progress record."""
        assert self.slot is not None and self.out is not None
        shape = self.shape
        self.drained = False
        self._raised = False
        driver.launch_raw(
            self.fn,
            (self.persistent, 1, 1),
            shape.block,
            shape.shared_mem,
            shape.stream,
            [*self._head, struct.pack("<I", stop), *self._tail],
            None if self._finishing else self.hooks.before_launch,
        )
        self.out.launches += 1
        self.slot.enqueue_read(int(self.record.data.ptr), shape.stream)  # covered by the wait
        driver.wait_for_stream(shape.stream, self._watch_for_pause)
        self.drained = True
        return self.slot.parse()

    def _watch_for_pause(self) -> None:
        """Raise the yield flag as soon as the session is asked to pause (see
        :class:`LaunchHooks`), or as soon as a Ctrl-C comes to a launch that will be
        rolled back; once per slice, the resume hook (or the rollback) lowers it.  While
        the broker locks the process, wait on the host (no CUDA call) until it lets go or
        a Ctrl-C comes."""
        self._while_cuda_blocked()
        if self._raised or self._finishing:
            return
        if self.hooks.pause_requested() or (self.snapshots and self.hooks.interrupted()):
            self._raised = True
            self.flag.set(1)
        self._while_cuda_blocked()

    def _while_cuda_blocked(self) -> None:
        delay = 1e-4
        while self.hooks.cuda_blocked():
            if self.hooks.interrupted():
                self._let_go()
                return
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def _let_go(self) -> None:
        if not self._let_go_done:
            self._let_go_done = True
            self.hooks.on_interrupt()

    def _wait_resume(self) -> None:
        """After a yield or an abort: wait for the resume, unless a Ctrl-C ends the launch
        (then the rollback is raised, or the rest runs without stopping)."""
        if not self._finishing:
            self.hooks.wait_for_resume(self.flag, self.hooks.interrupted)
        self._check_interrupt()

    def _check_interrupt(self) -> None:
        if self._finishing or not self.hooks.interrupted():
            return
        self._let_go()
        if self.snapshots:
            raise _Interrupted()
        self._finish_without_stopping()

    def _finish_without_stopping(self) -> None:
        """Ctrl-C with nothing to roll back to: the rest of the launch runs at once, not
        stopped by the session's flag nor held by its gate, so the buffers end fully
        written and the cell gets control back within the kernel's own time."""
        assert self.out is not None
        self._finishing = True
        self.out.interrupted = "finished"
        zero = yield_flags.zero_flag(self.shape.context)
        self._head[len(self.bound.values) + 1] = struct.pack("<Q", zero.device_ptr)
        self.hooks.exempt_from_hold(True)

    def _without_abort_checks(self) -> None:
        """Go on with yields between logical blocks only (after ``max_aborts``)."""
        assert self.out is not None
        plain = self.kernel.preemptible(abort_checks=False, fence=self.fence)
        self.fn = driver.modules.function(plain.ptx, self.kernel.entry.name, self.shape.context)
        self.out.notes.append(f"after {self.out.aborts} aborts: yields between logical blocks only")

    def _after_abort(self, state: dict[str, int], stop: int) -> int:
        """Where the launch goes on after an abort: saved threads keep everything (the
        counter); an idempotent restart goes on from the lowest block an abort left (all
        below are done); a rolled-back snapshot starts again."""
        assert self.out is not None
        if self.variant.saves_state:
            self.out.saves += 1
            self._wait_resume()
            return min(state["next"], stop)
        if self.mode is LaunchMode.SNAPSHOT and self.hooks.interrupted():
            self._let_go()
            raise _Interrupted()  # rolled back once, by run()
        self.undo()
        # A logical block longer than the gaps between preemptions would be aborted for
        # ever (a rollback loses everything, a restart the blocks in flight): after
        # max_aborts the launch only yields between blocks.
        if self.max_aborts is not None and self.out.aborts == self.max_aborts:
            self._without_abort_checks()
        self._wait_resume()
        if self.mode is LaunchMode.RESTART:
            return min(state["lowest_aborted"], state["next"], stop)
        self.out.fenced_accesses = 0
        return 0

    def _account(self, state: dict[str, int]) -> None:
        assert self.out is not None
        self.out.fenced_accesses += state["fenced"]
        self.out.gpu_ns += progress.slice_gpu_ns(state)
        if state["first_yield_ns"] != (1 << 64) - 1:
            self.out.first_yield_ns = self.out.first_yield_ns or state["first_yield_ns"]
            self.out.last_exit_ns = state["last_exit_ns"]
            self.out.stops_ns.append(
                (state["start_ns"], state["first_yield_ns"], state["last_exit_ns"])
            )

    def run(
        self, *, preempt_at: Sequence[int] = (), abort_at: Sequence[int] = (),
        fixed_chunk: bool = False,
    ) -> LaunchReport:  # fmt: skip
        """Slices until every logical block is done. ``preempt_at``/``abort_at``: see
        :func:`launch_kernel`."""
        assert self.out is not None
        self.slot = progress.PinnedSlot()
        total = self.shape.logical_blocks
        cuts = sorted({int(x) for x in preempt_at if 0 < int(x) < total})
        aborts = sorted(int(x) for x in abort_at if 0 <= int(x) <= total)
        try:
            if self.mode is LaunchMode.SNAPSHOT:
                self.take_snapshot()
            for cut in aborts:  # simulated aborts: run a prefix, undo it, start again
                self.write_record(0)
                self.run_slice(cut)
                self.undo()
            self._slices(total, cuts, fixed_chunk)
        except _Interrupted:
            self._roll_back_interrupted()
        except BaseException:
            self.abandon()
            raise
        finally:
            if self._finishing:
                self.hooks.exempt_from_hold(False)
        if self._raised:
            # Raised by this launch for a pause its last slice outran: lowered, so the next
            # launch is not stopped at once (the shim's hold or the gate holds it instead).
            self.flag.set(0)
        self.kernel.last_launch = self.out
        self.slot.release()
        return self.out

    def _roll_back_interrupted(self) -> None:
        """Ctrl-C, with a snapshot: the kernel has drained (a slice ended), so put the
        write-set back as it was before the launch and lower the flag this launch raised."""
        assert self.out is not None
        self.roll_back()
        driver.wait_for_stream(self.shape.stream)
        if self._raised:
            self.flag.set(0)
        self.out.interrupted = "rolled back"

    def _slices(self, total: int, cuts: list[int], fixed_chunk: bool) -> None:
        assert self.out is not None
        self.write_record(0)
        start = 0
        pending = list(cuts)
        saved = False  # threads parked with saved state: one more slice at least
        while start < total or saved:
            stop = pending.pop(0) if pending and pending[0] > start else total
            while pending and pending[0] <= start:
                pending.pop(0)
            state = self.run_slice(stop)
            self._account(state)
            saved = False  # a slice without an abort finished every saved thread
            if state["aborted"]:
                start = self._after_abort(state, stop)
                saved = self.variant.saves_state
                pending = []
                self.write_record(start)
                continue
            done_to = min(state["next"], stop)
            if done_to >= stop and state["end_ns"] > state["start_ns"] and not fixed_chunk:
                progress.BlockTimes.record(
                    self.times_key, state["end_ns"] - state["start_ns"], self.persistent,
                    stop - start,
                )  # fmt: skip
            if done_to < stop:  # the flag was seen: a real yield
                self.out.yields += 1
                self._wait_resume()
            elif stop < total:
                self.out.yields += 1  # a deterministic cut
            self._check_interrupt()
            start = done_to
            if start < total:
                self.write_record(start)

    def abandon(self) -> None:
        """An error (or a Ctrl-C raised in the middle of it): stop the kernel, wait for it
        to drain, undo its writes.  The flag is lowered again whatever happens: one left
        raised would stop every later launch of the session at once."""
        with contextlib.suppress(BaseException):
            try:
                self.flag.set(1)
                if not self.drained:
                    driver.wait_for_stream(self.shape.stream)
                self.drained = True
            finally:
                self.flag.set(0)
        if self.snapshots:
            with contextlib.suppress(BaseException):
                self.roll_back()
                driver.wait_for_stream(self.shape.stream)
        if self.slot is not None and self.drained:
            self.slot.release()  # else a record copy may be in flight: never reuse it
        self.kernel.last_launch = self.out
