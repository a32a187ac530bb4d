"""How the benchmark report writes a figure, a run's place and a command.

Shared by ``report`` and ``report_tables`` so that every table names device, driver and
date and prints its figures the same way.  It reads no files and knows no suite: each
function turns one value into text.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

THIRD_PARTY_LABELS = {
    "cupy_linalg": "cupy.linalg solve + QR, 4096^2",
    "cupy_fft": "cupy.fft 2-D, 8192^2",
    "cupyx_solver": "cupyx.scipy CG, 1M unknowns",
    "elementwise_long": "ElementwiseKernel, 0.4 s launches",
    "numba": "Numba @cuda.jit, 0.14 s launches",
    "torchvision": "torchvision ResNet-18 training",
    "transformer": "PyTorch transformer-encoder training",
    "long_gemm": "cuBLAS fp32 GEMMs, 8192^2 (~20 ms each)",
}
#: The library-heavy neighbours, whose tail target is 1.1 over repeated runs (the
#: repeated table); the one-run table keeps the others and their 1.3 target.
REPEATED_TAIL_LOWS = ("transformer", "long_gemm")


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**not met**")


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def where(document: dict) -> str:
    device = document.get("device") or "?"
    driver = document.get("driver")
    if isinstance(driver, int):  # cudaDriverGetVersion: 13000 means the CUDA 13.0 driver API
        driver = f"CUDA {driver // 1000}.{driver % 1000 // 10} driver API"
    date = (document.get("date") or "?")[:10]
    return f"{device}" + (f", driver {driver}" if driver else "") + f", {date}"


def portable(command: str) -> str:
    """The command as anyone would type it: the machine's own output folder is DIR, and
    a benchmark started by its file's path is started as the module it is."""
    command = re.sub(
        r"\S*python3?\s+\S*benchmarks/(\w+)\.py\b", r"python -m benchmarks.\1", command
    )
    return re.sub(r"--out \S+", "--out DIR", command)


def load_result(folder: Path, name: str) -> dict | None:
    """A result file of ``folder`` as JSON, or None where the run made none."""
    path = folder / name
    return json.loads(path.read_text()) if path.is_file() else None
