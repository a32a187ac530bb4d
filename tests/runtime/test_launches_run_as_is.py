"""Launches the shim can only hold and lock, never make preemptible, run unmodified and
say so once, in the cell that ran the first of their kind.

Cooperative launches (blocks that wait on each other), ``cuLaunchKernelEx`` with
attributes (clusters) and CUDA graph launches pass through the shim as they are: held
while the session is paused, stopped by the checkpoint lock, never transformed.  A real
ipykernel kernel preloads the real shim in front of a stand-in CUDA driver
(``fake_libcuda.c``; no GPU here).
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime_helpers import DRIVER_ENTRIES

from gpushare_ext.runtime import interpose

LAUNCHERS = (
    DRIVER_ENTRIES
    + r"""
_p, _u, _entry = p, u, entry
COOP = _entry(b"cuLaunchCooperativeKernel",
              ctypes.CFUNCTYPE(ctypes.c_int, _p, _u, _u, _u, _u, _u, _u, _u, _p, _p))
EX = _entry(b"cuLaunchKernelEx", ctypes.CFUNCTYPE(ctypes.c_int, _p, _p, _p, _p))
GRAPH = _entry(b"cuGraphLaunch", ctypes.CFUNCTYPE(ctypes.c_int, _p, _p))

class Config(ctypes.Structure):
    _fields_ = [("grid", _u * 3), ("block", _u * 3), ("shared", _u), ("stream", _p),
                ("attrs", _p), ("n", _u)]
attribute = ctypes.c_uint64(0)
clustered = Config((_u * 3)(1, 1, 1), (_u * 3)(32, 1, 1), 0, None,
                   ctypes.cast(ctypes.byref(attribute), _p), 1)
"""
)


def _env(fake_driver: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(LD_PRELOAD=str(interpose.NATIVE), LD_LIBRARY_PATH=str(fake_driver))
    env.pop("GPUSHARE_INTERPOSER", None)
    return env


def test_each_kind_run_as_is_is_said_once_in_the_cell_that_ran_it(kernels, fake_driver):
    (kernel,) = kernels(1, env=_env(fake_driver))
    kernel.run("%load_ext gpushare_ext\n" + LAUNCHERS).ok()
    quiet = kernel.run("x = 1").ok()
    assert "gpushare:" not in quiet.stderr

    first = kernel.run("print(COOP(None, 1, 1, 1, 32, 1, 1, 0, None, None))").ok()
    stdout = "".join(o["text"] for o in first.outputs if o.get("name") == "stdout")
    assert stdout.strip() == "0"  # the launch went through: the driver's success
    said = [line for line in first.stderr.splitlines() if line.startswith("gpushare:")]
    assert said == [
        "gpushare: cooperative launches (their blocks wait on each other: none may stop "
        "alone) run as they are: a pause holds the next one and the checkpoint lock stops "
        "the process, but one already on the GPU finishes first"
    ], first.describe()

    again = kernel.run(
        "COOP(None, 1, 1, 1, 32, 1, 1, 0, None, None)\n"
        "EX(ctypes.byref(clustered), None, None, None)\n"
        "GRAPH(None, None)\n"
    ).ok()
    said = [line for line in again.stderr.splitlines() if line.startswith("gpushare:")]
    # The cooperative kind was said before; the two new kinds once each.
    assert len(said) == 2, again.describe()
    assert said[0].startswith("gpushare: launches with attributes (thread-block clusters")
    assert said[1].startswith("gpushare: CUDA graph launches")

    third = kernel.run("GRAPH(None, None)\nEX(ctypes.byref(clustered), None, None, None)").ok()
    assert "gpushare:" not in third.stderr
