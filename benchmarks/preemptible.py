"""Long CuPy kernels made preemptible at load time, on a real GPU (run with the shim).

Started with the launch shim in ``LD_PRELOAD`` and ``CUPY_COMPILE_WITH_PTX=1`` (as the
server extension starts kernels).  For each kernel -- a user ``ElementwiseKernel`` of
tens of milliseconds per launch (idempotent), the same in place (not idempotent:
snapshot), a ``ReductionKernel`` summing a loop per element (one CuPy block), a
``RawKernel`` with ``atomicAdd`` into a histogram (not idempotent), a ``RawKernel``
called on its own output (idempotent statically, in place at launch) and a Numba
``@cuda.jit`` kernel -- the first launch runs unmodified (the shim times it) and is the
reference; later launches run preemptibly while a thread raises the session's yield
flag for 2 ms every 10 ms, as the
broker does for a pause.  One more runs the first kernel over a single resident wave,
so that each logical block lasts the whole launch.  Reported per kernel: bit-identical
to the reference, launches run preemptibly, yields, aborts undone and stops that saved
their state, how long after the flag rose the kernel had left the GPU (the stop
latency a pause waits for, against the kernel's own length), and the work kept: the
kernel time the launches needed over the GPU time the flag left free.

The stop latency is measured twice.  Host-side (``stop_ms``): from the raise to the
moment the launcher, polling its stream, saw the slice end -- that includes the host's
polling.  On the GPU's own clock (``gpu_stop_us``): from the host's raise (its wall
clock, put on the GPU's ``%globaltimer`` by a calibration kernel) to the last block's
exit, which the transformed kernel stamps; and the drain alone (``drain_us``), from the
first block that saw the flag to the last exit, both GPU stamps.  The flag is written
as the broker writes it (``cuStreamWriteValue32`` on a side stream), by default from
another process through the flag's IPC handle (``benchmarks/flag_raiser.py``), as the
broker's actuator writes it; each stop is also split into the raise's host side (the
write queued, then known to be written), the GPU's first sight of the flag and the
drain, with the GPU clock's offset measured before and after each kernel's run.

``python -m benchmarks.preemptible [--out DIR]`` prints one JSON line (the GPU test reads
it) and writes ``preemptible.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _kernels(cupy):
    n_iter = 200_000  # ~30 ms per launch on an H200: every launch meets a raised flag
    loop = "for (int i = 0; i < n; ++i) acc = acc * 0.999f + 0.5f;"
    long_ew = cupy.ElementwiseKernel(
        "float32 x, int32 n", "float32 y", f"float acc = x; {loop} y = acc;", "gps_long_ew"
    )
    inplace_ew = cupy.ElementwiseKernel(
        "int32 n", "float32 y", f"float acc = y; {loop} y = acc;", "gps_inplace_ew"
    )
    histogram = cupy.RawKernel(
        r"""extern "C" __global__ void gps_histogram(const float* x, unsigned* bins, int n, int it) {
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
            float v = x[i];
            for (int k = 0; k < it; ++k) v = v * 0.999f + 0.25f;
            atomicAdd(&bins[((unsigned)(v * 64.0f)) & 255u], 1u);
        }}""",
        "gps_histogram",
    )
    smooth = cupy.RawKernel(
        r"""extern "C" __global__ void gps_smooth(const float* a, float* b, int n, int it) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i >= n) return;
        float v = a[i]; for (int k = 0; k < it; ++k) v = v * 0.999f + 0.25f; b[i] = v; }""",
        "gps_smooth",
    )
    # A full reduction runs as one CuPy block: its loop is stopped by back-edge checks.
    long_reduce = cupy.ReductionKernel(
        "float32 x, int32 n", "float32 y", "_gps_loop(x, n)", "a + b", "y = a", "0",
        "gps_long_reduce",
        preamble="__device__ float _gps_loop(float x, int n) { float acc = x; "
        + loop + " return acc; }",
    )  # fmt: skip
    n = 1 << 22
    base = cupy.arange(n, dtype=cupy.float32) / 7

    def run_long_reduce():
        return long_reduce(base, cupy.int32(n_iter // 100))

    def run_long_ew():
        return long_ew(base, cupy.int32(n_iter))

    # One resident wave (2^18 threads): each logical block lasts the whole launch, far
    # longer than the gaps between preemptions; only a stop that keeps its work finishes.
    one_wave = cupy.ElementwiseKernel(
        "float32 x, int32 n", "float32 y", f"float acc = x; {loop} y = acc;", "gps_one_wave"
    )
    wave = base[: 1 << 18]

    def run_one_wave():
        return one_wave(wave, cupy.int32(n_iter * 8))

    def run_inplace_ew():
        y = base.copy()
        inplace_ew(cupy.int32(n_iter), y)
        return y

    def run_histogram():
        bins = cupy.zeros(256, dtype=cupy.uint32)
        histogram((1024,), (256,), (base, bins, cupy.int32(n), cupy.int32(n_iter // 2)))
        return bins

    def run_smooth_in_place():
        y = base.copy()
        smooth((n // 256,), (256,), (y, y, cupy.int32(n), cupy.int32(n_iter)))
        return y

    from benchmarks.tenant import numba_relax

    gps_numba_relax = numba_relax()

    def run_numba():
        out = cupy.empty_like(base)
        gps_numba_relax[n // 256, 256](base, out, n_iter)
        return out

    return {
        "gps_numba_relax": run_numba,
        "gps_long_ew": run_long_ew,
        "gps_long_reduce": run_long_reduce,
        "gps_one_wave": run_one_wave,
        "gps_inplace_ew": run_inplace_ew,
        "gps_histogram": run_histogram,
        "gps_smooth": run_smooth_in_place,
    }


class Preempter:
    """Raise the session's yield flag for ``on_ms`` every ``period_ms`` (a broker stand-in
    that writes the same device word the broker writes through its CUDA IPC handle),
    from a thread of this process (``--raise-in-process``)."""

    def __init__(self, flag, on_ms: float = 2.0, period_ms: float = 10.0) -> None:
        self.flag, self.on_ms, self.period_ms = flag, on_ms, period_ms
        self.raised: list[float] = []
        self.raised_ns: list[int] = []  # the same moments on the host's wall clock
        # Per raise, on the wall clock: the write queued (the call returned) and known to
        # be in device memory (its stream synchronised): what the host's side costs.
        self.queued_ns: list[int] = []
        self.written_ns: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(self.period_ms / 1e3)
            self.raised.append(time.perf_counter())
            self.raised_ns.append(time.time_ns())
            self.flag.set(1, wait=False)
            self.queued_ns.append(time.time_ns())
            self.flag.wait_written()
            self.written_ns.append(time.time_ns())
            time.sleep(self.on_ms / 1e3)
            self.flag.set(0)

    def __enter__(self) -> Preempter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.flag.set(0)


class RemotePreempter:
    """The same from another process through the flag's IPC handle, as the broker's
    actuator writes it (``benchmarks/flag_raiser.py``): the raise's own host time is
    then that process's, never waiting for this one's Python thread."""

    def __init__(self, flag, on_ms: float = 2.0, period_ms: float = 10.0) -> None:
        self.flag, self.on_ms, self.period_ms = flag, on_ms, period_ms
        self.raised: list[float] = []
        self.raised_ns: list[int] = []
        self.queued_ns: list[int] = []
        self.written_ns: list[int] = []
        self._child: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the raiser and wait until it has opened the flag (its context's creation
        is not part of any stop)."""
        command = [sys.executable, "-m", "benchmarks.flag_raiser", self.flag.ipc_handle().hex(),
                   str(self.on_ms), str(self.period_ms)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # not a notebook
        self._child = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parents[1], env=env,
        )  # fmt: skip
        assert self._child.stdout is not None
        line = self._child.stdout.readline().strip()
        if line != "ready":
            self._child.kill()
            raise SystemExit(f"the flag raiser did not start: {line or 'no word'}")

    def __enter__(self) -> RemotePreempter:
        if self._child is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        child, self._child = self._child, None
        assert child is not None and child.stdin is not None
        out, _ = child.communicate("stop\n", timeout=30)
        times = json.loads(out.strip().splitlines()[-1])
        self.raised, self.raised_ns = times["raised"], times["raised_ns"]
        self.queued_ns, self.written_ns = times["queued_ns"], times["written_ns"]
        self.flag.set(0)


def _gpu_clock_offset(cupy) -> tuple[int, int]:
    """(``%globaltimer`` minus the host's wall clock, its uncertainty), both ns: the
    tightest of 200 reads of the GPU timer between two host reads."""
    read = cupy.RawKernel(
        r"""extern "C" __global__ void gps_read_globaltimer(unsigned long long* out) {
        unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); *out = t; }""",
        "gps_read_globaltimer",
    )
    out = cupy.zeros(1, dtype=cupy.uint64)
    best: tuple[int, int] | None = None
    for _ in range(200):
        before = time.time_ns()
        read((1,), (1,), (out,))
        cupy.cuda.runtime.deviceSynchronize()
        after = time.time_ns()
        gpu = int(out.get()[0])
        half = (after - before) // 2
        if best is None or half < best[1]:
            best = (gpu - (before + half), half)
    assert best is not None
    return best


class ClockOffset:
    """``%globaltimer`` minus the host's wall clock, measured before and after a kernel's
    run and taken in between as a straight line: the two clocks drift apart by some
    microseconds a second, as much as a stop takes."""

    def __init__(self, before: tuple[int, int, int], after: tuple[int, int, int]) -> None:
        (self.t0, self.o0, e0), (self.t1, self.o1, e1) = before, after
        self.error_ns = max(e0, e1)

    def at(self, host_ns: int) -> int:
        if self.t1 == self.t0:
            return self.o0
        return self.o0 + (self.o1 - self.o0) * (host_ns - self.t0) // (self.t1 - self.t0)

    @property
    def drift_us_per_s(self) -> float:
        seconds = (self.t1 - self.t0) / 1e9
        return (self.o1 - self.o0) / 1e3 / seconds if seconds > 0 else 0.0


def _stamped_offset(cupy) -> tuple[int, int, int]:
    offset, error = _gpu_clock_offset(cupy)
    return time.time_ns(), offset, error


def _gpu_stops(reports: list, preempter: Preempter, offset: ClockOffset) -> dict[str, list[float]]:
    """Per stop, in µs: the raise (host clock) to the last block's exit (``free``), to
    the first sight of the flag on the GPU (``sight``), the drain, and the host's side of
    the raise (``queued``, ``written``); and apart, slices that began after the flag rose
    (from their start to their exit): the GPU held none of that kernel's work then."""
    out: dict[str, list[float]] = {
        k: [] for k in ("free", "sight", "drains", "queued", "written", "began_flagged")
    }
    raises = list(zip(preempter.raised_ns, preempter.queued_ns, preempter.written_ns, strict=False))
    for report in reports:
        for start, first, last in report.stops_ns:
            shift = offset.at(first - offset.o0)
            seen = first - shift  # on the host's clock
            out["drains"].append((last - first) / 1e3)
            raised = max((r for r in raises if r[0] <= seen), default=None)
            if raised is None:
                continue
            if start - shift > raised[0]:
                out["began_flagged"].append((last - start) / 1e3)
                continue
            out["free"].append((last - shift - raised[0]) / 1e3)
            out["sight"].append((seen - raised[0]) / 1e3)
            out["queued"].append((raised[1] - raised[0]) / 1e3)
            out["written"].append((raised[2] - raised[0]) / 1e3)
    return out


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _running_lease_block():
    """A control block in a private folder that says "a lease is held, running"."""
    import tempfile

    from gpushare_ext.control_block import ControlBlock
    from gpushare_ext.lease_state import LeaseState

    block = ControlBlock.create(Path(tempfile.mkdtemp(prefix="gpushare-bench-")) / "lease.cb")
    block.publish(gate_closed=False, state=LeaseState.RUNNING)
    return block


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for preemptible.json")
    parser.add_argument("--launches", type=int, default=4, help="preempted launches per kernel")
    parser.add_argument("--only", help="one kernel by name (e.g. gps_numba_relax)")
    parser.add_argument(
        "--raise-in-process",
        action="store_true",
        help="raise the flag from a thread of this process (default: from another "
        "process through the flag's IPC handle, as the broker's actuator does)",
    )
    parser.add_argument(
        "--check-instructions",
        type=int,
        help="threads read the flag about once per this many instructions of a loop "
        "(default: the transform's own, back_edges.CHECK_INSTRUCTIONS)",
    )
    parser.add_argument(
        "--on-ms", type=float, default=2.0, help="how long each raise lasts (default 2 ms)"
    )
    parser.add_argument(
        "--period-ms", type=float, default=10.0,
        help="one raise this often (default 10 ms); 1 ms with --on-ms 0.3 and a few hundred "
        "--launches of one kernel (--only) gives over 10,000 stops for the tail",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.on_ms < args.period_ms:
        parser.error("--on-ms must be above 0 and below --period-ms")
    return args


def _unpreempted_launches(run: Callable[[], Any], cupy: Any) -> tuple[Any, float, float]:
    """The first three launches, nobody raising the flag: the first's result (the
    reference) and time with CuPy's compile, and the third's, the transformed kernel's."""
    t0 = time.perf_counter()
    reference = run().get()  # the first launch: unmodified, timed by the shim
    cupy.cuda.runtime.deviceSynchronize()
    alone_s = time.perf_counter() - t0
    run().get()  # the second: analysed and transformed (the shim sent it here)
    t0 = time.perf_counter()
    run().get()  # the third: the transformed kernel, never preempted
    transformed_s = time.perf_counter() - t0
    return reference, alone_s, transformed_s


def _preempted_launches(
    name: str, run: Callable[[], Any], reference: Any, registry: Any, preempter: Any, launches: int
) -> tuple[bool, list, float, float]:
    """``launches`` launches while ``preempter`` raises the flag: whether every result
    matched ``reference``, the launches' reports, when they began and how long they took."""
    identical = True
    t0 = time.perf_counter()
    reports = []
    with preempter:
        for _ in range(launches):
            identical &= bool((run().get() == reference).all())
            reports += [
                t.kernel.last_launch
                for t in registry.twins.values()
                if name in t.name and t.kernel is not None and t.kernel.last_launch
                and all(t.kernel.last_launch is not r for r in reports)
            ]  # fmt: skip
        # Here, not after the raiser has stopped: its exit is no launch's time.
        preempted_s = time.perf_counter() - t0
    return identical, reports, t0, preempted_s


def _host_stop_latencies(stops: list[float], raised: list[float]) -> list[float]:
    """Each stop the launcher saw, from the latest raise before it (seconds)."""
    latencies = []
    for stopped in stops:
        latest = max((r for r in raised if r <= stopped), default=None)
        if latest is not None:
            latencies.append(stopped - latest)
    return latencies


def _measure_kernel(
    name: str,
    run: Callable[[], Any],
    registry: Any,
    flag: Any,
    stops: list[float],
    args: argparse.Namespace,
    cupy: Any,
) -> tuple[dict, int]:
    """One kernel's row, and how well the GPU clock's offset was known (ns)."""
    from gpushare_ext.runtime import interpose

    print(f"preemptible: {name} ...", file=sys.stderr, flush=True)
    reference, alone_s, transformed_s = _unpreempted_launches(run, cupy)
    before = (registry.launched, registry.yields, registry.aborts, registry.fallbacks,
              registry.saves)  # fmt: skip
    stops.clear()
    kind = Preempter if args.raise_in_process else RemotePreempter
    preempter = kind(flag, on_ms=args.on_ms, period_ms=args.period_ms)
    if isinstance(preempter, RemotePreempter):
        preempter.start()  # its CUDA context is made before the clock starts
    before_offset = _stamped_offset(cupy)
    identical, reports, t0, preempted_s = _preempted_launches(
        name, run, reference, registry, preempter, args.launches
    )
    offset = ClockOffset(before_offset, _stamped_offset(cupy))
    found = _gpu_stops(reports, preempter, offset)
    gpu_stops, drains, began_flagged = found["free"], found["drains"], found["began_flagged"]
    latencies = _host_stop_latencies(stops, preempter.raised)
    longest_us = max(
        (interpose.function_state(f)[1] for f, t in registry.twins.items() if name in t.name),
        default=0.0,
    )
    # The GPU time the flag left free, against the kernel time the launches needed.
    raised_meanwhile = sum(1 for r in preempter.raised if r < t0 + preempted_s)
    free_s = preempted_s - raised_meanwhile * preempter.on_ms / 1e3
    kept = args.launches * longest_us / 1e6 / free_s if free_s > 0 else None
    row = {
        "kernel": name,
        "kernel_ms": longest_us / 1e3,  # its first launch, timed by the shim
        "first_call_ms": alone_s * 1e3,  # the same with CuPy's compile
        "transformed_ms": transformed_s * 1e3,  # a launch of the transformed kernel
        "bit_identical": identical,
        "preemptible_launches": registry.launched - before[0],
        "yields": registry.yields - before[1],
        "aborts": registry.aborts - before[2],
        "saves": registry.saves - before[4],
        "fallbacks": registry.fallbacks - before[3],
        "work_kept": kept,
        "stop_ms_p50": statistics.median(latencies) * 1e3 if latencies else None,
        "stop_ms_max": max(latencies) * 1e3 if latencies else None,
        "gpu_stops": len(gpu_stops),
        "gpu_stop_us_p50": _percentile(gpu_stops, 50),
        "gpu_stop_us_p99": _percentile(gpu_stops, 99),
        "gpu_stop_us_p999": _percentile(gpu_stops, 99.9),
        "gpu_stop_us_max": max(gpu_stops, default=None),
        # Every stop, so that runs can be pooled (a run's p99 of a dozen stops
        # is its largest).
        "gpu_stops_us": [round(x, 1) for x in gpu_stops],
        "drain_us_p50": _percentile(drains, 50),
        "drain_us_p99": _percentile(drains, 99),
        # The raise's parts: the first sight of the flag on the GPU, and the
        # host's own side (the write queued; then known to be in memory).
        "sight_us_p50": _percentile(found["sight"], 50),
        "sight_us_p99": _percentile(found["sight"], 99),
        "queued_us_p50": _percentile(found["queued"], 50),
        "written_us_p50": _percentile(found["written"], 50),
        "written_us_p99": _percentile(found["written"], 99),
        "clock_drift_us_per_s": offset.drift_us_per_s,
        "began_flagged": len(began_flagged),
        "began_flagged_us_max": max(began_flagged, default=None),
    }
    return row, offset.error_ns


def _print_table(rows: list[dict], offset_error_ns: int) -> None:
    print(
        f"{'kernel':<16}{'ms':>8}{'tr. ms':>8}{'same':>6}{'runs':>6}{'yield':>7}{'abort':>7}{'saved':>7}"
        f"{'stop ms':>9}{'kept':>7}{'gpu stop us p50/p99/max':>25}{'drain us p99':>13}"
        f"{'sight us p50/p99':>18}{'written us p50/p99':>20}{'queued':>8}{'drift us/s':>11}",
        file=sys.stderr,
    )

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    for row in rows:
        stop, kept = row["stop_ms_p50"], row["work_kept"]
        gpu = "/".join(
            us(row[k]) for k in ("gpu_stop_us_p50", "gpu_stop_us_p99", "gpu_stop_us_max")
        )
        print(
            f"{row['kernel']:<16}{row['kernel_ms']:8.1f}{row['transformed_ms']:8.1f}"
            f"{'yes' if row['bit_identical'] else 'NO':>6}"
            f"{row['preemptible_launches']:6d}{row['yields']:7d}{row['aborts']:7d}{row['saves']:7d}"
            f"{'-' if stop is None else f'{stop:9.2f}':>9}"
            f"{'-' if kept is None else f'{kept:7.0%}':>7}{gpu:>25}{us(row['drain_us_p99']):>13}"
            f"{us(row['sight_us_p50']) + '/' + us(row['sight_us_p99']):>18}"
            f"{us(row['written_us_p50']) + '/' + us(row['written_us_p99']):>20}"
            f"{us(row['queued_us_p50']):>8}{row['clock_drift_us_per_s']:11.1f}",
            file=sys.stderr,
        )
    print(f"GPU clock offset known to +-{offset_error_ns / 1e3:.1f} us", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    import faulthandler

    # A hang shows where, then ends the run; long runs (many launches) get longer.
    faulthandler.dump_traceback_later(max(240, 60 + 2 * args.launches), exit=True)

    from gpushare_ext.kernels import back_edges, launch, yield_flags
    from gpushare_ext.runtime import interpose, preemptible

    if args.check_instructions:  # before any kernel is transformed
        back_edges.CHECK_INSTRUCTIONS = args.check_instructions
    registry = preemptible.install()
    if registry is None:
        raise SystemExit("start this with the launch shim in LD_PRELOAD (see the docstring)")
    import cupy

    flag = yield_flags.YieldFlag()
    yield_flags.set_session_yield_flag(flag)
    stops: list[float] = []  # flag raised -> the kernel left the GPU, seconds

    def timed_wait(f, interrupted) -> None:
        # The Preempter below owns the flag (it stands in for the broker): it lowers it.
        stops.append(time.perf_counter())
        yield_flags.poll_until_resumed(f, interrupted)

    launch.set_session_hooks(launch.LaunchHooks(wait_for_resume=timed_wait))
    # Long kernels run preemptibly only inside a lease: a control block that says one is
    # held and running stands in for the broker's.
    lease = _running_lease_block()
    interpose.point_at(lease.address())
    offset_error_ns = 0
    rows = []
    for name, run in _kernels(cupy).items():
        if args.only and name != args.only:
            continue
        row, error_ns = _measure_kernel(name, run, registry, flag, stops, args, cupy)
        rows.append(row)
        offset_error_ns = max(offset_error_ns, error_ns)
    document = {
        "benchmark": "preemptible",
        "check_instructions": back_edges.CHECK_INSTRUCTIONS,
        "raised_from": "this process" if args.raise_in_process else "another process",
        # Measured before and after each kernel's run, interpolated in between.
        "gpu_clock_offset_error_ns": offset_error_ns,  # every gpu_stop_us is +- this
        "rows": rows,
        "said": registry.said,
        "stats": interpose.stats(),
        "twins": {
            t.name: t.reason or ("preemptible" if t.analysed else "never long: not analysed")
            for t in registry.twins.values()
        },
    }
    if args.out:
        from benchmarks.environment import describe

        Path(args.out).mkdir(parents=True, exist_ok=True)
        text = json.dumps({**describe(), **document}, indent=2)
        (Path(args.out) / "preemptible.json").write_text(text)
    _print_table(rows, offset_error_ns)
    print(json.dumps(document))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUPY_COMPILE_WITH_PTX", "1")
    sys.exit(main())
