"""Numba ``@cuda.jit``-style kernels for the tests (compiled with ``compile_ptx``, no GPU)."""

from __future__ import annotations

import re
from functools import cache

from numba import cuda, float32, types


def nb_add(a, b, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a[i] + b[i]


def nb_scale_inplace(x, s):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = x[i] * s


def nb_histogram(data, bins):
    i = cuda.grid(1)
    if i < data.size:
        cuda.atomic.add(bins, data[i], 1)


def nb_grid_stride(x, y):
    start = cuda.grid(1)
    step = cuda.gridsize(1)
    for i in range(start, x.size, step):
        y[i] = x[i] * 2.0


def nb_matmul_shared(A, B, C):
    sA = cuda.shared.array((16, 16), float32)
    sB = cuda.shared.array((16, 16), float32)
    x, y = cuda.grid(2)
    tx = cuda.threadIdx.x
    ty = cuda.threadIdx.y
    n = A.shape[0]
    acc = float32(0.0)
    for t in range((n + 15) // 16):
        sA[ty, tx] = A[y, t * 16 + tx] if y < n and t * 16 + tx < n else float32(0.0)
        sB[ty, tx] = B[t * 16 + ty, x] if x < n and t * 16 + ty < n else float32(0.0)
        cuda.syncthreads()
        for k in range(16):
            acc += sA[ty, k] * sB[k, tx]
        cuda.syncthreads()
    if y < n and x < n:
        C[y, x] = acc


def nb_add_2d(a, out):
    x, y = cuda.grid(2)
    if y < a.shape[0] and x < a.shape[1]:
        out[y, x] = a[y, x] + float32(y)


# name -> (function, signature, expected verdict, {argument: access})
NUMBA_CASES = {
    "nb_add": (
        nb_add, "void(float32[:], float32[:], float32[:])", "idempotent",
        {"a": "read", "b": "read", "out": "written"},
    ),
    "nb_scale_inplace": (
        nb_scale_inplace, "void(float32[:], float32)", "non-idempotent", {"x": "read-written"},
    ),
    "nb_histogram": (
        nb_histogram, "void(uint8[:], uint32[:])", "non-idempotent",
        {"data": "read", "bins": "read-written"},
    ),
    "nb_grid_stride": (
        nb_grid_stride, "void(float32[:], float32[:])", "idempotent", {"x": "read", "y": "written"},
    ),
    "nb_matmul_shared": (
        nb_matmul_shared, "void(float32[:, :], float32[:, :], float32[:, :])", "idempotent",
        {"A": "read", "B": "read", "C": "written"},
    ),
    "nb_add_2d": (
        nb_add_2d, "void(float32[:, :], float32[:, :])", "idempotent", {"a": "read", "out": "written"},
    ),
}  # fmt: skip


def relax_once(v):
    return v * float32(0.999) + float32(0.25)


@cache
def linked_relax_pair(abi: str = "c") -> tuple[str, str, str]:
    """(the kernel's PTX, its entry's name, the callee's PTX) as
    ``benchmarks/long_neighbours.py`` ``numba_linked`` builds them, for cc 9.0: a kernel
    calling ``gps_relax``, a device function compiled on its own; ``abi``: how both
    sides declare it."""
    callee, _ = cuda.compile_ptx(
        relax_once, (types.float32,), device=True, abi=abi,
        abi_info={"abi_name": "gps_relax"}, cc=(9, 0),
    )  # fmt: skip
    relax = cuda.declare_device("gps_relax", "float32(float32)", abi=abi)

    def gps_numba_linked(x, iterations):
        i = cuda.grid(1)
        if i < x.size:
            v = x[i]
            for _ in range(iterations):
                v = relax(v)
            x[i] = v

    kernel, _ = cuda.compile_ptx(gps_numba_linked, (types.float32[::1], types.int64), cc=(9, 0))
    name = re.search(r"\.entry\s+(\S+)\(", kernel).group(1)
    return kernel, name, callee
