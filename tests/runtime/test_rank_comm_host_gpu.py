"""On a real GPU: the ``host-shm`` gradient path, through a broker on NVML.

Two ranks on software slices of the one GPU would average their gradients in its memory
(``cuda-ipc``); here each forces ``host-shm`` instead, the path of MIG instances, so that
it runs on a GPU without MIG: every bucket goes to page-locked host shared memory, back
to the GPU, and is summed there in rank order.  The weights after a few steps match one
process's, and both ranks hold the same bits.

Skips cleanly without a usable GPU.
"""

from __future__ import annotations

import pytest
from runtime_helpers import BrokerProcess, gpu_missing_reason, short_tempdir, wait_for

from gpushare_ext.runtime.session import GpuSession

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_missing_reason() is not None, reason=str(gpu_missing_reason())),
]
GIB = 1024**3
# Every rank on GPU 0, as software slices of it, also on a host with more GPUs (the
# broker would otherwise give each rank a GPU of its own: test_ranks_two_gpus.py).
# One byte: once DDP rebuilds its buckets after the first step, each of the model's four
# parameters is a bucket of its own, so a step goes through both halves of the block.
BUCKET_CAP_MB = 1e-6


@pytest.fixture(scope="module")
def gpu_broker():
    running = BrokerProcess(short_tempdir("gps-gpu-host-shm-"), simulate=None).start()
    yield running
    running.stop()


def host_memory_steps(steps: int) -> dict:
    """A small model trained through distributed_model with host-shm forced, each rank
    on its half of every batch (one process alone: the whole batch)."""
    import os

    import torch
    import torch.distributed as dist

    from gpushare_ext.runtime import rank_comm

    os.environ[rank_comm.COMM_ENV] = "host-shm"  # instead of the launcher's cuda-ipc
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    model = rank_comm.distributed_model(model.cuda(), bucket_cap_mb=BUCKET_CAP_MB)
    exchanges = list(rank_comm._exchanges)
    generator = torch.Generator().manual_seed(12)
    x = torch.randn(64, 256, generator=generator).cuda()
    y = torch.randn(64, 8, generator=generator).cuda()
    share = 64 // world
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(steps):
        part = slice(rank * share, (rank + 1) * share)
        loss = torch.nn.functional.mse_loss(model(x[part]), y[part])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
    return {
        "comm": rank_comm.comm_path(),
        "exchanges": [type(exchange).__name__ for exchange in exchanges],
        "pinned": [exchange.pinned for exchange in exchanges],
        "buckets_exchanged": sum(exchange._calls for exchange in exchanges),
        "weights": weights.tolist(),
    }


def test_two_ranks_through_pinned_host_memory_match_one_process(gpu_broker):
    session = GpuSession(gpu_broker.socket)
    options = {"memory_bytes": 4 * GIB, "sm_share": 0.5, "device": "0"}
    steps = 5
    try:
        (alone,) = session.run_gang(host_memory_steps, steps, ranks=1, lease_options=options)
        first, second = session.run_gang(host_memory_steps, steps, ranks=2, lease_options=options)
    finally:
        session.close()
    assert alone["exchanges"] == []  # one process: no gang, nothing to average
    for rank in (first, second):
        assert rank["comm"] == "host-shm"
        assert rank["exchanges"] == ["HostSharedExchange"]
        assert rank["buckets_exchanged"] == 1 + 4 * (steps - 1)
    assert first["pinned"] == second["pinned"]
    assert first["weights"] == second["weights"]  # every rank sums the same bits
    worst = max(abs(a - b) for a, b in zip(first["weights"], alone["weights"], strict=True))
    assert worst < 1e-5
    wait_for(lambda: not gpu_broker.leases(), "the gang to be released")
