"""The launch shim on a real GPU, preloaded as the server extension starts kernels: it
sees CuPy's and PyTorch's launches, holds them while the session is paused (results
bit-identical afterwards), a pause drains in a few long kernels, and the checkpoint lock
and eviction still work on a process it holds.

Each case runs ``benchmarks/interposer.py`` in a fresh process.  Skipped cleanly without
a GPU.
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
    pytest.mark.skipif(not gpu_with("torch"), reason="needs an NVIDIA GPU with CuPy and PyTorch"),
]


def _scenario(name: str, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.interposer", name, *extra],
        capture_output=True, text=True, timeout=500, cwd=ROOT, env=shim_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_it_sees_the_launches_of_cupy_and_pytorch():
    seen = _scenario("count")
    assert seen["cupy_launches_seen"] >= seen["cupy_ops"], seen
    assert seen["torch_launches_seen"] >= seen["torch_ops"], seen


def test_a_paused_cupy_loop_stops_and_resumes_with_a_bit_identical_result():
    held = _scenario("hold")
    assert held["launches_while_paused"] <= 1, held
    assert held["steps_while_paused"] <= 1, held
    assert held["stats"]["held"] >= 1
    assert held["identical_to_undisturbed"], held


def test_a_paused_pytorch_training_loop_resumes_with_bit_identical_weights():
    held = _scenario("hold_torch")
    assert held["launches_while_paused"] <= 1, held
    assert held["steps_while_paused"] <= 1, held
    assert held["identical_to_undisturbed"], held


def test_a_pause_drains_in_a_few_long_kernels_not_a_queue_of_them():
    bounded = _scenario("drain")
    assert bounded["issued_before_pause"] > 20, bounded  # the host ran ahead of the GPU
    assert bounded["drain_in_matmuls"] <= 8, bounded


def test_the_checkpoint_lock_and_eviction_work_on_a_process_the_shim_holds():
    locked = _scenario("lock")
    assert (locked["lock"], locked["checkpoint"], locked["restore"], locked["unlock"]) == (
        "CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_SUCCESS", "CUDA_SUCCESS",
    ), locked  # fmt: skip
    assert locked["data_intact"], locked
