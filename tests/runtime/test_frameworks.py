"""A framework is one module in ``runtime/frameworks/`` plus one line in its registry: a
framework registered there is asked by the generic code, which names none itself.

Each case runs in a fresh interpreter (as a notebook kernel would), so that the real
frameworks' hooks see a process that never imported them, and what the fake one sets
(environment, the registry) goes with that process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gpushare_ext.runtime import interpose
from gpushare_ext.runtime.frameworks import FRAMEWORKS

ROOT = Path(__file__).resolve().parents[2]

FAKE_FRAMEWORK = r"""
import json, os
from gpushare_ext.runtime import frameworks
from gpushare_ext.runtime.frameworks import Framework

calls = []
fake = Framework(
    name="fake",
    select_device=lambda ordinal, bring_up: calls.append(["select", ordinal, bring_up]),
    install_quota=lambda: calls.append(["quota"]) or True,
    adopt_kernels=lambda adopter_of: calls.append(["adopt", adopter_of()]),
    kernel_environment={"FAKE_COMPILE_WITH_PTX": "1"},
)
frameworks.register(fake)
"""

BIND_AND_HOLD = (
    FAKE_FRAMEWORK
    + r"""
from gpushare_ext.protocol import Placement
from gpushare_ext.runtime import binding
from gpushare_ext.runtime.holds import ProcessHolds
from gpushare_ext.runtime.leases import LeaseHandle, LeaseOptions
from gpushare_ext.server_ext import preload_for_kernels

placement = Placement(device_index=3, device_uuid="GPU-fake", memory_bytes=1 << 30)
bound = binding.bind(placement, simulated=False)
handle = LeaseHandle(lease_id="L1", options=LeaseOptions(), output=None, placement=placement)
ProcessHolds().hold_on_device(handle, bound.ordinal, None, lambda: True)
environ = {}
said = preload_for_kernels(environ)
print(json.dumps({"calls": calls, "ordinal": binding.current_ordinal,
                  "environ": environ, "said": said}))
"""
)

ADOPT = (
    FAKE_FRAMEWORK
    + r"""
from gpushare_ext.runtime import preemptible
registry = preemptible.install()
print(json.dumps({"installed": registry is not None, "asked": [c[0] for c in calls],
                  "adopter_is_the_registry": bool(calls) and calls[0][1] is registry}))
"""
)


def run(script: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES",)}
    environ.update(PYTHONPATH=str(ROOT), **env)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_registry_holds_cupy_numba_and_torch():
    assert [f.name for f in FRAMEWORKS] == ["cupy", "numba", "torch"]


def test_a_registered_framework_is_bound_given_its_quota_and_its_kernel_environment():
    out = run(BIND_AND_HOLD)
    # Device binding selects the lease's GPU in it (bringing frameworks up: a whole GPU),
    # the holds of a bound lease check its allocations, and kernels start with its words.
    assert ["select", 3, True] in out["calls"] and out["ordinal"] == 3
    assert ["quota"] in out["calls"]
    assert out["calls"].index(["select", 3, True]) < out["calls"].index(["quota"])
    if interpose.shim_path().exists():
        assert out["environ"]["FAKE_COMPILE_WITH_PTX"] == "1", out["said"]
        assert out["environ"]["CUPY_COMPILE_WITH_PTX"] == "1"


def test_a_registered_framework_hands_its_kernels_to_the_preemptible_registry(fake_driver):
    out = run(ADOPT, LD_PRELOAD=str(interpose.NATIVE), LD_LIBRARY_PATH=str(fake_driver))
    assert out == {"installed": True, "asked": ["adopt"], "adopter_is_the_registry": True}
