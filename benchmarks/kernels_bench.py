"""Benchmark preemptible kernels on a GPU: overhead, fence cost, drain latency, snapshots.

What it measures (all in one run, JSON into --out):

* per corpus kernel: device time of the original vs the persistent preemptible kernel
  (and the fenced one), median and worst ratio, at the corpus's tiny sizes (10-25 us:
  ``overhead``) and at realistic sizes (each problem doubled until the original runs
  >= ~1 ms: ``overhead_realistic``);
* host wall time of a whole transactional launch vs the same path with ``mode="off"``
  (``launch_path``: the fixed per-launch cost of the launcher itself);
* yield-to-drain latency on the device clock (%globaltimer: first block that sees the
  flag -> last block that leaves, from the progress record) for logical blocks of about
  1 us .. 1 ms, the flag written in-process with cuStreamWriteValue32;
* end to end from another process: a subprocess writes the flag through the CUDA IPC
  handle; measured from the request to the host seeing the kernel finished;
* snapshot/rollback bandwidth of the launcher vs a plain device-to-device copy ceiling.

Usage: python benchmarks/kernels_bench.py --out benchmarks/results/kernels [--quick]
Needs a GPU, CuPy and cuda-bindings. Meant to take about 90 s on an H200 (--quick: ~30 s).
It must not change device settings (clocks, MIG, modes).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import platform
import struct
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "kernels"))

from benchmarks.stopping import exit_on_signals, track  # noqa: E402 - ROOT on the path first

SPIN_SRC = r"""
// A logical block that lasts between 0.5 and 1.5 x `ns` (so persistent blocks drift out of
// phase, as real blocks do), measured on %globaltimer.
extern "C" __global__ void spin_block(float* out, long long ns) {
    long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    unsigned h = (blockIdx.x * 2654435761u) >> 20;  // 0..4095
    long long len = ns / 2 + (ns * (long long)h) / 4096;
    long long t = t0;
    while (t - t0 < len) { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); }
    if (threadIdx.x == 0) out[blockIdx.x] = (float)(t - t0);
}
// One thread stamps the device clock: enqueued right behind the flag write.
extern "C" __global__ void stamp(unsigned long long* at) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    *at = t;
}
"""

CHILD = r"""
import sys
from gpushare_ext.kernels.yield_flags import write_yield_flag_from_handle as w
h = bytes.fromhex(sys.argv[1])
w(h, 0, 0)  # open the handle once, before timing
print("ready", flush=True)
for line in sys.stdin:
    w(h, int(line), 0)
    print("ok", flush=True)
"""


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def summary(xs: list[float]) -> dict:
    return {
        "n": len(xs), "p50": pct(xs, 50), "p99": pct(xs, 99), "p99_9": pct(xs, 99.9),
        "max": max(xs) if xs else float("nan"),
    }  # fmt: skip


class Timer:
    """Device time of work enqueued on the null stream, with CUDA events."""

    def __init__(self, cp):
        self.cp = cp

    def __call__(self, fn, reps: int, prepare=None) -> list[float]:
        cp = self.cp
        out = []
        if prepare:
            prepare()
        fn()  # warm-up (module load, caches)
        cp.cuda.Device().synchronize()
        for _ in range(reps):
            if prepare:
                prepare()  # not timed
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(cp.cuda.get_elapsed_time(a, b) * 1e3)  # us
        return out


def raw_launcher(k, case, fence: bool, sized=None, chunk=None):
    """Callables that launch the original and the transformed kernel once, whole grid, no
    Python loop, plus the (untimed) record reset. ``sized``: (grid, block, shared, args)
    instead of the case's own small problem. ``chunk``: logical blocks per claim (an int,
    or a one-element list the caller may change between launches); default: the
    launcher's choice for a first launch (``choose_chunk`` without a measurement)."""
    import cupy as cp

    from gpushare_ext.kernels import arguments, driver, progress, yield_flags
    from gpushare_ext.kernels.rewrite import PROGRESS_RECORD_BYTES

    if sized is None:
        args = case.make_args(cp, np.random.default_rng(0))
        g, b, shared = case.grid, case.block, case.shared
    else:
        g, b, shared, args = sized
    bound = arguments.bind_arguments(k, args)
    variant = k.preemptible(fence=fence)
    fn = driver.modules.function(variant.ptx, k.entry.name)
    orig = driver.modules.function(k.ptx, k.entry.name)
    total = g[0] * g[1] * g[2]
    sms = driver.DeviceFacts.sm_count()
    per_sm = driver.modules.blocks_per_sm(fn, b[0] * b[1] * b[2], shared)
    persistent = max(1, min(total, sms * int(per_sm)))
    if chunk is None:
        chunk = progress.choose_chunk(total, persistent, None)
    chunk_box = chunk if isinstance(chunk, list) else [int(chunk)]
    record = cp.zeros(PROGRESS_RECORD_BYTES, dtype=cp.uint8)
    init = cp.asarray(np.frombuffer(progress.initial_record(0), dtype=np.uint8))
    flag = yield_flags.as_flag(None)
    fence_vals = []
    for p in variant.fenced_params:
        addr, n = bound.extents.get(p, (0, 0))
        fence_vals += [struct.pack("<Q", addr), struct.pack("<Q", n)]
    extra = [struct.pack("<Q", record.data.ptr), struct.pack("<Q", flag.device_ptr),
             *(struct.pack("<I", v) for v in g), struct.pack("<I", total)]  # fmt: skip

    def reset():
        record[:] = init

    def transformed():
        vals = [*bound.values, *extra, struct.pack("<I", chunk_box[0]), *fence_vals]
        driver.launch_raw(fn, (persistent, 1, 1), b, shared, 0, vals)

    transformed.record = record  # for calibration: read after a launch
    transformed.persistent = persistent
    transformed.total = total
    transformed.chunk = chunk_box

    def original():
        driver.launch_raw(orig, g, b, shared, 0, bound.values)

    return original, transformed, reset


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:500]


def _calibrate_chunk(cp, launch, reset, rounds: int = 3) -> tuple[int, float | None]:
    """The launcher's adaptive choice: start from the first-launch chunk, measure the time
    per logical block from the record's stamps (as ``launch_kernel`` does after each
    completed slice) and re-choose, a few rounds. Returns (chunk, ns per logical block)."""
    from gpushare_ext.kernels import progress

    est = None
    box = launch.chunk
    box[0] = progress.choose_chunk(launch.total, launch.persistent, None)
    for _ in range(rounds):
        reset()
        launch()
        cp.cuda.Device().synchronize()
        rec = progress.read_record(launch.record)
        if rec["end_ns"] > rec["start_ns"] and launch.total >= 2 * launch.persistent:
            new = (rec["end_ns"] - rec["start_ns"]) * launch.persistent / launch.total
            est = new if est is None else 0.5 * (est + new)
        box[0] = progress.choose_chunk(launch.total, launch.persistent, est)
    return box[0], est


SWEEP_CHUNKS = (1, 4, 16, 64)


def _overhead_row(cp, timer: Timer, k, case, reps: int, sized=None, sweep=False) -> dict:
    orig, plain, reset1 = raw_launcher(k, case, fence=False, sized=sized, chunk=[1])
    _, fenced, reset2 = raw_launcher(k, case, fence=True, sized=sized, chunk=[1])
    chunk, block_ns = _calibrate_chunk(cp, plain, reset1)
    fenced.chunk[0] = chunk
    t0 = timer(orig, reps)
    t1 = timer(plain, reps, prepare=reset1)  # the record reset is not timed
    t2 = timer(fenced, reps, prepare=reset2)
    o, p, f = pct(t0, 50), pct(t1, 50), pct(t2, 50)
    row = {
        "kernel": case.id, "original_us": o, "preemptible_us": p, "fenced_us": f,
        "overhead": p / o - 1, "fence_overhead": f / p - 1,
        "added_us": p - o, "fence_added_us": f - p, "reps": reps,
        "chunk": chunk, "logical_block_ns": block_ns,
        "persistent_blocks": plain.persistent,
    }  # fmt: skip
    if sweep:  # forced chunk sizes: the data to tune CHUNK_TARGET_US with
        by = {}
        for c in SWEEP_CHUNKS:
            plain.chunk[0] = c
            by[str(c)] = pct(timer(plain, max(3, reps // 2), prepare=reset1), 50) / o - 1
        plain.chunk[0] = chunk
        row["overhead_by_chunk"] = by
    return row


def _print_row(row: dict) -> None:
    if "error" in row:
        print(f"  {row['kernel']:40s} FAILED: {row['error']}")
        return
    by = row.get("overhead_by_chunk")
    sweep = (" | " + " ".join(f"C{c}:{100 * v:+.1f}%" for c, v in by.items())) if by else ""
    print(
        f"  {row['kernel']:40s} {row['original_us']:9.1f} us  "
        f"+{100 * row['overhead']:6.1f}% (chunk {row.get('chunk')})  "
        f"fence +{100 * row['fence_overhead']:6.1f}%{sweep}"
    )


def _overhead_summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    ov = [r["overhead"] for r in ok]
    fo = [r["fence_overhead"] for r in ok]
    return {
        "median": pct(ov, 50), "worst": max(ov) if ov else float("nan"),
        "fence_median": pct(fo, 50), "fence_worst": max(fo) if fo else float("nan"),
        "kernels": len(ok), "failed": [r["kernel"] for r in rows if "error" in r],
        "added_us_median": pct([r["added_us"] for r in ok], 50),
    }  # fmt: skip


def bench_overhead(cp, reps: int) -> list[dict]:
    """The corpus at its own (tiny, 10-25 us) sizes: mostly fixed per-launch cost."""
    from corpus_specs import CASES

    from gpushare_ext.kernels import kernel

    timer = Timer(cp)
    rows = []
    for case in CASES:
        if case.make_args is None or case.refuse:
            continue
        try:
            row = _overhead_row(cp, timer, kernel(case.source, case.kernel), case, reps)
        except Exception as exc:
            row = {"kernel": case.id, "error": _err(exc)}
        rows.append(row)
        _print_row(row)
    return rows


# ---------------------------------------------------------------------------------------
# Realistic sizes: each corpus kernel on a problem where the original runs >= ~1 ms.
# ---------------------------------------------------------------------------------------

E = 1 << 26  # elements of the element-wise problems at scale 1


def _elementwise(make, block: int = 256, shared: int = 0):
    """A 1-D kernel over n = E * scale elements, one thread per element."""

    def sized(cp, rs, scale):
        n = E * scale
        return ((n + block - 1) // block, 1, 1), (block, 1, 1), shared, make(cp, rs, n)

    return sized


def _rn(cp, rs, n):
    return rs.standard_normal(n, dtype=cp.float32)


def _ri(cp, rs, n, hi=1000):
    return rs.randint(0, hi, n, dtype=cp.int32)


def _perm(cp, rs, n):
    return rs.permutation(n).astype(cp.int32)


def _grid_stride(cp, rs, scale):
    n = E * scale
    return (4096, 1, 1), (256, 1, 1), 0, (_rn(cp, rs, n), cp.empty(n, cp.float32), np.int32(n))


def _matmul(cp, rs, scale):
    n = 2048 if scale == 1 else 4096  # 8x the work: one step is enough
    t = (n + 15) // 16
    return (t, t, 1), (16, 16, 1), 0, (
        _rn(cp, rs, n * n), _rn(cp, rs, n * n), cp.empty(n * n, cp.float32), np.int32(n)
    )  # fmt: skip


def _transpose(cp, rs, scale):
    w, h = 8192 * scale, 8192
    return (w // 32, h // 32, 1), (32, 32, 1), 0, (
        _rn(cp, rs, w * h), cp.empty(w * h, cp.float32), np.int32(w), np.int32(h)
    )  # fmt: skip


def _rows_2d(cp, rs, scale):
    w, h = 8192, 8192 * scale
    return (w // 32, h // 8, 1), (32, 8, 1), 0, (
        _rn(cp, rs, w * h), cp.empty(w * h, cp.float32), np.int32(w), np.int32(h)
    )  # fmt: skip


def _fill_3d(cp, rs, scale):
    nx, ny, nz = 1024, 1024, 64 * scale
    return (nx // 16, ny // 4, nz // 2), (16, 4, 2), 0, (
        cp.empty(nx * ny * nz, cp.int32), np.int32(nx), np.int32(ny), np.int32(nz)
    )  # fmt: skip


def _smid(cp, rs, scale):
    blocks = (1 << 20) * scale  # blocks with (almost) no work: pure dispatch cost
    return (blocks, 1, 1), (128, 1, 1), 0, (cp.empty(blocks, cp.uint32),)


def _long_loop(inplace: bool):
    def sized(cp, rs, scale):
        n = (1 << 22) * scale
        g = ((n + 255) // 256, 1, 1)
        if inplace:
            return g, (256, 1, 1), 0, (_rn(cp, rs, n), np.int32(n), np.int32(20000))
        return g, (256, 1, 1), 0, (
            _rn(cp, rs, n), cp.empty(n, cp.float32), np.int32(n), np.int32(20000)
        )  # fmt: skip

    return sized


f32, i32 = np.float32, np.int32
REALISTIC = {
    "vector_add": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), _rn(cp, rs, n),
                                                  cp.empty(n, cp.float32), i32(n))),
    "scale_inplace": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), f32(1.0001), i32(n))),
    "saxpy": _elementwise(lambda cp, rs, n: (f32(2), _rn(cp, rs, n), _rn(cp, rs, n), i32(n))),
    "saxpy_out": _elementwise(lambda cp, rs, n: (f32(2), _rn(cp, rs, n), _rn(cp, rs, n),
                                                 cp.empty(n, cp.float32), i32(n))),
    "stencil_1d": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), cp.empty(n, cp.float32),
                                                  i32(n))),
    "matmul_tiled": _matmul,
    "reduce_sum": _elementwise(lambda cp, rs, n: (_ri(cp, rs, n), cp.zeros(1, cp.int32), i32(n))),
    "histogram": _elementwise(lambda cp, rs, n: (_ri(cp, rs, n, 256).astype(cp.uint8),
                                                 cp.zeros(256, cp.uint32), i32(n))),
    "block_scan": _elementwise(lambda cp, rs, n: (_ri(cp, rs, n), cp.empty(n, cp.int32), i32(n))),
    "gather": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), _perm(cp, rs, n),
                                              cp.empty(n, cp.float32), i32(n))),
    "scatter": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), _perm(cp, rs, n),
                                               cp.empty(n, cp.float32), i32(n))),
    "scatter_add": _elementwise(lambda cp, rs, n: (_ri(cp, rs, n), _ri(cp, rs, n, 1 << 16),
                                                   cp.zeros(1 << 16, cp.int32), i32(n))),
    "grid_stride_square": _grid_stride,
    "clamp_copy": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), cp.empty(n, cp.float32),
                                                  i32(n - 77), f32(-0.5), f32(0.5))),
    "add_rows_2d": _rows_2d,
    "fill_3d": _fill_3d,
    "transpose": _transpose,
    "copy_shift": _elementwise(lambda cp, rs, n: (_rn(cp, rs, n), cp.empty(n, cp.float32),
                                                  i32(n))),
    "max_reduce": _elementwise(lambda cp, rs, n: (_ri(cp, rs, n, 1 << 30),
                                                  cp.zeros(1, cp.int32), i32(n))),
    "smid_probe": _smid,
    "long_loop": _long_loop(False),
    "long_loop_inplace": _long_loop(True),
    "reverse_blocks": _elementwise(lambda cp, rs, n: (_ri(cp, rs, n), cp.empty(n, cp.int32),
                                                      i32(n)), shared=256 * 4),
}  # fmt: skip


REALISTIC_MAX_SCALE = {"matmul_tiled": 2}  # 4096^2 is the largest matmul


def _free(cp) -> None:
    cp.get_default_memory_pool().free_all_blocks()


def bench_overhead_realistic(
    cp, reps: int, target_us: float = 1000.0, max_scale: int = 8, budget_s: float = 60.0
) -> list[dict]:
    """Each corpus kernel scaled until the original runs >= ``target_us`` (doubling the
    problem up to ``max_scale``), fresh random inputs (generated on the device), CUDA
    events, median of ``reps`` after a warm-up. A kernel that fails is recorded with its
    error and the rest go on; kernels left when ``budget_s`` is spent are marked skipped."""
    from corpus_specs import CASES

    from gpushare_ext.kernels import kernel

    timer = Timer(cp)
    rows = []
    t_start = time.time()
    for case in CASES:
        if case.make_args is None or case.refuse or case.kernel not in REALISTIC:
            continue
        if time.time() - t_start > budget_s:
            rows.append({"kernel": case.id, "error": "skipped: time budget spent"})
            _print_row(rows[-1])
            continue
        make = REALISTIC[case.kernel]
        top = min(max_scale, REALISTIC_MAX_SCALE.get(case.kernel, max_scale))
        row: dict = {"kernel": case.id}
        try:
            k = kernel(case.source, case.kernel)
            rs = cp.random.RandomState(abs(hash(case.id)) % (1 << 31))
            scale = 1
            while True:
                sized = make(cp, rs, scale)
                orig, _, _ = raw_launcher(k, case, fence=False, sized=sized)
                probe = pct(timer(orig, 3), 50)
                if probe >= target_us or scale >= top:
                    break
                del sized, orig
                _free(cp)
                scale *= 2
            row = _overhead_row(cp, timer, k, case, reps, sized=sized, sweep=True)
            g, b = sized[0], sized[1]
            row.update(scale=scale, grid=list(g), block=list(b),
                       logical_blocks=g[0] * g[1] * g[2])  # fmt: skip
            # smid_probe records which SM ran each block: no two runs agree, by design.
            if case.verdict == "idempotent" and case.kernel != "smid_probe":
                row["matches_original"] = _same_outputs(cp, k, case, sized, row["chunk"])
        except Exception as exc:
            row["error"] = _err(exc)
        finally:
            sized = orig = None
            _free(cp)
        rows.append(row)
        _print_row(row)
    return rows


def _same_outputs(cp, k, case, sized, chunk=None) -> bool:
    """Idempotent kernels only: the transformed kernel's outputs equal the original's (its
    write-set is filled with a byte pattern first, so an output it skips shows up)."""
    from gpushare_ext.kernels import arguments

    args = sized[3]
    orig, plain, reset = raw_launcher(k, case, fence=False, sized=sized, chunk=chunk)
    bound = arguments.bind_arguments(k, args)
    outputs = [bound.arrays[p] for p in k.report.write_set if p in bound.arrays]
    for a in outputs:  # the same pattern under both runs: elements neither writes agree
        a.view(cp.uint8).fill(0xA5)
    orig()
    cp.cuda.Device().synchronize()
    want = [a.copy() for a in outputs]
    for a in outputs:
        a.view(cp.uint8).fill(0xA5)
    reset()
    plain()
    cp.cuda.Device().synchronize()
    same = all(
        bool((w.view(cp.uint8) == a.view(cp.uint8)).all())
        for w, a in zip(want, outputs, strict=True)
    )
    del want
    return same


def bench_launch_path(cp, reps: int) -> list[dict]:
    """Host wall time of a whole transactional launch (``k.launch``: bind, classify,
    record write, launch, wait, record read-back) against ``mode="off"`` (the original
    kernel through the same path: bind, launch, wait), corpus sizes. The difference is
    the fixed per-launch cost a notebook user sees, on top of the device-time overhead."""
    from corpus_specs import CASES

    from gpushare_ext.kernels import kernel

    rows = []
    for case in CASES:
        if case.make_args is None or case.refuse:
            continue
        try:
            k = kernel(case.source, case.kernel)
            args = case.make_args(cp, np.random.default_rng(0))
            times: dict[str, list[float]] = {"off": [], "transaction": []}
            for mode, kw in (("off", {"mode": "off"}), ("transaction", {})):
                k.launch(case.grid, case.block, args, shared_mem=case.shared, **kw)  # warm-up
                for _ in range(reps):
                    t0 = time.perf_counter()
                    k.launch(case.grid, case.block, args, shared_mem=case.shared, **kw)
                    times[mode].append((time.perf_counter() - t0) * 1e6)
            rep = k.last_launch
            row = {
                "kernel": case.id, "mode": rep.mode.value,
                "off_us": pct(times["off"], 50), "transaction_us": pct(times["transaction"], 50),
                "snapshot_bytes": rep.snapshot_bytes,
            }  # fmt: skip
            row["added_us"] = row["transaction_us"] - row["off_us"]
            print(
                f"  {case.id:40s} off {row['off_us']:8.1f} us  transaction "
                f"{row['transaction_us']:8.1f} us ({row['mode']})"
            )
        except Exception as exc:
            row = {"kernel": case.id, "error": _err(exc)}
            _print_row(row)
        rows.append(row)
    return rows


def bench_drain(cp, block_us: list[int], reps: int, ipc: bool) -> dict:
    from gpushare_ext.kernels import driver, kernel, progress, yield_flags
    from gpushare_ext.kernels.rewrite import PROGRESS_RECORD_BYTES

    k = kernel(SPIN_SRC, "spin_block")
    variant = k.preemptible()
    fn = driver.modules.function(variant.ptx, k.entry.name)
    st = kernel(SPIN_SRC, "stamp")
    stamp_fn = driver.modules.function(st.ptx, st.entry.name)
    stamp_at = cp.zeros(1, dtype=cp.uint64)
    side = driver.side_stream()
    sms = driver.DeviceFacts.sm_count()
    flag = yield_flags.YieldFlag()
    out_buf = cp.zeros(1 << 20, dtype=cp.float32)
    record = cp.zeros(PROGRESS_RECORD_BYTES, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    results: dict = {}
    child = None
    if ipc:
        child = track(subprocess.Popen(
            [sys.executable, "-c", CHILD, flag.ipc_handle().hex()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
        ))  # fmt: skip
        assert child.stdout.readline().strip() == "ready"
    try:
        for us in block_us:
            device, e2e, seen = [], [], []
            before_stamp = 0
            total = min(1 << 20, max(64 * sms, int(200_000 / max(us, 1)) * sms))
            # What the launcher would pick once it has measured blocks of `us`.
            chunk = progress.choose_chunk(total, sms, us * 1000.0)
            for _ in range(reps):
                flag.clear()
                record.set(np.frombuffer(progress.initial_record(0), dtype=np.uint8), stream=stream)
                vals = bound_vals(k, out_buf, us * 1000)
                extra = [struct.pack("<Q", record.data.ptr), struct.pack("<Q", flag.device_ptr),
                         struct.pack("<I", total), struct.pack("<I", 1), struct.pack("<I", 1),
                         struct.pack("<I", total), struct.pack("<I", chunk)]  # fmt: skip
                driver.launch_raw(fn, (sms, 1, 1), (32, 1, 1), 0, stream.ptr, [*vals, *extra])
                time.sleep(0.001 + 2 * us * 1e-6)  # let it run a few logical blocks
                t0 = time.perf_counter()
                if child is not None:
                    child.stdin.write("1\n")
                    child.stdin.flush()
                    child.stdout.readline()
                    driver.launch_raw(
                        stamp_fn,
                        (1, 1, 1),
                        (1, 1, 1),
                        0,
                        int(side),
                        [struct.pack("<Q", stamp_at.data.ptr)],
                    )  # after the child's write
                else:
                    drv = driver.cuda_driver()
                    drv.cuStreamWriteValue32(side, drv.CUdeviceptr(flag.device_ptr), 1, 0)
                    driver.launch_raw(
                        stamp_fn,
                        (1, 1, 1),
                        (1, 1, 1),
                        0,
                        int(side),
                        [struct.pack("<Q", stamp_at.data.ptr)],
                    )  # right behind the write
                stream.synchronize()
                e2e.append((time.perf_counter() - t0) * 1e6)
                driver.check(driver.cuda_driver().cuStreamSynchronize(side), "sync")
                rec = progress.read_record(record)
                t_flag = int(stamp_at.get()[0])
                if rec["first_yield_ns"] != (1 << 64) - 1:
                    # flag visible (stamp) -> last persistent block gone. The stamp kernel
                    # itself takes a few us to start: a kernel that drained faster than
                    # that is counted in drained_before_stamp, not as a zero.
                    if rec["last_exit_ns"] >= t_flag:
                        device.append((rec["last_exit_ns"] - t_flag) / 1e3)
                    else:
                        before_stamp += 1
                    seen.append((rec["last_exit_ns"] - rec["first_yield_ns"]) / 1e3)
            results[f"{us}us"] = {
                "logical_block_us": us, "chunk": chunk, "device_drain_us": summary(device),
                "first_seen_to_last_exit_us": summary(seen), "end_to_end_us": summary(e2e),
                "drained_before_stamp": before_stamp,
            }  # fmt: skip
            print(
                f"  block {us:5d} us (chunk {chunk}): drain after stamp p50 {pct(device, 50):8.1f} us "
                f"p99.9 {pct(device, 99.9):8.1f} ({before_stamp} drained before the stamp) | "
                f"first seen->last exit p50 {pct(seen, 50):6.1f} us | "
                f"end-to-end p50 {pct(e2e, 50):8.1f} p99.9 {pct(e2e, 99.9):8.1f} us"
            )
    finally:
        flag.clear()
        if child is not None:
            child.stdin.close()
            child.wait(timeout=30)
    return results


def bound_vals(k, out_buf, ns: int) -> list[bytes]:
    return [struct.pack("<Q", out_buf.data.ptr), struct.pack("<q", ns)]


def bench_snapshot(cp, sizes_mib: list[int], reps: int) -> list[dict]:
    """What the launcher does for a snapshot (allocate from the pool + D2D copy) and a
    rollback (D2D copy back), against a plain D2D copy into a ready buffer."""
    rows = [_snapshot_row(cp, Timer(cp), mib, reps) for mib in sizes_mib]
    return rows


def _snapshot_row(cp, timer: Timer, mib: int, reps: int) -> dict:
    nbytes = mib * (1 << 20)
    x = cp.ones(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(x)
    keep: list = []

    def ceiling():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, x.data.ptr, nbytes, 3, 0)

    def snapshot():
        copy = cp.empty(nbytes, dtype=cp.uint8)
        cp.cuda.runtime.memcpyAsync(copy.data.ptr, x.data.ptr, nbytes, 3, 0)
        keep.append(copy)

    def rollback():
        cp.cuda.runtime.memcpyAsync(x.data.ptr, dst.data.ptr, nbytes, 3, 0)

    tc = pct(timer(ceiling, reps), 50)
    ts = pct(timer(snapshot, reps, prepare=keep.clear), 50)
    tr = pct(timer(rollback, reps), 50)
    row = {
        "mib": mib,
        "copy_ceiling_gbps": nbytes / tc / 1e3,
        "snapshot_gbps": nbytes / ts / 1e3,
        "rollback_gbps": nbytes / tr / 1e3,
    }
    print(
        f"  {mib:5d} MiB: copy ceiling {row['copy_ceiling_gbps']:7.1f} GB/s, "
        f"snapshot {row['snapshot_gbps']:7.1f} GB/s, rollback {row['rollback_gbps']:7.1f} GB/s"
    )
    keep.clear()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for kernels_bench.json")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (about 30 s)")
    args = ap.parse_args(argv)
    exit_on_signals()  # ended by a signal, it still stops its child process
    import cupy as cp

    args.out.mkdir(parents=True, exist_ok=True)
    reps = 5 if args.quick else 30
    real_reps = 10 if args.quick else 20
    drain_reps = 30 if args.quick else 300
    props = cp.cuda.runtime.getDeviceProperties(0)
    versions = {}
    for pkg in ("cupy-cuda13x", "cupy-cuda12x", "cuda-bindings", "numba-cuda", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[pkg] = metadata.version(pkg)
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(),
        "command": " ".join([sys.executable, *sys.argv]),
        "device": props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
        "driver": cp.cuda.runtime.driverGetVersion(),
        "python": platform.python_version(),
        "packages": versions,
        "quick": args.quick,
    }
    t = time.time()
    print("overhead per corpus kernel, corpus (tiny) sizes (median device time):")
    result["overhead"] = bench_overhead(cp, reps)
    result["overhead_summary"] = _overhead_summary(result["overhead"])
    result["overhead_summary"]["what"] = (
        "device time (CUDA events) of one launch of the persistent preemptible kernel vs the "
        "original, corpus sizes (10-25 us kernels: mostly fixed per-launch cost); record reset "
        "not timed"
    )
    print(f"overhead per corpus kernel, realistic sizes (original >= ~1 ms, {real_reps} runs):")
    result["overhead_realistic"] = bench_overhead_realistic(
        cp, real_reps, budget_s=20 if args.quick else 60
    )
    result["overhead_realistic_summary"] = _overhead_summary(result["overhead_realistic"])
    result["overhead_realistic_summary"]["what"] = (
        "as overhead_summary, each kernel's problem doubled until the original runs >= ~1 ms "
        "(see scale/grid per kernel); matches_original: idempotent kernels' outputs equal"
    )
    print("host wall time of a whole transactional launch vs mode='off', corpus sizes:")
    result["launch_path"] = bench_launch_path(cp, 5 if args.quick else 20)
    ok = [r["added_us"] for r in result["launch_path"] if "error" not in r]
    result["launch_path_summary"] = {
        "added_us_median": pct(ok, 50), "added_us_worst": max(ok) if ok else float("nan"),
        "what": "host wall time of k.launch(...) (bind, classify, record write, launch, wait, "
        "read-back; snapshot copies for non-idempotent kernels) minus the same with mode='off'",
    }  # fmt: skip
    blocks = [1, 10, 100, 1000]
    print("yield-to-drain, flag written in-process:")
    result["drain_in_process"] = bench_drain(cp, blocks, drain_reps, ipc=False)
    print("yield-to-drain, flag written by another process through the IPC handle:")
    result["drain_ipc"] = bench_drain(cp, blocks, max(20, drain_reps // 3), ipc=True)
    result["drain_what"] = {
        "drain_in_process": "flag written by this process (cuStreamWriteValue32 on a side "
        "stream, the YieldFlag path); end_to_end_us: host write call -> host sees the kernel gone",
        "drain_ipc": "end to end from the broker's write: another process (standing in for the "
        "broker's actuator) calls write_yield_flag_from_handle through the CUDA IPC handle, as "
        "the actuator does; end_to_end_us: request sent over a pipe -> this process sees the "
        "kernel gone (includes the pipe round trip and the writer's stream sync)",
        "device_drain_us": "flag visible (a stamp kernel queued behind the write) -> last "
        "persistent block left, device clock",
        "first_seen_to_last_exit_us": "first block that saw the flag -> last block that left, "
        "device clock (progress record)",
    }
    print("snapshot / rollback bandwidth against a plain device-to-device copy:")
    result["snapshot"] = bench_snapshot(cp, [16, 256, 1024], 5 if args.quick else 20)
    result["elapsed_s"] = time.time() - t
    path = args.out / "kernels_bench.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
