"""``python -m benchmarks run --suite all --out benchmarks/results/<date>-<device>/`` and
``python -m benchmarks report DIR [--doc docs/benchmarks.md]``.

``run`` executes the suites one after the other as subprocesses (a failing suite is
recorded and the others go on) and writes each suite's JSON plus its log into DIR:

* ``control``    -- control plane: lease round trip and messages/s, 1..256 clients (CPU);
* ``kernels``    -- preemptible kernels: overhead over the corpus, yield-to-drain latency,
                    snapshot/rollback bandwidth against the copy ceiling (GPU);
* ``contention`` -- interactive latency under contention, low-priority throughput kept (GPU);
* ``checkpoint`` -- lock / evict / restore times against resident memory (GPU);
* ``fuzz``       -- a million hostile frames against a live broker (CPU);
* ``soak``       -- 100 ``kill -9``s of the broker under lease traffic (CPU).

``report`` turns a results folder into PNG plots and a markdown table (``report.md``)
and, with ``--doc``, replaces the tables of ``docs/benchmarks.md`` (between its bench
marks) with it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.stopping import exit_on_signals, run_to_end

SUITES = {
    "control": [
        "benchmarks.control_plane",
        ["--clients", "1,64,256,1024", "--open-loop", "1000", "--core-leases", "1,64,256,1000"],
    ],
    "kernels": ["benchmarks.kernels_bench", []],
    "contention": ["benchmarks.contention", []],
    "checkpoint": ["benchmarks.checkpoint", []],
    "fuzz": ["benchmarks.fuzz_frames", ["--frames", "1000000", "--clients", "2"]],
    "soak": ["benchmarks.crash_soak", ["--kills", "100"]],
}
GPU_SUITES = {"kernels", "contention", "checkpoint"}


def _gpu_present() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
        return count > 0
    except Exception:
        return False


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = list(SUITES) if args.suite == "all" else args.suite.split(",")
    unknown = [name for name in names if name not in SUITES]
    if unknown:
        print(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}", file=sys.stderr)
        return 2
    gpu = _gpu_present()
    failed = []
    summary = []
    for name in names:
        if name in GPU_SUITES and not gpu:
            print(f"[{name}] skipped: no GPU here (NVML finds none)")
            summary.append((name, "skipped (no GPU)", 0.0))
            continue
        module, extra = SUITES[name]
        command = [sys.executable, "-m", module, "--out", str(out), *extra]
        if args.quick and name != "control":
            command.append("--quick")
        if args.quick and name == "control":
            command = [sys.executable, "-m", module, "--out", str(out), "--clients", "1,16,64"]
        started = time.monotonic()
        print(f"[{name}] {' '.join(command[1:])}", flush=True)
        with open(out / f"{name}.log", "w") as log:
            # A suite past its time is stopped with SIGTERM, so that it stops its broker.
            code = run_to_end(command, args.timeout, stdout=log, stderr=subprocess.STDOUT)
        took = time.monotonic() - started
        status = "ok" if code == 0 else "timed out" if code is None else f"failed ({code})"
        if code != 0:
            failed.append(name)
        summary.append((name, status, took))
        print(f"[{name}] {status} in {took:.0f} s; log {out / (name + '.log')}", flush=True)
    print("\nsuite        status              seconds")
    for name, status, took in summary:
        print(f"{name:<12} {status:<19} {took:7.0f}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run benchmark suites")
    run_parser.add_argument(
        "--suite", default="all", help=f"all or a comma list of {', '.join(SUITES)}"
    )
    run_parser.add_argument(
        "--out", required=True, help="results folder, e.g. benchmarks/results/2026-11-30-h200"
    )
    run_parser.add_argument("--quick", action="store_true", help="smaller runs (smoke test)")
    run_parser.add_argument("--timeout", type=int, default=900, help="seconds allowed per suite")
    report_parser = sub.add_parser("report", help="plots and markdown from a results folder")
    report_parser.add_argument(
        "folders", nargs="+", help="results folders; plots go into the first"
    )
    report_parser.add_argument(
        "--doc",
        metavar="FILE",
        help="markdown file whose tables (between its bench marks) are replaced, "
        "e.g. docs/benchmarks.md",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        exit_on_signals()  # ended by a signal, it stops the suite it runs (and so its broker)
        return run(args)
    from benchmarks.report import build_report

    return build_report([Path(f) for f in args.folders], Path(args.doc) if args.doc else None)


if __name__ == "__main__":
    sys.exit(main())
