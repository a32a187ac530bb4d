"""A persistent launch's progress record and its chunk size.

What it is for: the record the transformed kernel keeps its counter, stamps and abort
marks in (``rewrite.RecordLayout``): its first state (:func:`initial_record`), reading
it back (:func:`parse_record`), and the page-locked host slot each slice's record
traffic goes through (:class:`PinnedSlot`), and the GPU time a slice's stamps span
(:func:`slice_gpu_ns`); and how many logical blocks one claim takes
(:func:`choose_chunk`, from the time per logical block :class:`BlockTimes` measured on
earlier slices).

What it must not do: launch kernels or decide a launch's mode; import ``cuda.bindings``
at module import time.
"""

from __future__ import annotations

import ctypes
import struct
import threading
from typing import Any, ClassVar

from gpushare_ext.kernels.driver import check, cuda_driver
from gpushare_ext.kernels.ptx import KernelError
from gpushare_ext.kernels.rewrite import NO_BLOCK, PROGRESS_RECORD_BYTES, RecordLayout

__all__ = [
    "CHUNK_FIRST",
    "CHUNK_FIRST_MIN_PER_BLOCK",
    "CHUNK_MAX",
    "CHUNK_TARGET_US",
    "NO_STAMP",
    "RECORD_HEADER",
    "BlockTimes",
    "PinnedSlot",
    "choose_chunk",
    "fit_chunk",
    "initial_record",
    "parse_record",
    "read_record",
    "slice_gpu_ns",
]


# The part of the record the launcher writes before and reads after each slice (the fence
# scratch area after it is never read).
RECORD_HEADER = RecordLayout.SCRATCH
# A %globaltimer stamp no block wrote: the initial value of a stamp reduced by minimum.
NO_STAMP = (1 << 64) - 1


def parse_record(raw: bytes) -> dict[str, int]:
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


def slice_gpu_ns(state: dict[str, int]) -> int:
    """The GPU time one slice took on the GPU's own clock (ns), from its first persistent
    block's start to its last leader's exit; 0 when a stamp is missing (the start stamp
    still holds its initial maximum) or the two do not make an interval."""
    start, end = state["start_ns"], state["end_ns"]
    if start == NO_STAMP or end <= start:
        return 0
    return end - start


def read_record(record: Any) -> dict[str, int]:
    """Read a record held in a CuPy array (a D2H copy and a sync; benchmarks use this)."""
    import numpy as np

    host = record.get()
    return parse_record(np.asarray(host, dtype=np.uint8).tobytes())


def initial_record(start_block: int = 0) -> bytes:
    raw = bytearray(PROGRESS_RECORD_BYTES)
    struct.pack_into("<I", raw, RecordLayout.NEXT_BLOCK, start_block)
    struct.pack_into("<Q", raw, RecordLayout.FIRST_YIELD_NS, NO_STAMP)
    struct.pack_into("<Q", raw, RecordLayout.START_NS, NO_STAMP)
    struct.pack_into("<I", raw, RecordLayout.LOWEST_ABORTED, NO_BLOCK)
    return bytes(raw)


class PinnedSlot:
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
            drv = cuda_driver()  # portable: page-locked for every context (device)
            ptr = int(
                check(
                    drv.cuMemHostAlloc(2 * RECORD_HEADER, drv.CU_MEMHOSTALLOC_PORTABLE),
                    "cuMemHostAlloc",
                )
            )
        self.ptr = ptr

    def write_header(self, record_ptr: int, start_block: int, stream_handle: int) -> None:
        drv = cuda_driver()
        src = self.ptr + RECORD_HEADER
        ctypes.memmove(src, initial_record(start_block), RECORD_HEADER)
        check(
            drv.cuMemcpyHtoDAsync(
                drv.CUdeviceptr(record_ptr), src, RECORD_HEADER, drv.CUstream(stream_handle)
            ),
            "cuMemcpyHtoDAsync(progress record)",
        )

    def enqueue_read(self, record_ptr: int, stream_handle: int) -> None:
        drv = cuda_driver()
        check(
            drv.cuMemcpyDtoHAsync(
                self.ptr, drv.CUdeviceptr(record_ptr), RECORD_HEADER, drv.CUstream(stream_handle)
            ),
            "cuMemcpyDtoHAsync(progress record)",
        )

    def parse(self) -> dict[str, int]:
        return parse_record(ctypes.string_at(self.ptr, RECORD_HEADER))

    def release(self) -> None:
        with self._lock:
            self._free.append(self.ptr)


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


class BlockTimes:
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


def fit_chunk(chunk: int, total: int, persistent: int) -> int:
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
