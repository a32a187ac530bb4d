"""On a real GPU: launches the shim cannot make preemptible run unmodified, with the same
results as without gpushare, under the hold and the checkpoint lock, and the cell says
once which protection applies and why.

The workloads (graph capture and replay, a cooperative launch, ``cuLaunchKernelEx`` with
a thread-block cluster attribute, dynamic parallelism, ``printf`` in a kernel, a long
kernel on managed memory, a long kernel whose PTX reads a cluster register the
transform does not model, a module unloaded while a launch of it runs) run three
ways: in a plain Python process (no gpushare: the reference), in an unmarked cell of a
kernel started as the server extension starts kernels (shim preloaded, CuPy compiling
to PTX), and in a ``%%gpu priority=low`` cell while the broker's chaos mode pauses that
kernel every 5-30 ms at the gate, with the yield flag and with the checkpoint lock.
Every outcome must match the reference.

Skips cleanly without a usable GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from gpu_support import ROOT, gpu_with, shim_env
from runtime_helpers import NotebookKernel, short_tempdir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not gpu_with("numba.cuda"), reason="needs a GPU with CuPy and Numba"),
]

# Each workload returns a short text that is the same whenever the work was done right.
WORKLOADS = r'''
import ctypes, json, threading, time
import numpy, cupy
from numba import cuda

N, ITER = 1 << 22, 200_000
LOOP = "float a = 0.5f; for (int k = 0; k < n; ++k) a = a * 0.999f + 0.5f;"
step = cupy.ElementwiseKernel("float32 x, int32 n", "float32 y",
                              LOOP + " y = x + (a > 0.0f ? 1.0f : 0.0f);", "gps_bad_step")
x = cupy.arange(N, dtype=cupy.float32)
want = cupy.asnumpy(x) + 1

def graph():
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupy.zeros_like(x)
        stream.begin_capture()
        step(x, ITER, y)
        captured = stream.end_capture()
        right = 0
        for _ in range(3):
            y.fill(0)
            captured.launch(stream)
            stream.synchronize()
            right += bool((y.get() == want).all())
    return f"ok {right}/3 replays right"

@cuda.jit
def _grid_sum(a, out):
    grid = cuda.cg.this_grid()
    i = cuda.grid(1)
    if i < a.size:
        cuda.atomic.add(out, 0, a[i])
    grid.sync()
    if i == 0:
        out[1] = out[0]

def cooperative():
    a = cuda.to_device(numpy.ones(128 * 256, dtype=numpy.float32))
    out = cuda.to_device(numpy.zeros(2, dtype=numpy.float32))
    _grid_sum[128, 256](a, out)
    return f"ok sum {out.copy_to_host()[1]:.0f}"

_EX_SOURCE = r"""extern "C" __global__ void gps_bad_cluster(float *y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * i;
}"""

_p, _u = ctypes.c_void_p, ctypes.c_uint
_get_entry = ctypes.CDLL("libcuda.so.1").cuGetProcAddress_v2
_get_entry.argtypes = [ctypes.c_char_p, ctypes.POINTER(_p), ctypes.c_int, ctypes.c_uint64, _p]

def _driver(name, *argtypes):
    """A driver entry point as a program gets it (the shim wraps what it hands out)."""
    found = _p()
    assert _get_entry(name.encode(), ctypes.byref(found), 12080, 0, None) == 0, name
    return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(found.value)

class _Attribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _u * 16)]

class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", _u * 3), ("block", _u * 3), ("shared", _u), ("stream", _p),
                ("attrs", ctypes.POINTER(_Attribute)), ("count", _u)]

CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION

def launch_with_cluster_attribute():
    kernel = cupy.RawKernel(_EX_SOURCE, "gps_bad_cluster")
    kernel.compile()
    y = cupy.zeros(1024, dtype=cupy.float32)
    pointer, n = ctypes.c_void_p(y.data.ptr), ctypes.c_int(1024)
    params = (_p * 2)(ctypes.addressof(pointer), ctypes.addressof(n))
    attribute = _Attribute(id=CLUSTER_DIMENSION)
    attribute.value[0], attribute.value[1], attribute.value[2] = 2, 1, 1
    config = _Config((_u * 3)(8, 1, 1), (_u * 3)(128, 1, 1), 0, None,
                     ctypes.pointer(attribute), 1)
    launch_ex = _driver("cuLaunchKernelEx", ctypes.POINTER(_Config), _p, _p, _p)
    error = launch_ex(ctypes.byref(config), kernel.kernel.ptr, ctypes.addressof(params), None)
    cupy.cuda.runtime.deviceSynchronize()
    right = bool((y.get() == 2.0 * numpy.arange(1024)).all())
    return f"ok {int(error)} {right}"

_NESTED = r"""
extern "C" __global__ void gps_bad_child(float *y, int base) { y[base + threadIdx.x] += 1.0f; }
extern "C" __global__ void gps_bad_parent(float *y) {
    if (threadIdx.x == 0) gps_bad_child<<<1, 32>>>(y, blockIdx.x * 32);
}"""

def dynamic_parallelism():
    try:
        module = cupy.RawModule(code=_NESTED, options=("-rdc=true",))
        parent = module.get_function("gps_bad_parent")
    except Exception as exc:  # the outcome is compared with the plain run's
        return f"compile failed: {type(exc).__name__}"
    y = cupy.zeros(64 * 32, dtype=cupy.float32)
    parent((64,), (32,), (y,))
    cupy.cuda.runtime.deviceSynchronize()
    return f"ok {float(y.sum().get()):.0f}"

def printf_in_kernel():
    kernel = cupy.RawKernel(
        r"""extern "C" __global__ void gps_bad_printf() { printf("gps-printf %d\n", threadIdx.x); }""",
        "gps_bad_printf")
    kernel((1,), (4,), ())
    cupy.cuda.runtime.deviceSynchronize()
    ctypes.CDLL(None).fflush(None)
    return "ok"

def managed_memory():
    m = cupy.ndarray((N,), dtype=cupy.float32, memptr=cupy.cuda.malloc_managed(N * 4))
    m[...] = x
    out = cupy.zeros_like(x)
    for _ in range(4):  # long launches: timed first, then handed to the runtime
        step(m, ITER, out)
    cupy.cuda.runtime.deviceSynchronize()
    return f"ok {bool((out.get() == want).all())}"

_CLUSTER_REGISTER = r"""extern "C" __global__ void gps_bad_cluster_rank(float *y, int n, int iters) {
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    float a = 0.5f;
    for (int k = 0; k < iters; ++k) a = a * 0.999f + 0.5f;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = (float)rank + (a > 0.0f ? 1.0f : 0.0f);
}"""

def unmodelled_ptx():
    kernel = cupy.RawKernel(_CLUSTER_REGISTER, "gps_bad_cluster_rank")
    y = cupy.zeros(N, dtype=cupy.float32)
    for _ in range(4):  # one at a time: the shim learns it is long from the first
        kernel((N // 256,), (256,), (y, numpy.int32(N), numpy.int32(ITER)))
        cupy.cuda.runtime.deviceSynchronize()
    return f"ok {bool((y.get() == 1.0).all())}"

_UNLOAD_SOURCE = r"""extern "C" __global__ void gps_bad_unload(float *y, int n, int iters) {
    float a = 0.5f;
    for (int k = 0; k < iters; ++k) a = a * 0.999f + 0.5f;
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += (a > 0.0f ? 1.0f : 0.0f);
}"""

def unload_during_launches():
    from cupy.cuda import compiler
    ptx = compiler.compile_using_nvrtc(_UNLOAD_SOURCE, ("-arch=compute_90",))
    ptx = ptx[0] if isinstance(ptx, tuple) else ptx
    ptx = ptx if isinstance(ptx, bytes) else ptx.encode()
    load = _driver("cuModuleLoadData", ctypes.POINTER(_p), ctypes.c_char_p)
    get = _driver("cuModuleGetFunction", ctypes.POINTER(_p), _p, ctypes.c_char_p)
    unload = _driver("cuModuleUnload", _p)
    launch = _driver("cuLaunchKernel", _p, _u, _u, _u, _u, _u, _u, _u, _p, _p, _p)
    synchronize = _driver("cuCtxSynchronize")
    get_context = _driver("cuCtxGetCurrent", ctypes.POINTER(_p))
    set_context = _driver("cuCtxSetCurrent", _p)
    module, function, context = _p(), _p(), _p()
    assert load(ctypes.byref(module), ptx.rstrip(b"\0") + b"\0") == 0
    assert get(ctypes.byref(function), module, b"gps_bad_unload") == 0
    assert get_context(ctypes.byref(context)) == 0
    y = cupy.zeros(N, dtype=cupy.float32)
    pointer, n, iters = ctypes.c_void_p(y.data.ptr), ctypes.c_int(N), ctypes.c_int(ITER)
    params = (_p * 3)(*(ctypes.addressof(v) for v in (pointer, n, iters)))
    codes = []
    launched = threading.Event()
    def launches():
        set_context(context)
        codes.append(launch(function, N // 256, 1, 1, 256, 1, 1, 0, None, params, None))
        launched.set()  # the unload comes while this launch runs
        synchronize()
    worker = threading.Thread(target=launches)
    worker.start()
    launched.wait(60)
    unloaded = unload(module)
    worker.join(120)
    cupy.cuda.runtime.deviceSynchronize()
    ran = codes.count(0)
    # Every launch that returned success ran whole: y counts them exactly.
    whole = bool((y.get() == float(ran)).all())
    later = step(x, 1000)  # the process goes on working
    return (f"ok unload {int(unloaded)}, {len(codes)} launches answered, whole {whole}, "
            f"later {bool((later.get() == want).all())}")

WORK = {
    "graph": graph, "cooperative": cooperative,
    "cluster attribute": launch_with_cluster_attribute,
    "dynamic parallelism": dynamic_parallelism, "printf": printf_in_kernel,
    "managed memory": managed_memory, "unmodelled PTX": unmodelled_ptx,
    "module unload": unload_during_launches,
}

def outcomes():
    seen = {}
    for name, work in WORK.items():
        try:
            seen[name] = work()
        except Exception as exc:
            seen[name] = f"raised {type(exc).__name__}: {exc}"[:200]
    return seen
'''

RUN_ALL = "import json\nprint('OUTCOMES', json.dumps(outcomes()))\n"

# What a cell says once for the launches the shim cannot make preemptible.  The shim
# holds every launch, so these are said in any cell (Numba's grid-synchronised kernel is
# launched with the cooperative attribute, so it counts as a launch with attributes):
SAID_ANYWHERE = {
    "graph": "CUDA graph launches",
    "cluster attribute": "launches with attributes",
}
# Long kernels go to the runtime only in a lease that somebody could preempt (chaos
# mode is such a somebody): a kernel the transform refuses is named there, once.  (The
# managed-memory workload's kernel only writes its output, so it may run preemptibly
# over managed memory too: its outcome is what is compared.)
SAID_IN_A_RIVALLED_LEASE = {"unmodelled PTX": "gps_bad_cluster_rank"}


def _outcomes(text: str) -> dict[str, str]:
    line = next(line for line in text.splitlines() if line.startswith("OUTCOMES "))
    return json.loads(line[len("OUTCOMES ") :])


def _comparable(seen: dict[str, str]) -> dict[str, str]:
    # How many launches a module unload let through depends on timing; the rest is exact.
    unload = re.sub(r", \d+ launches answered", "", seen.get("module unload", ""))
    return {**seen, "module unload": unload}


@pytest.fixture(scope="module")
def reference() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "CUPY_COMPILE_WITH_PTX")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", WORKLOADS + RUN_ALL], capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = _outcomes(done.stdout)
    print("plain:", json.dumps(seen, indent=1))
    for name in ("graph", "cooperative", "cluster attribute", "managed memory", "module unload"):
        assert seen[name].startswith("ok"), seen
    return seen


def test_launches_the_shim_cannot_make_preemptible_run_unmodified_and_say_so_once(
    reference, gpu_broker
):
    env = shim_env(
        CUPY_COMPILE_WITH_PTX="1",
        CUPY_CACHE_DIR=str(short_tempdir("gps-cupy-")),
        GPUSHARE_SOCKET=str(gpu_broker.socket),
    )
    kernel = NotebookKernel("bad-input", env).ready()
    try:
        kernel.run("%load_ext gpushare_ext\n" + WORKLOADS, timeout=300).ok()

        unmarked = kernel.run(RUN_ALL, timeout=600).ok()
        print("unmarked:", unmarked.final_text()[-3000:], unmarked.stderr[-3000:])
        assert _comparable(_outcomes(unmarked.final_text())) == _comparable(reference)
        said = [line for line in unmarked.stderr.splitlines() if line.startswith("gpushare:")]
        for name, words in SAID_ANYWHERE.items():
            assert sum(words in line for line in said) == 1, (name, said)

        # Under the lease, while chaos pauses the kernel at the gate, with the yield flag
        # and with the checkpoint lock: the same outcomes, and nothing said twice.
        kernel.run("%%gpu priority=low mem=8GiB\npass", timeout=120).ok()
        from gpushare_ext.client import BrokerClient

        with BrokerClient(gpu_broker.socket, client="cli") as admin:
            admin.chaos(kernel.pid, every_ms=(5.0, 30.0), pause_ms=(1.0, 10.0),
                        levels=(0, 1, 3), seed=7)  # fmt: skip
        try:
            chaos = kernel.run("%%gpu priority=low mem=8GiB\n" + RUN_ALL, timeout=600).ok()
        finally:
            with BrokerClient(gpu_broker.socket, client="cli") as admin:
                ended = admin.chaos(kernel.pid, stop=True)
        print("chaos:", chaos.final_text()[-3000:], chaos.stderr[-3000:], ended)
        assert _comparable(_outcomes(chaos.final_text())) == _comparable(reference)
        again = [line for line in chaos.stderr.splitlines() if line.startswith("gpushare:")]
        assert not any(words in line for line in again for words in SAID_ANYWHERE.values())
        for name, words in SAID_IN_A_RIVALLED_LEASE.items():
            assert sum(words in line for line in again) == 1, (name, again)
        paused = re.search(r"(\d+) pauses so far", ended)
        assert paused and int(paused.group(1)) > 0, ended  # the broker did pause it

        after = kernel.run("print('usable', bool((step(x, 1000).get() == want).all()))")
        assert "usable True" in after.ok().final_text()
    finally:
        kernel.shutdown()
