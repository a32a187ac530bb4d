"""The launch interposer on a real GPU: what it sees, how it holds, how fast a pause drains,
what it costs a training loop nobody preempts, and that the checkpoint lock still works.

Each scenario runs in its own process, started with the launch shim in ``LD_PRELOAD``
as the gpushare server extension starts kernels (``--mechanism cupti`` attaches the
CUPTI way instead), on a control block of its own under /dev/shm, written here the way
the broker writes it:

* ``count``    -- CuPy and PyTorch operations: launches the interposer saw, per library;
* ``hold``     -- a CuPy loop is paused for a second: launches and iterations stop, then go
                  on; its result is bit-identical to an undisturbed run;
* ``hold_torch`` -- the same for a PyTorch training loop (deterministic algorithms): its
                  weights afterwards, bit for bit;
* ``drain``    -- a thread queues 300 fp32 4096^2 matmuls; 0.2 s in, the session is paused:
                  the time until the GPU is idle, with the bound on work in flight (about
                  3 ms of GPU time) and without it;
* ``overhead`` -- ResNet-18 training steps (torchvision, batch 64, fp32) and a k-means style
                  CuPy loop in processes without the shim, with it attached (nobody
                  pausing) and with it attached but no bound, in turn: median step times;
* ``lock``     -- the checkpoint lock, checkpoint, restore and unlock of a process the shim
                  holds (levels 3 and 4 of the ladder), and its data afterwards.

Usage: ``python -m benchmarks.interposer all --out DIR`` (writes ``interposer.json`` and
prints a table) or ``python -m benchmarks.interposer SCENARIO`` (prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.stopping import exit_on_signals, track

SCENARIOS = ("count", "hold", "hold_torch", "drain", "overhead", "lock")


def _block(tmp: Path):
    from gpushare_ext.control_block import ControlBlock
    from gpushare_ext.lease_state import LeaseState

    block = ControlBlock.create(tmp / "session.cb")
    block.publish(gate_closed=False, state=LeaseState.RUNNING)
    return block


def _pause(block) -> None:
    from gpushare_ext.lease_state import LeaseState

    block.publish(gate_closed=False, state=LeaseState.PAUSED, level=0, reason="benchmark")


def _resume(block) -> None:
    from gpushare_ext.lease_state import LeaseState

    block.publish(gate_closed=False, state=LeaseState.RUNNING)


def scenario_count(tmp: Path) -> dict:
    import cupy as cp
    import torch

    from gpushare_ext.runtime import interpose

    block = _block(tmp)
    cp.zeros(1).sum()  # CUDA up before the subscription, as in a notebook
    torch.zeros(1, device="cuda").sum().item()
    attached = interpose.attach(block.address())
    before = interpose.stats()["launches"]
    a = cp.random.standard_normal((1024, 1024), dtype=cp.float32)
    for _ in range(50):
        a = a * 1.0001 + 1.0
    (a @ a).sum().item()
    cp.cuda.Device().synchronize()
    cupy_seen = interpose.stats()["launches"] - before
    before = interpose.stats()["launches"]
    x = torch.randn(512, 512, device="cuda")
    for _ in range(50):
        x = torch.relu(x @ x * 1e-3)
    x.sum().item()
    torch_seen = interpose.stats()["launches"] - before
    return {
        "scenario": "count",
        "cupy_ops": 52,
        "cupy_launches_seen": cupy_seen,
        "torch_ops": 101,
        "torch_launches_seen": torch_seen,
        "how": attached.describe(),
        "stats": interpose.stats(),
    }


def _paused_run(
    step: Callable[[int], None], steps: int, pause_at: int | None, block, synchronize
) -> dict:
    """Run ``step`` ``steps`` times; optionally paused for a second from another thread
    once ``pause_at`` steps are done. Returns what happened while paused."""
    progress = {"steps": 0}
    observed: dict = {}
    thread = None
    if pause_at is not None:

        def pauser() -> None:
            from gpushare_ext.runtime import interpose

            while progress["steps"] < pause_at:
                time.sleep(0.001)
            _pause(block)
            time.sleep(0.1)  # let what is in flight drain
            steps_then, launches_then = progress["steps"], interpose.stats()["launches"]
            time.sleep(1.0)
            observed["steps_while_paused"] = progress["steps"] - steps_then
            observed["launches_while_paused"] = interpose.stats()["launches"] - launches_then
            _resume(block)

        thread = threading.Thread(target=pauser, daemon=True)
        thread.start()
    for k in range(steps):
        step(k)
        progress["steps"] = k + 1
    synchronize()
    if thread is not None:
        thread.join(timeout=10)
    return observed


def _series(cp, steps: int, pause_at: int | None, block) -> tuple[str, dict]:
    """A deterministic CuPy loop; its result's digest and what happened while paused."""
    import hashlib

    state = {"x": cp.arange(1 << 22, dtype=cp.float32) / (1 << 22)}

    def step(k: int) -> None:
        state["x"] = cp.sin(state["x"]) * 0.5 + state["x"] * 0.5 + k * 1e-6

    observed = _paused_run(step, steps, pause_at, block, cp.cuda.Device().synchronize)
    return hashlib.sha256(cp.asnumpy(state["x"]).tobytes()).hexdigest(), observed


def _training(torch, steps: int, pause_at: int | None, block) -> tuple[str, dict]:
    """A deterministic PyTorch training loop (a small CNN, SGD with momentum); the digest
    of its weights afterwards and what happened while paused."""
    import hashlib

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    ).cuda()  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    images = torch.randn(64, 3, 64, 64, device="cuda")
    labels = torch.randint(0, 10, (64,), device="cuda")

    def step(_: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    observed = _paused_run(step, steps, pause_at, block, torch.cuda.synchronize)
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest(), observed


def _held_against_undisturbed(name: str, tmp: Path, loop, steps: int, pause_at: int) -> dict:
    """Run ``loop`` undisturbed, then with the shim attached and paused once: whether
    the two results are the same bytes, and what ran while paused."""
    from gpushare_ext.runtime import interpose

    block = _block(tmp)
    reference, _ = loop(steps, None, block)
    interpose.attach(block.address())
    started = time.monotonic()
    paused_digest, observed = loop(steps, pause_at, block)
    return {
        "scenario": name,
        "identical_to_undisturbed": paused_digest == reference,
        "seconds": round(time.monotonic() - started, 2),
        **observed,
        "stats": interpose.stats(),
    }


def scenario_hold(tmp: Path) -> dict:
    import cupy as cp

    cp.zeros(1).sum()
    return _held_against_undisturbed(
        "hold", tmp, lambda *a: _series(cp, *a), steps=3000, pause_at=500
    )


def scenario_hold_torch(tmp: Path) -> dict:
    """The same for a PyTorch training loop: its weights, bit for bit."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    return _held_against_undisturbed(
        "hold_torch", tmp, lambda *a: _training(torch, *a), steps=300, pause_at=50
    )


def scenario_drain(tmp: Path, window: int | None) -> dict:
    import cupy as cp

    from gpushare_ext.runtime import interpose

    block = _block(tmp)
    a = cp.random.standard_normal((4096, 4096), dtype=cp.float32)
    b = a @ a
    cp.cuda.Device().synchronize()
    started = time.perf_counter()
    for _ in range(10):
        b = a @ a
    cp.cuda.Device().synchronize()
    one_ms = (time.perf_counter() - started) * 100
    attached = interpose.attach(block.address(), window=window)
    issued = {"count": 0}

    def issuer() -> None:
        nonlocal b
        for _ in range(300):
            b = a @ a
            issued["count"] += 1

    thread = threading.Thread(target=issuer, daemon=True)
    thread.start()
    time.sleep(0.2)
    _pause(block)
    paused_at = time.perf_counter()
    issued_at_pause = issued["count"]
    cp.cuda.Device().synchronize()  # the other thread is held: this waits for what is queued
    drain_ms = (time.perf_counter() - paused_at) * 1000
    _resume(block)
    thread.join(timeout=60)
    cp.cuda.Device().synchronize()
    return {
        "scenario": "drain",
        "bound": attached.describe(),
        "matmul_ms": round(one_ms, 3),
        "issued_before_pause": issued_at_pause,
        "drain_ms": round(drain_ms, 2),
        "drain_in_matmuls": round(drain_ms / one_ms, 1),
        "stats": interpose.stats(),
    }


def _resnet_steps(steps: int):
    import torch
    import torchvision

    model = torchvision.models.resnet18(weights=None).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    data = torch.randn(64, 3, 224, 224, device="cuda")
    target = torch.randint(0, 1000, (64,), device="cuda")

    def step() -> float:
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data), target)
        loss.backward()
        optimizer.step()
        torch.cuda.synchronize()
        return time.perf_counter() - started

    for _ in range(10):
        step()
    return step


def _kmeans_steps():
    import cupy as cp

    points = cp.random.standard_normal((200_000, 16), dtype=cp.float32)
    centers = points[:64].copy()

    def step() -> float:
        nonlocal centers
        started = time.perf_counter()
        distances = ((points[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
        labels = distances.argmin(axis=1)
        sums = cp.zeros_like(centers)
        cp.add.at(sums, labels, points)
        counts = cp.bincount(labels, minlength=64)[:, None]
        centers = sums / cp.maximum(counts, 1)
        float(centers.sum())  # a host sync per iteration, as k-means loops do
        return time.perf_counter() - started

    for _ in range(5):
        step()
    return step


def scenario_overhead(tmp: Path, mode: str, steps: int = 100) -> dict:
    """One process's median step times, ``mode``: without, with, or unbounded."""
    from gpushare_ext.runtime import interpose

    block = _block(tmp)
    loops = {"resnet18_train_step": _resnet_steps(steps), "cupy_kmeans_step": _kmeans_steps()}
    if mode != "without":
        interpose.attach(block.address(), window=0 if mode == "unbounded" else None)
    result: dict = {"scenario": "overhead", "mode": mode, "steps": steps}
    for name, step in loops.items():
        result[name] = round(statistics.median(step() for _ in range(steps)) * 1000, 3)
    if mode != "without":
        result["stats"] = interpose.stats()
    return result


def _paired_overhead(overhead: dict[str, list], loop: str) -> dict:
    """The median over rounds of each mode against the run without the shim in the same
    round: the GPU's speed drifts between processes (10 % seen on the H200), and runs
    started one after the other drift least apart."""
    out = {}
    for mode in ("with", "unbounded"):
        ratios = [
            r[loop] / base[loop]
            for r, base in zip(overhead[mode], overhead["without"], strict=False)
            if loop in r and loop in base
        ]
        if ratios:
            out[f"overhead_pct_{mode}_paired"] = round((statistics.median(ratios) - 1) * 100, 2)
    return out


def scenario_lock(tmp: Path) -> dict:
    """Levels 3 and 4 on a process the shim holds: lock, checkpoint, restore, unlock."""
    import cupy as cp

    from gpushare_ext.runtime import interpose

    block = _block(tmp)
    a = cp.arange(1 << 24, dtype=cp.float32)
    expected = float((a * 2).sum())
    attached = interpose.attach(block.address())
    child_pid = os.getpid()
    # The checkpoint API acts on another process: ask the parent (no shim) to do it.
    request = Path(tmp) / "lock-me"
    request.write_text(str(child_pid))
    answer = Path(tmp) / "done"
    deadline = time.monotonic() + 60
    while not answer.exists() and time.monotonic() < deadline:
        (a * 1.0).sum()  # keep launching meanwhile
        time.sleep(0.01)
    steps = json.loads(answer.read_text()) if answer.exists() else {"error": "no answer"}
    return {
        "scenario": "lock",
        "how": attached.describe(),
        **steps,
        "data_intact": float((a * 2).sum()) == expected,
    }


def lock_from_outside(tmp: Path, pid: int) -> dict:
    from cuda.bindings import driver as cu

    def name(result) -> str:
        code = result[0] if isinstance(result, tuple) else result
        return cu.cuGetErrorName(code)[1].decode()

    cu.cuInit(0)
    args = cu.CUcheckpointLockArgs()
    args.timeoutMs = 5000
    steps = {"lock": name(cu.cuCheckpointProcessLock(pid, args))}
    if steps["lock"] == "CUDA_SUCCESS":
        steps["checkpoint"] = name(cu.cuCheckpointProcessCheckpoint(pid, None))
        if steps["checkpoint"] == "CUDA_SUCCESS":
            steps["restore"] = name(cu.cuCheckpointProcessRestore(pid, None))
        steps["unlock"] = name(cu.cuCheckpointProcessUnlock(pid, None))
    return steps


def run_one(name: str, window: int | None = None, mode: str = "with") -> dict:
    with tempfile.TemporaryDirectory(prefix="gps-interpose-", dir="/dev/shm") as tmp:
        path = Path(tmp)
        if name == "count":
            return scenario_count(path)
        if name == "hold":
            return scenario_hold(path)
        if name == "hold_torch":
            return scenario_hold_torch(path)
        if name == "drain":
            return scenario_drain(path, window)
        if name == "lock":
            return scenario_lock(path)
        return scenario_overhead(path, mode)


def _subprocess(name: str, *extra: str, mechanism: str = "preload", shim: bool = True) -> dict:
    from gpushare_ext.runtime.interpose import shim_path

    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if shim and mechanism == "preload":
        env["LD_PRELOAD"] = str(shim_path())
    if mechanism == "cupti":
        env["GPUSHARE_INTERPOSER"] = "cupti"
    if name == "lock":
        env["GPUSHARE_LOCK_CHILD"] = "1"
    process = track(subprocess.Popen(
        [sys.executable, "-m", "benchmarks.interposer", name, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    ))  # fmt: skip
    if name == "lock":
        _serve_lock_request(process)
    stdout, stderr = process.communicate(timeout=400)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if process.returncode != 0 or not lines:
        return {"scenario": name, "error": (stderr or stdout)[-2000:]}
    return json.loads(lines[-1])


def _serve_lock_request(process: subprocess.Popen) -> None:
    """The parent's half of ``lock``: find the child's request under /dev/shm, act on it."""
    import glob

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        for request in glob.glob("/dev/shm/gps-interpose-*/lock-me"):
            tmp = Path(request).parent
            pid = int(Path(request).read_text())
            if pid != process.pid:
                continue
            steps = lock_from_outside(tmp, pid)
            Path(request).unlink()
            (tmp / "done").write_text(json.dumps(steps))
            return
        time.sleep(0.05)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--window", type=int, default=None)
    parser.add_argument("--mode", choices=["without", "with", "unbounded"], default="with")
    parser.add_argument("--mechanism", choices=["preload", "cupti"], default="preload")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--quick", action="store_true", help="accepted for the suite runner")
    parser.add_argument(
        "--rounds", type=int, default=3, help="overhead: processes per mode, alternated"
    )
    return parser.parse_args()


def _overhead_summary(overhead: dict[str, list]) -> dict:
    """Per loop, each mode's median step time and its overhead over the run without the
    shim (as medians of all rounds and round by round)."""
    summary: dict = {"scenario": "overhead_summary"}
    for loop in ("resnet18_train_step", "cupy_kmeans_step"):
        medians = {
            mode: statistics.median(r[loop] for r in results if loop in r)
            for mode, results in overhead.items()
            if any(loop in r for r in results)
        }
        if "without" in medians:
            summary[loop] = {
                **{f"median_ms_{mode}": round(value, 3) for mode, value in medians.items()},
                **{
                    f"overhead_pct_{mode}": round((value / medians["without"] - 1) * 100, 2)
                    for mode, value in medians.items()
                    if mode != "without"
                },
                **_paired_overhead(overhead, loop),
            }
    return summary


def _run_all(args: argparse.Namespace) -> int:
    """Every scenario in a process of its own; ``interposer.json`` under ``--out``."""
    from benchmarks.environment import describe

    run = lambda *a, **k: _subprocess(*a, mechanism=args.mechanism, **k)  # noqa: E731
    runs = [
        run("count"),
        run("hold"),
        run("hold_torch"),
        run("drain"),
        run("drain", "--window", "0"),
        run("lock"),
    ]
    overhead: dict[str, list] = {"without": [], "with": [], "unbounded": []}
    for _ in range(args.rounds):  # alternate processes so that drift hits every mode alike
        for mode in overhead:
            overhead[mode].append(run("overhead", "--mode", mode, shim=mode != "without"))
    runs.append(_overhead_summary(overhead))
    runs += [r for results in overhead.values() for r in results if "error" in r]
    record = {**describe(), "mechanism": args.mechanism, "runs": runs, "overhead_runs": overhead}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "interposer.json").write_text(json.dumps(record, indent=2) + "\n")
    for entry in runs:
        print(json.dumps({k: v for k, v in entry.items() if k != "stats"}))
    return 0 if not any("error" in entry for entry in runs) else 1


def main() -> int:
    args = _parse_args()
    exit_on_signals()  # ended by a signal, it still stops the scenario it runs
    if args.scenario == "lock" and not os.environ.get("GPUSHARE_LOCK_CHILD"):
        # The checkpoint API acts on another process: this one is the parent, the child
        # (started with the shim) is the one locked.
        result = _subprocess("lock", mechanism=args.mechanism)
        print(json.dumps(result), flush=True)
        return 0 if "error" not in result else 1
    if args.scenario != "all":
        print(json.dumps(run_one(args.scenario, args.window, args.mode)), flush=True)
        return 0
    return _run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
