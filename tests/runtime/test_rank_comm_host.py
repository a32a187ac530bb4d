"""The ``host-shm`` gradient path with real rank processes on the CPU (gloo, no GPU).

The ranks are started by :func:`run_ranks` as CPU ranks, and each forces the path to
``host-shm`` itself before it wraps its model (the launcher picks ``gloo`` for CPU
ranks): the exchange then averages the gradients through one block of host shared
memory, summed on the CPU in rank order.  That is the same bookkeeping, ordering and
barriers as on MIG instances, less the pinning and the copies to and from the GPU.

Functions sent to the ranks are pickled by value (as a notebook cell's are), so the
workers never import this test module.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch

from gpushare_ext.protocol import Placement
from gpushare_ext.runtime.ranks import choose_comm, rank_environment, run_ranks

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHM = Path("/dev/shm")
STEPS, LR = 5, 0.1
# One byte: once DDP rebuilds its buckets after the first step, each of the small
# model's three parameters is a bucket of its own.  Three buckets a step go through the
# two halves of the block in turn, each step starting on the other half.
SMALL_BUCKETS_MB = 1e-6


# ------------------------------------------------------------------ functions the ranks run


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1, bias=False)
    )


def sgd_step(model: torch.nn.Module, lr: float) -> None:
    """Plain SGD, what torch.optim.SGD does without momentum (whose first step imports
    TorchDynamo: seconds more for each rank on a small machine)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= lr * parameter.grad


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def train_through_host_memory(
    features: torch.Tensor, targets: torch.Tensor, bucket_cap_mb: float | None
) -> dict[str, Any]:
    """Each rank trains on its share of the batch, gradients averaged through host-shm."""
    import torch.distributed as dist

    from gpushare_ext.runtime import rank_comm

    os.environ[rank_comm.COMM_ENV] = "host-shm"
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = rank_comm.distributed_model(small_model(), **options)
    exchanges = list(rank_comm._exchanges)
    share = len(features) // world
    mine = slice(rank * share, (rank + 1) * share)
    for _ in range(STEPS):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(features[mine]), targets[mine]).backward()
        sgd_step(model, LR)
    return {
        "path": rank_comm.comm_path(),
        "exchanges": [type(exchange).__name__ for exchange in exchanges],
        "buckets_exchanged": sum(exchange._calls for exchange in exchanges),
        "weights": weights_of(model.module),
    }


def train_alone(features: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    model = small_model()
    for _ in range(STEPS):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(features), targets).backward()
        sgd_step(model, LR)
    return weights_of(model)


def blocks_before_and_after_release() -> dict[str, Any]:
    """The shared-memory blocks of this rank's exchange, and /dev/shm while it trains
    and once every rank has released it."""
    import torch.distributed as dist

    from gpushare_ext.runtime import rank_comm

    os.environ[rank_comm.COMM_ENV] = "host-shm"
    model = rank_comm.distributed_model(torch.nn.Linear(4, 1))
    (exchange,) = rank_comm._exchanges
    names = [exchange._memory.name, exchange.barrier._memory.name]
    model(torch.ones(2, 4)).sum().backward()
    during = sorted(os.listdir(SHM))
    rank_comm.release()
    dist.barrier()  # every rank has released before any looks again
    return {"names": names, "during": during, "after": sorted(os.listdir(SHM)),
            "left": list(rank_comm._exchanges)}  # fmt: skip


def train_in_double_precision() -> dict[str, Any]:
    import torch.distributed as dist

    from gpushare_ext.runtime import rank_comm

    os.environ[rank_comm.COMM_ENV] = "host-shm"
    torch.manual_seed(0)
    model = rank_comm.distributed_model(torch.nn.Linear(4, 1).double())
    model(torch.full((2, 4), dist.get_rank() + 1.0, dtype=torch.float64)).sum().backward()
    return {
        "exchanges": len(rank_comm._exchanges),
        "grad": model.module.weight.grad.detach().clone(),
    }


# ------------------------------------------------------------------ real ranks


def batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    features = torch.randn(size, 4, generator=generator)
    targets = features @ torch.tensor([[1.5], [-2.0], [0.5], [3.0]]) + 0.25
    return features, targets


@pytest.mark.parametrize("bucket_cap_mb", [None, SMALL_BUCKETS_MB], ids=["one-bucket", "buckets"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_averaging_through_host_memory_match_one_process_bit_for_bit_among_them(
    world: int, bucket_cap_mb: float | None
):
    features, targets = batch(24)  # 12 or 8 rows a rank: every rank's mean weighs the same
    results = run_ranks(
        train_through_host_memory, features, targets, bucket_cap_mb,
        placements=[None] * world, out=io.StringIO(),
    )  # fmt: skip
    expected = train_alone(features, targets)
    for result in results:
        assert result["path"] == "host-shm"
        assert result["exchanges"] == ["HostSharedExchange"]
        for name, value in expected.items():
            torch.testing.assert_close(result["weights"][name], value, atol=1e-6, rtol=0)
    if bucket_cap_mb is not None:
        assert results[0]["buckets_exchanged"] == 1 + 3 * (STEPS - 1)
    first = results[0]["weights"]
    for other in results[1:]:
        assert all(torch.equal(first[name], other["weights"][name]) for name in first)
    assert not torch.equal(first["0.weight"], small_model().state_dict()["0.weight"])


def test_release_leaves_no_shared_memory_block_behind():
    before = set(os.listdir(SHM))
    results = run_ranks(blocks_before_and_after_release, placements=[None, None], out=io.StringIO())
    after = set(os.listdir(SHM))
    names = {name for result in results for name in result["names"]}
    assert len(names) == 2  # one data block and one barrier, the same for both ranks
    for result in results:
        assert names <= set(result["during"])
        assert not names & set(result["after"])
        assert result["left"] == []
    assert not names & (after - before)


def test_fp64_parameters_under_host_shm_keep_ddp_s_own_all_reduce():
    first, second = run_ranks(train_in_double_precision, placements=[None, None], out=io.StringIO())
    assert first["exchanges"] == second["exchanges"] == 0
    assert torch.equal(first["grad"], second["grad"])
    assert torch.equal(first["grad"], torch.full((1, 4), 3.0, dtype=torch.float64))


# ------------------------------------------------------------------ choosing the path


def placement(uuid: str, mig: str | None = None, index: int = 0) -> Placement:
    return Placement(device_index=index, device_uuid=uuid, mig_uuid=mig, memory_bytes=1 << 30)


def test_host_memory_is_the_path_of_gpu_ranks_that_cannot_map_each_other():
    two_migs = [placement("GPU-a", "MIG-1"), placement("GPU-a", "MIG-2")]
    assert choose_comm(two_migs, "gloo") == "host-shm"
    two_gpus = [placement("GPU-a"), placement("GPU-b", index=1)]
    assert choose_comm(two_gpus, "gloo") == "host-shm"
    assert choose_comm(two_gpus, "nccl") == "nccl"
    assert choose_comm([placement("GPU-a"), placement("GPU-a")], "gloo") == "cuda-ipc"
    assert choose_comm([placement("GPU-a", "MIG-1"), None], "gloo") == "gloo"
    assert choose_comm([None, None], "gloo") == "gloo"
    assert choose_comm([placement("GPU-a", "MIG-1")], "gloo") == "gloo"  # a gang of one
    env = rank_environment(0, 2, two_migs[0], "gloo", 29500, base={}, comm="host-shm")
    assert env["GPUSHARE_RANK_COMM"] == "host-shm"
