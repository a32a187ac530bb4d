"""A long kernel launched before the high-priority session existed is stopped for it.

Every framework's JIT path (``benchmarks/long_neighbours.py``): Numba ``@cuda.jit``, one
that links a device function in, CuPy's ``ElementwiseKernel``, ``ReductionKernel``,
``RawModule``, ``cupyx.jit`` and PTX loaded by hand through the driver API.  Each
neighbour runs kernels of about a second in a loop under a low-priority lease, with
nobody else on the broker, as the server extension starts kernels (the launch shim
preloaded, CuPy compiling to PTX); then a high-priority tenant arrives and runs a cell.
The neighbour's kernels must have been stopped for it (not waited out or time-sliced:
the launch under way when it came was ready to stop), and every output of the
neighbour must be bit-identical to its first, undisturbed one.

How fast the high cell ran is the benchmark's to say (``python -m benchmarks.third_party
--lows numba_inplace,...``), not a test's.  Skipped cleanly without a GPU.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from gpu_support import gpu_with

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not gpu_with("numba.cuda"), reason="needs an NVIDIA GPU with CuPy and Numba"
    ),
]

# Among them a Numba kernel that calls a device function linked in from PTX
# (``numba_linked``): the shim puts the callee's body into the kernel's module, so the
# twin loads from one PTX text (kernels/linking.py).
KINDS = (
    "numba_inplace", "numba_linked", "cupy_elementwise", "cupy_reduction", "cupy_rawmodule",
    "cupyx_jit", "driver_ptx",
)  # fmt: skip


@pytest.fixture(scope="module")
def broker_place():
    from benchmarks.broker_process import start_broker

    workdir = Path(tempfile.mkdtemp(prefix="gps-first-cell-"))
    broker, socket_path = start_broker(workdir)
    yield workdir, socket_path
    broker.terminate()
    broker.wait(timeout=30)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("kind", KINDS)
def test_a_kernel_launched_before_the_high_session_is_stopped_for_it(broker_place, kind):
    from benchmarks.contention import run_pair

    workdir, socket_path = broker_place
    result = run_pair(
        workdir, kind, "shim", socket_path, quick=True, requests="matmul", per_cell=20
    )

    low = result["low"]
    got = low["long_kernels"]
    assert got["preemptible"] >= 1, low.get("said")
    assert got["unmodified"] == 0, low.get("said")
    # Stopped for the newcomer: yields, saved stops or aborts, at least one.
    assert got["yields"] + got["saves"] + got["aborts"] >= 1, (got, low.get("said"))
    assert low["outputs_checked"] >= 1
    assert low["outputs_differing"] == 0, low
