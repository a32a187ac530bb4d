"""Interactive latency under contention (issue scenario 1), on a real GPU.

For each low-priority neighbour (CuPy matmuls, a PyTorch training loop, instrumented
preemptible kernels) and each mode, a high-priority tenant issues interactive requests
(CuPy 4096^2 fp32 matmul, a small inference-like sequence, an instrumented kernel) in
cells of ``--requests-per-cell`` requests.  Modes:

* ``alone``      -- the high tenant alone (through the broker), the baseline;
* ``timeslice``  -- both tenants, no broker: plain time-slicing;
* ``levels03``   -- broker with the gate and the process lock only;
* ``full``       -- broker with the whole ladder (instrumented neighbours yield, level 1);
* ``shim``       -- ``levels03`` with both tenants started with the launch shim in
                    ``LD_PRELOAD``, as the server extension starts kernels: the paused
                    neighbour's launches are held and it keeps about 3 ms queued
                    (``GPUSHARE_BENCH_SHIM_ROLES=low`` gives it to the neighbour only).

Reported: p50/p99 latency ratio against ``alone`` (same run), and the low tenant's
throughput retained: its iterations while the high tenant held no lease, over what it
achieves alone in the same time (target >= 90 %).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.broker_process import ROOT, checkout_env, start_broker
from benchmarks.stopping import exit_on_signals, track


def _tenant(args: list[str], socket_path: Path | None) -> subprocess.Popen:
    env = checkout_env(socket_path)
    shim_for = os.environ.get("GPUSHARE_BENCH_SHIM_ROLES", "low,high").split(",")
    role = args[args.index("--role") + 1] if "--role" in args else ""
    if "shim" in args and role in shim_for:
        from gpushare_ext.server_ext import preload_for_kernels

        preload_for_kernels(env)  # as the server extension starts kernels
    return track(
        subprocess.Popen([sys.executable, "-m", "benchmarks.tenant", *args], cwd=ROOT, env=env)
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def run_pair(
    workdir: Path,
    low_kind: str | None,
    mode: str,
    socket_path: Path | None,
    quick: bool,
    requests: str = "matmul,inference,instrumented",
    per_cell: int | None = None,
    notebook: bool = False,
) -> dict:
    """One measurement: optionally a low neighbour, then the high tenant's cells."""
    tag = f"{low_kind or 'none'}-{mode}"
    low = None
    ready = workdir / f"{tag}.ready"
    cells, per_cell = (1, per_cell or 20) if quick else (3, per_cell or 40)
    if low_kind is not None:
        low = _tenant(
            [
                "--role",
                "low",
                "--kind",
                low_kind,
                "--mode",
                mode,
                "--duration",
                "600",
                "--ready",
                str(ready),
                "--out",
                str(workdir / f"{tag}.low.json"),
            ],
            socket_path,
        )
        deadline = time.monotonic() + 180
        while not ready.exists():
            if low.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"low tenant {tag} did not start (exit {low.poll()})")
            time.sleep(0.1)
        time.sleep(1.0)  # let it reach a steady state
    started = time.time()
    high = _tenant(
        [
            "--role",
            "high",
            "--mode",
            mode,
            "--requests",
            requests,
            "--cells",
            str(cells),
            "--requests-per-cell",
            str(per_cell),
            "--out",
            str(workdir / f"{tag}.high.json"),
            *(["--notebook"] if notebook else []),
        ],
        socket_path,
    )
    if high.wait(timeout=600) != 0:
        raise RuntimeError(f"high tenant {tag} failed")
    ended = time.time()
    result: dict = {"low_kind": low_kind, "mode": mode, "window": [started, ended]}
    result["high"] = json.loads((workdir / f"{tag}.high.json").read_text())
    if low is not None:
        time.sleep(1.0)  # the low tenant runs on after the last cell
        low.terminate()
        low.wait(timeout=120)
        result["low"] = json.loads((workdir / f"{tag}.low.json").read_text())
    return result


def low_alone_rate(workdir: Path, kind: str, seconds: float) -> float:
    out = workdir / f"alone-{kind}.low.json"
    ready = workdir / f"alone-{kind}.ready"
    process = _tenant(
        [
            "--role",
            "low",
            "--kind",
            kind,
            "--mode",
            "timeslice",
            "--duration",
            str(seconds + 30),
            "--ready",
            str(ready),
            "--out",
            str(out),
        ],
        None,
    )
    while not ready.exists():
        if process.poll() is not None:
            raise RuntimeError(f"low tenant {kind} alone failed")
        time.sleep(0.1)
    time.sleep(1.0 + seconds)
    process.terminate()
    process.wait(timeout=120)
    finished = json.loads(out.read_text())["finished"]
    window = [t for t in finished if t >= finished[-1] - seconds]
    return (len(window) - 1) / (window[-1] - window[0]) if len(window) > 1 else 0.0


def _slowest(values: list[float], alone_p50: float, per_cell: int, count: int = 3) -> list:
    order = sorted(range(len(values)), key=lambda i: -values[i])[:count]
    return [
        {"cell": i // per_cell, "request": i % per_cell, "ratio": round(values[i] / alone_p50, 2)}
        for i in order
    ]


def summarise(
    results: list[dict], alone_rates: dict[str, float], per_cell: int | None = None
) -> list[dict]:
    """One row per tenant pair, mode and request kind.  With ``per_cell`` each row also
    names its three slowest requests (cell, place in the cell, times the alone p50): a
    p99 over a few cells is its slowest request or two, and where they fall says why."""
    baseline = next(r for r in results if r["mode"] == "alone")
    rows = []
    for result in results:
        for kind, values in result["high"]["latencies_s"].items():
            base = baseline["high"]["latencies_s"][kind]
            row = {
                "low": result["low_kind"] or "none",
                "mode": result["mode"],
                "request": kind,
                "p50_ms": percentile(values, 50) * 1e3,
                "p99_ms": percentile(values, 99) * 1e3,
                "p50_ratio": percentile(values, 50) / percentile(base, 50),
                "p99_ratio": percentile(values, 99) / percentile(base, 99),
                # The first grant also opens the session: left out where there are more.
                "grant_p50_ms": statistics.median(
                    result["high"]["grant_s"][1:] or result["high"]["grant_s"]
                )
                * 1e3,
            }
            row["p999_ms"] = percentile(values, 99.9) * 1e3
            row["p999_ratio"] = percentile(values, 99.9) / percentile(base, 99.9)
            if per_cell:
                row["slowest"] = _slowest(values, percentile(base, 50), per_cell)
                # The session's first cell, apart: it may meet a neighbour's kernel that
                # was launched before this session existed.
                first = values[:per_cell]
                row["first_cell_p50_ratio"] = percentile(first, 50) / percentile(base, 50)
                row["first_cell_max_ratio"] = max(first) / percentile(base, 50)
            rows.append(row)
        # Kept throughput is judged where the broker pauses the neighbour: without a broker
        # it is never paused, and its share of the held time is not idle time.
        if "low" in result and result["low_kind"] in alone_rates and result["mode"] != "timeslice":
            finished = result["low"]["finished"]
            held = result["high"]["held"]
            start, end = result["window"]
            idle = (end - start) - sum(b - a for a, b in held)
            done = [t for t in finished if start <= t <= end]
            rate = alone_rates[result["low_kind"]]
            retained = len(done) / (rate * idle) if rate > 0 and idle > 0 else float("nan")
            for row in rows:
                if row["low"] == result["low_kind"] and row["mode"] == result["mode"]:
                    row["low_retained"] = retained
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--quick", action="store_true", help="one cell per request kind, fewer requests"
    )
    parser.add_argument("--lows", default="cupy,torch,instrumented")
    parser.add_argument("--modes", default="timeslice,levels03,full")
    args = parser.parse_args(argv)
    exit_on_signals()  # ended by a signal, it still stops the broker and the tenants
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-contention-"))
    broker, socket_path = start_broker(workdir)
    results = []
    try:
        results.append(run_pair(workdir, None, "alone", socket_path, args.quick))
        alone_rates = {}
        for low_kind in args.lows.split(","):
            alone_rates[low_kind] = low_alone_rate(workdir, low_kind, 3.0 if args.quick else 5.0)
            for mode in args.modes.split(","):
                socket = None if mode == "timeslice" else socket_path
                try:
                    results.append(run_pair(workdir, low_kind, mode, socket, args.quick))
                except RuntimeError as exc:
                    results.append({"low_kind": low_kind, "mode": mode, "error": str(exc)})
                    print(f"contention {low_kind}/{mode} failed: {exc}", file=sys.stderr)
    finally:
        broker.terminate()
        broker.wait(timeout=30)
    good = [r for r in results if "error" not in r]
    rows = summarise(good, alone_rates)
    from benchmarks.environment import describe

    document = {
        "benchmark": "contention",
        **describe(),
        "rows": rows,
        "errors": [r for r in results if "error" in r],
        "alone_rates_per_s": alone_rates,
    }
    (out / "contention.json").write_text(json.dumps(document, indent=2))
    print(
        f"{'low':<13}{'mode':<11}{'request':<13}{'p50 ms':>8}{'p99 ms':>8}{'p50 x':>7}{'p99 x':>7}{'kept':>7}"
    )
    for row in rows:
        kept = row.get("low_retained")
        print(
            f"{row['low']:<13}{row['mode']:<11}{row['request']:<13}{row['p50_ms']:8.2f}{row['p99_ms']:8.2f}"
            f"{row['p50_ratio']:7.2f}{row['p99_ratio']:7.2f}{'' if kept is None else f'{kept:7.0%}'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
