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

Where the variant saves state (``transform.SavePlan``: no shared or local memory, no
barriers, no warp collectives), an abort is not undone at all: every stopped thread
saved its live registers, and the next slice reloads them and goes on, so an abort
keeps all the work done, whatever the kernel's idempotence. A snapshot is still taken
for what Ctrl-C must roll back.

The mode comes from the classification (idempotent -> resume, otherwise snapshot) and
can be forced. :class:`LaunchTransaction` is one launch (plan, snapshot, slices, roll
back); the runtime's :class:`LaunchHooks` are passed to it (``before_launch`` with the
stream handle before every launch, e.g. to enqueue ``cuStreamWaitValue32`` on the gate;
``wait_for_resume`` after a yield), by default the ones the session registered with
:func:`set_session_hooks`.

Also here: :class:`YieldFlag`, a device int32 the broker writes through a CUDA IPC
handle, and :func:`write_yield_flag_from_handle`, which the broker's actuator calls from
its own process (``cuStreamWriteValue32`` on a high-priority stream: no SM needed).

What it must not do: decide *when* to preempt (the broker does) or import CuPy/CUDA at
module import time (CPU-only machines import this module).
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from gpushare_ext.kernels.analysis import Classification, Idempotence, classify_launch
from gpushare_ext.kernels.ptx import KernelError, Param, set_version
from gpushare_ext.kernels.transform import (
    NO_BLOCK,
    PROGRESS_RECORD_BYTES,
    PreemptibleKernel,
    RecordLayout,
)

__all__ = [
    "LaunchHooks",
    "LaunchMode",
    "LaunchReport",
    "LaunchShape",
    "LaunchTransaction",
    "YieldFlag",
    "launch_kernel",
    "poll_until_resumed",
    "session_hooks",
    "set_session_hooks",
    "set_session_yield_flag",
    "write_yield_flag_from_handle",
]


def _no_gate(stream_handle: int) -> None:
    """Nothing to hold before a launch (no session gate)."""


def _never() -> bool:
    return False


def _nothing(exempt: bool) -> None:
    """No host-side hold to be exempt from (no launch shim)."""


def poll_until_resumed(flag: YieldFlag, interrupted: Callable[[], bool] = _never) -> None:
    """Wait until whoever raised the yield flag lowers it (polling, up to 5 ms between
    reads), or until ``interrupted()``.  Only for a caller that owns the flag's other
    writer (a test or benchmark standing in for the broker): nobody else lowers it."""
    delay = 1e-4
    while flag.read() != 0 and not interrupted():
        time.sleep(delay)
        delay = min(delay * 2, 5e-3)


def resume_without_owner(flag: YieldFlag, interrupted: Callable[[], bool] = _never) -> None:
    """After a yield with no session: no broker can have raised the flag, so it is this
    process's own (a launch stopped for Ctrl-C, or one left raised): lower it and go on.
    Waiting here would be a wait nobody ends."""
    if flag.read() != 0:
        flag.set(0)


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


# ---------------------------------------------------------------------------------------
# Driver helpers
# ---------------------------------------------------------------------------------------


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KernelError("no-cuda", "cuda-bindings is not installed", step="launch") from exc
    return driver


def _check(result: Any, what: str) -> Any:
    drv = _driver()
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        raise KernelError("cuda-error", f"{what} failed: {name}", step="launch")
    if len(rest) == 1:
        return rest[0]
    return rest or None


_initialised = False


def _ensure_context(device: int | None = None) -> Any:
    """Make the device's primary context current (CuPy's context when CuPy is in use)."""
    global _initialised
    drv = _driver()
    if not _initialised:  # cuInit once per process (it is idempotent, but not free)
        _check(drv.cuInit(0), "cuInit")
        _initialised = True
    ctx = _check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0 and device is None:
        return ctx
    dev = _check(drv.cuDeviceGet(device or 0), "cuDeviceGet")
    ctx = _check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    _check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


_ISA_FOR_DRIVER = {
    12000: "8.0", 12010: "8.1", 12020: "8.2", 12030: "8.3", 12040: "8.4", 12050: "8.5",
    12060: "8.5", 12080: "8.7", 12090: "8.8", 13000: "9.0", 13010: "9.1", 13020: "9.2",
}  # fmt: skip


def driver_ptx_isa() -> str:
    """The newest PTX ISA version the installed driver's JIT accepts."""
    drv = _driver()
    version = _check(drv.cuDriverGetVersion(), "cuDriverGetVersion")
    best = "8.0"
    for v, isa in sorted(_ISA_FOR_DRIVER.items()):
        if version >= v:
            best = isa
    return best


def _fit_version(ptx: str) -> str:
    import re

    m = re.search(r"^\s*\.version\s+(\d+)\.(\d+)", ptx, re.M)
    if not m:
        return ptx
    have = (int(m.group(1)), int(m.group(2)))
    isa = driver_ptx_isa()
    cap = tuple(int(x) for x in isa.split("."))
    return set_version(ptx, isa) if have > cap else ptx


class _ModuleCache:
    """Loaded modules, their functions and occupancy, per context (loaded once each)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mods: dict[tuple[int, str], Any] = {}
        self._fns: dict[tuple[int, str, str], Any] = {}
        self._occupancy: dict[tuple[int, int, int], int] = {}

    def function(self, ptx: str, name: str, ctx: Any = None) -> Any:
        drv = _driver()
        if ctx is None:
            ctx = _ensure_context()
        fkey = (int(ctx), ptx, name)
        fn = self._fns.get(fkey)
        if fn is not None:
            return fn
        key = (int(ctx), ptx)
        with self._lock:
            mod = self._mods.get(key)
            if mod is None:
                image = _fit_version(ptx).encode() + b"\0"
                result = drv.cuModuleLoadData(image)
                if result[0] != drv.CUresult.CUDA_SUCCESS:
                    _, err = drv.cuGetErrorName(result[0])
                    raise KernelError(
                        "module-load-failed",
                        f"the driver rejected the PTX of {name}: {err.decode() if err else result[0]}",
                        step="launch",
                    )
                mod = result[1]
                self._mods[key] = mod
            fn = _check(drv.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
            self._fns[fkey] = fn
        return fn

    def blocks_per_sm(self, fn: Any, threads: int, shared: int) -> int:
        """``cuOccupancyMaxActiveBlocksPerMultiprocessor``, cached per (function, block)."""
        key = (int(fn), threads, shared)
        n = self._occupancy.get(key)
        if n is None:
            n = int(
                _check(
                    _driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, shared),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                )
            )
            self._occupancy[key] = n
        return n


_modules = _ModuleCache()


# ---------------------------------------------------------------------------------------
# The yield flag
# ---------------------------------------------------------------------------------------


def _side_stream() -> Any:
    """A non-blocking stream of the highest priority (never waits on the legacy stream)."""
    drv = _driver()
    _ensure_context()  # the calling thread may have no current context
    _, greatest = _check(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    return _check(
        drv.cuStreamCreateWithPriority(drv.CUstream_flags.CU_STREAM_NON_BLOCKING, greatest),
        "cuStreamCreateWithPriority",
    )


def _write_word(stream: Any, address: int, value: int) -> None:
    drv = _driver()
    err = drv.cuStreamWriteValue32(
        stream,
        drv.CUdeviceptr(address),
        value,
        drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT,
    )
    err = err[0] if isinstance(err, tuple) else err
    if err != drv.CUresult.CUDA_SUCCESS:  # stream memory operations unsupported: a memset
        _check(drv.cuMemsetD32Async(drv.CUdeviceptr(address), value, 1, stream), "cuMemsetD32Async")
    _check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")


class YieldFlag:
    """A device-memory int32 the persistent kernels poll; nonzero means "yield now".

    Allocated with ``cuMemAlloc`` so it can be shared through a CUDA IPC handle. Written
    with ``cuStreamWriteValue32`` on a private high-priority non-blocking stream, never with
    a kernel (a kernel would queue behind the very kernel it should stop).
    """

    def __init__(self, device_ptr: int | None = None) -> None:
        drv = _driver()
        _ensure_context()
        self._owned = device_ptr is None
        if device_ptr is None:
            ptr = _check(drv.cuMemAlloc(4), "cuMemAlloc")
            _check(drv.cuMemsetD32(ptr, 0, 1), "cuMemsetD32")
            device_ptr = int(ptr)
        self.device_ptr = int(device_ptr)
        # Made here, in the thread that owns the context: set() may come from any thread.
        self._stream = _side_stream()

    def set(self, value: int = 1) -> None:
        _write_word(self._stream, self.device_ptr, value)

    def clear(self) -> None:
        self.set(0)

    def read(self) -> int:
        drv = _driver()
        buf = (ctypes.c_uint32 * 1)()
        _check(
            drv.cuMemcpyDtoHAsync(
                ctypes.addressof(buf), drv.CUdeviceptr(self.device_ptr), 4, self._stream
            ),
            "cuMemcpyDtoHAsync",
        )
        _check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        return int(buf[0])

    def ipc_handle(self) -> bytes:
        """64 bytes another process passes to :func:`write_yield_flag_from_handle`."""
        drv = _driver()
        handle = _check(
            drv.cuIpcGetMemHandle(drv.CUdeviceptr(self.device_ptr)), "cuIpcGetMemHandle"
        )
        return ctypes.string_at(handle.getPtr(), 64)

    def close(self) -> None:
        drv = _driver()
        if self._owned and self.device_ptr:
            drv.cuMemFree(drv.CUdeviceptr(self.device_ptr))
            self.device_ptr = 0
        if self._stream is not None:
            with contextlib.suppress(Exception):
                drv.cuStreamDestroy(self._stream)
            self._stream = None


_opened: dict[tuple[bytes, int], tuple[int, Any]] = {}
_opened_lock = threading.Lock()


def write_yield_flag_from_handle(handle_bytes: bytes, value: int, device: int = 0) -> None:
    """Write ``value`` into another process's yield flag (the broker's actuator calls this).

    Opens the IPC handle once per (handle, device) and keeps it open; the write is a
    ``cuStreamWriteValue32`` on a high-priority non-blocking stream, then a sync.
    """
    if len(handle_bytes) != 64:
        raise KernelError("bad-ipc-handle", "a CUDA IPC memory handle has 64 bytes", step="launch")
    drv = _driver()
    with _opened_lock:
        key = (bytes(handle_bytes), device)
        if key not in _opened:
            _ensure_context(device)
            handle = drv.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), bytes(handle_bytes), 64)
            ptr = _check(
                drv.cuIpcOpenMemHandle(
                    handle, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                ),
                "cuIpcOpenMemHandle",
            )
            _opened[key] = (int(ptr), _side_stream())
        ptr, stream = _opened[key]
    _write_word(stream, ptr, value)


_session_flag: Any = None


def set_session_yield_flag(flag: Any) -> None:
    """The runtime's control block registers the session's flag here (an object with
    ``.device_ptr`` or a device address)."""
    global _session_flag
    _session_flag = flag


# Wrappers around flags given as an address (or an object with ``.device_ptr``), one per
# address: wrapping once keeps launches from creating a stream each time.
_flag_views: dict[int, YieldFlag] = {}


def _as_flag(flag: Any) -> YieldFlag:
    if flag is None:
        global _session_flag
        if _session_flag is None:
            _session_flag = YieldFlag()
        flag = _session_flag
    if isinstance(flag, YieldFlag):
        return flag
    ptr = int(flag.device_ptr if hasattr(flag, "device_ptr") else flag)
    view = _flag_views.get(ptr)
    if view is None:
        view = _flag_views[ptr] = YieldFlag(device_ptr=ptr)
    return view


# A flag nobody raises, per context: the rest of a launch Ctrl-C interrupted runs with it.
_zero_flags: dict[int, YieldFlag] = {}


def _zero_flag(context: Any) -> YieldFlag:
    key = int(context) if context is not None else 0
    flag = _zero_flags.get(key)
    if flag is None:
        flag = _zero_flags[key] = YieldFlag()
    return flag


class _Interrupted(KernelError):
    """Ctrl-C during a launch that has a snapshot: roll it back (never leaves the
    transaction: :meth:`LaunchTransaction.run` catches it)."""

    def __init__(self) -> None:
        super().__init__("interrupted", "Ctrl-C: the launch is rolled back", step="launch")


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------

_PACK = {
    "u8": "B", "s8": "b", "b8": "B", "u16": "H", "s16": "h", "b16": "H", "f16": "e",
    "u32": "I", "s32": "i", "b32": "I", "f32": "f",
    "u64": "Q", "s64": "q", "b64": "Q", "f64": "d",
}  # fmt: skip


def _is_array(value: Any) -> bool:
    return hasattr(value, "__cuda_array_interface__")


def _array_extent(value: Any) -> tuple[int, int]:
    """(lowest address, bytes spanned) of a device array, any strides."""
    cai = value.__cuda_array_interface__
    ptr = int(cai["data"][0])
    shape = tuple(cai["shape"])
    import numpy as np

    itemsize = np.dtype(cai["typestr"]).itemsize
    if any(s == 0 for s in shape):
        return ptr, 0
    strides = cai.get("strides") or None
    if strides is None:
        n = itemsize
        for s in shape:
            n *= s
        return ptr, n
    lo = hi = 0
    for s, st in zip(shape, strides, strict=True):
        if st >= 0:
            hi += (s - 1) * st
        else:
            lo += (s - 1) * st
    return ptr + lo, hi - lo + itemsize


def _scalar(value: Any, p: Param) -> bytes:
    fmt = _PACK.get(p.type)
    if fmt is None or p.array is not None:
        if isinstance(value, (bytes, bytearray)) and len(value) == p.size:
            return bytes(value)
        raise KernelError(
            "bad-argument", f"parameter {p.name} ({p.type}[{p.array}]) needs {p.size} raw bytes"
        )
    if hasattr(value, "item"):
        value = value.item()
    if fmt in "efd":
        return struct.pack("<" + fmt, float(value))
    v = int(value)
    if fmt.isupper():
        v &= (1 << (8 * struct.calcsize(fmt))) - 1
    return struct.pack("<" + fmt, v)


@dataclass
class BoundArgs:
    values: list[bytes]  # one per original PTX parameter
    extents: dict[str, tuple[int, int]]  # pointer param -> (address, nbytes)
    arrays: dict[str, Any]  # pointer param -> the user's array


def bind_arguments(kernel: Any, args: Sequence[Any]) -> BoundArgs:
    entry = kernel.entry
    bindings = kernel.bindings
    if len(args) != len(bindings):
        names = ", ".join(b.name for b in bindings)
        raise KernelError(
            "bad-argument",
            f"{entry.name} takes {len(bindings)} arguments ({names}), got {len(args)}",
        )
    values: dict[str, bytes] = {}
    extents: dict[str, tuple[int, int]] = {}
    arrays: dict[str, Any] = {}
    for b, a in zip(bindings, args, strict=True):
        if b.kind == "numba-array":
            if not _is_array(a):
                raise KernelError("bad-argument", f"argument {b.name} must be a device array")
            cai = a.__cuda_array_interface__
            import numpy as np

            itemsize = np.dtype(cai["typestr"]).itemsize
            shape = tuple(cai["shape"])
            strides = cai.get("strides") or _c_strides(shape, itemsize)
            nitems = 1
            for s in shape:
                nitems *= s
            ptr = int(cai["data"][0])
            fields = [0, 0, nitems, itemsize, ptr, *shape, *strides]
            for p, v in zip(b.params, fields, strict=True):
                values[p] = _scalar(v, entry.param(p))
            extents[b.data_param] = _array_extent(a)
            arrays[b.data_param] = a
        else:
            p = entry.param(b.params[0])
            if _is_array(a):
                ptr, n = _array_extent(a)
                values[p.name] = struct.pack("<Q", int(a.__cuda_array_interface__["data"][0]))
                extents[p.name] = (ptr, n)
                arrays[p.name] = a
            else:
                values[p.name] = _scalar(a, p)
    return BoundArgs([values[p.name] for p in entry.params], extents, arrays)


def _c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    out = []
    acc = itemsize
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def _param_array(values: Sequence[bytes]) -> tuple[Any, Any]:
    """``kernelParams`` for cuLaunchKernel: one host buffer holding every value (each at a
    16-byte aligned offset) and the array of pointers into it. Keep both alive until the
    launch call returns (the driver copies the values during the call)."""
    offsets = []
    blob = bytearray()
    for v in values:
        offsets.append(len(blob))
        blob += v
        blob += b"\0" * (-len(blob) % 16)
    buf = ctypes.create_string_buffer(bytes(blob), max(len(blob), 8))
    base = ctypes.addressof(buf)
    ptrs = (ctypes.c_void_p * max(len(values), 1))(*[base + o for o in offsets])
    return ptrs, buf


def _dim3(v: Any) -> tuple[int, int, int]:
    if isinstance(v, int):
        return (v, 1, 1)
    t = tuple(int(x) for x in v)
    return (*t, 1, 1, 1)[:3]  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------
# The transaction
# ---------------------------------------------------------------------------------------


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
    chunk: int = 1  # logical blocks claimed per atomic
    saves: int = 0  # aborts whose threads saved their state (nothing to undo)
    interrupted: str = ""  # Ctrl-C ended it: "rolled back" (untouched) or "finished"
    notes: list[str] = field(default_factory=list)


def _stream_handle(stream: Any) -> int:
    if stream is None:
        try:
            import cupy

            return int(cupy.cuda.get_current_stream().ptr)
        except ImportError:
            return 0
    if hasattr(stream, "ptr"):
        return int(stream.ptr)
    if hasattr(stream, "handle"):
        return int(stream.handle)
    return int(stream)


def _choose_mode(kernel: Any, cls: Classification, forced: Any) -> LaunchMode:
    if forced is not None:
        mode = LaunchMode(forced)
        if mode is LaunchMode.RESTART and cls.verdict is not Idempotence.IDEMPOTENT:
            raise KernelError(
                "not-idempotent",
                f"restart mode needs an idempotent kernel; {kernel.entry.name} is "
                f"{cls.verdict.value}: {cls.reasons[0] if cls.reasons else ''}",
                step="launch",
            )
        return mode
    return LaunchMode.RESUME if cls.verdict is Idempotence.IDEMPOTENT else LaunchMode.SNAPSHOT


class _Device:
    """The few device facts the launcher needs, read once per context."""

    _cache: ClassVar[dict[int, tuple[int, str]]] = {}

    @classmethod
    def sm_count(cls, ctx: Any = None) -> int:
        if ctx is None:
            ctx = _ensure_context()
        key = int(ctx)
        hit = cls._cache.get(key)
        if hit is not None:
            return hit[0]
        drv = _driver()
        dev = _check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
        n = _check(
            drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev
            ),
            "cuDeviceGetAttribute",
        )
        cls._cache[key] = (int(n), "")
        return int(n)


# The part of the record the launcher writes before and reads after each slice (the fence
# scratch area after it is never read).
_RECORD_HEADER = RecordLayout.SCRATCH


def _parse_record(raw: bytes) -> dict[str, int]:
    L = RecordLayout
    (nxt,) = struct.unpack_from("<I", raw, L.NEXT_BLOCK)
    (fin,) = struct.unpack_from("<I", raw, L.FINISHED)
    (first,) = struct.unpack_from("<Q", raw, L.FIRST_YIELD_NS)
    (last,) = struct.unpack_from("<Q", raw, L.LAST_EXIT_NS)
    (fenced,) = struct.unpack_from("<Q", raw, L.FENCED)
    (aborted,) = struct.unpack_from("<I", raw, L.ABORTED)
    (yexits,) = struct.unpack_from("<I", raw, L.YIELD_EXITS)
    (start_ns,) = struct.unpack_from("<Q", raw, L.START_NS)
    (end_ns,) = struct.unpack_from("<Q", raw, L.END_NS)
    (lowest_aborted,) = struct.unpack_from("<I", raw, L.LOWEST_ABORTED)
    return {
        "next": nxt, "finished": fin, "first_yield_ns": first, "last_exit_ns": last,
        "fenced": fenced, "aborted": aborted, "yield_exits": yexits,
        "start_ns": start_ns, "end_ns": end_ns, "lowest_aborted": lowest_aborted,
    }  # fmt: skip


def _read_record(record: Any) -> dict[str, int]:
    """Read a record held in a CuPy array (a D2H copy and a sync; benchmarks use this)."""
    import numpy as np

    host = record.get()
    return _parse_record(np.asarray(host, dtype=np.uint8).tobytes())


def initial_record(start_block: int = 0) -> bytes:
    raw = bytearray(PROGRESS_RECORD_BYTES)
    struct.pack_into("<I", raw, RecordLayout.NEXT_BLOCK, start_block)
    struct.pack_into("<Q", raw, RecordLayout.FIRST_YIELD_NS, (1 << 64) - 1)
    struct.pack_into("<Q", raw, RecordLayout.START_NS, (1 << 64) - 1)
    struct.pack_into("<I", raw, RecordLayout.LOWEST_ABORTED, NO_BLOCK)
    return bytes(raw)


class _PinnedSlot:
    """Page-locked host memory for one launch's record traffic: the header written before
    each slice (``[H, 2H)``) and the header read back after it (``[0, H)``).

    Both copies are ``cuMemcpy*Async`` on the launch stream: the write is ordered before
    the launch and the read right behind it, so the one wait for the stream covers the
    kernel and the read-back (no second round trip, no allocation, no memset kernel).
    The header source is only rewritten after a wait for the stream, so a copy never reads
    it while it changes. Slots are reused; one whose copies may still be in flight (an
    interrupted launch that could not drain) is never put back.
    """

    _free: ClassVar[list[int]] = []
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        with self._lock:
            ptr = self._free.pop() if self._free else None
        if ptr is None:
            drv = _driver()  # portable: page-locked for every context (device)
            ptr = int(
                _check(
                    drv.cuMemHostAlloc(2 * _RECORD_HEADER, drv.CU_MEMHOSTALLOC_PORTABLE),
                    "cuMemHostAlloc",
                )
            )
        self.ptr = ptr

    def write_header(self, record_ptr: int, start_block: int, stream_handle: int) -> None:
        drv = _driver()
        src = self.ptr + _RECORD_HEADER
        ctypes.memmove(src, initial_record(start_block), _RECORD_HEADER)
        _check(
            drv.cuMemcpyHtoDAsync(
                drv.CUdeviceptr(record_ptr), src, _RECORD_HEADER, drv.CUstream(stream_handle)
            ),
            "cuMemcpyHtoDAsync(progress record)",
        )

    def enqueue_read(self, record_ptr: int, stream_handle: int) -> None:
        drv = _driver()
        _check(
            drv.cuMemcpyDtoHAsync(
                self.ptr, drv.CUdeviceptr(record_ptr), _RECORD_HEADER, drv.CUstream(stream_handle)
            ),
            "cuMemcpyDtoHAsync(progress record)",
        )

    def parse(self) -> dict[str, int]:
        return _parse_record(ctypes.string_at(self.ptr, _RECORD_HEADER))

    def release(self) -> None:
        with self._lock:
            self._free.append(self.ptr)


def _wait(stream_handle: int, on_tick: Callable[[], None] | None = None) -> None:
    """Wait for the stream with short sleeps so that Ctrl-C can land meanwhile;
    ``on_tick`` is called between sleeps.

    The sleep grows with the time already waited but stays under a tenth of it (at most
    1 ms), so a launch is not noticed much later than it ends.
    """
    drv = _driver()
    event = _check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    try:
        _check(drv.cuEventRecord(event, drv.CUstream(stream_handle)), "cuEventRecord")
        t0 = time.perf_counter()
        while True:
            err = drv.cuEventQuery(event)
            err = err[0] if isinstance(err, tuple) else err
            if err == drv.CUresult.CUDA_SUCCESS:
                return
            if err != drv.CUresult.CUDA_ERROR_NOT_READY:
                _check(err, "kernel execution")
            if on_tick is not None:
                on_tick()
            time.sleep(min(1e-3, max(1e-5, 0.1 * (time.perf_counter() - t0))))
    finally:
        drv.cuEventDestroy(event)


def _launch_raw(
    function: Any,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared: int,
    stream_handle: int,
    values: Sequence[bytes],
    before_launch: Callable[[int], None] = _no_gate,
) -> None:
    drv = _driver()
    before_launch(stream_handle)
    ptrs, keep = _param_array(values)
    _check(
        drv.cuLaunchKernel(
            function, *grid, *block, shared, drv.CUstream(stream_handle), ctypes.addressof(ptrs), 0
        ),
        "cuLaunchKernel",
    )
    del keep


# ---------------------------------------------------------------------------------------
# Chunk size: logical blocks claimed per atomic
# ---------------------------------------------------------------------------------------

#: Wall time one chunk should take on a persistent block (us): the leader's serial
#: dispatch (flag load, atomic, barrier: ~1-2 us of latency) is paid once per chunk, and a
#: yield waits for at most one chunk per persistent block. ``launch_kernel(
#: chunk_target_us=...)`` overrides per launch. 12 us keeps the drain within the 18 us
#: target while amortising the dispatch: on the H200, ~1 us logical blocks cost +29 % at
#: C = 4 and -5 % at C = 16 (benchmarks/results, overhead_by_chunk).
CHUNK_TARGET_US = 12.0
CHUNK_MAX = 64
#: Chunk of a kernel's first launch (no measurement yet) when there are at least
#: ``CHUNK_FIRST_MIN_PER_BLOCK`` logical blocks per persistent block; else 1.
CHUNK_FIRST = 8
CHUNK_FIRST_MIN_PER_BLOCK = 64


class _BlockTimes:
    """Estimated wall time of one logical block on one persistent block (ns), per kernel
    variant and launch shape, from the progress record's ``%globaltimer`` stamps (first
    persistent block start, last exit) of slices that ran without a yield:
    ``(end - start) * persistent / logical blocks run``. Smoothed (mean with the previous
    estimate) so one noisy slice does not swing the chunk size."""

    _lock = threading.Lock()
    _ns: ClassVar[dict[tuple, float]] = {}

    @classmethod
    def get(cls, key: tuple) -> float | None:
        return cls._ns.get(key)

    @classmethod
    def record(cls, key: tuple, elapsed_ns: int, persistent: int, blocks: int) -> None:
        # Too few logical blocks per persistent block: launch ramp and tail dominate.
        if elapsed_ns <= 0 or blocks < 2 * persistent:
            return
        est = elapsed_ns * persistent / blocks
        with cls._lock:
            old = cls._ns.get(key)
            cls._ns[key] = est if old is None else 0.5 * (old + est)

    @classmethod
    def clear(cls) -> None:
        with cls._lock:
            cls._ns.clear()


def choose_chunk(
    logical_blocks: int,
    persistent_blocks: int,
    block_ns: float | None,
    target_us: float | None = None,
) -> int:
    """Logical blocks per claim: about ``target_us`` of work per chunk given the estimated
    time of one logical block (``block_ns``; ``None`` before the first measurement), at
    most ``CHUNK_MAX``, and small enough that every persistent block gets >= 4 chunks."""
    target = CHUNK_TARGET_US if target_us is None else float(target_us)
    k = max(1, persistent_blocks)
    spread = max(1, -(-logical_blocks // (k * 4)))  # ceil(logical / (4 K))
    if block_ns is None:
        c = CHUNK_FIRST if logical_blocks >= CHUNK_FIRST_MIN_PER_BLOCK * k else 1
    else:
        c = round(target * 1e3 / max(block_ns, 1.0))
    return max(1, min(c, CHUNK_MAX, spread))


def _fit_chunk(chunk: int, total: int, persistent: int) -> int:
    """The counter overshoots ``total`` by at most one chunk per persistent block: keep it
    below 2^32 (a wrapped counter would hand out ids again)."""
    while chunk > 1 and total + persistent * chunk >= NO_BLOCK:
        chunk //= 2
    if total + persistent * chunk >= NO_BLOCK:
        raise KernelError(
            "grid-too-large",
            f"{total} blocks + {persistent} persistent blocks overflow the 32-bit counter",
            step="launch",
        )
    return chunk


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
    from the measured time per logical block, see :func:`choose_chunk`);
    ``chunk_target_us``: the wall time a chunk should take (default ``CHUNK_TARGET_US``).

    ``hooks``: the gate and the wait for resume (default: :func:`session_hooks`).
    """
    if bound is None:
        kernel = kernel.bind(args)
        bound = bind_arguments(kernel, args)
    hooks = hooks or session_hooks()
    g = _dim3(grid)
    b = _dim3(block)
    total = g[0] * g[1] * g[2]
    if total >= NO_BLOCK:
        raise KernelError(
            "grid-too-large", f"{total} blocks exceed the 32-bit logical id", step="launch"
        )
    cls = classify_launch(kernel.report, bound.extents)
    sh = _stream_handle(stream)
    ctx = _ensure_context()
    if not preemptible or mode in (LaunchMode.OFF, "off"):
        return _run_unmodified(kernel, g, b, shared_mem, sh, bound, cls, ctx, sync, "", hooks)
    chosen = _choose_mode(kernel, cls, mode)
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
        kernel, variant, shape, bound, cls, chosen, _as_flag(yield_flag), hooks,
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
    fn = _modules.function(kernel.ptx, kernel.entry.name, ctx)
    _launch_raw(fn, g, b, shared_mem, sh, bound.values, hooks.before_launch)
    total = g[0] * g[1] * g[2]
    out = LaunchReport(kernel.entry.name, LaunchMode.OFF, cls, total, total, launches=1)
    if note:
        out.notes.append(note)
    kernel.last_launch = out
    if sync:
        _wait(sh)
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
        self.slot: _PinnedSlot | None = None
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
        self.fn = _modules.function(variant.ptx, name, shape.context)
        sms = _Device.sm_count(shape.context)
        per_sm = _modules.blocks_per_sm(self.fn, shape.threads_per_block, shape.shared_mem)
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
            size = choose_chunk(
                total, self.persistent, _BlockTimes.get(self.times_key), chunk_target_us
            )
        self.chunk = _fit_chunk(size, total, self.persistent)
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
        _launch_raw(
            self.fn,
            (self.persistent, 1, 1),
            shape.block,
            shape.shared_mem,
            shape.stream,
            [*self._head, struct.pack("<I", stop), *self._tail],
            _no_gate if self._finishing else self.hooks.before_launch,
        )
        self.out.launches += 1
        self.slot.enqueue_read(int(self.record.data.ptr), shape.stream)  # covered by the wait
        _wait(shape.stream, self._watch_for_pause)
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
        zero = _zero_flag(self.shape.context)
        self._head[len(self.bound.values) + 1] = struct.pack("<Q", zero.device_ptr)
        self.hooks.exempt_from_hold(True)

    def _without_abort_checks(self) -> None:
        """Go on with yields between logical blocks only (after ``max_aborts``)."""
        assert self.out is not None
        plain = self.kernel.preemptible(abort_checks=False, fence=self.fence)
        self.fn = _modules.function(plain.ptx, self.kernel.entry.name, self.shape.context)
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
        if state["first_yield_ns"] != (1 << 64) - 1:
            self.out.first_yield_ns = self.out.first_yield_ns or state["first_yield_ns"]
            self.out.last_exit_ns = state["last_exit_ns"]

    def run(
        self, *, preempt_at: Sequence[int] = (), abort_at: Sequence[int] = (),
        fixed_chunk: bool = False,
    ) -> LaunchReport:  # fmt: skip
        """Slices until every logical block is done. ``preempt_at``/``abort_at``: see
        :func:`launch_kernel`."""
        assert self.out is not None
        self.slot = _PinnedSlot()
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
        _wait(self.shape.stream)
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
                _BlockTimes.record(
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
                    _wait(self.shape.stream)
                self.drained = True
            finally:
                self.flag.set(0)
        if self.snapshots:
            with contextlib.suppress(BaseException):
                self.roll_back()
                _wait(self.shape.stream)
        if self.slot is not None and self.drained:
            self.slot.release()  # else a record copy may be in flight: never reuse it
        self.kernel.last_launch = self.out
