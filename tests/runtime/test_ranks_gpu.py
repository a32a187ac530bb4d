"""On a real GPU: a gang of ranks on software slices of one device, through a broker on
NVML and the real ladder.

* every rank runs on the device its placement names (checked through its CUDA UUID) and
  gloo all-reduces CUDA tensors between ranks that share it;
* a high-priority lease arriving while a low-priority gang trains locks every rank's
  process (level 3) at once, the ranks stall together, resume, and end with the same
  result as an undisturbed run;
* under MPS (a control daemon of the test's own), where the lock does not work, the
  same gang, started by a process with the launch shim preloaded, is held at the launch
  gate (level 0) instead, with the same result.

Skips cleanly without a usable GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_helpers import BrokerProcess, gpu_missing_reason, short_tempdir, wait_for

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted
from gpushare_ext.runtime.session import GpuSession

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(gpu_missing_reason() is not None, reason=str(gpu_missing_reason())),
]
GIB = 1024**3
# Every rank on GPU 0, as software slices of it, also on a host with more GPUs (the
# broker would otherwise give each rank a GPU of its own: test_ranks_two_gpus.py).


def device_and_sum() -> tuple[str, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([dist.get_rank() + 1.0], device="cuda")
    dist.all_reduce(value)
    return str(torch.cuda.get_device_properties(0).uuid), float(value.item())


def train_steadily(steps: int, seed: int) -> dict:
    """A deterministic CUDA loop; when each step ended, and a checksum of the result."""
    import torch
    import torch.distributed as dist

    torch.manual_seed(seed + dist.get_rank())
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2048, device="cuda") / 64
    ends = []
    for _ in range(steps):
        for _ in range(20):
            a = torch.tanh(a @ b)
        torch.cuda.synchronize()
        ends.append(time.time())
    total = a.double().sum()
    dist.all_reduce(total)
    return {"ends": ends, "checksum": float(total.item())}


def test_ranks_run_on_their_placement_and_all_reduce_cuda_tensors(gpu_broker, capsys):
    session = GpuSession(gpu_broker.socket)
    try:
        results = session.run_gang(
            device_and_sum,
            ranks=2,
            lease_options={"memory_bytes": 4 * GIB, "sm_share": 0.5, "device": "0"},
        )
    finally:
        session.close()
    uuid = gpu_broker.status().devices[0].info.uuid.removeprefix("GPU-")
    assert results == [(uuid, 3.0), (uuid, 3.0)]
    assert "gloo: ranks 0 and 1 share GPU 0" in capsys.readouterr().out
    wait_for(lambda: not gpu_broker.leases(), "the gang to be released")


def wrapped_steps(steps: int, force_comm: str = "", bucket_cap_mb: float | None = None) -> dict:
    """A small model trained by DDP through distributed_model, each rank on its half
    (``force_comm``: a gradient path instead of the launcher's choice)."""
    import torch
    import torch.distributed as dist

    from gpushare_ext.runtime import rank_comm

    if force_comm:
        os.environ[rank_comm.COMM_ENV] = force_comm
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = rank_comm.distributed_model(model.cuda(), **options)
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
        "pinned": [getattr(exchange, "pinned", None) for exchange in exchanges],
        "buckets_exchanged": sum(getattr(exchange, "_calls", 0) for exchange in exchanges),
        "weights": weights.tolist(),
    }


def test_ranks_on_one_gpu_average_gradients_in_its_memory_like_one_process(gpu_broker):
    session = GpuSession(gpu_broker.socket)
    options = {"memory_bytes": 4 * GIB, "sm_share": 0.5, "device": "0"}
    try:
        (alone,) = session.run_gang(wrapped_steps, 5, ranks=1, lease_options=options)
        first, second = session.run_gang(wrapped_steps, 5, ranks=2, lease_options=options)
    finally:
        session.close()
    assert first["comm"] == second["comm"] == "cuda-ipc"
    assert first["weights"] == second["weights"]  # every rank sums the same bits
    worst = max(abs(a - b) for a, b in zip(first["weights"], alone["weights"], strict=True))
    assert worst < 1e-5


def test_a_high_lease_locks_every_rank_together_and_the_result_is_unchanged(gpu_broker):
    steps = 400  # about 6 s on an H200: the pause comes in the middle
    options = {"memory_bytes": 4 * GIB, "sm_share": 0.5, "priority": "low", "device": "0"}
    session = GpuSession(gpu_broker.socket)
    try:
        undisturbed = session.run_gang(train_steadily, steps, 7, ranks=2, lease_options=options)
        outcome: dict = {}

        def disturbed() -> None:
            outcome["results"] = session.run_gang(
                train_steadily, steps, 7, ranks=2, lease_options=options
            )

        runner = threading.Thread(target=disturbed)
        runner.start()
        held = hold_gang_with_high_lease(gpu_broker, os.getpid(), 3, "both ranks to be locked")
        runner.join(timeout=120)
        assert not runner.is_alive()
    finally:
        session.close()
    # No step of either rank ended while the gang was locked.
    assert_held_together(outcome["results"], undisturbed, held, ended=0)
    wait_for(lambda: not gpu_broker.leases(), "the gang to be released")


@dataclass
class HeldGang:
    """What :func:`hold_gang_with_high_lease` saw: the ranks before, the ranks paused,
    and when the pause began and ended."""

    members: list
    paused: list
    paused_at: float
    resumed_at: float


def hold_gang_with_high_lease(broker, not_pid: int, level: int | None, what: str) -> HeldGang:
    """Once a gang's two ranks run (in processes other than ``not_pid``) and are into
    their loop, take a high-priority lease, wait until both ranks are paused (at
    ``level``, or any level for None), hold them 2 s and release it."""
    members = wait_for(
        lambda: [v for v in broker.leases() if v.pid != not_pid]
        if len(broker.leases()) == 2 else None,
        "both ranks to run in their own processes", 60,
    )  # fmt: skip
    time.sleep(1.5)  # into the loop
    with BrokerClient(broker.socket) as explorer:
        high = explorer.request_lease(priority=250, memory_bytes=4 * GIB)
        assert isinstance(high, Granted)

        def held() -> list | None:
            views = [v for v in broker.leases() if v.lease_id != high.lease_id
                     and v.state.value == "paused"
                     and (level is None or v.preemption_level == level)]  # fmt: skip
            return views if len(views) == 2 else None

        try:
            paused = wait_for(held, what)
        except AssertionError as exc:
            views = [(v.lease_id, v.pid, v.state.value, v.preemption_level, v.reason)
                     for v in broker.leases()]  # fmt: skip
            raise AssertionError(f"{exc}: {views}\n{broker.log_tail()}") from None
        paused_at = time.time()
        time.sleep(2.0)
        explorer.release(high.lease_id)
    return HeldGang(members, paused, paused_at, time.time())


def assert_held_together(results: list, undisturbed: list, held: HeldGang, ended: int) -> None:
    """Both ranks stalled together (at most ``ended`` steps of each ended during the
    pause) and the gang's result is the undisturbed one."""
    assert [r["checksum"] for r in results] == [r["checksum"] for r in undisturbed]
    assert {m.pid for m in held.members} == {v.pid for v in held.paused}
    for rank in results:
        during = [t for t in rank["ends"] if held.paused_at + 0.2 < t < held.resumed_at - 0.2]
        assert len(during) <= ended
        gaps = [b - a for a, b in zip(rank["ends"], rank["ends"][1:], strict=False)]
        assert max(gaps) >= 1.5


GATED_GANG = """
import json, sys
sys.path[:0] = {tests!r}  # this module, and the helpers it imports
import cloudpickle
import test_ranks_gpu
from gpushare_ext.runtime import interpose
from gpushare_ext.runtime.session import GpuSession

assert interpose.preloaded_here(), "the launch shim is not preloaded"
cloudpickle.register_pickle_by_value(test_ranks_gpu)
session = GpuSession(sys.argv[1])
try:
    results = session.run_gang(
        test_ranks_gpu.train_steadily, int(sys.argv[2]), 7, ranks=2,
        lease_options={{"memory_bytes": 4 << 30, "sm_share": 0.5, "priority": "low", "device": "0"}},
    )
finally:
    session.close()
print(json.dumps(results))
"""


def _gated_gang(socket, steps: int, environment: dict[str, str]) -> subprocess.Popen:
    """A notebook-like process with the launch shim preloaded (as the server extension
    starts kernels) running a low-priority gang of two ranks; its ranks inherit the shim."""
    from gpushare_ext.runtime import interpose

    here = Path(__file__).parent
    script = GATED_GANG.format(tests=[str(here), str(here.parent)])
    env = {**os.environ, **environment, "LD_PRELOAD": str(interpose.shim_path())}
    return subprocess.Popen(
        [sys.executable, "-c", script, str(socket), str(steps)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def _results_of(process: subprocess.Popen) -> list[dict]:
    out, _ = process.communicate(timeout=180)
    assert process.returncode == 0, out[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is None, reason="no MPS here")
def test_under_mps_a_high_lease_holds_a_gang_at_its_launch_gate_and_the_result_is_unchanged():
    from benchmarks.distributed import mps_daemon, mps_running

    steps = 400
    directory = short_tempdir("gps-gpu-mps-")
    broker = BrokerProcess(directory, simulate=None, config_toml="[broker]\nmps = true\n")
    with mps_daemon() as environment:
        broker.start()
        try:
            undisturbed = _results_of(_gated_gang(broker.socket, steps, environment))
            gang = _gated_gang(broker.socket, steps, environment)
            held = hold_gang_with_high_lease(
                broker, gang.pid, 0, "both ranks to be held at the gate"
            )
            results = _results_of(gang)
        finally:
            broker.stop()
    assert not mps_running()
    # At most the step under way when the gate closed ended during the pause.
    assert_held_together(results, undisturbed, held, ended=1)
