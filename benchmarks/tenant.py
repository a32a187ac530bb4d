"""One tenant of the contention benchmark, run as its own process (a notebook stand-in).

``--role low`` saturates the GPU until told to stop (CuPy matmuls, a PyTorch training
loop, or instrumented preemptible kernels) and records when each iteration finished.
``--role high`` issues interactive requests in "cells": each cell takes a lease (unless
``--mode timeslice``), issues requests with think time between them, and releases.
Both write one JSON file; the coordinator (:mod:`benchmarks.contention`) reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.long_neighbours import LONG_NEIGHBOURS
from benchmarks.stopping import exit_on_signals


def _lease(mode: str, priority: str, instrumented: bool = False):
    import contextlib

    if mode in ("timeslice", "none"):
        return contextlib.nullcontext()
    import gpushare_ext

    # Both tenants on GPU 0: this measures contention, not late binding.
    return gpushare_ext.lease(
        priority=priority, memory_bytes=16 << 30, instrumented_only=instrumented, device="0"
    )


def run_low(args: argparse.Namespace) -> dict:
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    finished: list[float] = []
    ready = Path(args.ready) if args.ready else None
    import cupy

    full_ladder = args.kind == "instrumented" and args.mode == "full"
    if args.mode == "shim":  # as %load_ext gpushare_ext does in a notebook
        from gpushare_ext.runtime import preemptible

        preemptible.install()
    with _lease(args.mode, "low", instrumented=full_ladder):
        third_party = THIRD_PARTY.get(args.kind)
        if third_party is not None:
            step = third_party()
        elif args.kind == "cupy":
            a = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
            b = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
            step = lambda: a @ b  # noqa: E731
        elif args.kind == "torch":
            import torch

            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(4096, 8192), torch.nn.ReLU(), torch.nn.Linear(8192, 4096)
            ).cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
            data = torch.randn(2048, 4096, device="cuda")

            def step():
                optimizer.zero_grad(set_to_none=True)
                loss = model(data).square().mean()
                loss.backward()
                optimizer.step()
        elif args.kind == "instrumented":
            step = _instrumented_step()
        else:
            raise SystemExit(f"unknown low kind {args.kind}")
        first = step()
        # A long neighbour's step returns what it wrote, the same every step: its first,
        # run as it was before any high-priority session existed, is the reference.
        reference = first.copy() if args.kind in LONG_NEIGHBOURS else None
        if reference is not None:
            # The comparison's own kernels compile at their first use (seconds, on a
            # fresh machine): compiled now, so no step after "ready" waits for NVRTC.
            cupy.array_equal(reference, reference)
        cupy.cuda.runtime.deviceSynchronize()
        if ready:
            ready.write_text("ready")
        deadline = time.monotonic() + args.duration
        checked = mismatches = 0
        while not stop["now"] and time.monotonic() < deadline:
            output = step()
            cupy.cuda.runtime.deviceSynchronize()
            finished.append(time.time())
            if reference is not None:
                checked += 1
                mismatches += not bool(cupy.array_equal(cupy.asarray(output), reference))
    result = {"role": "low", "kind": args.kind, "mode": args.mode, "finished": finished}
    if reference is not None:
        result["outputs_checked"], result["outputs_differing"] = checked, mismatches
    if args.mode == "shim":
        from gpushare_ext.runtime import interpose, preemptible

        result["preemptible"] = preemptible.summary()
        result["long_kernels"] = preemptible.counts()
        result["said"] = list(getattr(preemptible.installed(), "said", []))
        result["interposer"] = interpose.stats()
    return result


def _cupy_linalg():
    """cupy.linalg: a linear solve and a QR of 4096^2 fp32 (cuSOLVER and cuBLAS kernels)."""
    import cupy

    rng = cupy.random.default_rng(0)
    a = rng.standard_normal((4096, 4096), dtype=cupy.float32) + 64 * cupy.eye(
        4096, dtype=cupy.float32
    )
    b = rng.standard_normal((4096, 64), dtype=cupy.float32)

    def step():
        cupy.linalg.solve(a, b)
        cupy.linalg.qr(a, mode="r")

    return step


def _cupy_fft():
    """cupy.fft: forward and inverse 2-D FFTs of 8192^2 complex64 (cuFFT kernels)."""
    import cupy

    x = cupy.random.default_rng(0).standard_normal((8192, 8192), dtype=cupy.float32)
    x = x.astype(cupy.complex64)
    return lambda: cupy.fft.ifft2(cupy.fft.fft2(x))


def _cupyx_solver():
    """cupyx.scipy: conjugate gradients on a 2-D Poisson matrix (many short kernels, syncs)."""
    import cupy
    import cupyx.scipy.sparse as sparse
    import cupyx.scipy.sparse.linalg as splinalg

    n = 1024
    ones = cupy.ones(n, dtype=cupy.float32)
    line = sparse.diags([-ones[:-1], 2 * ones, -ones[:-1]], [-1, 0, 1], format="csr")
    eye = sparse.identity(n, dtype=cupy.float32, format="csr")
    matrix = (sparse.kron(line, eye) + sparse.kron(eye, line)).tocsr()
    rhs = cupy.ones(n * n, dtype=cupy.float32)
    return lambda: splinalg.cg(matrix, rhs, maxiter=50)


def _elementwise_long():
    """A user ElementwiseKernel of about 0.4 s per launch (a per-element loop)."""
    import cupy

    kernel = cupy.ElementwiseKernel(
        "float32 x, int32 n",
        "float32 y",
        "float acc = x; for (int i = 0; i < n; ++i) acc = acc * 0.999f + 0.5f; y = acc;",
        "bench_elementwise_long",
    )
    x = cupy.arange(1 << 22, dtype=cupy.float32) / 7
    return lambda: kernel(x, cupy.int32(2_600_000))


def numba_relax():
    """A Numba @cuda.jit kernel with a per-element loop (``iterations`` FMAs each); its
    name, ``gps_numba_relax``, is what the preemptible benchmark looks it up by.  The
    one copy of this kernel: the tests compile its ``py_func`` to PTX without a GPU."""
    from benchmarks.environment import allow_numba_import

    allow_numba_import()
    from numba import cuda, float32

    @cuda.jit
    def gps_numba_relax(x, out, iterations):
        i = cuda.grid(1)
        if i < x.size:
            v = x[i]
            for _ in range(iterations):
                v = v * float32(0.999) + float32(0.5)
            out[i] = v

    return gps_numba_relax


def _numba_kernel():
    """A Numba @cuda.jit kernel of about 0.14 s per launch."""
    import numpy as np

    relax = numba_relax()  # first: it makes Numba importable beside a newer NumPy
    from numba import cuda

    x = cuda.to_device(np.arange(1 << 22, dtype=np.float32) / 7)
    out = cuda.device_array_like(x)
    return lambda: relax[(1 << 22) // 256, 256](x, out, 130_000)


def _torchvision_training():
    """A torchvision ResNet-18 training step (batch 64, 224^2, SGD)."""
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=100).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    images = torch.randn(64, 3, 224, 224, device="cuda")
    labels = torch.randint(0, 100, (64,), device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    return step


def _transformer_training():
    """A PyTorch transformer-encoder training step (6 layers, d_model 1024, 32 x 512
    tokens, fused AdamW): cuBLAS and fused attention kernels, nothing JIT-compiled."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=1024, nhead=16, dim_feedforward=4096, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, num_layers=6).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randn(32, 512, 1024, device="cuda")

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(tokens).square().mean().backward()
        optimizer.step()

    return step


def _long_gemms():
    """cuBLAS fp32 GEMMs of 8192^2 (about 20 ms each on an H200): few, long library
    kernels that the shim can only hold, never stop."""
    import cupy

    a = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
    b = cupy.random.standard_normal((8192, 8192), dtype=cupy.float32)
    return lambda: a @ b


def _short_gemms():
    """cuBLAS fp32 GEMMs of 4096^2 back to back (about 2.7 ms each on an H200): library
    kernels of a few milliseconds, held at launch, never stopped on the GPU."""
    import cupy

    a = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
    b = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)

    def step():
        for _ in range(8):
            a @ b

    return step


# Low-priority tenants made of code gpushare did not write (benchmarks/third_party.py).
THIRD_PARTY: dict[str, Callable[[], Callable[[], object]]] = {
    "cupy_linalg": _cupy_linalg,
    "cupy_fft": _cupy_fft,
    "cupyx_solver": _cupyx_solver,
    "elementwise_long": _elementwise_long,
    "numba": _numba_kernel,
    "torchvision": _torchvision_training,
    "transformer": _transformer_training,
    "long_gemm": _long_gemms,
    "short_gemm": _short_gemms,
    **LONG_NEIGHBOURS,
}


def _instrumented_step():
    """A persistent preemptible kernel (level 1 capable), launched again and again."""
    import cupy

    from gpushare_ext.kernels import kernel

    source = r"""
    extern "C" __global__ void burn(float* out, const float* in, int n, int rounds) {
        int i = blockIdx.x * blockDim.x + threadIdx.x;
        if (i >= n) return;
        float v = in[i];
        for (int r = 0; r < rounds; ++r) v = v * 0.999f + 0.001f * __sinf(v);
        out[i] = v;
    }
    """
    burn = kernel(source, "burn")
    n = 1 << 24
    data = cupy.random.random(n, dtype=cupy.float32)
    out = cupy.empty_like(data)
    blocks = (n + 255) // 256

    def step():
        burn((blocks,), (256,), (out, data, cupy.int32(n), cupy.int32(64)))

    return step


def _request_factory(kind: str):
    import cupy

    if kind == "matmul":
        a = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)

        def request():
            return a @ a
    elif kind == "inference":
        weights = [
            cupy.random.standard_normal((1024, 1024), dtype=cupy.float32) / 32 for _ in range(8)
        ]
        x = cupy.random.standard_normal((64, 1024), dtype=cupy.float32)

        def request():
            h = x
            for w in weights:
                h = cupy.maximum(h @ w, 0)
            e = cupy.exp(h - h.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)
    elif kind == "instrumented":
        from gpushare_ext.kernels import kernel

        scale = kernel(
            r"""extern "C" __global__ void scale(float* y, const float* x, float s, int n) {
                int i = blockIdx.x * blockDim.x + threadIdx.x;
                if (i < n) y[i] = s * x[i];
            }""",
            "scale",
        )
        n = 1 << 22
        x = cupy.random.random(n, dtype=cupy.float32)
        y = cupy.empty_like(x)

        def request():
            scale(((n + 255) // 256,), (256,), (y, x, cupy.float32(2.0), cupy.int32(n)))
    else:
        raise SystemExit(f"unknown request kind {kind}")
    return request


def run_high(args: argparse.Namespace) -> dict:
    import cupy

    kinds = args.requests.split(",")
    factories = {kind: _request_factory(kind) for kind in kinds}
    for request in factories.values():  # warm up: compile, cuBLAS handles
        request()
    cupy.cuda.runtime.deviceSynchronize()
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    grants: list[float] = []
    held: list[tuple[float, float]] = []
    for cell in range(args.cells):
        for kind in kinds:
            request = factories[kind]
            asked = time.perf_counter()
            with _lease(args.mode, "high"):
                granted = time.perf_counter()
                grants.append(granted - asked)
                began = time.time()
                for _ in range(args.requests_per_cell):
                    t0 = time.perf_counter()
                    request()
                    cupy.cuda.runtime.deviceSynchronize()
                    results[kind].append(time.perf_counter() - t0)
                    time.sleep(args.think_ms / 1e3)
                held.append((began, time.time()))
            time.sleep(args.gap_s)
        del cell
    return {
        "role": "high",
        "mode": args.mode,
        "latencies_s": results,
        "grant_s": grants,
        "held": held,
    }


NOTEBOOK_SETUP = """\
%load_ext gpushare_ext
import json, time
import cupy
a = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
b = cupy.random.standard_normal((4096, 4096), dtype=cupy.float32)
a @ b
cupy.cuda.runtime.deviceSynchronize()
"""

NOTEBOOK_CELL = """\
{magic}
_began, _latencies = time.time(), []
for _ in range({requests}):
    _t = time.perf_counter()
    a @ b
    cupy.cuda.runtime.deviceSynchronize()
    _latencies.append(time.perf_counter() - _t)
    time.sleep({think_s})
print("GPUSHARE-BENCH " + json.dumps([_began, time.time(), _latencies]))
"""


def run_high_notebook(args: argparse.Namespace) -> dict:
    """The high tenant as a real notebook: an ipykernel kernel running ``%%gpu
    priority=high`` cells of matmuls (``--requests matmul`` only)."""
    from jupyter_client.manager import start_new_kernel

    if args.requests != "matmul":
        raise SystemExit("the notebook high tenant runs matmul cells only")
    manager, client = start_new_kernel(kernel_name="python3", env=dict(os.environ))
    try:

        def run(code: str) -> str:
            reply = client.execute_interactive(code, timeout=600, output_hook=collect)
            if reply["content"]["status"] != "ok":
                raise SystemExit(f"notebook cell failed: {reply['content'].get('evalue')}")
            return "".join(printed)

        printed: list[str] = []

        def collect(message: dict) -> None:
            if message["msg_type"] == "stream":
                printed.append(message["content"]["text"])

        run(NOTEBOOK_SETUP)
        magic = "" if args.mode == "timeslice" else "%%gpu priority=high mem=16GiB device=0"
        latencies: list[float] = []
        grants: list[float] = []
        held: list[tuple[float, float]] = []
        for _ in range(args.cells):
            printed.clear()
            asked = time.time()
            cell = NOTEBOOK_CELL.format(
                magic=magic, requests=args.requests_per_cell, think_s=args.think_ms / 1e3
            )
            output = run(cell.lstrip("\n"))
            line = next(x for x in output.splitlines() if x.startswith("GPUSHARE-BENCH "))
            began, ended, cell_latencies = json.loads(line.split(" ", 1)[1])
            grants.append(began - asked)
            held.append((began, ended))
            latencies += cell_latencies
            time.sleep(args.gap_s)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    return {
        "role": "high",
        "mode": args.mode,
        "latencies_s": {"matmul": latencies},
        "grant_s": grants,
        "held": held,
        "notebook": True,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=["low", "high"], required=True)
    parser.add_argument("--kind", default="cupy", help="low tenant work: cupy, torch, instrumented")
    parser.add_argument("--mode", default="broker", help="timeslice (no broker) or a broker mode")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--requests", default="matmul,inference,instrumented")
    parser.add_argument("--cells", type=int, default=3)
    parser.add_argument("--requests-per-cell", type=int, default=40)
    parser.add_argument("--think-ms", type=float, default=10.0)
    parser.add_argument("--gap-s", type=float, default=0.3)
    parser.add_argument("--ready", help="file to create once the low tenant runs")
    parser.add_argument("--notebook", action="store_true", help="high tenant: a real ipykernel")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    # Stopped by its benchmark (SIGTERM), a high tenant still shuts down its notebook
    # kernel; the low tenant's own SIGTERM handler ends its loop and writes its record.
    exit_on_signals()
    if args.role == "low":
        result = run_low(args)
    else:
        result = run_high_notebook(args) if args.notebook else run_high(args)
    result["pid"] = os.getpid()
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
