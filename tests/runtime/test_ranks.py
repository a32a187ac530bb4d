"""run_ranks with real worker processes and real torch.distributed (gloo on the CPU).

Every rank here is a CPU rank (placement None), so the tests need no GPU: the ranks are
``python -m gpushare_ext.runtime.rank_worker`` processes meeting at a rendezvous on
127.0.0.1, as they would on a GPU host.  The last tests drive a real ipykernel kernel:
interrupting it stops every rank, and a failing rank leaves it usable.

Functions sent to the ranks are pickled by value (as a notebook cell's are), so the
workers never import this test module.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest
import torch
from runtime_helpers import NotebookKernel, wait_for

from gpushare_ext.protocol import Placement
from gpushare_ext.runtime.rank_worker import ORPHANED_STATUS
from gpushare_ext.runtime.ranks import (
    RankError,
    RankFailed,
    RankUsageError,
    RendezvousError,
    UnknownBackend,
    choose_backend,
    rank_environment,
    run_ranks,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

CPU_RANKS_2: list[Placement | None] = [None, None]
RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$")


class Lines:
    """A stream that keeps every line written to it, with when it arrived."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.arrived: list[float] = []
        self._partial = ""

    def write(self, text: str) -> int:
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        for line in complete:
            self.lines.append(line)
            self.arrived.append(time.monotonic())
        return len(text)

    def flush(self) -> None:
        pass

    def of_rank(self, rank: int) -> list[str]:
        return [m[2] for line in self.lines if (m := RANK_LINE.match(line)) and int(m[1]) == rank]

    def value(self, rank: int, key: str) -> str:
        for line in self.of_rank(rank):
            if line.startswith(key + " "):
                return line[len(key) + 1 :]
        raise AssertionError(f"rank {rank} printed no {key!r} line; got {self.lines}")


def workers_left() -> list[psutil.Process]:
    """The rank workers among this test process's descendants."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "gpushare_ext.runtime.rank_worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture
def payload_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where run_ranks makes its payload directory during the test (an empty directory)."""
    parent = tmp_path / "tmp"
    parent.mkdir(mode=0o700)
    monkeypatch.setattr(tempfile, "tempdir", str(parent))
    return parent


# ------------------------------------------------------------------ functions the ranks run


def all_reduce_rank_plus_one() -> list[float]:
    import torch.distributed as dist

    tensor = torch.tensor([dist.get_rank() + 1.0, 10.0 * (dist.get_rank() + 1)])
    dist.all_reduce(tensor)
    return tensor.tolist()


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    """Plain SGD, what torch.optim.SGD does without momentum: its first step imports
    TorchDynamo, two seconds more for this file on a small machine."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= lr * parameter.grad


Trained = tuple[list[float], dict[str, torch.Tensor]]  # per-step losses, final weights


def train_linear(features: torch.Tensor, targets: torch.Tensor, steps: int, lr: float) -> Trained:
    """Each rank trains on its half of the batch under DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(features.shape[1], 1))
    share = len(features) // world
    mine = slice(rank * share, (rank + 1) * share)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features[mine]), targets[mine])
        loss.backward()  # DDP averages the gradients of the ranks here
        sgd_step(model, lr)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, {
        name: value.detach().clone() for name, value in model.module.state_dict().items()
    }


def train_linear_alone(
    features: torch.Tensor, targets: torch.Tensor, steps: int, lr: float
) -> Trained:
    torch.manual_seed(0)
    model = torch.nn.Linear(features.shape[1], 1)
    losses = []
    for _ in range(steps):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(features), targets)
        loss.backward()
        sgd_step(model, lr)
        losses.append(loss.item())
    return losses, model.state_dict()


def print_then_wait_for(release: str) -> bool:
    """Print, then wait until the test has seen the line (it creates ``release``)."""
    import torch.distributed as dist

    directory = Path(sys.argv[1])  # the payload directory the launcher made
    print("payload-mode", oct(directory.stat().st_mode & 0o777), flush=True)
    print("file-modes", " ".join(oct(p.stat().st_mode & 0o777) for p in directory.iterdir()))
    print("early from", dist.get_rank(), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.02)
    return os.path.exists(release)


def rank_one_raises() -> None:
    import torch.distributed as dist

    print("pid", os.getpid(), flush=True)
    print("payload", sys.argv[1], flush=True)
    dist.barrier()  # both have printed (what is in the pipe is read even after a kill)
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    time.sleep(60)


def rank_one_kills_itself() -> None:
    import torch.distributed as dist

    print("pid", os.getpid(), flush=True)
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


# ------------------------------------------------------------------ real ranks


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_gives_the_sum_on_every_rank(world_size: int):
    results = run_ranks(all_reduce_rank_plus_one, placements=[None] * world_size, out=Lines())
    total = world_size * (world_size + 1) / 2
    assert results == [[total, 10.0 * total]] * world_size


def test_ddp_on_two_ranks_matches_one_process_on_the_whole_batch():
    generator = torch.Generator().manual_seed(1234)
    features = torch.randn(16, 4, generator=generator)
    targets = features @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.25
    steps, lr = 5, 0.1
    (losses_0, weights_0), (losses_1, weights_1) = run_ranks(
        train_linear, features, targets, steps, lr, placements=CPU_RANKS_2, out=Lines()
    )
    expected_losses, expected_weights = train_linear_alone(features, targets, steps, lr)
    assert losses_0 == pytest.approx(expected_losses, abs=1e-5)
    assert losses_1 == pytest.approx(expected_losses, abs=1e-5)
    assert expected_losses[-1] < expected_losses[0]  # it did train
    for name, expected in expected_weights.items():
        torch.testing.assert_close(weights_0[name], expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(weights_1[name], expected, atol=1e-5, rtol=0)


def test_output_streams_while_the_ranks_run_with_rank_prefixes(tmp_path: Path):
    release = tmp_path / "seen"
    seen = {0: False, 1: False}

    class Watching(Lines):
        def write(self, text: str) -> int:
            written = super().write(text)
            for rank in seen:
                seen[rank] = seen[rank] or f"early from {rank}" in " ".join(self.of_rank(rank))
            if all(seen.values()):
                release.touch()
            return written

    out, err = Watching(), Lines()
    results = run_ranks(print_then_wait_for, str(release), placements=CPU_RANKS_2, out=out, err=err)
    # Each rank saw the release, which the test made only after reading both "early" lines:
    # the lines came while the ranks were still running.
    assert results == [True, True]
    assert out.lines[0].startswith("gpushare: starting 2 ranks (gloo: ")
    assert "rendezvous 127.0.0.1:" in out.lines[0]
    assert out.of_rank(0)[-1] == "early from 0"
    assert out.of_rank(1)[-1] == "early from 1"
    assert "to stderr" in err.of_rank(0) and "to stderr" in err.of_rank(1)
    assert out.value(0, "payload-mode") == "0o700"
    assert set(out.value(0, "file-modes").split()) == {"0o600"}


def test_a_raising_rank_stops_the_others_and_says_which_one(payload_parent: Path):
    out, err = Lines(), Lines()
    started = time.monotonic()
    with pytest.raises(RankFailed) as failure:
        run_ranks(rank_one_raises, placements=CPU_RANKS_2, out=out, err=err, grace_s=2.0)
    assert time.monotonic() - started < 30  # rank 0's 60 s sleep was cut short
    error = failure.value
    assert str(error) == "rank 1 of 2 failed: ValueError: boom from rank one"
    assert (error.rank, error.world_size) == (1, 2)
    assert 'raise ValueError("boom from rank one")' in error.remote_traceback
    assert any("ValueError: boom from rank one" in line for line in err.of_rank(1))
    sleeper = int(out.value(0, "pid"))
    assert not psutil.pid_exists(sleeper)
    assert workers_left() == []
    payload = Path(out.value(0, "payload"))
    assert payload.parent == payload_parent
    assert not payload.exists()
    assert list(payload_parent.iterdir()) == []


def test_a_rank_killed_by_a_signal_is_named_with_the_signal(payload_parent: Path):
    out = Lines()
    with pytest.raises(RankFailed) as failure:
        run_ranks(rank_one_kills_itself, placements=CPU_RANKS_2, out=out, err=Lines(), grace_s=2)
    assert str(failure.value) == "rank 1 of 2 died (signal SIGKILL)"
    assert failure.value.remote_traceback == ""
    assert not psutil.pid_exists(int(out.value(0, "pid")))
    assert workers_left() == []
    assert list(payload_parent.iterdir()) == []


def test_a_cell_source_runs_as_main_with_the_process_group():
    source = textwrap.dedent(
        """\
        import torch.distributed as dist
        print("cell on rank", dist.get_rank(), "of", dist.get_world_size(), "in", __name__)
        """
    )
    out = Lines()
    assert run_ranks(source, placements=CPU_RANKS_2, out=out, err=Lines()) == [None, None]
    assert out.of_rank(0) == ["cell on rank 0 of 2 in __main__"]
    assert out.of_rank(1) == ["cell on rank 1 of 2 in __main__"]


def test_a_failing_cell_shows_its_own_line_in_the_traceback(payload_parent: Path):
    # One rank and no torch in the source: no process group, a fast worker.
    source = "x = 1\nraise KeyError('no such column')\n"
    with pytest.raises(RankFailed) as failure:
        run_ranks(source, placements=[None], out=Lines(), err=Lines())
    assert str(failure.value) == "rank 0 of 1 failed: KeyError: 'no such column'"
    assert 'File "<cell>", line 2' in failure.value.remote_traceback
    assert "raise KeyError('no such column')" in failure.value.remote_traceback
    assert list(payload_parent.iterdir()) == []


def test_a_rendezvous_port_in_use_is_refused_before_any_rank_starts(payload_parent: Path):
    out = Lines()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError) as refused:
            run_ranks(all_reduce_rank_plus_one, placements=CPU_RANKS_2, port=port, out=out)
    assert str(refused.value) == (
        f"gpushare: rendezvous port {port} is in use on this host; "
        "leave port unset to use a free one"
    )
    assert out.lines == []  # not even the start line
    assert workers_left() == []
    assert list(payload_parent.iterdir()) == []


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        ({"target": all_reduce_rank_plus_one, "placements": []}, RankUsageError, "no ranks to run"),
        ({"target": 42, "placements": CPU_RANKS_2}, RankUsageError, "not a value of type int"),
        (
            {"target": print, "args": (threading.Lock(),), "placements": CPU_RANKS_2},
            RankUsageError,
            "argument 1 (a lock) cannot be sent to the ranks",
        ),
        ({"target": print, "placements": CPU_RANKS_2, "port": "29500"}, RankUsageError, "'29500'"),
        ({"target": print, "placements": CPU_RANKS_2, "port": 70000}, RankUsageError, "1..65535"),
        ({"target": print, "placements": CPU_RANKS_2, "backend": "mpx"}, UnknownBackend, "'mpx'"),
        ({"target": print, "placements": [None, "GPU-0"]}, RankUsageError, "rank 1 is a str"),
        ({"target": "x = (", "placements": [None]}, RankUsageError, "does not compile"),
        ({"target": "x = 1", "args": (1,), "placements": [None]}, RankUsageError, "no arguments"),
    ],
)
def test_bad_input_is_one_line_and_starts_nothing(
    call: dict[str, Any], error: type[RankError], message: str, payload_parent: Path
):
    out = Lines()
    with pytest.raises(error) as refused:
        run_ranks(call["target"], *call.get("args", ()), out=out, **{
            key: value for key, value in call.items() if key not in ("target", "args")
        })  # fmt: skip
    text = str(refused.value)
    assert message in text
    assert "\n" not in text and text.startswith("gpushare: ")
    assert isinstance(refused.value, ValueError)
    assert out.lines == []
    assert workers_left() == []
    assert list(payload_parent.iterdir()) == []


# ------------------------------------------------------------------ backend and environment


def gpu(index: int, uuid: str, mig: str | None = None, **extra: Any) -> Placement:
    return Placement(
        device_index=index, device_uuid=uuid, mig_uuid=mig, memory_bytes=8 << 30, **extra
    )


def test_nccl_only_when_every_rank_has_a_whole_gpu_of_its_own():
    assert choose_backend([gpu(0, "GPU-a"), gpu(1, "GPU-b")]) == (
        "nccl",
        "every rank has a GPU of its own",
    )
    assert choose_backend([gpu(0, "GPU-a"), gpu(0, "GPU-a")]) == (
        "gloo",
        "ranks 0 and 1 share GPU 0",
    )
    backend, reason = choose_backend([gpu(0, "GPU-a", mig="MIG-1"), gpu(0, "GPU-a", mig="MIG-2")])
    assert backend == "gloo" and "MIG instance" in reason
    assert choose_backend([gpu(0, "GPU-a"), None]) == ("gloo", "rank 1 runs on the CPU")
    with pytest.raises(RankUsageError, match="rank 1 has none"):
        run_ranks(print, placements=[gpu(0, "GPU-a"), None], backend="nccl", out=Lines())


def test_a_rank_s_environment_names_its_slice_and_the_rendezvous():
    base = {"PATH": "/usr/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}
    shared = gpu(3, "GPU-c", sm_share=0.25, mps=True)
    env = rank_environment(1, 2, shared, "gloo", 41234, base=base)
    assert {key: env[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
    }
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "41234")
    assert (env["CUDA_VISIBLE_DEVICES"], env["GPUSHARE_RANK_BACKEND"]) == ("GPU-c", "gloo")
    assert env["GPUSHARE_RANK_MEMORY_BYTES"] == str(8 << 30)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=8192M"
    assert (env["PYTHONUNBUFFERED"], env["GPUSHARE_RANK_PARENT"]) == ("1", str(os.getpid()))
    cpu = rank_environment(0, 2, None, "gloo", 41234, base=base)
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in cpu  # not the kernel's own limits
    assert "GPUSHARE_RANK_MEMORY_BYTES" not in cpu
    mig = rank_environment(0, 1, gpu(0, "GPU-a", mig="MIG-x"), "gloo", 1, base=base)
    assert mig["CUDA_VISIBLE_DEVICES"] == "MIG-x"


# ------------------------------------------------------------------ in a real notebook kernel


@pytest.fixture(scope="module")
def kernel() -> Iterator[NotebookKernel]:
    started = NotebookKernel("ranks-kernel")
    try:
        yield started.ready()
    finally:
        started.shutdown()


def test_interrupting_the_kernel_stops_every_rank(kernel: NotebookKernel):
    cell = kernel.submit(
        textwrap.dedent(
            """\
            import os, time
            from gpushare_ext.runtime.ranks import run_ranks

            def sleeper():
                print("pid", os.getpid(), flush=True)
                time.sleep(60)

            run_ranks(sleeper, placements=[None, None], grace_s=2.0)
            """
        )
    )

    def both_pids() -> list[int] | None:
        pids = dict(re.findall(r"\[rank (\d)\] pid (\d+)", cell.shown_text()))
        return [int(pids["0"]), int(pids["1"])] if len(pids) == 2 else None

    pids = wait_for(both_pids, "both ranks to print their pid", 60)
    assert all(psutil.pid_exists(pid) for pid in pids)
    kernel.interrupt()
    cell.wait(30)
    assert cell.error is not None and cell.error["ename"] == "KeyboardInterrupt", cell.describe()
    assert "gpushare: stopped all 2 ranks" in cell.final_text(), cell.describe()
    # The ranks got the interrupt themselves (a KeyboardInterrupt each), not just a kill.
    assert "[rank 0] interrupted" in cell.stderr and "[rank 1] interrupted" in cell.stderr
    wait_for(lambda: not any(psutil.pid_exists(pid) for pid in pids), "the ranks to be gone", 5)


def test_a_failing_rank_in_the_kernel_shows_one_line_and_the_kernel_goes_on(
    kernel: NotebookKernel,
):
    cell = kernel.run(
        textwrap.dedent(
            """\
            import time
            from gpushare_ext.runtime.ranks import run_ranks

            def rank_one_fails():
                import torch.distributed as dist

                if dist.get_rank() == 1:
                    raise ValueError("boom in the kernel")
                time.sleep(60)

            run_ranks(rank_one_fails, placements=[None, None], grace_s=2.0)
            """
        ),
        timeout=60,
    )
    assert cell.error is not None, cell.describe()
    assert (cell.error["ename"], cell.error["evalue"]) == (
        "RankFailed",
        "rank 1 of 2 failed: ValueError: boom in the kernel",
    )
    assert "[rank 1] ValueError: boom in the kernel" in cell.stderr
    assert kernel.run("1 + 1").ok().final_text().strip() == "2"
    # The rank's traceback names the cell's line, though the function was typed into a cell.
    remote = kernel.run("import sys; print(sys.last_value.remote_traceback)").ok().final_text()
    assert 'raise ValueError("boom in the kernel")' in remote, remote


def test_the_ranks_die_with_their_kernel(tmp_path: Path):
    # A killed kernel cannot remove its payload directory: let it be under tmp_path.
    doomed = NotebookKernel("ranks-doomed-kernel", {**os.environ, "TMPDIR": str(tmp_path)})
    try:
        doomed.ready()
        # One rank whose cell does not mention torch: no process group, a fast worker.
        cell = doomed.submit(
            textwrap.dedent(
                """\
                from gpushare_ext.runtime.ranks import run_ranks
                rank_cell = "import os, time\\nprint('pid', os.getpid(), flush=True)\\ntime.sleep(60)"
                run_ranks(rank_cell, placements=[None])
                """
            )
        )
        found = wait_for(lambda: re.search(r"\[rank 0\] pid (\d+)", cell.shown_text()), "a pid", 60)
        worker = int(found[1])
        assert psutil.pid_exists(worker)
        doomed.kill()  # SIGKILL: no cleanup code of the kernel runs, only PR_SET_PDEATHSIG
        wait_for(lambda: not psutil.pid_exists(worker), "the rank to die with its kernel", 10)
    finally:
        doomed.shutdown()


def test_a_worker_whose_launcher_is_gone_exits_at_once(tmp_path: Path):
    not_my_parent = str(os.getpid() + 1_000_000)  # no such process
    env = {**os.environ, "GPUSHARE_RANK_PARENT": not_my_parent, "WORLD_SIZE": "1"}
    started = time.monotonic()
    finished = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.runtime.rank_worker", str(tmp_path), "0"],
        env=env,
        capture_output=True,
        timeout=30,
    )
    assert finished.returncode == ORPHANED_STATUS, finished.stderr
    assert list(tmp_path.iterdir()) == []  # it did not even look for its payload
    assert time.monotonic() - started < 10


# ------------------------------------------------------------------ the gradient path


def _gpu(uuid: str, mig: str | None = None) -> Placement:
    return Placement(device_index=0, device_uuid=uuid, mig_uuid=mig, memory_bytes=1 << 30)


def test_gradients_go_through_the_gpus_memory_only_when_every_rank_shares_one_gpu():
    from gpushare_ext.runtime.ranks import choose_comm

    same = [_gpu("GPU-a"), _gpu("GPU-a")]
    assert choose_comm(same, "gloo") == "cuda-ipc"
    assert choose_comm([_gpu("GPU-a"), _gpu("GPU-b")], "nccl") == "nccl"
    assert choose_comm([_gpu("GPU-a", "MIG-1"), _gpu("GPU-a", "MIG-2")], "gloo") == "host-shm"
    assert choose_comm([_gpu("GPU-a"), None], "gloo") == "gloo"
    assert choose_comm([None, None], "gloo") == "gloo"
    assert choose_comm([_gpu("GPU-a")], "gloo") == "gloo"
    env = rank_environment(0, 2, same[0], "gloo", 29500, base={}, comm="cuda-ipc")
    assert env["GPUSHARE_RANK_COMM"] == "cuda-ipc"


def _train_wrapped(steps: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from gpushare_ext.runtime.rank_comm import comm_path, distributed_model

    torch.manual_seed(3)
    model = distributed_model(torch.nn.Linear(4, 1))
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    assert comm_path() == "gloo"
    generator = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)
    half = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[half]), y[half])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return [float(v) for v in model.module.weight.detach().flatten()]


def test_distributed_model_on_cpu_ranks_is_ddp_over_gloo_and_keeps_ranks_in_step():
    first, second = run_ranks(_train_wrapped, 3, placements=[None, None], out=io.StringIO())
    assert first == second
