"""Preemptible kernels: parse -> analyse -> classify -> transform -> assemble -> launch.

What it is for: the notebook-facing API (``kernel``, ``jit``) and the pieces the runtime
and broker use (``YieldFlag``, ``write_yield_flag_from_handle``, the ``LaunchHooks``
of ``launch``). See ``docs/kernels.md``.

What it must not do: import CUDA, CuPy or Numba at import time (``import gpushare_ext``
stays cheap and works without a GPU); everything heavy is imported where it is used.
"""

from __future__ import annotations

from gpushare_ext.kernels.analysis import analyse_entry, analyse_module
from gpushare_ext.kernels.classification import classify_launch
from gpushare_ext.kernels.frontends import Kernel, NumbaKernel, jit, kernel
from gpushare_ext.kernels.launch import LaunchMode, LaunchReport
from gpushare_ext.kernels.ptx import KernelError, PtxModule, parse_ptx
from gpushare_ext.kernels.report import Access, Classification, Idempotence, KernelReport
from gpushare_ext.kernels.toolchain import compile_cuda
from gpushare_ext.kernels.transform import (
    PreemptibleKernel,
    TransformOptions,
    assemble,
    find_ptxas,
    make_preemptible,
)
from gpushare_ext.kernels.yield_flags import (
    YieldFlag,
    set_session_yield_flag,
    write_yield_flag_from_handle,
)

__all__ = [
    "Access",
    "Classification",
    "Idempotence",
    "Kernel",
    "KernelError",
    "KernelReport",
    "LaunchMode",
    "LaunchReport",
    "NumbaKernel",
    "PreemptibleKernel",
    "PtxModule",
    "TransformOptions",
    "YieldFlag",
    "analyse_entry",
    "analyse_module",
    "assemble",
    "classify_launch",
    "compile_cuda",
    "find_ptxas",
    "jit",
    "kernel",
    "make_preemptible",
    "parse_ptx",
    "set_session_yield_flag",
    "write_yield_flag_from_handle",
]
