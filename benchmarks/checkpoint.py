"""Lock, evict (checkpoint), restore and unlock times against resident device memory.

A tenant process holds ``size`` GiB of CuPy arrays and keeps a kernel stream busy; the
broker's own actuator (:class:`gpushare_ext.broker.hands.actuators.CudaProcessControl`, the
code that preempts real sessions) locks it, checkpoints it, restores and unlocks it.
NVML confirms the memory left the device and came back; the tenant's checksum
confirms the data is intact.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TENANT = r"""
import sys, time, hashlib, cupy
gib = float(sys.argv[1]); ready = sys.argv[2]; done = sys.argv[3]
n = int(gib * (1 << 30) // 4)
data = cupy.random.random(n, dtype=cupy.float32)
before = hashlib.sha256(cupy.asnumpy(data[:: max(1, n // (1 << 22))]).tobytes()).hexdigest()
full_before = float(data.sum(dtype=cupy.float64))
cupy.cuda.runtime.deviceSynchronize()
open(ready, "w").write(before)
small = cupy.ones(1 << 20, dtype=cupy.float32)
import os
while not os.path.exists(done):
    small = small * 1.0000001
    cupy.cuda.runtime.deviceSynchronize()
    time.sleep(0.001)
after = hashlib.sha256(cupy.asnumpy(data[:: max(1, n // (1 << 22))]).tobytes()).hexdigest()
full_after = float(data.sum(dtype=cupy.float64))
open(done + ".result", "w").write("intact" if (before == after and full_before == full_after) else "CHANGED")
"""


def process_memory_mib(pid: int) -> int:
    """Device memory NVML attributes to ``pid`` on GPU 0, in MiB (0: none there)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == pid:
                return int((process.usedGpuMemory or 0) // (1 << 20))
        return 0
    finally:
        pynvml.nvmlShutdown()


def measure(size_gib: float, control, workdir: Path) -> dict:
    ready = workdir / f"ready-{size_gib}"
    done = workdir / f"done-{size_gib}"
    from benchmarks.stopping import track

    tenant = track(
        subprocess.Popen([sys.executable, "-c", TENANT, str(size_gib), str(ready), str(done)])
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if tenant.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tenant with {size_gib} GiB did not start")
            time.sleep(0.05)
        time.sleep(0.3)
        resident = process_memory_mib(tenant.pid)
        t0 = time.perf_counter()
        control.lock(tenant.pid, 0, 10000)
        t1 = time.perf_counter()
        control.checkpoint(tenant.pid, 0)
        t2 = time.perf_counter()
        evicted = process_memory_mib(tenant.pid)
        t3 = time.perf_counter()
        control.restore(tenant.pid, 0)
        t4 = time.perf_counter()
        control.unlock(tenant.pid, 0)
        t5 = time.perf_counter()
        restored = process_memory_mib(tenant.pid)
        done.write_text("go")
        tenant.wait(timeout=300)
        intact = (workdir / f"done-{size_gib}.result").read_text() == "intact"
        return {
            "size_gib": size_gib,
            "resident_mib": resident,
            "after_checkpoint_mib": evicted,
            "after_restore_mib": restored,
            "lock_ms": (t1 - t0) * 1e3,
            "checkpoint_s": t2 - t1,
            "restore_s": t4 - t3,
            "unlock_ms": (t5 - t4) * 1e3,
            "data_intact": intact,
        }
    finally:
        if tenant.poll() is None:
            tenant.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", default="0.5,2,8,20,40", help="GiB resident in the tenant")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.environment import describe
    from benchmarks.stopping import exit_on_signals

    exit_on_signals()  # ended by a signal, it still stops the tenant
    from gpushare_ext.broker.hands.actuators import CudaProcessControl

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-ckpt-"))
    control = CudaProcessControl([0])
    rows = []
    try:
        for size in [float(s) for s in args.sizes.split(",")]:
            try:
                rows.append(measure(size, control, workdir))
            except Exception as exc:  # keep the other sizes; the failure is in the results
                rows.append({"size_gib": size, "error": str(exc)})
    finally:
        control.close()
    (out / "checkpoint.json").write_text(
        json.dumps({"benchmark": "checkpoint", **describe(), "rows": rows}, indent=2)
    )
    print(
        f"{'GiB':>6}{'resident':>10}{'evicted':>9}{'lock ms':>9}{'ckpt s':>8}{'restore s':>10}{'unlock ms':>10} intact"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['size_gib']:>6} error: {row['error']}")
            continue
        print(
            f"{row['size_gib']:>6}{row['resident_mib']:>10}{row['after_checkpoint_mib']:>9}{row['lock_ms']:>9.1f}"
            f"{row['checkpoint_s']:>8.2f}{row['restore_s']:>10.2f}{row['unlock_ms']:>10.1f} {row['data_intact']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
