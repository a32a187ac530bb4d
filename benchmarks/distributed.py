"""Distributed training across slices of one GPU, launched from the notebook API.

What it measures: a torchvision ResNet-18 (GroupNorm instead of BatchNorm, so that each
rank's share of a batch gives the gradient of the whole batch exactly) trained on
synthetic CIFAR-sized images through :func:`gpushare_ext.launch`, on a broker of its
own over the real GPU (``gpushare broker --inventory nvml``):

* ``single``: one rank on the whole GPU (the baseline);
* ``ranks-2``, ``ranks-4``: one model trained by 2 and 4 ranks, each a software slice of
  the one GPU (memory quota, SM share 1/N), gradients averaged on the path the launcher
  picks for them (through the GPU's memory: ``cuda-ipc``);
* ``ranks-2-gloo``, ``ranks-4-gloo`` (left out with ``--skip-gloo``): the same through
  DDP's gloo all-reduce;
* ``ranks-2-host-shm``, ``ranks-4-host-shm``: the same, with the gradients averaged
  through pinned host shared memory (the path of MIG instances) although the ranks
  share one GPU, so that it can be measured on a host without MIG;
* ``two-singles`` and ``two-gangs``: two trainings at once (two notebooks' worth: two
  processes asking the broker), as two single-rank jobs and as two gangs of 2;
* with ``--mps``, each of those again with an MPS control daemon the run starts itself
  (private pipe and log folders) and stops at the end, and the broker's policy set to
  ``mps = true`` (shares become MPS thread limits).

Each row: images per second (global batch x steps / the slowest rank's time, after
warm-up steps), the loss of every step (the mean over ranks), and for the multi-rank
rows the largest relative difference from the single-process loss curve with the same
seed and data.  Usage (on a GPU host)::

    python -m benchmarks.distributed --out DIR [--mps] [--steps 40] [--batch 256]

writes ``DIR/distributed.json`` (device, driver, date, command, results) and prints a
table.  It must not touch the GPU's modes: MPS runs as this user's own daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.environment import describe
from benchmarks.stopping import stop, track

GIB = 1024**3
SEED = 1234
MEMORY_PER_RANK = 12 * GIB
POOL_BATCHES = 32
SEED_CLAIMS = {
    "single to distributed on one GPU": "+21.9 % at most",
    "several distributed trainings sharing GPUs": "+14 % on average",
}


def train(steps: int, warmup: int, global_batch: int, seed: int, size: int, comm: str) -> dict:
    """One rank's training (runs in a worker process: everything it needs is imported
    here)."""
    import torch
    import torch.distributed as dist
    import torchvision
    from torch import nn

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = torch.device("cuda", 0)
    torch.manual_seed(seed)
    model = torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(32, c))
    model = model.to(device)
    if world > 1 and comm == "gloo":
        model = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    elif world > 1:
        from gpushare_ext.runtime.rank_comm import COMM_ENV, distributed_model

        if comm == "host-shm":
            os.environ[COMM_ENV] = "host-shm"  # instead of the launcher's cuda-ipc
        model = distributed_model(model)
    # Plain SGD at a small rate: random labels make a larger one diverge, and a chaotic
    # run would hide whether the ranks compute the single process's gradient.
    optimiser = torch.optim.SGD(model.parameters(), lr=0.005)
    generator = torch.Generator().manual_seed(seed)
    total = warmup + steps
    share = global_batch // world
    mine = slice(rank * share, (rank + 1) * share)
    # The data set made identically everywhere, each rank's part kept on the GPU (the
    # loop measures training, not copies from pageable host memory); long runs cycle
    # through it, so that two trainings at once overlap for many seconds.
    pool = min(total, POOL_BATCHES)
    images = torch.randn(pool, global_batch, 3, size, size, generator=generator)
    labels = torch.randint(0, 10, (pool, global_batch), generator=generator)
    images, labels = images[:, mine].to(device), labels[:, mine].to(device)
    losses = []
    started = 0.0
    for step in range(total):
        if step == warmup:
            torch.cuda.synchronize()
            started = time.perf_counter()
        batch = step % pool
        loss = nn.functional.cross_entropy(model(images[batch]), labels[batch])
        optimiser.zero_grad(set_to_none=True)
        loss.backward()
        optimiser.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    mean = torch.stack(losses)
    if world > 1:
        dist.all_reduce(mean)
        mean /= world
    return {
        "rank": rank,
        "world": world,
        "elapsed_s": elapsed,
        "losses": mean.tolist(),
        "device_uuid": str(torch.cuda.get_device_properties(0).uuid),
    }


def run_job(ranks: int, args: argparse.Namespace, comm: str) -> dict:
    """One training through the notebook API (this process is the notebook)."""
    import gpushare_ext

    started = time.perf_counter()
    steps, batch = args.steps, args.batch
    results = gpushare_ext.launch(
        train, steps, args.warmup, batch, SEED, args.size, comm,
        ranks=ranks, memory_bytes=MEMORY_PER_RANK, sm_share=1.0 / ranks if ranks > 1 else 1.0,
    )  # fmt: skip
    slowest = max(r["elapsed_s"] for r in results)
    return {
        "ranks": ranks,
        "comm": comm if ranks > 1 else "",
        "images_per_s": round(steps * batch / slowest, 1),
        "train_s": round(slowest, 3),
        "wall_s": round(time.perf_counter() - started, 2),
        "losses": [round(x, 6) for x in results[0]["losses"]],
        "device_uuids": sorted({r["device_uuid"] for r in results}),
    }


def _jobs_at_once(
    socket: Path, jobs: list[int], args: argparse.Namespace, comm: str = "auto"
) -> list[dict]:
    """Several trainings at the same time, each from a process of its own."""
    env = {**os.environ, "GPUSHARE_SOCKET": str(socket)}
    sizes = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
             "--size", str(args.size), "--comm", comm]  # fmt: skip
    processes = [
        track(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.distributed", "--job", str(ranks), *sizes],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
        )
        for ranks in jobs
    ]
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=600)
        if process.returncode != 0:
            raise RuntimeError(f"a training job failed ({process.returncode}):\n{out[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@contextlib.contextmanager
def mps_daemon() -> Iterator[dict[str, str]]:
    """An MPS control daemon of this run's own; its environment for the clients."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        raise RuntimeError("nvidia-cuda-mps-control is not on PATH: MPS cannot be measured")
    folder = Path(tempfile.mkdtemp(prefix="gps-mps-"))
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"),
        "CUDA_MPS_LOG_DIRECTORY": str(folder / "log"),
    }
    for path in env.values():
        Path(path).mkdir()
    full = {**os.environ, **env}
    subprocess.run([control, "-d"], env=full, check=True, timeout=30)
    try:
        yield env
    finally:
        subprocess.run([control], input="quit\n", text=True, env=full, timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and mps_running():
            time.sleep(0.2)
        shutil.rmtree(folder, ignore_errors=True)


def mps_running() -> bool:
    found = subprocess.run(["pgrep", "-f", "nvidia-cuda-mps"], capture_output=True, text=True)
    return bool(found.stdout.strip())


@contextlib.contextmanager
def _broker(mps: bool) -> Iterator[Path]:
    from gpushare_ext.broker.edges.launch import BrokerProcess

    directory = Path(tempfile.mkdtemp(prefix="gps-dist-"))
    config = "[broker]\nmps = true\n" if mps else None
    broker = track(BrokerProcess(directory, simulate=None, config_toml=config, log_level="warning"))
    try:
        yield broker.start().socket
    finally:  # also when it never answered
        stop(broker, 60)
        shutil.rmtree(directory, ignore_errors=True)


def _curve_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-9) for a, b in zip(losses, reference, strict=True))


def measure(args: argparse.Namespace, mps: bool) -> list[dict]:
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        if mps:
            os.environ.update(stack.enter_context(mps_daemon()))
        socket = stack.enter_context(_broker(mps))
        single, *_ = _jobs_at_once(socket, [1], args)
        rows.append({"config": "single", **single})
        for ranks in (2, 4):
            comms = ["auto"]
            comms += [] if args.skip_gloo else ["gloo"]
            comms += [] if args.skip_host_shm else ["host-shm"]
            for comm in comms:
                (gang,) = _jobs_at_once(socket, [ranks], args, comm)
                gang["loss_max_rel_diff"] = _curve_difference(gang["losses"], single["losses"])
                gang["loss_first_rel_diff"] = _curve_difference(
                    gang["losses"][:1], single["losses"][:1]
                )
                name = f"ranks-{ranks}" + ("" if comm == "auto" else f"-{comm}")
                rows.append({"config": name, **gang})
        for name, jobs in (("two-singles", [1, 1]), ("two-gangs", [2, 2])):
            together = _jobs_at_once(socket, jobs, args)
            rows.append(
                {
                    "config": name,
                    "ranks": jobs,
                    "images_per_s": round(sum(job["images_per_s"] for job in together), 1),
                    "each_images_per_s": [job["images_per_s"] for job in together],
                    "wall_s": max(job["wall_s"] for job in together),
                }
            )
    for row in rows:
        row["mps"] = mps
    return rows


def _gains(rows: list[dict]) -> dict:
    by = {(row["config"], row["mps"]): row for row in rows}
    gains = {}
    for mps in sorted({row["mps"] for row in rows}):
        base = by[("single", mps)]["images_per_s"]
        for ranks in (2, 4):
            row = by.get((f"ranks-{ranks}", mps))
            if row:
                gains[f"ranks-{ranks} vs single{' (mps)' if mps else ''}"] = round(
                    100 * (row["images_per_s"] / base - 1), 1
                )
        singles, gangs = by.get(("two-singles", mps)), by.get(("two-gangs", mps))
        if singles and gangs:
            gains[f"two gangs vs two singles{' (mps)' if mps else ''}"] = round(
                100 * (gangs["images_per_s"] / singles["images_per_s"] - 1), 1
            )
    return gains


def _print_table(rows: list[dict], gains: dict) -> None:
    print(f"{'config':>12} {'mps':>4} {'ranks':>7} {'images/s':>10} {'loss diff':>10}")
    for row in rows:
        diff = row.get("loss_max_rel_diff")
        print(
            f"{row['config']:>12} {row['mps']!s:>4} {row['ranks']!s:>7} "
            f"{row['images_per_s']:>10.1f} {'' if diff is None else f'{diff:.2e}':>10}"
        )
    for name, gain in gains.items():
        print(f"  {name}: {gain:+.1f} %")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.distributed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, help="folder for distributed.json")
    parser.add_argument("--mps", action="store_true", help="also measure under an MPS daemon")
    parser.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    parser.add_argument("--warmup", type=int, default=8, help="untimed first steps (default 8)")
    parser.add_argument("--batch", type=int, default=512, help="global batch (default 512)")
    parser.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    parser.add_argument(
        "--comm", choices=("auto", "gloo", "host-shm"), default="auto",
        help="gradient all-reduce: the launcher's choice for the slices, plain gloo, or "
        "pinned host shared memory",
    )  # fmt: skip
    parser.add_argument(
        "--skip-gloo", action="store_true", help="leave out the rows that average through gloo"
    )
    parser.add_argument(
        "--skip-host-shm",
        action="store_true",
        help="leave out the rows that average through pinned host shared memory",
    )
    parser.add_argument("--job", type=int, metavar="RANKS", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.batch) < 1 or args.warmup < 0 or args.batch % 4:
        parser.error("steps and batch must be positive, warmup >= 0, batch a multiple of 4")
    if args.job is not None:
        print(json.dumps(run_job(args.job, args, args.comm)), flush=True)
        return 0
    if args.out is None:
        parser.error("--out is required")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args, mps=False)
    _write(args, argv, rows)  # what was measured stays if the MPS part cannot finish
    if args.mps:
        rows += measure(args, mps=True)
    gains = _write(args, argv, rows)
    _print_table(rows, gains)
    return 0


def _write(args: argparse.Namespace, argv: list[str] | None, rows: list[dict]) -> dict:
    gains = _gains(rows)
    document = {
        **describe(),
        "command": "python -m benchmarks.distributed " + " ".join(argv or sys.argv[1:]),
        "model": f"torchvision resnet18 (GroupNorm), synthetic 3x{args.size}x{args.size} "
        "images, 10 classes, SGD lr 0.005",
        "steps": args.steps,
        "warmup": args.warmup,
        "global_batch": args.batch,
        "memory_per_rank_bytes": MEMORY_PER_RANK,
        "results": rows,
        "gains_percent": gains,
        "seed_claims": SEED_CLAIMS,
    }
    (args.out / "distributed.json").write_text(json.dumps(document, indent=2) + "\n")
    return gains


if __name__ == "__main__":
    sys.exit(main())
