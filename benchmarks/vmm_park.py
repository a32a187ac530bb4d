"""Parking device memory through the virtual memory management API, measured.

The question this answers before the launch shim backs allocations this way: how fast
can a process's device memory leave the GPU and come back *at the same addresses*?
Memory is allocated as the shim would (``cuMemAddressReserve`` + ``cuMemCreate`` +
``cuMemMap``), filled with random words and fingerprinted on the GPU; a park copies
every allocation to pinned host memory over ``--streams`` streams in ``--chunk-mib``
pieces, then unmaps and releases the physical memory (the device's free memory is read
before and after); a restore creates new physical memory, maps it at the same virtual
addresses and copies the bytes back.  The fingerprint is taken again by a kernel that
reads the restored addresses.  Four host sides are timed: a pinned pool allocated
ahead (``cuMemHostAlloc``: the link alone), a shared-memory file registered at park
time (``cuMemHostRegister``: what a pool shared with the broker costs), pageable
memory (fresh, and with its pages touched ahead); and the checkpoint API is tried on a
child holding VMM memory (whether it still parks such a process).

    python -m benchmarks.vmm_park --gib 16 --allocations 16 --out DIR

Needs a GPU, CuPy and cuda-bindings.  It must not be imported by the package.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.environment import describe

GIB = 1024**3
MIB = 1024**2


class DriverError(RuntimeError):
    pass


def _ok(cu, answer):
    """The values of a cuda-bindings answer, or DriverError naming the failed call."""
    result, *values = answer if isinstance(answer, tuple) else (answer,)
    if result != cu.CUresult.CUDA_SUCCESS:
        raise DriverError(cu.cuGetErrorName(result)[1].decode())
    return values[0] if len(values) == 1 else values


def _prop(cu, device: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    return prop


def _access(cu, device: int):
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return desc


class VmmAllocation:
    """One reserved address range with physical memory mapped into it (or parked)."""

    def __init__(self, cu, device: int, size: int) -> None:
        self.cu, self.device, self.size = cu, device, size
        self.address = int(_ok(cu, cu.cuMemAddressReserve(size, 0, 0, 0)))
        self.handle = None
        self.map()

    def map(self) -> None:
        cu = self.cu
        self.handle = _ok(cu, cu.cuMemCreate(self.size, _prop(cu, self.device), 0))
        _ok(cu, cu.cuMemMap(self.address, self.size, 0, self.handle, 0))
        _ok(cu, cu.cuMemSetAccess(self.address, self.size, [_access(cu, self.device)], 1))

    def unmap(self) -> None:
        cu = self.cu
        _ok(cu, cu.cuMemUnmap(self.address, self.size))
        _ok(cu, cu.cuMemRelease(self.handle))
        self.handle = None


def _fingerprint(cupy, allocations: list[VmmAllocation]) -> str:
    """XOR and sum of every 64-bit word, computed on the GPU at the given addresses."""
    xor = cupy.ReductionKernel("uint64 x", "uint64 y", "x", "a ^ b", "y = a", "0", "vmm_xor")
    x = s = 0
    for allocation in allocations:
        memory = cupy.cuda.UnownedMemory(allocation.address, allocation.size, None)
        words = cupy.ndarray(
            (allocation.size // 8,), dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(memory, 0)
        )
        x ^= int(xor(words))
        s = (s + int(words.sum(dtype=cupy.uint64))) % 2**64
    return f"{x:x}-{s:x}"


def _copy_all(cu, allocations, host: int, streams, chunk: int, to_host: bool) -> None:
    offset = 0
    count = 0
    for allocation in allocations:
        for piece in range(0, allocation.size, chunk):
            length = min(chunk, allocation.size - piece)
            stream = streams[count % len(streams)]
            if to_host:
                _ok(
                    cu,
                    cu.cuMemcpyDtoHAsync(host + offset, allocation.address + piece, length, stream),
                )
            else:
                _ok(
                    cu,
                    cu.cuMemcpyHtoDAsync(allocation.address + piece, host + offset, length, stream),
                )
            offset += length
            count += 1
    for stream in streams:
        _ok(cu, cu.cuStreamSynchronize(stream))


def _free_bytes(cu) -> int:
    free, _total = _ok(cu, cu.cuMemGetInfo())
    return int(free)


def park_cycle(cupy, cu, allocations, host: int, streams, chunk: int) -> dict:
    total = sum(a.size for a in allocations)
    free_before = _free_bytes(cu)
    started = time.perf_counter()
    _copy_all(cu, allocations, host, streams, chunk, to_host=True)
    copied = time.perf_counter()
    for allocation in allocations:
        allocation.unmap()
    parked = time.perf_counter()
    free_parked = _free_bytes(cu)
    for allocation in allocations:
        allocation.map()
    mapped = time.perf_counter()
    _copy_all(cu, allocations, host, streams, chunk, to_host=False)
    restored = time.perf_counter()
    return {
        "gib": round(total / GIB, 2),
        "park_s": round(parked - started, 3),
        "park_copy_gib_s": round(total / GIB / (copied - started), 2),
        "park_gib_s": round(total / GIB / (parked - started), 2),
        "unmap_ms": round((parked - copied) * 1000, 1),
        "freed_gib": round((free_parked - free_before) / GIB, 2),
        "map_ms": round((mapped - parked) * 1000, 1),
        "restore_s": round(restored - parked, 3),
        "restore_gib_s": round(total / GIB / (restored - parked), 2),
    }


def _registered_shm(cu, size: int) -> tuple[int, float, object]:
    """A shared-memory file mapped and registered for the GPU: its address, the seconds
    registration took, and what keeps it alive."""
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="vmm-park-")
    os.unlink(path)
    os.ftruncate(fd, size)
    area = mmap.mmap(fd, size)
    os.close(fd)
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(area))
    started = time.perf_counter()
    _ok(cu, cu.cuMemHostRegister(address, size, cu.CU_MEMHOSTREGISTER_PORTABLE))
    return address, time.perf_counter() - started, area


def _pageable_cycles(cupy, cu, allocations, total: int, streams, chunk: int, before: str) -> dict:
    """Parks into pageable host memory (the driver stages such copies through pinned
    buffers of its own): a fresh anonymous mapping, and one whose pages were touched
    ahead (``MAP_POPULATE``), so the cost of faulting pages in is seen apart."""
    import ctypes

    rows = {}
    for name, flags in (
        ("fresh", mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
        ("populated", mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)),
    ):
        started = time.perf_counter()
        area = mmap.mmap(-1, total, flags=flags)
        mapped_s = time.perf_counter() - started
        address = ctypes.addressof(ctypes.c_char.from_buffer(area))
        row = park_cycle(cupy, cu, allocations, address, streams, chunk)
        row["identical"] = _fingerprint(cupy, allocations) == before
        row["map_host_s"] = round(mapped_s, 3)
        rows[name] = row
        print("pageable", name, json.dumps(row), flush=True)
        del address
        area.close()
    return rows


CHILD = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import cupy
from cuda.bindings import driver as cu
from benchmarks.vmm_park import VmmAllocation, _fingerprint
cupy.cuda.runtime.getDeviceCount(); cupy.zeros(1)
allocations = [VmmAllocation(cu, 0, 1 << 30) for _ in range(2)]
gen = cupy.random.default_rng(7)
for a in allocations:
    mem = cupy.cuda.UnownedMemory(a.address, a.size, None)
    arr = cupy.ndarray((a.size // 8,), dtype=cupy.int64, memptr=cupy.cuda.MemoryPointer(mem, 0))
    arr[...] = gen.integers(0, 2**62, size=arr.size, dtype=cupy.int64)
cupy.cuda.runtime.deviceSynchronize()
print("ready", _fingerprint(cupy, allocations), flush=True)
sys.stdin.readline()
print("after", _fingerprint(cupy, allocations), flush=True)
"""


def checkpoint_of_vmm_process() -> dict:
    """Whether the checkpoint API still parks a process whose memory is VMM-mapped."""
    from benchmarks.checkpoint_limits import checkpoint_cycle, finish

    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(Path(__file__).resolve().parents[1])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    ready = child.stdout.readline().strip()
    cycle = checkpoint_cycle(child.pid)
    after, rc = finish(child)
    return {
        "ready": ready,
        **cycle,
        "after": after,
        "rc": rc,
        "identical": ready.split()[-1:] == after.split()[-1:] and bool(ready),
    }


def measure(gib: float, count: int, chunk_mib: int, stream_counts: list[int], repeats: int) -> dict:
    import cupy
    from cuda.bindings import driver as cu

    cupy.zeros(1)  # the runtime's primary context, current on this thread
    device = 0
    granularity = int(
        _ok(
            cu,
            cu.cuMemGetAllocationGranularity(
                _prop(cu, device),
                cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            ),
        )
    )
    each = max(granularity, int(gib * GIB / count) // granularity * granularity)
    started = time.perf_counter()
    allocations = [VmmAllocation(cu, device, each) for _ in range(count)]
    allocate_s = time.perf_counter() - started
    gen = cupy.random.default_rng(1234)
    for allocation in allocations:
        memory = cupy.cuda.UnownedMemory(allocation.address, allocation.size, None)
        words = cupy.ndarray(
            (allocation.size // 8,), dtype=cupy.int64, memptr=cupy.cuda.MemoryPointer(memory, 0)
        )
        words[...] = gen.integers(0, 2**63 - 1, size=words.size, dtype=cupy.int64)
    cupy.cuda.runtime.deviceSynchronize()
    before = _fingerprint(cupy, allocations)
    total = each * count
    started = time.perf_counter()
    pool = int(_ok(cu, cu.cuMemHostAlloc(total, cu.CU_MEMHOSTALLOC_PORTABLE)))
    pool_s = time.perf_counter() - started
    result: dict = {
        "granularity_mib": granularity // MIB,
        "allocation_mib": each // MIB,
        "allocations": count,
        "allocate_ms": round(allocate_s * 1000, 1),
        "pinned_pool_s": round(pool_s, 3),
        "pinned_pool_gib_s": round(total / GIB / pool_s, 2),
        "pool": [],
    }
    chunk = chunk_mib * MIB
    for streams_n in stream_counts:
        streams = [
            _ok(cu, cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
            for _ in range(streams_n)
        ]
        for repeat in range(repeats):
            row = {
                "streams": streams_n,
                "repeat": repeat,
                **park_cycle(cupy, cu, allocations, pool, streams, chunk),
            }
            row["identical"] = _fingerprint(cupy, allocations) == before
            result["pool"].append(row)
            print("pool", json.dumps(row), flush=True)
    _ok(cu, cu.cuMemFreeHost(pool))
    address, register_s, area = _registered_shm(cu, total)
    result["shm_register_s"] = round(register_s, 3)
    result["shm_register_gib_s"] = round(total / GIB / register_s, 2)
    streams = [
        _ok(cu, cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        for _ in range(max(stream_counts))
    ]
    row = park_cycle(cupy, cu, allocations, address, streams, chunk)
    row["identical"] = _fingerprint(cupy, allocations) == before
    result["shm"] = row
    print("shm", json.dumps(row), "register", register_s, flush=True)
    _ok(cu, cu.cuMemHostUnregister(address))
    del area
    result["pageable"] = _pageable_cycles(cupy, cu, allocations, total, streams, chunk, before)
    try:
        result["checkpoint_of_vmm_process"] = checkpoint_of_vmm_process()
    except Exception as exc:  # the measurement above stands; say what this one did
        result["checkpoint_of_vmm_process"] = {"error": repr(exc)}
    print("checkpoint", json.dumps(result["checkpoint_of_vmm_process"]), flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--allocations", type=int, default=16)
    parser.add_argument("--chunk-mib", type=int, default=64)
    parser.add_argument("--streams", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    stream_counts = [int(n) for n in args.streams.split(",")]
    result = {
        **describe(),
        "benchmark": "vmm_park",
        "command": " ".join(["python -m benchmarks.vmm_park", *(argv or sys.argv[1:])]),
        **measure(args.gib, args.allocations, args.chunk_mib, stream_counts, args.repeats),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vmm_park.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
