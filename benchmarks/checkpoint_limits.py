"""What the CUDA checkpoint API does with managed (UVM) memory and CUDA IPC on this
driver: lock, checkpoint, restore and unlock of plain CuPy processes (no gpushare), and
whether their data survives.

Four cases: a plain process; one with managed memory; the exporter and (a fresh pair)
the importer of memory shared through CUDA IPC.  The broker's parking rules come from
these answers (docs/policy.md, "What is never parked").  Each result is printed as it
comes, then the whole as JSON::

    python benchmarks/checkpoint_limits.py > checkpoint_limits.json

Needs a GPU, CuPy and cuda-bindings.  A step that hangs is reported as such after 25 s.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

TARGET = r"""
import sys, cupy as cp
mode = sys.argv[1]
n = (256 << 20) // 4
if mode == "managed":
    mem = cp.cuda.ManagedMemory(n * 4)
    a = cp.ndarray((n,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(mem, 0))
    a[:] = 1.5
elif mode in ("ipc_export", "plain"):
    a = cp.full((n,), 1.5, dtype=cp.float32)
    if mode == "ipc_export":
        print("handle", bytes(cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)).hex(), flush=True)
elif mode == "ipc_import":
    ptr = cp.cuda.runtime.ipcOpenMemHandle(bytes.fromhex(sys.argv[2]))
    memory = cp.cuda.UnownedMemory(ptr, n * 4, None)
    a = cp.ndarray((n,), dtype=cp.float32, memptr=cp.cuda.MemoryPointer(memory, 0))
cp.cuda.runtime.deviceSynchronize()
print("ready", float(a.sum()), flush=True)
sys.stdin.readline()
print("after", float(a.sum()), flush=True)
"""
STEP_TIMEOUT_S = 25.0


def _name(cu, result) -> str:
    return cu.cuGetErrorName(result)[1].decode()


def checkpoint_cycle(pid: int) -> dict:
    """Lock, checkpoint, restore, unlock ``pid``: each step's answer (or "hung")."""
    from cuda.bindings import driver as cu

    cu.cuInit(0)
    out: dict = {}

    def run() -> None:
        started = time.monotonic()
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = 5000
        result = cu.cuCheckpointProcessLock(pid, args)[0]
        out["lock"] = _name(cu, result)
        if result != cu.CUresult.CUDA_SUCCESS:
            return
        result = cu.cuCheckpointProcessCheckpoint(pid, None)[0]
        out["checkpoint"] = _name(cu, result)
        if result == cu.CUresult.CUDA_SUCCESS:
            out["restore"] = _name(cu, cu.cuCheckpointProcessRestore(pid, None)[0])
        out["unlock"] = _name(cu, cu.cuCheckpointProcessUnlock(pid, None)[0])
        out["s"] = round(time.monotonic() - started, 2)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(STEP_TIMEOUT_S)
    if worker.is_alive():
        out["hung"] = True
    return out


def start(mode: str, *extra: str) -> subprocess.Popen:
    from benchmarks.stopping import track

    return track(
        subprocess.Popen(
            [sys.executable, "-c", TARGET, mode, *extra],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )


def finish(process: subprocess.Popen) -> tuple[str, int | None]:
    """Let the target read its data again: its line, and its exit status."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    if not select.select([process.stdout], [], [], 15)[0]:
        process.kill()
        return "no answer in 15 s", None
    line = process.stdout.readline().strip()
    process.wait(timeout=15)
    return line, process.returncode


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script
    from benchmarks.stopping import exit_on_signals

    exit_on_signals()  # ended by a signal, it still stops the processes it checkpoints
    results: dict = {}
    for mode in ("plain", "managed"):
        target = start(mode)
        assert target.stdout is not None
        result = {"ready": target.stdout.readline().strip(), **checkpoint_cycle(target.pid)}
        result["after"], result["rc"] = finish(target)
        results[mode] = result
        print(mode, json.dumps(result), file=sys.stderr, flush=True)
    for victim in ("exporter", "importer"):
        exporter = start("ipc_export")
        assert exporter.stdout is not None
        handle = exporter.stdout.readline().split()[1]
        exporter_ready = exporter.stdout.readline().strip()
        importer = start("ipc_import", handle)
        assert importer.stdout is not None
        importer_ready = importer.stdout.readline().strip()
        target = exporter if victim == "exporter" else importer
        result = {"ready": [exporter_ready, importer_ready], **checkpoint_cycle(target.pid)}
        result["after_importer"] = finish(importer)
        result["after_exporter"] = finish(exporter)
        results[f"ipc_{victim}"] = result
        print(victim, json.dumps(result), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
