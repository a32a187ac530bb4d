"""What a long neighbour's launches got when a high-priority session arrived (real GPU).

``python -m benchmarks.first_cell_probe KIND[,KIND...]`` runs, for each long neighbour of
``benchmarks/long_neighbours.py``, the pair the GPU test runs
(``tests/runtime/test_first_cell_gpu.py``: the neighbour's ~1 s kernels under a
low-priority lease, then one high-priority cell of 20 matmuls) and prints what the test
only asserts: the high requests' p50 and slowest, the neighbour's long-kernel counts
(launched preemptible, yields, saves, aborts, unmodified), what the shim said, its
counters, the gaps between the neighbour's steps and when the high tenant came.  Each
pair's record goes to ``$OUT/KIND.json`` and the broker's log to ``$OUT/broker.log``.

It diagnoses; it asserts nothing and is not a benchmark whose figures are reported.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.broker_process import start_broker
from benchmarks.contention import run_pair


def _print_pair(kind: str, record: dict, seconds: float) -> None:
    low = record["low"]
    latencies = sorted(record["high"]["latencies_s"]["matmul"])
    print(
        f"== {kind} ({seconds:.0f} s): high p50 {latencies[len(latencies) // 2] * 1e3:.1f} ms,"
        f" slowest {latencies[-1] * 1e3:.1f} ms"
    )
    print("  long kernels:", low.get("long_kernels"))
    print("  said:", low.get("said"), "| summary:", low.get("preemptible"))
    print("  shim:", {k: v for k, v in (low.get("interposer") or {}).items() if v})
    finished = low["finished"]
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(finished)]
    print("  neighbour steps:", len(finished), "gaps (s):", gaps[:12])
    if finished:
        print(
            "  high window (s after the first step):",
            [round(t - finished[0], 2) for t in record["window"]],
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    out = Path(os.environ.get("OUT", "/tmp/first-cell-probe"))
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gps-first-cell-probe-"))
    broker, socket_path = start_broker(workdir)
    try:
        for kind in args[0].split(","):
            started = time.monotonic()
            try:
                record = run_pair(
                    workdir, kind, "shim", socket_path, quick=True, requests="matmul", per_cell=20
                )
            except RuntimeError as exc:
                print(f"== {kind}: failed: {exc}")
                continue
            (out / f"{kind}.json").write_text(json.dumps(record, indent=1, default=str))
            _print_pair(kind, record, time.monotonic() - started)
    finally:
        broker.terminate()
        broker.wait(timeout=30)
        for log in workdir.glob("*.log"):
            shutil.copy(log, out / log.name)
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
