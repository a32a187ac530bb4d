"""The yield flag: a device int32 the persistent kernels poll, and who writes it.

What it is for: :class:`YieldFlag` (allocated so that a CUDA IPC handle can share it,
written with ``cuStreamWriteValue32`` on a high-priority stream, never with a kernel);
:func:`write_yield_flag_from_handle`, which the broker's actuator calls from its own
process; the session's flag (:func:`set_session_yield_flag`) and the views a launch
makes of a flag given as an address; and the two waits after a yield
(:func:`poll_until_resumed`, :func:`resume_without_owner`).

What it must not do: decide when to raise the flag (the broker and the session do), or
import ``cuda.bindings`` at module import time.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

from gpushare_ext.kernels.driver import check, cuda_driver, ensure_context, side_stream
from gpushare_ext.kernels.ptx import KernelError

__all__ = [
    "YieldFlag",
    "as_flag",
    "poll_until_resumed",
    "resume_without_owner",
    "set_session_yield_flag",
    "write_yield_flag_from_handle",
    "zero_flag",
]


def _never() -> bool:
    return False


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


def _write_word(stream: Any, address: Any, value: int, wait: bool = True) -> None:
    """``address``: an int or a ready ``CUdeviceptr`` (made once by a flag that is
    written often: a raise's own host time is part of every stop)."""
    drv = cuda_driver()
    ptr = address if isinstance(address, drv.CUdeviceptr) else drv.CUdeviceptr(address)
    flags = _WRITE_DEFAULT if _WRITE_DEFAULT is not None else _write_default(drv)
    err = drv.cuStreamWriteValue32(stream, ptr, value, flags)
    err = err[0] if isinstance(err, tuple) else err
    if err != drv.CUresult.CUDA_SUCCESS:  # stream memory operations unsupported: a memset
        check(drv.cuMemsetD32Async(ptr, value, 1, stream), "cuMemsetD32Async")
    if wait:
        check(drv.cuStreamSynchronize(stream), "cuStreamSynchronize")


_WRITE_DEFAULT: Any = None  # the flags enum member, looked up once (its value is 0)


def _write_default(drv: Any) -> Any:
    global _WRITE_DEFAULT
    _WRITE_DEFAULT = drv.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    return _WRITE_DEFAULT


class YieldFlag:
    """A device-memory int32 the persistent kernels poll; nonzero means "yield now".

    Allocated with ``cuMemAlloc`` so it can be shared through a CUDA IPC handle. Written
    with ``cuStreamWriteValue32`` on a private high-priority non-blocking stream, never with
    a kernel (a kernel would queue behind the very kernel it should stop).
    """

    def __init__(self, device_ptr: int | None = None) -> None:
        drv = cuda_driver()
        ensure_context()
        self._owned = device_ptr is None
        if device_ptr is None:
            ptr = check(drv.cuMemAlloc(4), "cuMemAlloc")
            check(drv.cuMemsetD32(ptr, 0, 1), "cuMemsetD32")
            device_ptr = int(ptr)
        self.device_ptr = int(device_ptr)
        self._ptr = drv.CUdeviceptr(self.device_ptr)
        # Made here, in the thread that owns the context: set() may come from any thread.
        self._stream = side_stream()

    def set(self, value: int = 1, *, wait: bool = True) -> None:
        """Write ``value``; with ``wait``, return once it is in device memory.  Without,
        the write is queued (high priority) and :meth:`wait_written` waits for it."""
        _write_word(self._stream, self._ptr, value, wait)

    def wait_written(self) -> None:
        check(cuda_driver().cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    def clear(self) -> None:
        self.set(0)

    def read(self) -> int:
        drv = cuda_driver()
        buf = (ctypes.c_uint32 * 1)()
        check(
            drv.cuMemcpyDtoHAsync(
                ctypes.addressof(buf), drv.CUdeviceptr(self.device_ptr), 4, self._stream
            ),
            "cuMemcpyDtoHAsync",
        )
        check(drv.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
        return int(buf[0])

    def ipc_handle(self) -> bytes:
        """64 bytes another process passes to :func:`write_yield_flag_from_handle`."""
        drv = cuda_driver()
        handle = check(drv.cuIpcGetMemHandle(drv.CUdeviceptr(self.device_ptr)), "cuIpcGetMemHandle")
        return ctypes.string_at(handle.getPtr(), 64)

    def close(self) -> None:
        drv = cuda_driver()
        if self._owned and self.device_ptr:
            drv.cuMemFree(drv.CUdeviceptr(self.device_ptr))
            self.device_ptr = 0
        if self._stream is not None:
            with contextlib.suppress(Exception):
                drv.cuStreamDestroy(self._stream)
            self._stream = None


_opened: dict[tuple[bytes, int], tuple[Any, Any]] = {}  # (CUdeviceptr, stream)
_opened_lock = threading.Lock()


def open_yield_flag_from_handle(handle_bytes: bytes, device: int = 0) -> tuple[int, Any]:
    """Open another process's yield flag once per (handle, device) and keep it open: its
    address here and the high-priority stream writes go on.

    The first open of a process also creates its CUDA context (about a quarter of a
    second on an H200), so the broker's actuator opens a flag when it is registered,
    not at the first pause that writes it.
    """
    if len(handle_bytes) != 64:
        raise KernelError("bad-ipc-handle", "a CUDA IPC memory handle has 64 bytes", step="launch")
    drv = cuda_driver()
    with _opened_lock:
        key = (bytes(handle_bytes), device)
        if key not in _opened:
            ensure_context(device)
            handle = drv.CUipcMemHandle()
            ctypes.memmove(handle.getPtr(), bytes(handle_bytes), 64)
            ptr = check(
                drv.cuIpcOpenMemHandle(
                    handle, drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
                ),
                "cuIpcOpenMemHandle",
            )
            _opened[key] = (ptr, side_stream())
        address, stream = _opened[key]
        return int(address), stream


def write_yield_flag_from_handle(handle_bytes: bytes, value: int, device: int = 0) -> None:
    """Write ``value`` into another process's yield flag (the broker's actuator calls this):
    a ``cuStreamWriteValue32`` on a high-priority non-blocking stream, then a sync."""
    open_yield_flag_from_handle(handle_bytes, device)
    ptr, stream = _opened[(bytes(handle_bytes), device)]
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


def as_flag(flag: Any) -> YieldFlag:
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


def zero_flag(context: Any) -> YieldFlag:
    key = int(context) if context is not None else 0
    flag = _zero_flags.get(key)
    if flag is None:
        flag = _zero_flags[key] = YieldFlag()
    return flag
