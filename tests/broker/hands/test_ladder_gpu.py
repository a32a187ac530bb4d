"""The broker's GPU edges on a real device: NVML inventory, the stream gate (level 0),
the checkpoint lock and eviction (levels 3 and 4) through the broker's own actuator.

Skipped cleanly without a GPU.  Never changes the device's MIG layout, clocks or modes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from gpu_support import gpu_with

from benchmarks.checkpoint import process_memory_mib

ROOT = Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not gpu_with(), reason="needs an NVIDIA GPU with CuPy"),
]


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def test_nvml_inventory_reads_the_real_device_without_changing_it():
    from gpushare_ext.broker.hands.inventory import NvmlInventory

    inventory = NvmlInventory()
    try:
        devices = inventory.devices()
        readings = inventory.readings()
    finally:
        inventory.close()
    assert devices and devices[0].memory_total_mib > 10_000
    assert devices[0].multiprocessor_count > 0
    assert devices[0].profiles or not devices[0].mig_enabled
    assert readings[0].index == devices[0].index
    print(
        "inventory:",
        devices[0].name,
        devices[0].memory_total_mib,
        "MiB",
        devices[0].multiprocessor_count,
        "SMs, MIG",
        devices[0].mig_enabled,
        [p.name for p in devices[0].profiles],
    )


TENANT = textwrap.dedent(
    """
    import sys, time, hashlib, os, cupy
    gib = float(sys.argv[1]); ready = sys.argv[2]; done = sys.argv[3]
    n = int(gib * (1 << 30) // 4)
    data = cupy.random.random(n, dtype=cupy.float32)
    digest = lambda: hashlib.sha256(cupy.asnumpy(data).tobytes()).hexdigest()
    before = digest()
    counter = cupy.zeros(1, dtype=cupy.int64)
    cupy.cuda.runtime.deviceSynchronize()
    open(ready, "w").write(str(os.getpid()))
    steps = 0
    while not os.path.exists(done):
        counter += 1
        cupy.cuda.runtime.deviceSynchronize()
        steps += 1
        with open(ready + ".steps.tmp", "w") as f:  # whole or not at all: a rename
            f.write(str(steps))
        os.replace(ready + ".steps.tmp", ready + ".steps")
        time.sleep(0.002)
    open(done + ".result", "w").write("intact" if digest() == before else "CHANGED")
    """
)


def test_lock_pauses_and_eviction_frees_memory_then_everything_comes_back(tmp_path):
    from gpushare_ext.broker.hands.actuators import CudaProcessControl

    ready, done = tmp_path / "ready", tmp_path / "done"
    tenant = subprocess.Popen(
        [sys.executable, "-c", TENANT, "2", str(ready), str(done)], env=_env()
    )
    control = CudaProcessControl([0])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready.steps").exists():
            assert tenant.poll() is None and time.monotonic() < deadline, "tenant did not start"
            time.sleep(0.05)
        resident = process_memory_mib(tenant.pid)
        assert resident >= 2000, f"tenant should hold about 2 GiB, NVML says {resident} MiB"

        started = time.perf_counter()
        control.lock(tenant.pid, 0, 10_000)
        lock_ms = (time.perf_counter() - started) * 1e3
        steps = int((tmp_path / "ready.steps").read_text())
        time.sleep(0.5)
        assert int((tmp_path / "ready.steps").read_text()) <= steps + 1, (
            "a locked process kept computing"
        )

        started = time.perf_counter()
        control.checkpoint(tenant.pid, 0)
        checkpoint_s = time.perf_counter() - started
        evicted = process_memory_mib(tenant.pid)
        assert evicted < resident / 4, f"eviction left {evicted} of {resident} MiB on the device"

        started = time.perf_counter()
        control.restore(tenant.pid, 0)
        control.unlock(tenant.pid, 0)
        restore_s = time.perf_counter() - started
        time.sleep(0.5)
        assert int((tmp_path / "ready.steps").read_text()) > steps + 1, "it did not resume"
        assert process_memory_mib(tenant.pid) >= resident * 0.9
        done.write_text("stop")
        assert tenant.wait(timeout=120) == 0
        assert (tmp_path / "done.result").read_text() == "intact"
        print(
            f"lock {lock_ms:.1f} ms, checkpoint {checkpoint_s:.2f} s ({resident} MiB -> {evicted}),"
            f" restore+unlock {restore_s:.2f} s"
        )
    finally:
        control.close()
        if tenant.poll() is None:
            tenant.kill()


def test_closed_gate_holds_work_queued_behind_it_without_blocking_the_host():
    import tempfile
    import threading

    import cupy

    from gpushare_ext.control_block import ControlBlock
    from gpushare_ext.lease_state import LeaseState
    from gpushare_ext.runtime.gate import DeviceGate

    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))  # control blocks live on tmpfs
    block = ControlBlock.create(folder / "s.cb")
    session_view = ControlBlock.open(folder / "s.cb")
    gate = DeviceGate(session_view)
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    y = x * 2  # load the kernels now: a module load waits for a held stream
    cupy.cuda.runtime.deviceSynchronize()
    # The broker opens the gate from elsewhere; here a timer stands in for it.
    opened_at: list[float] = []

    def broker_opens() -> None:
        opened_at.append(time.perf_counter())
        block.publish(gate_closed=False, state=LeaseState.RUNNING)

    try:
        block.publish(gate_closed=True, state=LeaseState.PAUSED)
        with gate.stream:
            gate.hold_here()  # the gate is closed: the wait is queued
            y = x * 3
            done = cupy.cuda.Event()
            done.record()
        timer = threading.Timer(0.5, broker_opens)
        timer.start()
        time.sleep(0.3)
        held = not done.done
        done.synchronize()
        released_us = (time.perf_counter() - opened_at[0]) * 1e6
        assert held, "work behind a closed gate ran"
        assert float(y[-1]) == 3 * ((1 << 20) - 1)
        print(f"gate released queued work {released_us:.0f} us after the host write")
    finally:
        block.publish(gate_closed=False, state=LeaseState.RUNNING)
        gate.close()
        session_view.close()
        block.close()


def test_demo_runs_on_the_real_gpu_and_the_preempted_result_is_identical():
    result = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "demo"],  # its default length shows a pause
        capture_output=True,
        text=True,
        timeout=400,
        env=_env(),
        cwd=ROOT,
    )
    print(result.stdout[-4000:], result.stderr[-3000:])
    assert result.returncode == 0
    assert "the real GPU" in result.stdout
    assert "yes (sha256 match)" in result.stdout
    assert "yes: paused" in result.stdout  # the demo showed what it is for
