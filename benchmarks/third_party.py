"""Interactive latency beside low-priority work gpushare did not write, on a real GPU.

The low-priority tenants are third-party code (``benchmarks/tenant.py: THIRD_PARTY``):
CuPy's own ``cupy.linalg`` (solve, QR) and ``cupy.fft``, a ``cupyx.scipy`` conjugate
gradient solver, a user ``ElementwiseKernel`` of about 0.4 s per launch, a Numba
``@cuda.jit`` kernel, a torchvision ResNet-18 training loop, a PyTorch transformer-encoder
training loop, long cuBLAS GEMMs (8192^2 fp32) and short ones back to back (4096^2),
and the long kernels of every framework's JIT path (``benchmarks/long_neighbours.py``:
Numba, CuPy's kernel classes, ``cupyx.jit``, PTX loaded through the driver API), each
about a second a launch; their every output is checked against their first, undisturbed
one.  Each row also gives the session's first cell apart (its slowest request: the one
that may meet a neighbour's kernel launched before the session existed).  The high-priority
tenant runs cells of 20 fp32 4096^2 matmuls with 10 ms think time, each under a
``priority=high`` lease: with ``--notebook`` it is a real ipykernel kernel running
``%%gpu priority=high`` cells, else a process taking the same lease through
``gpushare_ext.lease`` (the code path ``%%gpu`` uses).  Modes, in the same run:

* ``alone``     -- the high tenant alone, the baseline;
* ``timeslice`` -- both, no broker: plain time-slicing;
* ``shim``      -- gpushare as deployed: the broker, and both tenants started as the
                   server extension starts kernels (launch shim preloaded, CuPy
                   compiling to PTX so long kernels are made preemptible at load).

``python -m benchmarks.third_party --out DIR [--quick] [--lows a,b]`` writes
``third_party.json``; ``python -m benchmarks report`` puts it in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.broker_process import start_broker
from benchmarks.contention import low_alone_rate, run_pair, summarise
from benchmarks.stopping import exit_on_signals
from benchmarks.tenant import THIRD_PARTY

MODES = ("timeslice", "shim")


def _parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The options, the modes beside the alone baseline and the neighbours, checked."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="one cell per tenant")
    parser.add_argument("--lows", default=",".join(THIRD_PARTY))
    parser.add_argument(
        "--notebook", action="store_true",
        help="the high tenant is a real ipykernel notebook running %%%%gpu cells",
    )  # fmt: skip
    parser.add_argument(
        "--modes", default=",".join(MODES),
        help=f"modes beside the alone baseline, of {', '.join(MODES)} (default: both)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    modes = [mode for mode in args.modes.split(",") if mode]
    if not modes or any(mode not in MODES for mode in modes):
        parser.error(f"--modes {args.modes!r}: choose from {', '.join(MODES)}")
    lows = [kind for kind in args.lows.split(",") if kind]
    unknown = [kind for kind in lows if kind not in THIRD_PARTY]
    if unknown:
        parser.error(f"unknown tenant {unknown[0]!r}; choose from {', '.join(THIRD_PARTY)}")
    return args, modes, lows


def _measure(
    workdir: Path, socket_path: Path, lows: list[str], modes: list[str], pair: dict
) -> tuple[list[dict], dict[str, float]]:
    """The alone baseline, then each neighbour alone and beside the high tenant in each
    mode; a failure is recorded and the others go on.  Returns the runs and each
    neighbour's rate alone."""
    results: list[dict] = [run_pair(workdir, None, "alone", socket_path, **pair)]
    alone_rates: dict[str, float] = {}
    for kind in lows:
        try:
            alone_rates[kind] = low_alone_rate(workdir, kind, 3.0 if pair["quick"] else 6.0)
        except RuntimeError as exc:
            results.append({"low_kind": kind, "mode": "alone", "error": str(exc)})
            print(f"third_party {kind} alone failed: {exc}", file=sys.stderr)
            continue
        for mode in modes:
            socket = None if mode == "timeslice" else socket_path
            try:
                results.append(run_pair(workdir, kind, mode, socket, **pair))
            except RuntimeError as exc:
                results.append({"low_kind": kind, "mode": mode, "error": str(exc)})
                print(f"third_party {kind}/{mode} failed: {exc}", file=sys.stderr)
    return results, alone_rates


def _rows_of(rows: list[dict], result: dict) -> list[dict]:
    """The summary rows of ``result``'s neighbour and mode."""
    return [r for r in rows if r["low"] == result["low_kind"] and r["mode"] == result["mode"]]


def _add_neighbour_notes(rows: list[dict], good: list[dict]) -> None:
    """What the shim did in each neighbour, and whether the neighbour's every output
    matched its first, undisturbed one, for the reader."""
    for result in good:
        if result["mode"] == "shim" and "low" in result:
            for row in _rows_of(rows, result):
                row["low_preemptible"] = result["low"].get("preemptible", "")
                row["low_said"] = result["low"].get("said", [])
        if "low" in result and "outputs_checked" in result["low"]:
            for row in _rows_of(rows, result):
                row["low_outputs_checked"] = result["low"]["outputs_checked"]
                row["low_bit_identical"] = result["low"]["outputs_differing"] == 0


def _add_cell_ratios(rows: list[dict], good: list[dict]) -> None:
    """Cell time: a cell's requests back to back, against alone (``good[0]``)."""
    for result in good:
        if result["mode"] == "alone":
            continue
        for row in _rows_of(rows, result):
            row["cell_p90_ratio"] = _cell_ratio(result, good[0])


def _keep_raw(out: Path, workdir: Path) -> None:
    raw = out / "third_party-raw"  # each tenant's own record and the broker's log
    raw.mkdir(exist_ok=True)
    for path in workdir.glob("*"):
        if path.suffix in (".json", ".log"):
            shutil.copy(path, raw / path.name)


def _print_table(rows: list[dict]) -> None:
    # The wait for each grant is shown beside the cells: a grant that waits for the
    # sessions it pauses to stop must not look free.  Its median leaves out the first,
    # which also opens the session.
    print(
        f"{'low':<18}{'mode':<11}{'p50 x':>7}{'p99 x':>7}{'p99.9 x':>8}{'1st max x':>10}"
        f"{'cell p90 x':>11}{'grant p50 ms':>13}{'kept':>7}{'same':>6}"
    )
    for row in rows:
        kept, cell = row.get("low_retained"), row.get("cell_p90_ratio")
        same = row.get("low_bit_identical")
        print(
            f"{row['low']:<18}{row['mode']:<11}{row['p50_ratio']:7.2f}{row['p99_ratio']:7.2f}"
            f"{row['p999_ratio']:8.2f}{row.get('first_cell_max_ratio', float('nan')):10.2f}"
            f"{'' if cell is None else f'{cell:11.2f}'}{row['grant_p50_ms']:13.1f}"
            f"{'' if kept is None else f'{kept:7.0%}'}{'' if same is None else f'{same!s:>6}'}"
        )


def main(argv: list[str] | None = None) -> int:
    args, modes, lows = _parse_args(argv)
    exit_on_signals()  # ended by a signal, it still stops the broker and the tenants
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-third-party-"))
    broker, socket_path = start_broker(workdir)
    pair = {"quick": args.quick, "requests": "matmul", "per_cell": 20, "notebook": args.notebook}
    try:
        results, alone_rates = _measure(workdir, socket_path, lows, modes, pair)
    finally:
        broker.terminate()
        broker.wait(timeout=30)
    good = [r for r in results if "error" not in r]
    rows = summarise(good, alone_rates, per_cell=pair["per_cell"])
    _add_neighbour_notes(rows, good)
    _add_cell_ratios(rows, good)
    from benchmarks.environment import describe

    document = {
        "benchmark": "third_party",
        **describe(),
        "command": "python -m benchmarks.third_party " + " ".join(argv or sys.argv[1:]),
        "high_tenant": "ipykernel notebook, %%gpu cells" if args.notebook else "process, lease()",
        "rows": rows,
        "errors": [r for r in results if "error" in r],
        "alone_rates_per_s": alone_rates,
    }
    (out / "third_party.json").write_text(json.dumps(document, indent=2))
    _keep_raw(out, workdir)
    _print_table(rows)
    return 0


def _cell_ratio(result: dict, baseline: dict) -> float:
    """p90 of the time a cell's requests took in total, over the same alone."""

    def cells(document: dict) -> list[float]:
        values = document["high"]["latencies_s"]["matmul"]
        per_cell = 20
        return sorted(
            sum(values[i : i + per_cell]) for i in range(0, len(values) - per_cell + 1, per_cell)
        )

    def p90(values: list[float]) -> float:
        return values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]

    return p90(cells(result)) / p90(cells(baseline))


if __name__ == "__main__":
    sys.exit(main())
