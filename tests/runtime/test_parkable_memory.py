"""Parkable memory on the stand-in driver (no GPU here): the preloaded shim backs large
allocations through the virtual memory management API, parks them to pinned host memory
(releasing their "physical" memory) and brings them back at the same addresses.

The stand-in maps its memory with mmap and unmaps a parked range to PROT_NONE, so a copy
or a launch that reached a parked range without the shim's restore would kill the test
process: a test that passes shows the guard ran first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtime_helpers import DRIVER_ENTRIES, preloaded_env

MIB = 1 << 20

PRELUDE = (
    DRIVER_ENTRIES
    + r"""
import json, sys
from gpushare_ext.runtime import parkable
u64 = ctypes.c_uint64
ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(u64), ctypes.c_size_t)
FREE = ctypes.CFUNCTYPE(ctypes.c_int, u64)
D2H = ctypes.CFUNCTYPE(ctypes.c_int, p, u64, ctypes.c_size_t)
H2D = ctypes.CFUNCTYPE(ctypes.c_int, u64, p, ctypes.c_size_t)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, p, u, u, u, u, u, u, u, p, p, p)
alloc, free = entry(b"cuMemAlloc", ALLOC), entry(b"cuMemFree", FREE)
d2h, h2d = entry(b"cuMemcpyDtoH", D2H), entry(b"cuMemcpyHtoD", H2D)
launch = entry(b"cuLaunchKernel", LAUNCH)
for name in ("fake_physical_bytes", "fake_pinned_bytes", "fake_plain_allocs", "fake_launches"):
    getattr(cuda, name).restype = ctypes.c_ulonglong
cuda.fake_physical_limit.argtypes = [ctypes.c_ulonglong]
cuda.fake_pinned_limit.argtypes = [ctypes.c_ulonglong]
MIB = 1 << 20

def allocate(mib, fill):
    x = u64()
    assert alloc(ctypes.byref(x), mib * MIB) == 0
    data = bytes([fill]) * (mib * MIB)
    assert h2d(x.value, ctypes.create_string_buffer(data, len(data)), len(data)) == 0
    return x.value

def read(address, mib):
    out = ctypes.create_string_buffer(mib * MIB)
    answer = d2h(out, address, mib * MIB)
    return answer, sorted(set(out.raw))

def moved(m):
    return {"mib": m.bytes // MIB, "allocations": m.allocations, "left_mib": m.left_bytes // MIB,
            "why": m.why_short}
"""
)


def run(script: str, fake_driver: Path, **env_extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + script],
        capture_output=True,
        text=True,
        timeout=60,
        env=preloaded_env(fake_driver, **env_extra),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


PARK_AND_RESTORE = r"""
old, young, small = allocate(4, 1), allocate(6, 2), allocate(1, 3)
out = {"plain_allocs": cuda.fake_plain_allocs(), "physical_mib": cuda.fake_physical_bytes() // MIB,
       "small_parkable": parkable.parkable_base(small) is not None,
       "inside": parkable.parkable_base(young + 5 * MIB) == young}
out["park"] = moved(parkable.park())
out["physical_after_park"] = cuda.fake_physical_bytes() // MIB
out["pinned_after_park"] = cuda.fake_pinned_bytes() // MIB
out["restore"] = moved(parkable.restore())
out["read"] = [read(old, 4), read(young, 6), read(small, 1)]
out["pinned_after_restore"] = cuda.fake_pinned_bytes() // MIB
for x in (old, young, small):
    free(x)
out["physical_after_free"] = cuda.fake_physical_bytes()
print(json.dumps(out))
"""


def test_large_allocations_are_parked_and_come_back_at_their_addresses(fake_driver):
    out = run(PARK_AND_RESTORE, fake_driver, GPUSHARE_PARKABLE_MEMORY="1")

    assert out["plain_allocs"] == 1  # the 1 MiB one is cuMemAlloc's
    assert out["physical_mib"] == 10 and not out["small_parkable"] and out["inside"]
    assert out["park"] == {"mib": 10, "allocations": 2, "left_mib": 0, "why": ""}
    assert out["physical_after_park"] == 0  # the GPU memory was released
    assert out["pinned_after_park"] == 10
    assert out["restore"] == {"mib": 10, "allocations": 2, "left_mib": 0, "why": ""}
    # [answer, the distinct byte values read]: each allocation holds what it was given
    assert out["read"] == [[0, [1]], [0, [2]], [0, [3]]]
    assert out["pinned_after_restore"] == 0 and out["physical_after_free"] == 0


TOUCHED_WHILE_PARKED = r"""
a, b = allocate(4, 7), allocate(4, 8)
parkable.park()
out = {"read": read(b, 4)}  # the copy restores first (else it would fault here)
out["parked_after_read_mib"] = parkable.stats()["parked_bytes"] // MIB
parkable.park()
launch(None, 1, 1, 1, 1, 1, 1, 0, None, None, None)
out["launched"] = cuda.fake_launches()
out["parked_after_launch_mib"] = parkable.stats()["parked_bytes"] // MIB
out["read_after_launch"] = read(a, 4)
stats = parkable.stats()
out["guard"] = [stats["guard_restores"], stats["guard_failures"]]
print(json.dumps(out))
"""


def test_a_copy_or_a_launch_while_parked_restores_first(fake_driver):
    out = run(TOUCHED_WHILE_PARKED, fake_driver, GPUSHARE_PARKABLE_MEMORY="1")

    assert out["read"] == [0, [8]] and out["parked_after_read_mib"] == 0
    assert out["launched"] == 1 and out["parked_after_launch_mib"] == 0
    assert out["read_after_launch"] == [0, [7]]
    assert out["guard"] == [2, 0]


LEAST_RECENT_FIRST = r"""
first, second, third = allocate(4, 1), allocate(4, 2), allocate(4, 3)
out = {"part": moved(parkable.park(want_bytes=6 * MIB))}  # two allocations cover 6 MiB
out["first_parked"] = parkable.stats()["parked_bytes"] // MIB
parkable.restore()
out["all"] = moved(parkable.park(want_bytes=0))
parkable.restore()
out["over"] = moved(parkable.park(want_bytes=20 * MIB))
parkable.restore()
print(json.dumps(out))
"""


def test_a_park_moves_what_is_asked_the_least_recently_used_first(fake_driver):
    out = run(LEAST_RECENT_FIRST, fake_driver, GPUSHARE_PARKABLE_MEMORY="1")

    assert out["part"] == {"mib": 8, "allocations": 2, "left_mib": 4, "why": ""}
    assert out["first_parked"] == 8
    assert out["all"]["mib"] == 12
    assert out["over"]["mib"] == 12
    assert out["over"]["why"] == "this process holds 8 MiB of parkable memory less than asked"


BUDGETS = r"""
a, b = allocate(4, 1), allocate(4, 2)
out = {"budget": moved(parkable.park(want_bytes=0, host_limit_bytes=6 * MIB))}
parkable.restore()
cuda.fake_pinned_limit(2 * MIB)
out["pinned"] = moved(parkable.park())
cuda.fake_pinned_limit(1 << 40)
out["parked"] = moved(parkable.park())
cuda.fake_physical_limit(6 * MIB)  # the GPU's memory went to someone else meanwhile
out["restore_short"] = moved(parkable.restore())
out["read_fails"] = read(b, 4)[0] if out["restore_short"]["left_mib"] else None
cuda.fake_physical_limit(1 << 40)
out["restore"] = moved(parkable.restore())
out["read"] = [read(a, 4), read(b, 4)]
out["guard_failures"] = parkable.stats()["guard_failures"]
print(json.dumps(out))
"""


def test_budgets_stop_a_park_and_a_full_gpu_stops_a_restore_without_a_fault(fake_driver):
    out = run(BUDGETS, fake_driver, GPUSHARE_PARKABLE_MEMORY="1")

    assert out["budget"] == {
        "mib": 4,
        "allocations": 1,
        "left_mib": 4,
        "why": "the host budget for parked memory is spent (4 MiB more needed)",
    }
    assert out["pinned"] == {
        "mib": 0,
        "allocations": 0,
        "left_mib": 8,
        "why": "the host could not pin 4 MiB more for parked memory",
    }
    assert out["parked"]["mib"] == 8
    assert out["restore_short"]["mib"] == 4 and out["restore_short"]["left_mib"] == 4
    assert out["restore_short"]["why"] == "the GPU has no room yet for 4 MiB of it (CUDA error 2)"
    assert out["read_fails"] == 2  # out of memory from the copy, not a fault
    assert out["restore"]["mib"] == 4 and out["restore"]["why"] == ""
    assert out["read"] == [[0, [1]], [0, [2]]]
    assert out["guard_failures"] == 1


FREED_WHILE_PARKED = r"""
a = allocate(4, 1)
parkable.park()
free(a)
out = {"pinned": cuda.fake_pinned_bytes(), "physical": cuda.fake_physical_bytes(),
       "stats": parkable.stats()}
print(json.dumps(out))
"""


def test_memory_freed_while_parked_leaves_nothing_behind(fake_driver):
    out = run(FREED_WHILE_PARKED, fake_driver, GPUSHARE_PARKABLE_MEMORY="1")

    assert out["pinned"] == 0 and out["physical"] == 0
    assert out["stats"]["parked_bytes"] == 0 and out["stats"]["parked_count"] == 0


OFF = r"""
found = p()
get_proc(b"cuMemAlloc", ctypes.byref(found), 12080, 0, None)
cuda.cuMemAlloc_v2.restype = ctypes.c_int
real = ctypes.cast(cuda.cuMemAlloc_v2, p).value
a = allocate(4, 1)
print(json.dumps({"wrapped": found.value != real, "plain_allocs": cuda.fake_plain_allocs(),
                  "park": moved(parkable.park())}))
"""


def test_without_the_setting_allocations_are_the_drivers_own(fake_driver):
    out = run(OFF, fake_driver)

    assert out["wrapped"] is False and out["plain_allocs"] == 1
    assert out["park"] == {
        "mib": 0,
        "allocations": 0,
        "left_mib": 0,
        "why": "no parkable memory here",
    }


def test_a_larger_threshold_keeps_smaller_allocations_plain(fake_driver):
    out = run(
        PARK_AND_RESTORE,
        fake_driver,
        GPUSHARE_PARKABLE_MEMORY="1",
        GPUSHARE_PARKABLE_MIN_KIB="5120",
    )

    assert out["plain_allocs"] == 2 and out["physical_mib"] == 6
    assert out["park"]["mib"] == 6


SERVED = r"""
from gpushare_ext.control_block import ControlBlock
block = ControlBlock.open(sys.argv[1])
a, b = allocate(4, 5), allocate(4, 6)
print(json.dumps({"serving": parkable.serve_parks_at(block.address())}), flush=True)
for line in sys.stdin:
    if line.strip() == "look":
        print(json.dumps({"physical_mib": cuda.fake_physical_bytes() // MIB,
                          "pinned_mib": cuda.fake_pinned_bytes() // MIB,
                          "parked_mib": parkable.stats()["parked_bytes"] // MIB}), flush=True)
    elif line.strip() == "read":
        print(json.dumps({"read": [read(a, 4), read(b, 4)]}), flush=True)
    else:
        break
print(json.dumps({"done": True}))
"""


def test_the_broker_asks_the_shims_park_service_through_the_control_block(fake_driver, tmp_path):
    import time

    from gpushare_ext.control_block import ControlBlock

    block = ControlBlock.create(tmp_path / "session.cb")
    session = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + SERVED, str(tmp_path / "session.cb")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=preloaded_env(fake_driver, GPUSHARE_PARKABLE_MEMORY="1"),
    )
    assert session.stdin is not None and session.stdout is not None

    def ask(word: str) -> dict:
        session.stdin.write(word + "\n")
        session.stdin.flush()
        return json.loads(session.stdout.readline())

    def answer(request: int) -> tuple[int, int]:
        deadline = time.monotonic() + 10
        while (found := block.park_answer(request)) is None:
            assert time.monotonic() < deadline, "the park service did not answer"
            time.sleep(0.01)
        return found

    try:
        assert json.loads(session.stdout.readline()) == {"serving": True}
        assert block.parkable_resident_bytes == 8 * MIB
        assert answer(block.request_park(4 * MIB)) == (4 * MIB, 0)
        assert block.parkable_resident_bytes == 4 * MIB
        assert ask("look") == {"physical_mib": 4, "pinned_mib": 4, "parked_mib": 4}
        assert answer(block.request_park(0, host_limit_bytes=6 * MIB)) == (0, 1)  # budget
        assert answer(block.request_restore()) == (4 * MIB, 0)
        assert block.parkable_resident_bytes == 8 * MIB
        assert answer(block.request_park(0)) == (8 * MIB, 0)
        assert ask("look") == {"physical_mib": 0, "pinned_mib": 8, "parked_mib": 8}
        # the session's own copy restores first, the bytes as they were
        assert ask("read") == {"read": [[0, [5]], [0, [6]]]}
        assert block.parkable_resident_bytes == 8 * MIB
    finally:
        session.stdin.write("quit\n")
        session.stdin.flush()
        session.wait(timeout=10)
        block.close()
