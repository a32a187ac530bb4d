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
import subprocess
import sys
import threading
import time

import pytest
from runtime_helpers import BrokerProcess, short_tempdir, wait_for
from test_ranks_gpu import device_and_sum, train_steadily

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted
from gpushare_ext.runtime.session import GpuSession

GIB = 1024**3


def _gpus_missing() -> str | None:
    probe = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no usable GPU: {exc}"
    if done.returncode != 0:
        return "no usable GPU (CuPy could not count devices)"
    count = int(done.stdout.strip() or 0)
    return None if count >= 2 else f"{count} GPU here: these tests need two"


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpus_missing() is not None, reason=str(_gpus_missing())),
]


@pytest.fixture(scope="module")
def gpu_broker():
    running = BrokerProcess(short_tempdir("gps-gpu-two-"), simulate=None).start()
    yield running
    running.stop()


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
        wait_for(
            lambda: len([v for v in gpu_broker.leases() if v.pid != os.getpid()]) == 2,
            "both ranks to run in their own processes",
        )
        time.sleep(1.5)
        with BrokerClient(gpu_broker.socket) as explorer:
            high = explorer.request_lease(priority=250, memory_bytes=4 * GIB)
            assert isinstance(high, Granted)
            paused = wait_for(
                lambda: [v for v in gpu_broker.leases()
                         if v.lease_id != high.lease_id and v.state.value == "paused"]
                if len(gpu_broker.leases()) == 3 else None,
                "a paused gang",
            )  # fmt: skip
            assert len(paused) == 2  # never one rank alone
            paused_at = time.time()
            time.sleep(2.0)
            explorer.release(high.lease_id)
        resumed_at = time.time()
        runner.join(timeout=120)
        assert not runner.is_alive()
    finally:
        session.close()
    results = outcome["results"]
    assert [r["checksum"] for r in results] == [r["checksum"] for r in undisturbed]
    for rank in results:
        assert len([t for t in rank["ends"] if paused_at + 0.2 < t < resumed_at - 0.2]) <= 1
    wait_for(lambda: not gpu_broker.leases(), "the gang to be released")
