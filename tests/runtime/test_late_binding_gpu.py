"""Late binding on a host with several GPUs: the device of a lease is chosen at grant
time by load, two concurrent sessions land on different GPUs, and a session moves to
another GPU between cells when its first one is busy.

Needs at least two GPUs; skipped cleanly otherwise.  Only reads the devices.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from gpushare_ext.broker.edges.launch import BrokerProcess

ROOT = Path(__file__).resolve().parents[2]


def _gpu_count() -> int:
    probe = "import cupy; print(cupy.cuda.runtime.getDeviceCount())"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return int(done.stdout.strip() or 0) if done.returncode == 0 else 0


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(_gpu_count() < 2, reason="late binding needs at least two GPUs"),
]

SESSION = textwrap.dedent(
    """
    import json, sys, time
    import cupy
    import gpushare_ext

    def where(handle):
        device = cupy.cuda.Device()
        uuid = bytes(cupy.cuda.runtime.getDeviceProperties(device.id)["uuid"]).hex()
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        assert float((x * 2).sum()) == float(x.sum()) * 2
        return {"lease": handle.lease_id, "index": handle.placement.device_index,
                "lease_uuid": handle.placement.device_uuid, "cuda_uuid": uuid}

    cells = []
    for spec in sys.argv[1:]:
        hold, _, device = spec.partition("@")
        hold = float(hold)
        with gpushare_ext.lease(priority="normal", memory_bytes=4 << 30, device=device or "auto") as handle:
            cells.append(where(handle))
            time.sleep(hold)
        time.sleep(0.2)
    print(json.dumps(cells))
    """
)


def _same_gpu(lease_uuid: str, cuda_uuid_hex: str) -> bool:
    return lease_uuid.removeprefix("GPU-").replace("-", "").lower() == cuda_uuid_hex


@pytest.fixture
def broker():
    folder = Path(tempfile.mkdtemp(prefix="gps-lb-"))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("GPUSHARE_DEVICES", None)
    running = BrokerProcess(
        folder, simulate=None, socket_name="b.sock", journal=folder / "j.sqlite", env=env
    ).start(timeout=60)
    env["GPUSHARE_SOCKET"] = str(running.socket)
    yield env
    running.stop(timeout=30)
    print(running.output()[-2000:])


def _session(env: dict, *cells: str) -> subprocess.Popen:
    """A kernel-like process running one lease per cell; a cell is "SECONDS[@DEVICE]"."""
    return subprocess.Popen(
        [sys.executable, "-c", SESSION, *cells],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(process: subprocess.Popen) -> list[dict]:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_two_concurrent_sessions_land_on_different_gpus(broker):
    first = _session(broker, "4")
    time.sleep(1.5)  # the first one holds its GPU when the second asks
    second = _session(broker, "1")
    a, b = _result(first)[0], _result(second)[0]
    print("late binding:", a, b)
    assert a["index"] != b["index"], "both sessions were put on the same GPU"
    assert _same_gpu(a["lease_uuid"], a["cuda_uuid"])
    assert _same_gpu(b["lease_uuid"], b["cuda_uuid"])


def test_a_session_moves_to_another_gpu_between_cells(broker):
    # Cell 1 asks for GPU 0.  Meanwhile another session settles on GPU 0 as well, so when
    # cell 2 asks for any GPU, the idle GPU 1 is the better place: the session moves.
    mover = _session(broker, "2@0", "0.5@auto")
    time.sleep(1.0)
    blocker = _session(broker, "6@0")
    cells = _result(mover)
    _result(blocker)
    print("mover cells:", cells)
    for cell in cells:
        assert _same_gpu(cell["lease_uuid"], cell["cuda_uuid"]), cell
    assert cells[0]["index"] == 0
    assert cells[1]["index"] != 0, "the second cell stayed on the busy GPU"
