"""On a real GPU, in notebook kernels started as the server extension starts them (the
launch shim preloaded, CuPy compiling to PTX): long kernels never hang a cell, and Ctrl-C
always gives control back with every buffer whole.

* an *unmarked* cell (no ``%%gpu``) runs long kernels with atomics to the end, also right
  after a ``%%gpu`` cell whose lease ended while it was paused;
* Ctrl-C while another user's high-priority cell holds the GPU and a long kernel of ours
  waits to be resumed: the KeyboardInterrupt comes within a second, the buffer the kernel
  updates in place is as before the launch or fully updated (never half), and the next
  cell runs the kernel correctly.

Skips cleanly without a usable GPU.  Failures print the broker's log and every cell.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from gpu_support import shim_env
from runtime_helpers import (
    NotebookKernel,
    gpu_missing_reason,
    holding_cell,
    short_tempdir,
    wait_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(gpu_missing_reason() is not None, reason=str(gpu_missing_reason())),
]

# Our own kernels, each about 40 ms per launch on an H200 (the loop keeps them long).
KERNELS_CELL = r"""
import os, time
import cupy, numpy
from gpushare_ext.runtime import preemptible
N, ITER = 1 << 22, 260_000
loop = "float a = 0.5f; for (int k = 0; k < n; ++k) a = a * 0.999f + 0.5f;"
# In place (read and written): not idempotent, so a snapshot is rolled back on Ctrl-C.
bump = cupy.ElementwiseKernel("int32 n", "float32 y", loop + " y = y + (a > 0.0f ? 1.0f : 0.0f);", "gps_t_bump")
# Writes only its output: idempotent, so a Ctrl-C runs the rest of it to the end.
fill = cupy.ElementwiseKernel("float32 x, int32 n, float32 c", "float32 y", loop + " y = (a > x ? c : 0.0f);", "gps_t_fill")
# Atomics into a small raw array (a histogram): many threads on few addresses.
count = cupy.ElementwiseKernel(
    "int32 v, int32 n", "raw int32 bins",
    loop + " if (a > 0.0f) atomicAdd(&bins[v & 63], 1);", "gps_t_count")
y = cupy.zeros(N, dtype=cupy.float32)
x = cupy.zeros(N, dtype=cupy.float32)
z = cupy.zeros(N, dtype=cupy.float32)
values = cupy.arange(N, dtype=cupy.int32)
expected_bins = numpy.bincount(numpy.arange(N) & 63, minlength=64).astype(numpy.int32)
registry = preemptible.installed()
def histogram():
    bins = cupy.zeros(64, dtype=cupy.int32)
    count(values, ITER // 4, bins)
    return bins
started = time.perf_counter()
bump(ITER, y); fill(x, ITER, 1.0, z); histogram()  # first launches: timed by the shim
cupy.cuda.runtime.deviceSynchronize()
print("registry", registry is not None, f"first launches {time.perf_counter() - started:.2f} s")
"""


def _env(socket: Path) -> dict[str, str]:
    return shim_env(
        CUPY_COMPILE_WITH_PTX="1",
        CUPY_CACHE_DIR=str(short_tempdir("gps-cupy-")),
        GPUSHARE_SOCKET=str(socket),
    )


@pytest.fixture
def pair(gpu_broker):
    low = NotebookKernel("low", _env(gpu_broker.socket)).ready()
    high = NotebookKernel("high", _env(gpu_broker.socket)).ready()
    yield low, high
    for kernel in (low, high):
        kernel.shutdown()


def _paused(broker, pid: int) -> bool:
    return any(lease.state == "paused" for lease in broker.leases_of(pid))


def test_unmarked_cells_run_long_kernels_to_the_end_even_after_a_lease_ended_paused(
    gpu_broker, pair
):
    low, high = pair
    for kernel in (low, high):
        kernel.run("%load_ext gpushare_ext", timeout=120).ok()
    setup = low.run(KERNELS_CELL, timeout=300).ok()
    assert "registry True" in setup.final_text(), setup.describe()
    unmarked = (
        "ok = all(bool((histogram().get() == expected_bins).all()) for _ in range(4))\n"
        "bump(ITER, y); cupy.cuda.runtime.deviceSynchronize()\n"
        "print('unmarked ok', ok, 'launched preemptibly', registry.launched)\n"
    )
    first = low.run(unmarked, timeout=120).ok()
    assert "unmarked ok True launched preemptibly 0" in first.final_text(), first.describe()

    # A %%gpu cell that is paused and ends while paused (its lease ends at the broker).
    scratch = short_tempdir()
    paused_cell = low.submit(
        "%%gpu priority=low\n"
        "print('running', flush=True)\n"
        "deadline = time.time() + 60\n"
        f"while not os.path.exists({str(scratch / 'end')!r}) and time.time() < deadline:\n"
        "    time.sleep(0.01)\n"
    )
    paused_cell.wait_shown("running")
    holder = high.submit(holding_cell(scratch / "release", "high"))
    try:
        holder.wait_shown("holding since")
        wait_for(lambda: _paused(gpu_broker, low.pid), "the low cell to be paused")
        (scratch / "end").touch()
        paused_cell.wait(timeout=60)
        assert paused_cell.error is None, paused_cell.describe()
        again = low.run(unmarked, timeout=120).ok()
        assert "unmarked ok True" in again.final_text(), again.describe()
    finally:
        (scratch / "release").touch()
        holder.wait(timeout=120)


@pytest.mark.parametrize(
    ("call", "check"),
    [
        # in place: whole launches only, so every element was bumped the same times
        ("bump(ITER, y)", "v = y.get(); print('whole', v.min() == v.max(), int(v.min()), done)"),
        # idempotent: every element holds one launch's constant, never a mix
        ("fill(x, ITER, float(done + 1), z)",
         "v = z.get(); print('whole', v.min() == v.max(), int(v.min()), done)"),
    ],
    ids=["snapshot-rolled-back", "restart-finished"],
)  # fmt: skip
def test_ctrl_c_while_paused_in_a_long_kernel_returns_at_once_with_whole_buffers(
    gpu_broker, pair, call, check
):
    low, high = pair
    for kernel in (low, high):
        kernel.run("%load_ext gpushare_ext", timeout=120).ok()
    low.run(
        KERNELS_CELL + "\ny.fill(0); z.fill(0); cupy.cuda.runtime.deviceSynchronize()", timeout=300
    ).ok()
    scratch = short_tempdir()
    looping = low.submit(
        "%%gpu priority=low\n"
        "done = 0\n"
        "print('launching', flush=True)\n"
        "try:\n"
        "    while True:\n"
        f"        {call}\n"
        "        done += 1\n"
        "except KeyboardInterrupt:\n"
        "    print(f'interrupted at {time.time()!r}', flush=True)\n"
        "    raise\n"
    )
    looping.wait_shown("launching")
    time.sleep(1.0)  # a few launches run preemptibly first
    holder = high.submit(holding_cell(scratch / "release", "high"))
    try:
        holder.wait_shown("holding since")
        wait_for(lambda: _paused(gpu_broker, low.pid), "the low cell to be paused")
        time.sleep(0.5)  # the low kernel's launch is now stopped, waiting for the resume
        interrupted_at = time.time()
        low.interrupt()
        looping.wait(timeout=60)
        assert looping.error is not None, looping.describe()
        assert looping.error["ename"] == "KeyboardInterrupt", looping.describe()
        reached = float(looping.stdout_value("interrupted at") or "nan")
        took = reached - interrupted_at
        print(f"Ctrl-C reached the cell {took * 1000:.0f} ms after the interrupt")
        assert took < 1.0, looping.describe()
    finally:
        (scratch / "release").touch()
        holder.wait(timeout=120)
    seen = low.run(
        "cupy.cuda.runtime.deviceSynchronize()\n" + check + "\n"
        "print('counts', registry.launched, registry.interrupted, registry.fallbacks)",
        timeout=60,
    ).ok()
    text = seen.final_text()
    whole, value, done = text.split("whole ", 1)[1].split()[:3]
    assert whole == "True", text  # never a half-written buffer
    assert int(value) in (int(done), int(done) + 1), text
    # The kernel is usable: the next cell runs the kernel again, correctly.
    after = low.run(
        "%%gpu priority=low\n"
        "before = y.get().copy(); bump(ITER, y); v = y.get()\n"
        "print('next cell', bool((v == before + 1).all()))",
        timeout=120,
    ).ok()
    assert "next cell True" in after.final_text(), after.describe() + "\n" + gpu_broker.log_tail()


def test_ctrl_c_in_an_unmarked_loop_of_long_kernels_leaves_no_queue_behind(gpu_broker, pair):
    """No lease, so nothing makes the kernels preemptible: each runs as it is, but the
    shim keeps at most two of them on the GPU.  Ctrl-C drops the launch waiting behind
    them and says so; the next cell's sync waits for those two, not for a queue of
    dozens (before: ~50 s for a loop of 1 s kernels)."""
    low, _ = pair
    low.run("%load_ext gpushare_ext", timeout=120).ok()
    low.run(
        KERNELS_CELL.replace("ITER = 1 << 22, 260_000", "ITER = 1 << 22, 2_600_000"), timeout=300
    ).ok()  # each launch now about 0.4 s on an H200
    looping = low.submit(
        "print('launching', flush=True)\nfor _ in range(200):\n    fill(x, ITER, 1.0, z)\n"
    )
    looping.wait_shown("launching")
    time.sleep(2.0)
    low.interrupt()
    looping.wait(timeout=60)
    assert looping.error is not None and looping.error["ename"] == "KeyboardInterrupt"
    assert "Ctrl-C dropped 1 launch of long kernels" in looping.shown_text(), looping.describe()
    synced = low.run(
        "started = time.perf_counter(); cupy.cuda.runtime.deviceSynchronize()\n"
        "print(f'synced in {time.perf_counter() - started:.2f} s')",
        timeout=120,
    ).ok()
    took = float(synced.final_text().split("synced in ")[1].split()[0])
    print(f"the next cell's sync waited {took:.2f} s")
    assert took < 3.0, synced.describe()  # two launches of ~0.4 s at most, not ~80 s
