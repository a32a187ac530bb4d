"""What a long kernel costs under gpushare when nobody waits, on a real GPU.

Each way runs in a fresh real ipykernel kernel, as a notebook user's would:

* ``plain``      -- no launch shim, no gpushare (the reference);
* ``unmarked``   -- started as the gpushare server extension starts kernels (the launch
                    shim in ``LD_PRELOAD``, ``CUPY_COMPILE_WITH_PTX=1``), ``%load_ext
                    gpushare_ext``, cells without ``%%gpu``;
* ``alone``      -- the same, cells under ``%%gpu priority=low``, no other session: long
                    kernels run preemptibly all the same (one launched as it is could
                    not be stopped for a session that comes later), so this is the
                    price of being ready to stop with nobody waiting;
* ``rival``      -- the same, while another notebook that ran a ``%%gpu priority=high``
                    cell stays connected (idle): it may ask at any moment.

Kernel kinds, each about 30-50 ms per launch on an H200: a CuPy ``ElementwiseKernel``
(a loop per element), a CuPy ``ReductionKernel`` (a loop per element, then a sum), a
CuPy ``RawKernel`` with ``atomicAdd`` into a histogram, and a Numba ``@cuda.jit`` loop.
Per kind and way: the median GPU time of a launch after the first (CUDA events around
each launch), the first launch's time (it runs as it is, with the framework's compile,
and the shim times it), and whether the results are bit-identical to ``plain``.  In
the ``alone`` and ``rival`` ways the second launch is the one the shim analyses and
transforms: each run's ``times_ms`` keeps it first, and the median over enough launches
leaves it out (the report shows what it added).

``python -m benchmarks.long_kernel_cost --out DIR [--repeats 3] [--launches 12]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.deadline_kernel import DeadlineKernel, kernel_environment
from benchmarks.stopping import exit_on_signals, track

WAYS = ("plain", "unmarked", "alone", "rival")
ROOT = Path(__file__).resolve().parents[1]

SETUP = r"""
import hashlib, json, time
import numpy, cupy
from numba import cuda
N, ITER = 1 << 22, {iterations}
LOOP = "float a = x; for (int k = 0; k < n; ++k) a = a * 0.999f + 0.25f;"
elementwise = cupy.ElementwiseKernel("float32 x, int32 n", "float32 y", LOOP + " y = a;",
                                     "gps_cost_elementwise")
reduction = cupy.ReductionKernel("float32 x, int32 n", "float32 y",
    "_loop(x, n)", "a + b", "y = a", "0", "gps_cost_reduction",
    preamble="__device__ float _loop(float x, int n) {{ float a = x; "
             "for (int k = 0; k < n; ++k) a = a * 0.999f + 0.25f; return a; }}")
histogram = cupy.RawKernel(r'''extern "C" __global__ void gps_cost_histogram(
    const float* x, unsigned* bins, int n, int it) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
    float v = x[i]; for (int k = 0; k < it; ++k) v = v * 0.999f + 0.25f;
    atomicAdd(&bins[((unsigned)(v * 64.0f)) & 255u], 1u); }}''', "gps_cost_histogram")

@cuda.jit
def numba_loop(x, y, n):
    i = cuda.grid(1)
    if i < x.size:
        a = x[i]
        for _ in range(n):
            a = a * numpy.float32(0.999) + numpy.float32(0.25)
        y[i] = a

x = cupy.arange(N, dtype=cupy.float32) / 7
y = cupy.empty_like(x)
bins = cupy.zeros(256, dtype=cupy.uint32)
x_numba = cuda.to_device(cupy.asnumpy(x))
y_numba = cuda.device_array_like(x_numba)

def launch(kind):
    if kind == "elementwise":
        elementwise(x, ITER, y); return y
    if kind == "reduction":
        return reduction(x, ITER)
    if kind == "histogram":
        bins.fill(0)
        histogram((N // 256,), (256,), (x, bins, numpy.int32(N), numpy.int32(ITER)))
        return bins
    numba_loop[N // 256, 256](x_numba, y_numba, ITER)
    return y_numba

def digest(value):
    host = value.copy_to_host() if hasattr(value, "copy_to_host") else cupy.asnumpy(value)
    return hashlib.sha256(numpy.ascontiguousarray(host).tobytes()).hexdigest()[:16]

def measure(kind, launches):
    # Numba launches on its own default stream, CuPy on its current one (inside a lease,
    # the session's): each is timed with its own framework's events.
    times = []
    for _ in range(launches):
        if kind == "numba":
            start, end = cuda.event(), cuda.event()
            start.record()
            out = launch(kind)
            end.record(); end.synchronize()
            times.append(cuda.event_elapsed_time(start, end))
            continue
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        out = launch(kind)
        end.record(); end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return times, digest(out)
print("ready")
"""

MEASURE = r"""{magic}
_result = {{}}
for _kind in ("elementwise", "reduction", "histogram", "numba"):
    _times, _digest = measure(_kind, {launches})
    _result[_kind] = {{"first_ms": _times[0], "times_ms": _times[1:], "digest": _digest}}
from gpushare_ext.runtime import interpose, preemptible
try:
    _stats = interpose.stats()
except Exception:
    _stats = {{}}
_result["shim"] = {{k: _stats.get(k, 0) for k in ("preemptible", "unrivalled")}}
_result["summary"] = preemptible.summary()
print("RESULT " + json.dumps(_result))
"""


def _env(way: str, socket: Path | None) -> dict[str, str]:
    return kernel_environment(shim=way != "plain", socket=socket, package_root=ROOT)


def run_way(way: str, socket: Path | None, args: argparse.Namespace) -> dict:
    kernel = DeadlineKernel(_env(way, socket))
    rival = None
    try:
        if way != "plain":
            status, text = kernel.run("%load_ext gpushare_ext", 120)
            if status != "ok":
                raise SystemExit(f"%load_ext failed in {way}: {text[-2000:]}")
        status, text = kernel.run(SETUP.format(iterations=args.iterations), 600)
        if status != "ok":
            raise SystemExit(f"setup failed in {way}: {text[-2000:]}")
        if way == "rival":
            rival = DeadlineKernel(_env(way, socket))
            status, text = rival.run("%load_ext gpushare_ext", 120)
            status, text = rival.run("%%gpu priority=high mem=4GiB\nimport cupy\nprint('ok')", 120)
            if status != "ok":
                raise SystemExit(f"the rival's cell failed: {text[-2000:]}")
        magic = "%%gpu priority=low mem=20GiB" if way in ("alone", "rival") else ""
        status, text = kernel.run(MEASURE.format(magic=magic, launches=args.launches), 600)
        line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
        if status != "ok" or line is None:
            return {"way": way, "error": text[-2000:]}
        return {"way": way, **json.loads(line.split(" ", 1)[1])}
    finally:
        kernel.close()
        if rival is not None:
            rival.close()


def table(runs: list[dict]) -> list[dict]:
    """Per kind and way: median launch time over all repeats, its ratio to plain, the
    first launch, and whether every repeat's result matched plain's."""
    kinds = ("elementwise", "reduction", "histogram", "numba")
    rows = []
    plain = [r for r in runs if r["way"] == "plain" and "error" not in r]
    for kind in kinds:
        reference = statistics.median(t for r in plain for t in r[kind]["times_ms"])
        digests = {r[kind]["digest"] for r in plain}
        for way in WAYS:
            mine = [r for r in runs if r["way"] == way and "error" not in r]
            if not mine:
                continue
            per_repeat = [statistics.median(r[kind]["times_ms"]) for r in mine]
            median = statistics.median(t for r in mine for t in r[kind]["times_ms"])
            rows.append({
                "kind": kind, "way": way, "median_ms": median,
                "vs_plain": median / reference,
                "repeat_medians_vs_plain": [m / reference for m in per_repeat],
                "first_ms": statistics.median(r[kind]["first_ms"] for r in mine),
                "identical": all(r[kind]["digest"] in digests for r in mine),
            })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--repeats", type=int, default=3, help="fresh kernels per way")
    parser.add_argument("--launches", type=int, default=12, help="per kind, after the first")
    parser.add_argument("--iterations", type=int, default=200_000, help="loop trips per element")
    args = parser.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    if bad := [w for w in ways if w not in WAYS]:
        parser.error(f"unknown way {bad[0]!r}; choose from {', '.join(WAYS)}")
    if "plain" not in ways:
        parser.error("the plain way is the reference: keep it in --ways")
    args.launches += 1  # the first launch is reported on its own
    args.out.mkdir(parents=True, exist_ok=True)
    exit_on_signals()
    from gpushare_ext.broker.edges.launch import BrokerProcess

    workdir = Path(tempfile.mkdtemp(prefix="gpushare-cost-", dir="/tmp"))
    broker = track(BrokerProcess(workdir, simulate=None).start())
    runs = []
    try:
        for repeat in range(args.repeats):  # the ways interleaved: drift hits all alike
            for way in ways:
                print(f"long_kernel_cost: repeat {repeat} {way}", file=sys.stderr, flush=True)
                started = time.perf_counter()
                run = run_way(way, broker.socket, args)
                run.update(repeat=repeat, seconds=time.perf_counter() - started)
                runs.append(run)
    finally:
        broker.stop()
    from benchmarks.environment import describe

    rows = table(runs)
    document = {**describe(), "benchmark": "long_kernel_cost", "runs": runs, "table": rows}
    (args.out / "long_kernel_cost.json").write_text(json.dumps(document, indent=2))
    print(f"{'kind':<12}{'way':<10}{'median ms':>10}{'x plain':>9}{'repeats':>22}"
          f"{'first ms':>10}{'same':>6}")  # fmt: skip
    for row in rows:
        spread = " ".join(f"{r:.3f}" for r in row["repeat_medians_vs_plain"])
        print(f"{row['kind']:<12}{row['way']:<10}{row['median_ms']:10.2f}{row['vs_plain']:9.3f}"
              f"{spread:>22}{row['first_ms']:10.1f}{'yes' if row['identical'] else 'NO':>6}")  # fmt: skip
    for run in runs:
        if "error" in run:
            print(f"{run['way']} repeat {run['repeat']}: {run['error'][-300:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
