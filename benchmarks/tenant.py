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
from pathlib import Path


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
    with _lease(args.mode, "low", instrumented=full_ladder):
        if args.kind == "cupy":
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
        step()
        cupy.cuda.runtime.deviceSynchronize()
        if ready:
            ready.write_text("ready")
        deadline = time.monotonic() + args.duration
        while not stop["now"] and time.monotonic() < deadline:
            step()
            cupy.cuda.runtime.deviceSynchronize()
            finished.append(time.time())
    return {"role": "low", "kind": args.kind, "mode": args.mode, "finished": finished}


def _instrumented_step():
    """A persistent preemptible kernel (level 1 capable), launched again and again."""
    import cupy

    from gpushare_ext.runtime.kernels import kernel

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
        from gpushare_ext.runtime.kernels import kernel

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
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run_low(args) if args.role == "low" else run_high(args)
    result["pid"] = os.getpid()
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
