"""On a host with two or more GPUs: a gang of two ranks placed one per GPU by the broker,
with NCCL between them, through a broker on NVML and the real ladder.

* each rank runs on its own GPU, the one its placement names (checked through its CUDA
  UUID), and NCCL all-reduces between them;
* a high-priority single-GPU lease arriving while a low-priority gang trains stops both
  ranks together (never one alone), and the gang ends with the same result as
  undisturbed.

Skips cleanly on a host with fewer than two GPUs (the one-GPU runs are in
``test_ranks_gpu.py``).
"""

from __future__ import annotations

import os
import threading

import pytest
from runtime_helpers import gpu_missing_reason, wait_for
from test_ranks_gpu import (
    assert_held_together,
    device_and_sum,
    hold_gang_with_high_lease,
    train_steadily,
)

from gpushare_ext.runtime.session import GpuSession

GIB = 1024**3


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_missing_reason(2) is not None, reason=str(gpu_missing_reason(2))),
]


def test_a_gang_of_two_gets_one_gpu_per_rank_and_nccl(gpu_broker, capsys):
    session = GpuSession(gpu_broker.socket)
    try:
        results = session.run_gang(device_and_sum, ranks=2, lease_options={"memory_bytes": 8 * GIB})
    finally:
        session.close()
    uuids = [device.info.uuid.removeprefix("GPU-") for device in gpu_broker.status().devices]
    assert [uuid for uuid, _ in results] == uuids[:2]  # rank 0 on GPU 0, rank 1 on GPU 1
    assert [total for _, total in results] == [3.0, 3.0]
    assert "nccl: every rank has a GPU of its own" in capsys.readouterr().out
    wait_for(lambda: not gpu_broker.leases(), "the gang to be released")


def test_a_high_single_gpu_lease_stops_both_ranks_together(gpu_broker):
    """The high lease shares one of the two GPUs with one rank: both ranks stop."""
    steps = 400
    options = {"memory_bytes": 8 * GIB, "priority": "low"}
    session = GpuSession(gpu_broker.socket)
    try:
        undisturbed = session.run_gang(train_steadily, steps, 7, ranks=2, lease_options=options)
        outcome: dict = {}
        runner = threading.Thread(
            target=lambda: outcome.setdefault(
                "results",
                session.run_gang(train_steadily, steps, 7, ranks=2, lease_options=options),
            )
        )
        runner.start()
        # The high lease shares one of the GPUs with one rank: both ranks must stop.
        held = hold_gang_with_high_lease(gpu_broker, os.getpid(), None, "the whole gang paused")
        runner.join(timeout=120)
        assert not runner.is_alive()
    finally:
        session.close()
    assert_held_together(outcome["results"], undisturbed, held, ended=1)
    wait_for(lambda: not gpu_broker.leases(), "the gang to be released")
