"""Where a long kernel's preemptible cost goes, on a real GPU: one variant at a time.

A long kernel that runs ready to stop (a rival may ask) pays for three things the
transform adds: the persistent grid that claims logical blocks (``yield``), the yield
flag read at loop back-edges with tight loops unrolled so that the read is rare
(``abort``), and the live registers a stopping thread saves (``abort+save``, what the
launch shim uses).  This times each, and the back-edge check at other read intervals and
unroll depths (``back_edges.CHECK_INSTRUCTIONS``, ``UNROLL``), on two kernels of about 30 ms: a grid-stride loop per element (as a CuPy
``ElementwiseKernel`` runs) and the same loop feeding ``atomicAdd`` into a histogram.
Nobody raises the flag: this is the price of being ready.

Each figure is the median wall time of a synchronous launch through the real launcher
(``launch_kernel``) over the original's, both measured in the same process.

``python -m benchmarks.check_cost [--out DIR] [--repeats 7]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

SOURCE = r"""
extern "C" __global__ void gps_cc_loop(const float* x, float* y, long long n, int it) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)blockDim.x * gridDim.x) {
        float a = x[i];
        for (int k = 0; k < it; ++k) a = a * 0.999f + 0.25f;
        y[i] = a;
    }
}
extern "C" __global__ void gps_cc_histogram(const float* x, unsigned* bins, int n, int it) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int k = 0; k < it; ++k) v = v * 0.999f + 0.25f;
    atomicAdd(&bins[((unsigned)(v * 64.0f)) & 255u], 1u);
}
"""

# (name, abort checks, save state, unroll copies, a flag read once per this many
# instructions of a loop)
VARIANTS = (
    ("yield", False, True, 32, 1024),
    ("abort", True, False, 32, 1024),
    ("abort+save", True, True, 32, 1024),
    ("abort+save read /256 instr", True, True, 32, 256),
    ("abort+save read /4096 instr", True, True, 32, 4096),
    ("abort+save unroll 16", True, True, 16, 1024),
    ("abort+save unroll 8", True, True, 8, 1024),
    ("abort+save unroll 64", True, True, 64, 1024),
    ("abort+save unroll 1", True, True, 1, 1024),
)


def _median_ms(launch: Callable[[], object], repeats: int) -> float:
    import cupy

    launch()  # warm-up: module load, first-launch chunk measurement
    cupy.cuda.runtime.deviceSynchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        launch()
        cupy.cuda.runtime.deviceSynchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _fresh_kernel(name: str, unroll: int, check_instructions: int, save: bool):
    """The kernel compiled again, its abort-mode variant built with these settings."""
    from gpushare_ext.kernels import back_edges, kernel
    from gpushare_ext.kernels.rewrite import TransformOptions
    from gpushare_ext.kernels.transform import make_preemptible

    back_edges.UNROLL, back_edges.CHECK_INSTRUCTIONS = unroll, check_instructions
    k = kernel(SOURCE, name)
    if not save:  # the launcher asks for the saving variant: hand it the other one
        built = make_preemptible(
            k.module, k.entry.name, TransformOptions(abort_checks=True, save_state=False),
            report=k.report,
        )  # fmt: skip
        k._variants[TransformOptions(abort_checks=True)] = built
    return k


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for check_cost.json")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    import cupy
    import numpy

    from gpushare_ext.kernels import back_edges
    from gpushare_ext.kernels.launch import launch_kernel

    defaults = back_edges.UNROLL, back_edges.CHECK_INSTRUCTIONS
    n, iterations = 1 << 22, 200_000
    x = cupy.arange(n, dtype=cupy.float32) / 7
    y = cupy.empty_like(x)
    bins = cupy.zeros(256, dtype=cupy.uint32)
    full = (n // 256, 1, 1), (256, 1, 1)
    one_block = (1, 1, 1), (512, 1, 1)  # one SM, 16 warps: nothing hides a check's cost
    # label -> (kernel, grid, block, arguments)
    calls = {
        "gps_cc_loop": ("gps_cc_loop", *full, (x, y, numpy.int64(n), numpy.int32(iterations))),
        "gps_cc_histogram": (
            "gps_cc_histogram",
            *full,
            (x, bins, numpy.int32(n), numpy.int32(iterations // 2)),
        ),
        "gps_cc_loop one block": (
            "gps_cc_loop",
            *one_block,
            (x, y, numpy.int64(512 * 64), numpy.int32(iterations)),
        ),
    }
    rows = []
    for label_of_call, (name, grid, block, call) in calls.items():
        original = _fresh_kernel(name, *defaults, save=True)
        plain_ms = _median_ms(
            lambda k=original, a=call, g=grid, b=block: launch_kernel(
                k, g, b, a, preemptible=False
            ),
            args.repeats,
        )
        reference = (y.copy(), bins.copy())
        for label, aborts, save, unroll, check_instructions in VARIANTS:
            k = _fresh_kernel(name, unroll, check_instructions, save)
            bins.fill(0)
            ms = _median_ms(
                lambda k=k, a=call, c=aborts, g=grid, b=block: launch_kernel(
                    k, g, b, a, abort_checks=c
                ),
                args.repeats,
            )
            same = bool((y == reference[0]).all()) if name == "gps_cc_loop" else None
            rows.append(
                {"kernel": label_of_call, "variant": label, "plain_ms": plain_ms, "ms": ms,
                 "x_plain": ms / plain_ms, "same_as_plain": same}
            )  # fmt: skip
            print(
                f"{label_of_call:<24}{label:<28}{plain_ms:9.2f}{ms:9.2f}{ms / plain_ms:8.3f}",
                flush=True,
            )
    back_edges.UNROLL, back_edges.CHECK_INSTRUCTIONS = defaults
    if args.out:
        from benchmarks.environment import describe

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        document = {"benchmark": "check_cost", **describe(), "rows": rows,
                    "command": "python -m benchmarks.check_cost " + " ".join(argv or sys.argv[1:])}  # fmt: skip
        (out / "check_cost.json").write_text(json.dumps(document, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
