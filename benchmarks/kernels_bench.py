"""Benchmark preemptible kernels on a GPU: overhead, fence cost, drain latency, snapshots.

What it measures (all in one run, JSON into --out):

* per corpus kernel: device time of the original vs the persistent preemptible kernel
  (and the fenced one), median and worst ratio;
* yield-to-drain latency on the device clock (%globaltimer: first block that sees the
  flag -> last block that leaves, from the progress record) for logical blocks of about
  1 us .. 1 ms, the flag written in-process with cuStreamWriteValue32;
* end to end from another process: a subprocess writes the flag through the CUDA IPC
  handle; measured from the request to the host seeing the kernel finished;
* snapshot/rollback bandwidth of the launcher vs a plain device-to-device copy ceiling.

Usage: python benchmarks/kernels_bench.py --out benchmarks/results/kernels [--quick]
Needs a GPU, CuPy and cuda-bindings. Takes about 3 minutes on an H200 (--quick: ~30 s).
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
from gpushare_ext.runtime.kernels.launch import write_yield_flag_from_handle as w
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


def raw_launcher(k, case, fence: bool):
    """A callable that launches the transformed kernel once, whole grid, no Python loop."""
    import cupy as cp

    from gpushare_ext.runtime.kernels import launch as L
    from gpushare_ext.runtime.kernels.transform import PROGRESS_RECORD_BYTES

    rng = np.random.default_rng(0)
    args = case.make_args(cp, rng)
    bound = L.bind_arguments(k, args)
    variant = k.preemptible(fence=fence)
    fn = L._modules.function(variant.ptx, k.entry.name)
    orig = L._modules.function(k.ptx, k.entry.name)
    g, b = case.grid, case.block
    total = g[0] * g[1] * g[2]
    sms = L._Device.sm_count()
    per_sm = L._check(
        L._driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
            fn, b[0] * b[1] * b[2], case.shared
        ),
        "occupancy",
    )
    persistent = max(1, min(total, sms * int(per_sm)))
    record = cp.zeros(PROGRESS_RECORD_BYTES, dtype=cp.uint8)
    init = cp.asarray(np.frombuffer(L.initial_record(0), dtype=np.uint8))
    flag = L._as_flag(None)
    fence_vals = []
    for p in variant.fenced_params:
        addr, n = bound.extents.get(p, (0, 0))
        fence_vals += [struct.pack("<Q", addr), struct.pack("<Q", n)]
    extra = [struct.pack("<Q", record.data.ptr), struct.pack("<Q", flag.device_ptr),
             *(struct.pack("<I", v) for v in g), struct.pack("<I", total), *fence_vals]  # fmt: skip

    def reset():
        record[:] = init

    def transformed():
        L._launch_raw(fn, (persistent, 1, 1), b, case.shared, 0, [*bound.values, *extra])

    def original():
        L._launch_raw(orig, g, b, case.shared, 0, bound.values)

    return original, transformed, reset


def bench_overhead(cp, reps: int) -> list[dict]:
    from corpus_specs import CASES

    from gpushare_ext.runtime.kernels import kernel

    timer = Timer(cp)
    rows = []
    for case in CASES:
        if case.make_args is None or case.refuse:
            continue
        k = kernel(case.source, case.kernel)
        orig, plain, reset1 = raw_launcher(k, case, fence=False)
        _, fenced, reset2 = raw_launcher(k, case, fence=True)
        t0 = timer(orig, reps)
        t1 = timer(plain, reps, prepare=reset1)  # the record reset is not timed
        t2 = timer(fenced, reps, prepare=reset2)
        rows.append({
            "kernel": case.id, "original_us": pct(t0, 50), "preemptible_us": pct(t1, 50),
            "fenced_us": pct(t2, 50), "overhead": pct(t1, 50) / pct(t0, 50) - 1,
            "fence_overhead": pct(t2, 50) / pct(t1, 50) - 1,
        })  # fmt: skip
        print(
            f"  {case.id:40s} {rows[-1]['original_us']:9.1f} us  "
            f"+{100 * rows[-1]['overhead']:6.1f}%  fence +{100 * rows[-1]['fence_overhead']:6.1f}%"
        )
    return rows


def bench_drain(cp, block_us: list[int], reps: int, ipc: bool) -> dict:
    from gpushare_ext.runtime.kernels import kernel
    from gpushare_ext.runtime.kernels import launch as L
    from gpushare_ext.runtime.kernels.transform import PROGRESS_RECORD_BYTES

    k = kernel(SPIN_SRC, "spin_block")
    variant = k.preemptible()
    fn = L._modules.function(variant.ptx, k.entry.name)
    st = kernel(SPIN_SRC, "stamp")
    stamp_fn = L._modules.function(st.ptx, st.entry.name)
    stamp_at = cp.zeros(1, dtype=cp.uint64)
    side = L._side_stream()
    sms = L._Device.sm_count()
    flag = L.YieldFlag()
    out_buf = cp.zeros(1 << 20, dtype=cp.float32)
    record = cp.zeros(PROGRESS_RECORD_BYTES, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    results: dict = {}
    child = None
    if ipc:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, flag.ipc_handle().hex()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=str(ROOT),
        )  # fmt: skip
        assert child.stdout.readline().strip() == "ready"
    try:
        for us in block_us:
            device, e2e, seen = [], [], []
            before_stamp = 0
            total = min(1 << 20, max(64 * sms, int(200_000 / max(us, 1)) * sms))
            for _ in range(reps):
                flag.clear()
                record.set(np.frombuffer(L.initial_record(0), dtype=np.uint8), stream=stream)
                vals = bound_vals(k, out_buf, us * 1000)
                extra = [struct.pack("<Q", record.data.ptr), struct.pack("<Q", flag.device_ptr),
                         struct.pack("<I", total), struct.pack("<I", 1), struct.pack("<I", 1),
                         struct.pack("<I", total)]  # fmt: skip
                L._launch_raw(fn, (sms, 1, 1), (32, 1, 1), 0, stream.ptr, [*vals, *extra])
                time.sleep(0.001 + 2 * us * 1e-6)  # let it run a few logical blocks
                t0 = time.perf_counter()
                if child is not None:
                    child.stdin.write("1\n")
                    child.stdin.flush()
                    child.stdout.readline()
                    L._launch_raw(
                        stamp_fn,
                        (1, 1, 1),
                        (1, 1, 1),
                        0,
                        int(side),
                        [struct.pack("<Q", stamp_at.data.ptr)],
                    )  # after the child's write
                else:
                    drv = L._driver()
                    drv.cuStreamWriteValue32(side, drv.CUdeviceptr(flag.device_ptr), 1, 0)
                    L._launch_raw(
                        stamp_fn,
                        (1, 1, 1),
                        (1, 1, 1),
                        0,
                        int(side),
                        [struct.pack("<Q", stamp_at.data.ptr)],
                    )  # right behind the write
                stream.synchronize()
                e2e.append((time.perf_counter() - t0) * 1e6)
                L._check(L._driver().cuStreamSynchronize(side), "sync")
                rec = L._read_record(record)
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
                "logical_block_us": us, "device_drain_us": summary(device),
                "first_seen_to_last_exit_us": summary(seen), "end_to_end_us": summary(e2e),
                "drained_before_stamp": before_stamp,
            }  # fmt: skip
            print(
                f"  block {us:5d} us: drain after stamp p50 {pct(device, 50):8.1f} us "
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
    import cupy as cp

    args.out.mkdir(parents=True, exist_ok=True)
    reps = 5 if args.quick else 30
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
    print("overhead per corpus kernel (median device time):")
    result["overhead"] = bench_overhead(cp, reps)
    ov = [r["overhead"] for r in result["overhead"]]
    fo = [r["fence_overhead"] for r in result["overhead"]]
    result["overhead_summary"] = {"median": pct(ov, 50), "worst": max(ov),
                                  "fence_median": pct(fo, 50), "fence_worst": max(fo)}  # fmt: skip
    blocks = [1, 10, 100, 1000]
    print("yield-to-drain, flag written in-process:")
    result["drain_in_process"] = bench_drain(cp, blocks, drain_reps, ipc=False)
    print("yield-to-drain, flag written by another process through the IPC handle:")
    result["drain_ipc"] = bench_drain(cp, blocks, max(20, drain_reps // 3), ipc=True)
    print("snapshot bandwidth:")
    result["snapshot"] = bench_snapshot(cp, [16, 256] if args.quick else [16, 256, 1024], reps)
    result["elapsed_s"] = time.time() - t
    path = args.out / "kernels_bench.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path} ({result['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
