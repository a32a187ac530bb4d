"""Long kernels from every framework's JIT path, as low-priority neighbours (real GPU).

Each builder returns a step: one launch of a kernel of about 0.5-1 s on an H100/H200,
loaded the way its framework loads it, that returns the array it wrote.  A step first
puts the input back where the kernel updates in place, so every step's output must be
bit-identical to the first step's, which ran as it was (before any high-priority
session existed): the tenant compares each output with it on the GPU
(``benchmarks/tenant.py``), whatever pauses came between.

* ``numba_inplace``  -- Numba ``@cuda.jit``, an in-place update of a 16 MiB array
  (the neighbour a user met: ~1 s a launch, launched in a plain loop);
* ``numba_linked``   -- Numba ``@cuda.jit`` calling a device function it links from
  PTX (``link=``: Numba's linker, cuLink or nvJitLink);
* ``cupy_elementwise`` -- CuPy ``ElementwiseKernel``, in place;
* ``cupy_reduction`` -- CuPy ``ReductionKernel`` (a loop per element, then a sum);
* ``cupy_rawmodule`` -- CuPy ``RawModule`` (CUDA C through NVRTC), in place;
* ``cupyx_jit``      -- ``cupyx.jit.rawkernel`` (Python compiled by CuPy), in place;
* ``driver_ptx``     -- PTX from NVRTC loaded by hand with the driver API
  (``cuModuleLoadData``, ``cuLaunchKernel`` through ctypes), in place.

This module only builds workloads; the coordinator and the tenants live beside it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

ELEMENTS = 1 << 22  # 16 MiB of float32
THREADS = 256
# Per-element loop lengths that make a launch last about a second on an H200 (less on
# an H100's fewer, slower SMs it lasts longer): measured, then rounded.
CUPY_ITERATIONS = 6_000_000
NUMBA_ITERATIONS = 900_000
# Each iteration of ``numba_linked`` calls a device function that is not inlined (it is
# linked in as PTX): not yet measured, a quarter of Numba's count for now.
NUMBA_LINKED_ITERATIONS = NUMBA_ITERATIONS // 4

Step = Callable[[], Any]

LOOP_C = r"""
extern "C" __global__ void gps_neighbour_inplace(float* x, int n, int iterations) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int k = 0; k < iterations; ++k) v = v * 0.999f + 0.25f;
    x[i] = v;
}
"""


def _blocks() -> int:
    return (ELEMENTS + THREADS - 1) // THREADS


def _cupy_input():
    import cupy

    return cupy.arange(ELEMENTS, dtype=cupy.float32) / 7


def _numba_in_place(kernel: Any, iterations: int = 0) -> Step:
    """A step that puts the input back and launches a Numba ``kernel(x, iterations)``
    that updates ``x`` in place (``NUMBA_ITERATIONS`` unless given)."""
    import cupy
    from numba import cuda

    start = _cupy_input()
    x = cupy.empty_like(start)
    device_x = cuda.as_cuda_array(x)

    def step():
        x[...] = start
        kernel[_blocks(), THREADS](device_x, iterations or NUMBA_ITERATIONS)
        return x

    return step


def numba_inplace() -> Step:
    from benchmarks.environment import allow_numba_import

    allow_numba_import()
    from numba import cuda, float32

    @cuda.jit
    def gps_numba_inplace(x, iterations):
        i = cuda.grid(1)
        if i < x.size:
            v = x[i]
            for _ in range(iterations):
                v = v * float32(0.999) + float32(0.25)
            x[i] = v

    return _numba_in_place(gps_numba_inplace)


def numba_linked() -> Step:
    """A kernel whose loop body is a device function Numba links in from PTX.

    The callee is compiled with the C ABI, so it is declared with the C ABI too: a
    declaration in Numba's own ABI (``declare_device``'s default: a pointer for the
    result, a status returned) links by name all the same and calls it with parameters
    it does not take (undefined: the kernel's PTX then reads a status where the callee
    leaves a float, and need neither run long nor write ``x``).  A call that is not
    inlined costs more than the FMA it wraps: fewer iterations than ``numba_inplace``."""
    import tempfile
    from pathlib import Path

    from benchmarks.environment import allow_numba_import

    allow_numba_import()
    from numba import cuda, float32, types

    def relax_once(v):
        return v * float32(0.999) + float32(0.25)

    ptx, _ = cuda.compile_ptx_for_current_device(
        relax_once, (types.float32,), device=True, abi="c", abi_info={"abi_name": "gps_relax"}
    )
    ptx_file = Path(tempfile.mkdtemp(prefix="gps-link-")) / "relax.ptx"
    ptx_file.write_text(ptx)
    relax = cuda.declare_device("gps_relax", "float32(float32)", abi="c")

    @cuda.jit(link=[str(ptx_file)])
    def gps_numba_linked(x, iterations):
        i = cuda.grid(1)
        if i < x.size:
            v = x[i]
            for _ in range(iterations):
                v = relax(v)
            x[i] = v

    return _numba_in_place(gps_numba_linked, NUMBA_LINKED_ITERATIONS)


def cupy_elementwise() -> Step:
    import cupy

    kernel = cupy.ElementwiseKernel(
        "int32 n",
        "float32 x",
        "float a = x; for (int k = 0; k < n; ++k) a = a * 0.999f + 0.25f; x = a;",
        "gps_neighbour_elementwise",
    )
    start = _cupy_input()
    x = cupy.empty_like(start)

    def step():
        x[...] = start
        kernel(cupy.int32(CUPY_ITERATIONS), x)
        return x

    return step


def cupy_reduction() -> Step:
    import cupy

    kernel = cupy.ReductionKernel(
        "float32 x, int32 n",
        "float32 y",
        "_relax(x, n)",
        "a + b",
        "y = a",
        "0",
        "gps_neighbour_reduction",
        preamble="__device__ float _relax(float x, int n) { float a = x; "
        "for (int k = 0; k < n; ++k) a = a * 0.999f + 0.25f; return a; }",
    )
    x = _cupy_input().reshape(1024, -1)
    return lambda: kernel(x, cupy.int32(CUPY_ITERATIONS), axis=1)


def cupy_rawmodule() -> Step:
    import cupy

    module = cupy.RawModule(code=LOOP_C)
    kernel = module.get_function("gps_neighbour_inplace")
    start = _cupy_input()
    x = cupy.empty_like(start)

    def step():
        x[...] = start
        kernel((_blocks(),), (THREADS,), (x, cupy.int32(ELEMENTS), cupy.int32(CUPY_ITERATIONS)))
        return x

    return step


def cupyx_jit() -> Step:
    import cupy
    from cupyx import jit

    @jit.rawkernel()
    def gps_neighbour_jit(x, n, iterations):
        i = jit.blockIdx.x * jit.blockDim.x + jit.threadIdx.x
        if i < n:
            v = x[i]
            for _ in range(iterations):
                v = v * cupy.float32(0.999) + cupy.float32(0.25)
            x[i] = v

    start = _cupy_input()
    x = cupy.empty_like(start)

    def step():
        x[...] = start
        gps_neighbour_jit(
            (_blocks(),), (THREADS,), (x, cupy.int32(ELEMENTS), cupy.int32(CUPY_ITERATIONS))
        )
        return x

    return step


def _nvrtc_ptx(source: str, name: str) -> bytes:
    """PTX of ``source`` for this GPU, from NVRTC through cuda-bindings."""
    import cupy
    from cuda.bindings import nvrtc

    def check(result):
        status, *values = result if isinstance(result, tuple) else (result,)
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed: {status}")
        return values[0] if values else None

    arch = f"--gpu-architecture=compute_{cupy.cuda.Device().compute_capability}".encode()
    program = check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    check(nvrtc.nvrtcCompileProgram(program, 1, [arch]))
    size = check(nvrtc.nvrtcGetPTXSize(program))
    ptx = b" " * size
    check(nvrtc.nvrtcGetPTX(program, ptx))
    return ptx


def driver_ptx() -> Step:
    """PTX loaded with ``cuModuleLoadData`` and launched with ``cuLaunchKernel``, by hand
    through ctypes, as a user's own driver-API code would (the launch shim sees it
    through ``dlsym``, like every framework's)."""
    import cupy

    start = _cupy_input()  # CuPy's context is the current one from here on
    x = cupy.empty_like(start)
    ptx = _nvrtc_ptx(LOOP_C, "gps_neighbour.cu")
    cuda = ctypes.CDLL("libcuda.so.1")
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    if cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(ptx)) != 0:
        raise RuntimeError("cuModuleLoadData failed")
    if cuda.cuModuleGetFunction(ctypes.byref(function), module, b"gps_neighbour_inplace") != 0:
        raise RuntimeError("cuModuleGetFunction failed")
    pointer = ctypes.c_void_p(x.data.ptr)
    n, iterations = ctypes.c_int(ELEMENTS), ctypes.c_int(CUPY_ITERATIONS)
    params = (ctypes.c_void_p * 3)(
        ctypes.addressof(pointer), ctypes.addressof(n), ctypes.addressof(iterations)
    )
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
    ]  # fmt: skip

    # ``params`` holds the values' addresses only: the step keeps the values alive.
    arguments = (pointer, n, iterations)

    def step(keep_alive: tuple = arguments):  # referenced, so never freed meanwhile
        x[...] = start
        cupy.cuda.runtime.deviceSynchronize()  # the copy is on CuPy's stream; ours is 0
        status = cuda.cuLaunchKernel(
            function, _blocks(), 1, 1, THREADS, 1, 1, 0, None, params, None
        )
        if status != 0:
            raise RuntimeError(f"cuLaunchKernel failed ({status})")
        return x

    return step


LONG_NEIGHBOURS: dict[str, Callable[[], Step]] = {
    "numba_inplace": numba_inplace,
    "numba_linked": numba_linked,
    "cupy_elementwise": cupy_elementwise,
    "cupy_reduction": cupy_reduction,
    "cupy_rawmodule": cupy_rawmodule,
    "cupyx_jit": cupyx_jit,
    "driver_ptx": driver_ptx,
}
