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
from runtime_helpers import gpu_missing_reason, wait_for
from test_ranks_gpu import wrapped_steps

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


def test_two_ranks_through_pinned_host_memory_match_one_process(gpu_broker):
    session = GpuSession(gpu_broker.socket)
    options = {"memory_bytes": 4 * GIB, "sm_share": 0.5, "device": "0"}
    steps = 5
    try:
        (alone,) = session.run_gang(
            wrapped_steps, steps, "host-shm", BUCKET_CAP_MB, ranks=1, lease_options=options
        )
        first, second = session.run_gang(
            wrapped_steps, steps, "host-shm", BUCKET_CAP_MB, ranks=2, lease_options=options
        )
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
