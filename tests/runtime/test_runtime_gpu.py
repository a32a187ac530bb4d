"""On a real GPU: two notebook kernels share it through a broker using NVML and the real ladder.

* a low-priority CuPy loop (``examples/training_low.ipynb``) is locked (level 3,
  ``cuCheckpointProcessLock``) while a high-priority cell (``examples/interactive_high.ipynb``)
  runs; the high cell's p50 latency stays within 10 % of running alone, and the loop's
  result is bit-identical to an undisturbed run;
* when the high lease needs the memory, the low process is evicted (its device memory,
  as NVML sees it, goes to ~0) and restored afterwards with its data intact;
* inside ``%%gpu mem=1GiB`` a 2 GiB CuPy allocation raises MemoryError naming quota and usage.

Skips cleanly without a usable GPU.  Failures print the broker's log and every cell output.
"""

from __future__ import annotations

import ast
import json
import time

import pytest
from runtime_helpers import (
    BrokerProcess,
    example_cells,
    gpu_missing_reason,
    run_example,
    wait_for,
)

from gpushare_ext.protocol import PRIORITY_CLASSES, LeaseState

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_missing_reason() is not None, reason=str(gpu_missing_reason())),
]

SIZE = 4096
LOW_STEPS = 40_000  # a few seconds of 4096x4096 @ 4096x64 steps on an H200
LOW = {"steps": LOW_STEPS, "step_seconds": 0.0, "size": SIZE, "use_gpu": True, "seed": 7}
HIGH = {"use_gpu": True, "repeats": 40, "size": SIZE}


@pytest.fixture(scope="module")
def undisturbed_checksum(on_gpu_broker) -> str:
    """The low-priority loop alone on the GPU: the result every preempted run must match."""
    alone = run_example("training_low.ipynb", LOW).wait(180)
    checksum = alone.value("checksum")
    assert checksum, alone.describe()
    return checksum


# ------------------------------------------------------------------ NVML


def nvml_used_mib(pid: int) -> int | None:
    """Device memory NVML attributes to ``pid`` (MiB), or None if it has no context there."""
    import pynvml

    pynvml.nvmlInit()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid:
                    return int((process.usedGpuMemory or 0) // (1024 * 1024))
    finally:
        pynvml.nvmlShutdown()
    return None


def p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def diagnostics(broker: BrokerProcess, *runs) -> str:
    parts = [f"--- broker log ---\n{broker.log_tail(6000)}"]
    with_status = ""
    try:
        with_status = "\n".join(repr(lease) for lease in broker.leases())
    except Exception as exc:  # the broker may be the thing that failed
        with_status = f"(status failed: {exc})"
    parts.append(f"--- leases now ---\n{with_status}")
    parts += [run.describe() for run in runs]
    return "\n".join(parts)


def run_high_notebook(kernel, gpu_line: str | None = None) -> list[float]:
    """Run examples/interactive_high.ipynb's cells in ``kernel``; its latencies in ms."""
    cells = example_cells("interactive_high.ipynb", HIGH, gpu_line)
    last = None
    for source in cells:
        last = kernel.run(source, timeout=120).ok()
    latencies = json.loads(last.stdout_value("latencies_ms"))
    assert len(latencies) == HIGH["repeats"], last.describe()
    return latencies


def nvml_pids() -> list[int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        return [
            process.pid
            for index in range(pynvml.nvmlDeviceGetCount())
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(
                pynvml.nvmlDeviceGetHandleByIndex(index)
            )
        ]
    finally:
        pynvml.nvmlShutdown()


def wait_until_looping(low, broker: BrokerProcess, *, need_nvml: bool) -> int:
    """Until the low loop's lease runs and its process holds device memory; returns its pid.

    Without ``need_nvml`` a process NVML does not list (another pid namespace) is tolerated.
    """
    wait_for(
        lambda: (
            low.done.is_set()
            or any(
                lease.state == LeaseState.RUNNING and lease.priority == PRIORITY_CLASSES["low"]
                for lease in broker.leases()
            )
        ),
        "the low-priority lease to run",
        timeout=120,
    )
    pid = low.kernel_pid
    assert pid, diagnostics(broker, low)
    deadline = time.monotonic() + 60
    while not low.done.is_set() and (nvml_used_mib(pid) or 0) == 0:
        if time.monotonic() > deadline:
            message = f"NVML never listed the low kernel (pid {pid}); it lists {nvml_pids()}"
            if need_nvml:
                raise AssertionError(message + "\n" + diagnostics(broker, low))
            print(message, "-- going on without it")
            time.sleep(2.0)
            break
        time.sleep(0.05)
    if low.done.is_set():
        low.wait(1)  # raises with the notebook's error, if any
        raise AssertionError(
            f"the low loop ended before it could be preempted: raise LOW_STEPS\n{low.describe()}"
        )
    time.sleep(0.5)  # into the loop
    return pid


# ------------------------------------------------------------------ tests


def test_a_high_priority_cell_locks_the_low_loop_and_keeps_its_latency(
    on_gpu_broker, undisturbed_checksum, kernels
):
    (high,) = kernels(1)
    alone = run_high_notebook(high)  # the baseline: the same kernel, the GPU to itself

    low = run_example("training_low.ipynb", LOW)
    wait_until_looping(low, on_gpu_broker, need_nvml=False)
    contended = run_high_notebook(high)
    low.wait(180)

    report = diagnostics(on_gpu_broker, low)
    final = low.cell_text()
    assert "paused for a higher-priority session" in final, report
    assert "ladder level 3" in final, report  # a CuPy loop is locked: cuCheckpointProcessLock
    assert "resumed after" in final, report
    assert p50(contended) <= 1.10 * p50(alone), (
        f"high-priority p50 {p50(contended):.3f} ms vs {p50(alone):.3f} ms alone\n"
        f"alone {alone}\ncontended {contended}\n{report}"
    )
    assert low.value("checksum") == undisturbed_checksum, report
    assert len(ast.literal_eval(low.value("timeline"))) == LOW_STEPS


def gpu_total_gib() -> int:
    """GPU 0's memory, whole GiB."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total >> 30)
    finally:
        pynvml.nvmlShutdown()


def test_eviction_frees_the_low_loops_memory_and_restore_brings_it_back_intact(
    on_gpu_broker, undisturbed_checksum, kernels, tmp_path
):
    # Together they do not fit on the GPU (100 + 60 GiB on a 140 GiB H200, 55 + 33 on an
    # 80 GiB H100): the high lease needs an eviction.
    total = gpu_total_gib()
    low_gib, high_gib = total * 5 // 7, total * 3 // 7
    (high,) = kernels(1)
    high.run("%load_ext gpushare_ext").ok()
    low = run_example("training_low.ipynb", LOW, gpu_line=f"%%gpu priority=low mem={low_gib}GiB")
    pid = wait_until_looping(low, on_gpu_broker, need_nvml=True)
    before = nvml_used_mib(pid)
    release = tmp_path / "release"

    cell = high.submit(
        f"%%gpu priority=high mem={high_gib}GiB\n"
        "import os, time, cupy\n"
        "a = cupy.ones((1024, 1024), dtype=cupy.float32)\n"
        "print('sum', float(a.sum()), flush=True)\n"
        f"while not os.path.exists({str(release)!r}):\n"
        "    time.sleep(0.05)\n"
    )
    cell.wait_shown("sum", timeout=120)
    during = wait_for(
        lambda: (nvml_used_mib(pid) or 0) < 64 and [nvml_used_mib(pid) or 0],
        "the evicted loop's device memory to be freed",
        30,
    )[0]
    release.touch()
    cell.ok(60)
    after = 0  # the restored process until its loop ends and nbclient stops the kernel
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and after < (before or 1) * 0.9 and not low.done.is_set():
        after = max(after, nvml_used_mib(pid) or 0)
        time.sleep(0.05)
    low.wait(180)

    report = diagnostics(on_gpu_broker, low, cell) + f"\nNVML MiB: {before} -> {during} -> {after}"
    assert before and before > 64, report
    assert after >= before * 0.9, report
    final = low.cell_text()
    assert "ladder level 4" in final and "resumed after" in final, report
    assert low.value("checksum") == undisturbed_checksum, report


def test_a_cupy_allocation_over_the_lease_raises_memory_error(on_gpu_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()

    run = kernel.run(
        "%%gpu mem=1GiB\n"
        "import cupy\n"
        "try:\n"
        "    cupy.empty(2 * 1024**3, dtype=cupy.uint8)\n"
        "except MemoryError as exc:\n"
        "    print('refused', type(exc).__name__, exc)\n"
        "else:\n"
        "    print('allocated')\n",
        timeout=120,
    ).ok()

    text = run.final_text()
    assert "refused QuotaExceeded" in text, run.describe() + diagnostics(on_gpu_broker)
    assert "CuPy allocation of 2.0 GiB refused: the lease allows 1.0 GiB" in text, text
    assert "is already in use" in text, text
    # outside a lease the quota is gone again
    free = kernel.run("import cupy\nx = cupy.empty(2 * 1024**3, dtype=cupy.uint8)\nprint('ok')")
    assert "ok" in free.ok().final_text()
