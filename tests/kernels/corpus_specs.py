"""The kernel corpus as data: file, kernel, expected classification, and how to launch it.

Shared by the CPU tests (classification, transforms, ptxas) and the GPU tests (bit-exact
results under preemption). ``make_args(cp, rng)`` builds fresh random inputs with CuPy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).parent / "corpus"


@dataclass(frozen=True)
class Case:
    file: str
    kernel: str
    verdict: str
    access: dict[str, str]  # parameter (as written) -> read / written / read-written
    grid: tuple[int, int, int] = (128, 1, 1)
    block: tuple[int, int, int] = (256, 1, 1)
    shared: int = 0
    make_args: Callable[[Any, Any], tuple] | None = None
    refuse: str | None = None  # KernelError code the transform must raise
    loops: bool = False
    barriers: bool = False
    atomics: bool = False
    early_return: bool = False
    uses_ctaid: frozenset[str] = field(default_factory=lambda: frozenset("x"))
    aborts_ok: bool = True  # rollback can restore everything the kernel writes

    @property
    def id(self) -> str:
        return f"{self.file}:{self.kernel}"

    @property
    def source(self) -> str:
        return (CORPUS / self.file).read_text()


N = 128 * 256


def _f32(cp, rng, n=N):
    return cp.asarray(rng.standard_normal(n).astype("float32"))


def _i32(cp, rng, n=N, hi=1000):
    return cp.asarray(rng.integers(0, hi, n).astype("int32"))


def _np():
    import numpy as np

    return np


CASES: list[Case] = [
    Case("vector_add.cu", "vector_add", "idempotent", {"a": "read", "b": "read", "c": "written"},
         make_args=lambda cp, r: (_f32(cp, r), _f32(cp, r), cp.zeros(N, "float32"), _np().int32(N))),
    Case("scale_inplace.cu", "scale_inplace", "non-idempotent", {"x": "read-written"},
         make_args=lambda cp, r: (_f32(cp, r), _np().float32(1.5), _np().int32(N))),
    Case("saxpy.cu", "saxpy", "non-idempotent", {"x": "read", "y": "read-written"},
         make_args=lambda cp, r: (_np().float32(2.0), _f32(cp, r), _f32(cp, r), _np().int32(N))),
    Case("saxpy.cu", "saxpy_out", "idempotent", {"x": "read", "y": "read", "out": "written"},
         make_args=lambda cp, r: (_np().float32(2.0), _f32(cp, r), _f32(cp, r),
                                  cp.zeros(N, "float32"), _np().int32(N))),
    Case("stencil.cu", "stencil_1d", "idempotent", {"in": "read", "out": "written"},
         barriers=True, loops=False,
         make_args=lambda cp, r: (_f32(cp, r), cp.zeros(N, "float32"), _np().int32(N))),
    Case("matmul_tiled.cu", "matmul_tiled", "idempotent", {"A": "read", "B": "read", "C": "written"},
         grid=(16, 16, 1), block=(16, 16, 1), loops=True, barriers=True,
         uses_ctaid=frozenset("xy"),
         make_args=lambda cp, r: (_f32(cp, r, 256 * 256), _f32(cp, r, 256 * 256),
                                  cp.zeros(256 * 256, "float32"), _np().int32(256))),
    Case("reduce_atomic.cu", "reduce_sum", "non-idempotent", {"x": "read", "total": "read-written"},
         loops=True, barriers=True, atomics=True,
         make_args=lambda cp, r: (_i32(cp, r), cp.zeros(1, "int32"), _np().int32(N))),
    Case("histogram.cu", "histogram", "non-idempotent", {"data": "read", "bins": "read-written"},
         atomics=True,
         make_args=lambda cp, r: (cp.asarray(r.integers(0, 256, N).astype("uint8")),
                                  cp.zeros(256, "uint32"), _np().int32(N))),
    Case("scan_block.cu", "block_scan", "idempotent", {"in": "read", "out": "written"},
         loops=True, barriers=True,
         make_args=lambda cp, r: (_i32(cp, r), cp.zeros(N, "int32"), _np().int32(N))),
    Case("gather_scatter.cu", "gather", "idempotent", {"src": "read", "idx": "read", "dst": "written"},
         make_args=lambda cp, r: (_f32(cp, r), cp.asarray(r.permutation(N).astype("int32")),
                                  cp.zeros(N, "float32"), _np().int32(N))),
    Case("gather_scatter.cu", "scatter", "idempotent", {"src": "read", "idx": "read", "dst": "written"},
         make_args=lambda cp, r: (_f32(cp, r), cp.asarray(r.permutation(N).astype("int32")),
                                  cp.zeros(N, "float32"), _np().int32(N))),
    Case("gather_scatter.cu", "scatter_add", "non-idempotent",
         {"src": "read", "idx": "read", "dst": "read-written"}, atomics=True,
         make_args=lambda cp, r: (_i32(cp, r), cp.asarray(r.integers(0, 512, N).astype("int32")),
                                  cp.zeros(512, "int32"), _np().int32(N))),
    Case("grid_stride.cu", "grid_stride_square", "idempotent", {"x": "read", "y": "written"},
         loops=True, grid=(128, 1, 1),
         make_args=lambda cp, r: (_f32(cp, r, 4 * N), cp.zeros(4 * N, "float32"), _np().int32(4 * N))),
    Case("early_return.cu", "clamp_copy", "idempotent", {"x": "read", "y": "written"},
         early_return=True,
         make_args=lambda cp, r: (_f32(cp, r), cp.zeros(N, "float32"), _np().int32(N - 77),
                                  _np().float32(-0.5), _np().float32(0.5))),
    Case("pointer_table.cu", "pointer_table", "unknown", {"rows": "read"},
         grid=(4, 32, 1), aborts_ok=False, uses_ctaid=frozenset("xy"), make_args=None),
    Case("grids.cu", "add_rows_2d", "idempotent", {"a": "read", "b": "written"},
         grid=(8, 32, 1), block=(32, 8, 1), uses_ctaid=frozenset("xy"),
         make_args=lambda cp, r: (_f32(cp, r, 256 * 256), cp.zeros(256 * 256, "float32"),
                                  _np().int32(256), _np().int32(256))),
    Case("grids.cu", "fill_3d", "idempotent", {"out": "written"},
         grid=(4, 8, 5), block=(16, 4, 2), uses_ctaid=frozenset("xyz"),
         make_args=lambda cp, r: (cp.zeros(64 * 32 * 10, "int32"), _np().int32(64),
                                  _np().int32(32), _np().int32(10))),
    Case("transpose.cu", "transpose", "idempotent", {"in": "read", "out": "written"},
         grid=(8, 16, 1), block=(32, 32, 1), barriers=True, uses_ctaid=frozenset("xy"),
         make_args=lambda cp, r: (_f32(cp, r, 256 * 512), cp.zeros(256 * 512, "float32"),
                                  _np().int32(256), _np().int32(512))),
    Case("copy_shift.cu", "copy_shift", "idempotent", {"src": "read", "dst": "written"},
         make_args=lambda cp, r: (_f32(cp, r), cp.zeros(N, "float32"), _np().int32(N))),
    Case("spin_barrier.cu", "spin_barrier", "non-idempotent",
         {"arrived": "read-written", "data": "written"}, refuse="not-resumable", loops=True, barriers=True,
         atomics=True, make_args=None),
    Case("atomic_max.cu", "max_reduce", "idempotent", {"x": "read", "result": "written"},
         atomics=True,
         make_args=lambda cp, r: (_i32(cp, r, hi=1 << 30), cp.zeros(1, "int32"), _np().int32(N))),
    Case("smid_probe.cu", "smid_probe", "idempotent", {"out": "written"},
         make_args=lambda cp, r: (cp.zeros(128, "uint32"),)),
    Case("long_loop.cu", "long_loop", "idempotent", {"x": "read", "y": "written"},
         loops=True, early_return=True,
         make_args=lambda cp, r: (_f32(cp, r), cp.zeros(N, "float32"), _np().int32(N),
                                  _np().int32(2000))),
    Case("long_loop.cu", "long_loop_inplace", "non-idempotent", {"x": "read-written"},
         loops=True, early_return=True,
         make_args=lambda cp, r: (_f32(cp, r), _np().int32(N), _np().int32(2000))),
    Case("oob_store.cu", "oob_store", "idempotent", {"a": "written"}, make_args=None),
    Case("dynamic_shared.cu", "reverse_blocks", "idempotent", {"in": "read", "out": "written"},
         barriers=True, shared=256 * 4,
         make_args=lambda cp, r: (_i32(cp, r), cp.zeros(N, "int32"), _np().int32(N))),
    Case("early_exit_barrier.cu", "early_exit_barrier", "idempotent", {"x": "read", "y": "written"},
         refuse="early-exit-before-barrier", barriers=True, early_return=True, make_args=None),
]  # fmt: skip

TRANSFORMABLE = [c for c in CASES if c.refuse is None]
