"""What every benchmark result records about where and how it ran."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from importlib import metadata

PACKAGES = (
    "gpushare-ext",
    "cupy-cuda13x",
    "cupy-cuda12x",
    "numba-cuda",
    "cuda-bindings",
    "nvidia-ml-py",
    "torch",
    "msgspec",
    "ipykernel",
)


def _gpu() -> dict:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return {
            "device": name.decode() if isinstance(name, bytes) else name,
            "driver": driver.decode() if isinstance(driver, bytes) else driver,
            "gpu_count": count,
        }
    except Exception as exc:  # no GPU: say so rather than guess
        return {"device": f"no GPU ({type(exc).__name__})", "driver": None, "gpu_count": 0}


def describe() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "host": platform.node(),
        # The cores this run may use (a run pinned with taskset has fewer than the host).
        "cpu_count": _usable_cpus(),
        "host_cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit,
        "packages": versions,
        **_gpu(),
    }


def allow_numba_import() -> None:
    """Let numba-cuda import beside a NumPy newer than it knows.

    Some numba-cuda releases register an overload for ``numpy.row_stack``, which NumPy
    2.5 removed (it was an alias of ``vstack``), so ``import numba.cuda`` fails there.
    Benchmarks that run Numba kernels restore the alias first; nothing else changes.
    """
    import numpy

    if not hasattr(numpy, "row_stack"):
        numpy.row_stack = numpy.vstack


def _usable_cpus() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count()
