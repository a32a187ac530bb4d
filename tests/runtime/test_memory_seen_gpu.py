"""On a real GPU: memory a process holds without a lease (an idle notebook's arrays, a
program the broker does not know) is counted by placement from NVML, so a request that
only fits in it waits, saying why, and is granted once that memory is freed.

Skips cleanly without a usable GPU.  Holds at most 100 GiB for a few seconds.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from runtime_helpers import BrokerProcess, gpu_missing_reason, short_tempdir

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, Queued

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(gpu_missing_reason() is not None, reason=str(gpu_missing_reason())),
]

HOLDER = """
import sys, time, cupy
block = cupy.zeros(int(sys.argv[1]) << 30, dtype=cupy.uint8)  # an idle notebook's arrays
cupy.cuda.runtime.deviceSynchronize()
print("holding", flush=True)
sys.stdin.readline()  # until the test says let go
"""


def test_memory_held_outside_any_lease_makes_a_request_wait_until_it_is_freed():
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    total_gib = pynvml.nvmlDeviceGetMemoryInfo(handle).total / (1 << 30)
    if pynvml.nvmlDeviceGetMigMode(handle)[0]:
        pytest.skip("GPU 0 has MIG on: memory is read per whole GPU only")
    hold_gib = int(total_gib * 0.7)
    ask_gib = int(total_gib * 0.5)  # fits an empty GPU, not beside what the holder keeps

    broker = BrokerProcess(short_tempdir("gps-seen-"), simulate=None).start()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(hold_gib)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        time.sleep(2.5)  # two of the broker's NVML readings
        granted = threading.Event()
        client = BrokerClient(
            broker.socket,
            listener=lambda m: granted.set() if isinstance(m, Granted) else None,
        )
        reply = client.request_lease(priority=250, memory_bytes=ask_gib << 30, label="big")
        assert isinstance(reply, Queued), f"granted beside {hold_gib} GiB held: {reply}"
        assert "held outside any lease" in reply.reason, reply.reason
        assert not granted.wait(2.0), "granted while the memory was still held"

        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(timeout=60) == 0
        assert granted.wait(15.0), "not granted after the memory was freed"
        client.close()
    finally:
        if holder.poll() is None:
            holder.kill()
        broker.stop()
        pynvml.nvmlShutdown()
