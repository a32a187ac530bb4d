"""CuPy's own k-means example in notebook cells with and without gpushare, on a real GPU.

The example is CuPy's ``examples/kmeans/kmeans.py`` (give its path: it is CuPy's code,
read from a CuPy checkout, never part of this project).  Each way runs in a fresh real
ipykernel kernel, as a notebook user would:

* ``plain``    -- no launch shim, no gpushare (the reference);
* ``unmarked`` -- started as the gpushare server extension starts kernels (the launch
                  shim in ``LD_PRELOAD``, ``CUPY_COMPILE_WITH_PTX=1``), ``%load_ext
                  gpushare_ext``, cells without ``%%gpu``;
* ``lease``    -- the same kernel, each fit in a ``%%gpu priority=low`` cell on a broker.

Each fit is a cell with a deadline: one that does not end in time counts as a hang (its
Python stack is dumped with ``py-spy`` when that is installed) and the kernel is killed.
Reported per way: seconds per fit, the centres' largest difference from ``plain`` and
whether the labels agree, and what the launch shim did with the long kernels.

``python -m benchmarks.unmarked --example PATH [--example PATH ...] --out DIR``.  Each
example runs the fit functions it has (``fit_custom`` and ``fit_xp``, or an older
revision's ``fit(X, k, iterations, use_custom_kernel)``).  ``--package-root DIR`` runs
another copy of gpushare (e.g. an earlier commit's, to show a fix) in the kernels.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.deadline_kernel import DeadlineKernel, kernel_environment
from benchmarks.stopping import exit_on_signals

WAYS = ("plain", "unmarked", "lease")

SETUP = r"""
import importlib.util, json, sys, time
import cupy, numpy
import matplotlib
matplotlib.use("Agg")
sys.argv = ["kmeans"]
_spec = importlib.util.spec_from_file_location("kmeans_example", {path!r})
km = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(km)
_rs = numpy.random.RandomState(0)
X = cupy.asarray(numpy.r_[_rs.randn({n}, 2) + 1, _rs.randn({n}, 2) - 1].astype(numpy.{dtype}))
"""

FIT = r"""{magic}
cupy.random.seed(0); numpy.random.seed(0)
_t = time.perf_counter()
_out = {call}
centers, pred = _out[0], _out[1]
cupy.cuda.runtime.deviceSynchronize()
_reg = None
try:
    from gpushare_ext.runtime import preemptible as _pre
    _reg = _pre.installed()
except ImportError:
    pass
print("RESULT " + json.dumps({{
    "seconds": time.perf_counter() - _t,
    "centers": cupy.asnumpy(centers).astype(float).tolist(),
    "labels": int(cupy.asnumpy(pred).astype("int64").sum()),
    "preemptible": getattr(_reg, "launched", None),
    "fallbacks": getattr(_reg, "fallbacks", None),
    "said": list(getattr(_reg, "said", [])),
}}))
"""


def _calls(example: Path) -> list[tuple[str, str]]:
    text = example.read_text()
    if "def fit_custom" in text:
        return [("fit_custom", "km.fit_custom(X, 8, 10)"), ("fit_xp", "km.fit_xp(X, 8, 10)")]
    return [("fit(custom)", "km.fit(X, 8, 10, True)"), ("fit(xp)", "km.fit(X, 8, 10, False)")]


def _env(way: str, package_root: Path, socket: Path | None) -> dict[str, str]:
    return kernel_environment(shim=way != "plain", socket=socket, package_root=package_root)


def run_way(
    way: str, example: Path, package_root: Path, socket: Path | None, args: argparse.Namespace
) -> list[dict]:
    kernel = DeadlineKernel(_env(way, package_root, socket))
    rows = []
    try:
        if way != "plain":
            status, text = kernel.run("%load_ext gpushare_ext", 120)
            if status != "ok":
                raise SystemExit(f"%load_ext failed: {text}")
        setup = SETUP.format(path=str(example), n=args.samples, dtype=args.dtype)
        status, text = kernel.run(setup, 300)
        if status != "ok":
            raise SystemExit(f"setup failed in {way}: {text}")
        for name, call in _calls(example):
            magic = "%%gpu priority=low" if way == "lease" else ""
            for repeat in range(args.repeats):
                cell = FIT.format(magic=magic, call=call).lstrip("\n")
                started = time.perf_counter()
                status, text = kernel.run(cell, args.deadline)
                row = {"example": example.name, "fit": name, "way": way, "repeat": repeat}
                if status == "timeout":
                    row.update(hung=True, waited_s=time.perf_counter() - started)
                    row["stack"] = kernel.stack()
                    rows.append(row)
                    print(f"unmarked: {way} {name} did not end in {args.deadline:g} s",
                          file=sys.stderr, flush=True)  # fmt: skip
                    return rows
                line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
                if status != "ok" or line is None:
                    row.update(error=text[-2000:])
                else:
                    row.update(hung=False, **json.loads(line.split(" ", 1)[1]))
                rows.append(row)
    finally:
        kernel.close()
    return rows


def compare(rows: list[dict]) -> list[dict]:
    """Each way's fits against ``plain``'s: largest centre difference, same labels."""
    reference = {
        (r["example"], r["fit"]): r for r in rows if r["way"] == "plain" and "centers" in r
    }
    summary: dict[tuple, dict] = {}
    for row in rows:
        key = (row["example"], row["fit"], row["way"])
        entry = summary.setdefault(key, {
            "example": row["example"], "fit": row["fit"], "way": row["way"], "fits": 0,
            "hung": 0, "errors": 0, "seconds": [], "max_center_diff": 0.0, "labels_equal": True,
        })  # fmt: skip
        entry["fits"] += 1
        if row.get("hung"):
            entry["hung"] += 1
            continue
        if "error" in row:
            entry["errors"] += 1
            continue
        entry["seconds"].append(row["seconds"])
        ref = reference.get((row["example"], row["fit"]))
        if ref is not None:
            diff = max(
                abs(a - b)
                for ca, cb in zip(row["centers"], ref["centers"], strict=True)
                for a, b in zip(ca, cb, strict=True)
            )
            entry["max_center_diff"] = max(entry["max_center_diff"], diff)
            entry["labels_equal"] &= row["labels"] == ref["labels"]
        entry["preemptible_launches"] = row.get("preemptible")
        entry["said"] = row.get("said")
    out = []
    for entry in summary.values():
        seconds = sorted(entry.pop("seconds"))
        entry["median_s"] = seconds[len(seconds) // 2] if seconds else None
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--example", action="append", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--samples", type=int, default=1_000_000, help="per blob (two blobs)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=120.0, help="seconds per fit cell")
    parser.add_argument("--package-root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--name", default="unmarked", help="the JSON file's name")
    args = parser.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    if bad := [w for w in ways if w not in WAYS]:
        parser.error(f"unknown way {bad[0]!r}; choose from {', '.join(WAYS)}")
    for example in args.example:
        if not example.is_file():
            parser.error(f"{example} is not a file (CuPy's examples/kmeans/kmeans.py)")
    from benchmarks.broker_process import start_broker

    exit_on_signals()  # SIGTERM (timeout) too stops the broker and kernels it started
    workdir = Path(tempfile.mkdtemp(prefix="gpushare-unmarked-"))
    broker, socket = start_broker(workdir) if "lease" in ways else (None, None)
    rows: list[dict] = []
    try:
        for example in args.example:
            for way in ways:
                print(f"unmarked: {example.name} {way} ...", file=sys.stderr, flush=True)
                rows += run_way(way, example.resolve(), args.package_root.resolve(),
                                socket if way == "lease" else None, args)  # fmt: skip
    finally:
        if broker is not None:
            broker.terminate()
            broker.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    from benchmarks.environment import describe

    summary = compare(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    document = {**describe(), "benchmark": "unmarked", "package_root": str(args.package_root),
                "summary": summary, "rows": rows}  # fmt: skip
    (args.out / f"{args.name}.json").write_text(json.dumps(document, indent=2))
    print(f"{'example':<14}{'fit':<13}{'way':<10}{'fits':>5}{'hung':>5}{'err':>5}"
          f"{'median s':>10}{'max diff':>10}{'labels':>8}{'preempt.':>9}")  # fmt: skip
    for s in summary:
        median = "-" if s["median_s"] is None else f"{s['median_s']:.3f}"
        print(f"{s['example'][:13]:<14}{s['fit']:<13}{s['way']:<10}{s['fits']:>5}{s['hung']:>5}"
              f"{s['errors']:>5}{median:>10}{s['max_center_diff']:>10.2g}"
              f"{'same' if s['labels_equal'] else 'DIFF':>8}"
              f"{s.get('preemptible_launches') if s.get('preemptible_launches') is not None else '-':>9}")  # fmt: skip
    return 1 if any(s["hung"] or s["errors"] for s in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
