"""How long the checkpoint lock takes on a busy process: its first lock against later ones.

Beside a PyTorch transformer-encoder training loop, the first pause of the run took
235-300 ms to lock the process, the later ones 2-6 ms (``third_party``, broker log).
This measures the lock alone, from this process (as the broker's actuator does), on
victims started fresh for each case:

* ``cupy``            -- 2048^2 CuPy matmuls, synchronised every 4;
* ``torch``           -- the transformer-encoder training step of ``benchmarks.tenant``;
* ``torch-shim``      -- the same started with the launch shim preloaded (no session);
* ``torch-state``     -- the same, ``cuCheckpointProcessGetState`` asked before the locks;
* ``torch-idle-warm`` -- one lock and unlock right after its first step, then the
                         training loop, then the locks.

Each case: five lock/unlock pairs 0.1 s apart, then two more 2 s apart.

``python -m benchmarks.first_lock --out DIR [--cases torch,torch-shim]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

VICTIM = r"""
import sys, time
kind = sys.argv[1]
if kind == "cupy":
    import cupy
    a = cupy.random.standard_normal((2048, 2048), dtype=cupy.float32)
    def step():
        for _ in range(4):
            a @ a
    sync = cupy.cuda.runtime.deviceSynchronize
else:
    import torch
    from benchmarks.tenant import THIRD_PARTY
    step = THIRD_PARTY["transformer"]()
    sync = torch.cuda.synchronize
step(); sync()
print("first-step", flush=True)
if sys.stdin.readline().strip() != "go":
    raise SystemExit(1)
deadline = time.time() + 90
while time.time() < deadline:
    step(); sync()
"""

CASES = ("cupy", "torch", "torch-shim", "torch-state", "torch-idle-warm")


def _driver():
    from cuda.bindings import driver as cu

    def check(result, what: str):
        err = result[0] if isinstance(result, tuple) else result
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {cu.cuGetErrorName(err)[1]}")

    check(cu.cuInit(0), "cuInit")
    return cu, check


def _ms(action) -> float:
    started = time.perf_counter()
    action()
    return round((time.perf_counter() - started) * 1e3, 2)


def run_case(case: str) -> dict:
    cu, check = _driver()

    def lock(pid: int) -> None:
        args = cu.CUcheckpointLockArgs()
        args.timeoutMs = 10_000
        check(cu.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock")

    def unlock(pid: int) -> None:
        check(cu.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock")

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if case == "torch-shim":
        from gpushare_ext.server_ext import preload_for_kernels

        preload_for_kernels(env)
    else:
        env.pop("LD_PRELOAD", None)
    kind = "cupy" if case == "cupy" else "torch"
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    record: dict = {"case": case}
    try:
        assert victim.stdout is not None and victim.stdin is not None
        if victim.stdout.readline().strip() != "first-step":
            raise RuntimeError(f"the {kind} victim did not start")
        pid = victim.pid
        if case == "torch-idle-warm":
            record["idle_lock_ms"] = _ms(lambda: lock(pid))
            record["idle_unlock_ms"] = _ms(lambda: unlock(pid))
        victim.stdin.write("go\n")
        victim.stdin.flush()
        time.sleep(3.0)  # a steady training loop
        if case == "torch-state":
            record["get_state_ms"] = _ms(
                lambda: check(cu.cuCheckpointProcessGetState(pid), "state")
            )
            time.sleep(0.5)
        pairs = []
        for gap in (0.1, 0.1, 0.1, 0.1, 0.1, 2.0, 2.0):
            pairs.append([_ms(lambda: lock(pid)), _ms(lambda: unlock(pid))])
            time.sleep(gap)
        record["lock_unlock_ms"] = pairs
    finally:
        victim.kill()
        victim.wait()
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for first_lock.json")
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args(argv)
    records = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}: one of {', '.join(CASES)}")
        record = run_case(case)
        records.append(record)
        print(json.dumps(record), flush=True)
    if args.out:
        from benchmarks.environment import describe

        Path(args.out).mkdir(parents=True, exist_ok=True)
        document = {**describe(), "benchmark": "first_lock", "cases": records}
        (Path(args.out) / "first_lock.json").write_text(json.dumps(document, indent=2))
    print(f"{'case':<18}{'first lock ms':>14}{'locks 2-5 ms':>22}{'after 2 s gaps ms':>20}")
    for record in records:
        locks = [pair[0] for pair in record["lock_unlock_ms"]]
        print(
            f"{record['case']:<18}{locks[0]:>14}{' '.join(map(str, locks[1:5])):>22}"
            f"{' '.join(map(str, locks[5:])):>20}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
