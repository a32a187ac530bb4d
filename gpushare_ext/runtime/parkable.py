"""This process's parkable device memory, through the preloaded launch shim.

With ``GPUSHARE_PARKABLE_MEMORY=1`` the shim backs every allocation of at least
``GPUSHARE_PARKABLE_MIN_KIB`` (2 MiB by default) through the driver's virtual memory
management API (``native/parkable_memory.c``), so that the allocation's bytes can move
to pinned host memory and back at the host link's speed while its address, which the
program holds, stays valid.  :func:`park` moves allocations out (the least recently
allocated or restored first, until enough has left the GPU, within a host budget);
:func:`restore` brings all of them back.  Between the two, a launch or a copy that
reaches the driver through the shim restores everything first, so nothing touches an
unmapped range.

This module speaks to the native code and words what it answers; it decides neither
what nor when to park (the broker does) and shows nothing.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from gpushare_ext.control_block import PARK_REQUEST_OFFSET as PARK_WORDS_OFFSET
from gpushare_ext.runtime import interpose

ENABLE_VARIABLE = "GPUSHARE_PARKABLE_MEMORY"
MIN_KIB_VARIABLE = "GPUSHARE_PARKABLE_MIN_KIB"
DEFAULT_STREAMS = 4  # copies spread over this many streams fill the host link (measured)


class _MoveResult(ctypes.Structure):
    _fields_ = [
        ("bytes", ctypes.c_uint64),
        ("allocations", ctypes.c_uint64),
        ("left_bytes", ctypes.c_uint64),
        ("copy_ns", ctypes.c_uint64),
        ("total_ns", ctypes.c_uint64),
        ("error", ctypes.c_int),
        ("why", ctypes.c_char * 160),
    ]


class _MemoryStats(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "allocations", "resident_bytes", "parked_bytes", "parked_count", "fallbacks",
            "parks", "restores", "parked_total", "restored_total", "park_ns", "restore_ns",
            "guard_restores", "guard_failures",
        )
    ]  # fmt: skip


@dataclass(frozen=True)
class Moved:
    """What one park or restore did."""

    bytes: int  # device memory that left the GPU (park) or came back (restore)
    allocations: int
    left_bytes: int  # what stayed: resident after a park, parked after a restore
    copy_s: float  # the copies alone
    total_s: float
    why_short: str  # why it moved less than asked ("" when it did not)

    @property
    def gib_per_s(self) -> float:
        """The rate of the whole call (copies, unmapping and mapping included)."""
        return self.bytes / 2**30 / self.total_s if self.total_s > 0 else 0.0


def enabled_here() -> bool:
    """Whether this process was started with parkable memory on (the shim reads the same
    variable once, at its first allocation)."""
    return os.environ.get(ENABLE_VARIABLE) == "1"


def _library() -> ctypes.CDLL:
    library = interpose.native_library()
    library.gps_park_memory.argtypes = [
        ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint, ctypes.POINTER(_MoveResult),
    ]  # fmt: skip
    library.gps_park_memory.restype = ctypes.c_int
    library.gps_restore_memory.argtypes = [ctypes.c_uint, ctypes.POINTER(_MoveResult)]
    library.gps_restore_memory.restype = ctypes.c_int
    library.gps_memory_stats.argtypes = [ctypes.POINTER(_MemoryStats)]
    library.gps_memory_stats.restype = None
    library.gps_parkable_base.argtypes = [ctypes.c_ulonglong]
    library.gps_parkable_base.restype = ctypes.c_ulonglong
    return library


def _moved(result: _MoveResult) -> Moved:
    return Moved(
        bytes=int(result.bytes),
        allocations=int(result.allocations),
        left_bytes=int(result.left_bytes),
        copy_s=result.copy_ns / 1e9,
        total_s=result.total_ns / 1e9,
        why_short=result.why.decode("utf-8", "replace"),
    )


def park(want_bytes: int = 0, host_limit_bytes: int = 0, streams: int = DEFAULT_STREAMS) -> Moved:
    """Move parkable allocations to host memory until ``want_bytes`` have left the GPU
    (0: all of them), this process's parked bytes staying within ``host_limit_bytes``
    (0: no limit).  Blocks for the copies; the GIL is let go meanwhile."""
    if want_bytes < 0 or host_limit_bytes < 0 or streams < 1:
        raise ValueError("park: sizes must be >= 0 and streams >= 1")
    result = _MoveResult()
    _library().gps_park_memory(want_bytes, host_limit_bytes, streams, ctypes.byref(result))
    return _moved(result)


def restore(streams: int = DEFAULT_STREAMS) -> Moved:
    """Bring every parked allocation back to its address; ``why_short`` says what stayed
    parked and why (the GPU has no room for it yet, say)."""
    if streams < 1:
        raise ValueError("restore: streams must be >= 1")
    result = _MoveResult()
    _library().gps_restore_memory(streams, ctypes.byref(result))
    return _moved(result)


def stats() -> dict[str, int]:
    """The native counters: parkable allocations, bytes resident and parked, moves."""
    out = _MemoryStats()
    _library().gps_memory_stats(ctypes.byref(out))
    return {name: int(getattr(out, name)) for name, _ in out._fields_}


def serve_parks_at(block_address: int | None) -> bool:
    """Have the preloaded shim's park service follow the control block mapped at
    ``block_address`` (None: follow none): the broker writes park and restore requests
    there and the service carries them out in this process.  False when this process
    has no parkable memory (not started with it, or the shim is not preloaded)."""
    library = interpose._preloaded()
    if library is None or not enabled_here():
        return False
    library.gps_serve_parks.argtypes = [ctypes.c_void_p]
    library.gps_serve_parks.restype = ctypes.c_int
    words = None if block_address is None else block_address + PARK_WORDS_OFFSET
    return library.gps_serve_parks(words) == 0


def resident_bytes() -> int:
    """Parkable device memory on the GPU now (0 when this process has none: not started
    with parkable memory, or the shim is not preloaded)."""
    if interpose._preloaded() is None or not enabled_here():
        return 0
    return stats()["resident_bytes"]


def parkable_base(address: int) -> int | None:
    """Where the parkable allocation holding ``address`` starts; None when none does."""
    base = int(_library().gps_parkable_base(address))
    return base or None
