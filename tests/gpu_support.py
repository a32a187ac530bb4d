"""What the GPU tests share: whether a usable GPU is here, and the environment of a
process started as the server extension starts notebook kernels (the shim preloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_with(*modules: str) -> bool:
    """A GPU CuPy can count, and ``modules`` importable, in a fresh interpreter."""
    probe = "; ".join(
        [
            *(f"import {m}" for m in ("cupy", *modules)),
            "assert cupy.cuda.runtime.getDeviceCount() > 0",
        ]
    )
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def shim_env(**extra: str) -> dict[str, str]:
    """The test's environment with this checkout importable and the launch shim preloaded."""
    from gpushare_ext.runtime.interpose import shim_path

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["LD_PRELOAD"] = str(shim_path())
    env.update(extra)
    return env
