"""On a real GPU: memory of CuPy, PyTorch (a model and its optimizer state) and Numba,
allocated in a process with the shim preloaded and parkable memory on, leaves the GPU
(the device's free memory grows by what was parked) and comes back at the same
addresses, bit-identical: once through an explicit restore, once through the first
kernel launched after the park, which restores it before it reaches the driver.

Skips cleanly without a usable GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_helpers import gpu_missing_reason

from gpushare_ext.runtime import interpose

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(gpu_missing_reason() is not None, reason=str(gpu_missing_reason())),
]

SCRIPT = r"""
import hashlib, json
import cupy, numpy, torch
from numba import cuda as numba_cuda
from gpushare_ext.runtime import parkable

def free_bytes():
    return cupy.cuda.runtime.memGetInfo()[0]

arrays = [cupy.random.default_rng(i).integers(0, 2**62, size=32 << 20, dtype=cupy.int64)
          for i in range(4)]  # 4 x 256 MiB
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
                            torch.nn.Linear(4096, 4096)).cuda()
optimizer = torch.optim.Adam(model.parameters())
batch = torch.randn(256, 4096, device="cuda")
model(batch).square().mean().backward()
optimizer.step()  # the optimizer's state exists now
host = numpy.arange(16 << 20, dtype=numpy.float32)
numba_array = numba_cuda.to_device(host)
cupy.cuda.runtime.deviceSynchronize()

def fingerprint():
    digest = hashlib.sha256()
    for a in arrays:
        digest.update(cupy.asnumpy(a).tobytes())
    for tensor in list(model.state_dict().values()) + [
        s for state in optimizer.state.values() for s in state.values() if torch.is_tensor(s)
    ]:
        digest.update(tensor.detach().cpu().numpy().tobytes())
    digest.update(numba_array.copy_to_host().tobytes())
    return digest.hexdigest()

addresses = {
    "cupy": arrays[0].data.ptr,
    "torch": model[0].weight.data_ptr(),
    "torch_optimizer": next(iter(optimizer.state.values()))["exp_avg"].data_ptr(),
    "numba": int(numba_array.device_ctypes_pointer.value),
}
out = {"parkable": {k: parkable.parkable_base(v) is not None for k, v in addresses.items()}}
before = fingerprint()
expected_out = model(batch).sum().item()
for way in ("explicit", "launch"):
    free_before = free_bytes()
    moved = parkable.park()
    freed = free_bytes() - free_before
    if way == "explicit":
        back = parkable.restore()
        out[way + "_restore_gib_s"] = round(back.gib_per_s, 2)
    # "launch": the first kernel (the fingerprint's copies and the model's matmuls)
    # restores everything before it reaches the driver.
    out[way] = {
        "parked_gib": round(moved.bytes / 2**30, 2),
        "freed_gib": round(freed / 2**30, 2),
        "park_gib_s": round(moved.gib_per_s, 2),
        "why_short": moved.why_short,
        "identical": fingerprint() == before,
        "model_output_identical": model(batch).sum().item() == expected_out,
    }
out["same_addresses"] = addresses == {
    "cupy": arrays[0].data.ptr,
    "torch": model[0].weight.data_ptr(),
    "torch_optimizer": next(iter(optimizer.state.values()))["exp_avg"].data_ptr(),
    "numba": int(numba_array.device_ctypes_pointer.value),
}
out["stats"] = parkable.stats()
print(json.dumps(out))
"""


def test_cupy_torch_and_numba_memory_is_parked_and_restored_at_the_same_addresses():
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=str(interpose.NATIVE),
        GPUSHARE_PARKABLE_MEMORY="1",
        PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
        ),
    )
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    assert out["parkable"] == {"cupy": True, "torch": True, "torch_optimizer": True, "numba": True}
    for way in ("explicit", "launch"):
        result = out[way]
        assert result["why_short"] == "", result
        assert result["parked_gib"] >= 1.4, result  # the CuPy arrays alone are 1 GiB
        assert result["freed_gib"] >= result["parked_gib"] * 0.9, result
        assert result["identical"] and result["model_output_identical"], result
    assert out["same_addresses"]
    assert out["stats"]["guard_restores"] >= 1 and out["stats"]["guard_failures"] == 0
