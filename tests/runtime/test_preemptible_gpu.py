"""Long CuPy kernels become preemptible at load time with no change to the notebook's
code: stopped mid-kernel by the session's yield flag, results bit-identical (idempotent
restart, snapshot rollback of in-place updates and of atomics; CuPy and Numba), on a
real GPU.

Runs ``benchmarks/preemptible.py`` in a fresh process with the launch shim preloaded, as
the server extension starts kernels.  Skipped cleanly without a GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from gpu_support import ROOT, gpu_with, shim_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not gpu_with(), reason="needs an NVIDIA GPU with CuPy"),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    cache = str(tmp_path_factory.mktemp("cupy-cache"))  # no cubins cached from earlier runs
    env = shim_env(CUPY_COMPILE_WITH_PTX="1", CUPY_CACHE_DIR=cache)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.preemptible"],
        capture_output=True, text=True, timeout=500, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(measured: dict, kernel: str) -> dict:
    return next(r for r in measured["rows"] if r["kernel"] == kernel)


@pytest.mark.parametrize(
    "kernel",
    ["gps_long_ew", "gps_one_wave", "gps_inplace_ew", "gps_histogram", "gps_smooth",
     "gps_numba_relax"],
)  # fmt: skip
def test_a_preempted_long_kernel_gives_the_undisturbed_result(measured, kernel):
    row = _row(measured, kernel)
    assert row["bit_identical"], row
    assert row["preemptible_launches"] >= 3, (row, measured["said"])
    assert row["fallbacks"] == 0, measured["said"]
    assert row["yields"] + row["aborts"] + row["saves"] >= row["preemptible_launches"], row


@pytest.mark.parametrize("kernel", ["gps_long_ew", "gps_one_wave", "gps_inplace_ew",
                                    "gps_smooth", "gps_numba_relax"])  # fmt: skip
def test_kernels_that_hold_their_state_in_registers_keep_it_when_stopped(measured, kernel):
    """No shared or local memory, no barriers: a stop saves the threads' registers and
    nothing is undone, even where one logical block outlasts every gap (one wave)."""
    row = _row(measured, kernel)
    assert row["saves"] >= 1 and row["aborts"] == 0, row


def test_a_long_kernel_leaves_the_gpu_soon_after_the_flag_rises(measured):
    row = _row(measured, "gps_long_ew")
    assert row["kernel_ms"] > 20, row
    # A kernel of tens of milliseconds stops within a loop iteration, not at its end.
    assert row["stop_ms_p50"] is not None and row["stop_ms_p50"] < row["kernel_ms"] / 4, row
