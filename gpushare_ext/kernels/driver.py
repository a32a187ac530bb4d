"""The CUDA driver as the launcher uses it: context, loaded modules, streams, launches.

What it is for: the calls into ``cuda.bindings.driver`` that every other launch module
shares: the error check, the current context, the PTX ISA the driver's JIT accepts
(``driver_ptx_isa``), the module cache (PTX loaded once per context, occupancy), the
number of SMs, a high-priority side stream, a wait for a stream that lets Ctrl-C land,
and one raw ``cuLaunchKernel``.

What it must not do: import ``cuda.bindings`` at module import time (CPU-only machines
import this module), or know about transactions, yield flags or a kernel's analysis.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from gpushare_ext.kernels.arguments import param_array
from gpushare_ext.kernels.ptx import KernelError, set_version

__all__ = [
    "DeviceFacts",
    "ModuleCache",
    "check",
    "cuda_driver",
    "driver_ptx_isa",
    "ensure_context",
    "launch_raw",
    "modules",
    "side_stream",
    "stream_handle",
    "wait_for_stream",
]


def cuda_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KernelError("no-cuda", "cuda-bindings is not installed", step="launch") from exc
    return driver


def check(result: Any, what: str) -> Any:
    drv = cuda_driver()
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


def ensure_context(device: int | None = None) -> Any:
    """Make the device's primary context current (CuPy's context when CuPy is in use)."""
    global _initialised
    drv = cuda_driver()
    if not _initialised:  # cuInit once per process (it is idempotent, but not free)
        check(drv.cuInit(0), "cuInit")
        _initialised = True
    ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0 and device is None:
        return ctx
    dev = check(drv.cuDeviceGet(device or 0), "cuDeviceGet")
    ctx = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


_ISA_FOR_DRIVER = {
    12000: "8.0", 12010: "8.1", 12020: "8.2", 12030: "8.3", 12040: "8.4", 12050: "8.5",
    12060: "8.5", 12080: "8.7", 12090: "8.8", 13000: "9.0", 13010: "9.1", 13020: "9.2",
}  # fmt: skip


def driver_ptx_isa() -> str:
    """The newest PTX ISA version the installed driver's JIT accepts."""
    drv = cuda_driver()
    version = check(drv.cuDriverGetVersion(), "cuDriverGetVersion")
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


class ModuleCache:
    """Loaded modules, their functions and occupancy, per context (loaded once each)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mods: dict[tuple[int, str], Any] = {}
        self._fns: dict[tuple[int, str, str], Any] = {}
        self._occupancy: dict[tuple[int, int, int], int] = {}
        # Host time spent in cuModuleLoadData (the driver's JIT of each transformed PTX,
        # which its own disk cache keeps across processes), and the modules loaded.
        self.load_ns = 0
        self.loaded = 0

    def function(self, ptx: str, name: str, ctx: Any = None) -> Any:
        drv = cuda_driver()
        if ctx is None:
            ctx = ensure_context()
        fkey = (int(ctx), ptx, name)
        fn = self._fns.get(fkey)
        if fn is not None:
            return fn
        key = (int(ctx), ptx)
        with self._lock:
            mod = self._mods.get(key)
            if mod is None:
                image = _fit_version(ptx).encode() + b"\0"
                began = time.perf_counter_ns()
                result = drv.cuModuleLoadData(image)
                self.load_ns += time.perf_counter_ns() - began
                self.loaded += 1
                if result[0] != drv.CUresult.CUDA_SUCCESS:
                    _, err = drv.cuGetErrorName(result[0])
                    raise KernelError(
                        "module-load-failed",
                        f"the driver rejected the PTX of {name}: {err.decode() if err else result[0]}",
                        step="launch",
                    )
                mod = result[1]
                self._mods[key] = mod
            fn = check(drv.cuModuleGetFunction(mod, name.encode()), f"cuModuleGetFunction({name})")
            self._fns[fkey] = fn
        return fn

    def blocks_per_sm(self, fn: Any, threads: int, shared: int) -> int:
        """``cuOccupancyMaxActiveBlocksPerMultiprocessor``, cached per (function, block)."""
        key = (int(fn), threads, shared)
        n = self._occupancy.get(key)
        if n is None:
            n = int(
                check(
                    cuda_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, shared),
                    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
                )
            )
            self._occupancy[key] = n
        return n


modules = ModuleCache()


def side_stream() -> Any:
    """A non-blocking stream of the highest priority (never waits on the legacy stream)."""
    drv = cuda_driver()
    ensure_context()  # the calling thread may have no current context
    _, greatest = check(drv.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
    return check(
        drv.cuStreamCreateWithPriority(drv.CUstream_flags.CU_STREAM_NON_BLOCKING, greatest),
        "cuStreamCreateWithPriority",
    )


def stream_handle(stream: Any) -> int:
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


class DeviceFacts:
    """The few device facts the launcher needs, read once per context."""

    _cache: ClassVar[dict[int, tuple[int, str]]] = {}

    @classmethod
    def sm_count(cls, ctx: Any = None) -> int:
        if ctx is None:
            ctx = ensure_context()
        key = int(ctx)
        hit = cls._cache.get(key)
        if hit is not None:
            return hit[0]
        drv = cuda_driver()
        dev = check(drv.cuCtxGetDevice(), "cuCtxGetDevice")
        n = check(
            drv.cuDeviceGetAttribute(
                drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev
            ),
            "cuDeviceGetAttribute",
        )
        cls._cache[key] = (int(n), "")
        return int(n)


def wait_for_stream(stream_handle: int, on_tick: Callable[[], None] | None = None) -> None:
    """Wait for the stream with short sleeps so that Ctrl-C can land meanwhile;
    ``on_tick`` is called between sleeps.

    The sleep grows with the time already waited but stays under a tenth of it (at most
    1 ms), so a launch is not noticed much later than it ends.
    """
    drv = cuda_driver()
    event = check(drv.cuEventCreate(drv.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    try:
        check(drv.cuEventRecord(event, drv.CUstream(stream_handle)), "cuEventRecord")
        t0 = time.perf_counter()
        while True:
            err = drv.cuEventQuery(event)
            err = err[0] if isinstance(err, tuple) else err
            if err == drv.CUresult.CUDA_SUCCESS:
                return
            if err != drv.CUresult.CUDA_ERROR_NOT_READY:
                check(err, "kernel execution")
            if on_tick is not None:
                on_tick()
            time.sleep(min(1e-3, max(1e-5, 0.1 * (time.perf_counter() - t0))))
    finally:
        drv.cuEventDestroy(event)


def launch_raw(
    function: Any,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    shared: int,
    stream_handle: int,
    values: Sequence[bytes],
    before_launch: Callable[[int], None] | None = None,
) -> None:
    """One ``cuLaunchKernel``; ``before_launch(stream)`` runs first (the session's gate)."""
    drv = cuda_driver()
    if before_launch is not None:
        before_launch(stream_handle)
    ptrs, keep = param_array(values)
    check(
        drv.cuLaunchKernel(
            function, *grid, *block, shared, drv.CUstream(stream_handle), ctypes.addressof(ptrs), 0
        ),
        "cuLaunchKernel",
    )
    del keep
