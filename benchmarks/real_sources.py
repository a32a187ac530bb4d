"""``python -m benchmarks.real_sources TREE [-I DIR]... --label NAME --out FOLDER``.

Runs ``gpushare classify`` (the real command, one process per file) on every ``.cu``
file of a checkout of a public CUDA project, unmodified, and records per file whether
it was analysed, how (nvcc whole, device code alone, texture stand-ins), each kernel's
label, and for the files that were not the first line of the error.  The point is the
share of what users have that compiles as it is, and why the rest does not; the
project's files are read in place, never copied.

Writes ``real_sources-<label>.json`` into FOLDER and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks.environment import describe

TIMEOUT_S = 300


def _classify(path: Path, includes: list[str]) -> dict:
    argv = [sys.executable, "-m", "gpushare_ext.cli", "classify", str(path), "--json"]
    for folder in includes:
        argv += ["-I", folder]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"file": str(path), "analysed": False, "error": f"timed out after {TIMEOUT_S} s"}
    if proc.returncode != 0:
        error = proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else "no message"
        return {
            "file": str(path),
            "analysed": False,
            "error": error.removeprefix("gpushare classify: "),
            "traceback": "Traceback" in proc.stderr,
        }
    document = json.loads(proc.stdout)
    return {
        "file": str(path),
        "analysed": True,
        "note": document.get("note", ""),
        "kernels": [{"name": k["name"], "verdict": k["verdict"]} for k in document["kernels"]],
    }


def _why(error: str) -> str:
    """The kind of a failure, for counting: the message without file names and numbers."""
    kinds = (
        ("no kernels", "no kernels in the file"),
        ("no kernel to analyse", "only templates never instantiated"),
        ("is meant to be #included", "meant to be #included (the includer named)"),
        ("cannot find the header", "a header not found (-I needed)"),
        ("is not installed", "a CUDA header not installed"),
        ("texture is not a template", "texture references, and other errors"),
    )
    for needle, kind in kinds:
        if needle in error:
            return kind
    return re.sub(r"\d+", "N", error.split(": ", 1)[-1])[:80]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.real_sources", description=__doc__)
    parser.add_argument("tree", help="a checkout of a public CUDA project")
    parser.add_argument("-I", dest="includes", action="append", default=[], metavar="DIR")
    parser.add_argument("--label", required=True, help="what the tree is (project@commit)")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    tree = Path(args.tree)
    files = sorted(tree.rglob("*.cu"))
    if not files:
        parser.error(f"{tree}: no .cu files under it")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda f: _classify(f, args.includes), files))
    for row in rows:
        row["file"] = str(Path(row["file"]).relative_to(tree))
    analysed = [r for r in rows if r["analysed"]]
    verdicts = Counter(k["verdict"] for r in analysed for k in r["kernels"])
    how = Counter(
        "device code alone" if "host code does not compile" in r["note"]
        else "texture stand-ins" if r["note"]
        else "whole file"
        for r in analysed
    )  # fmt: skip
    failures = Counter(_why(r["error"]) for r in rows if not r["analysed"])
    document = {
        **describe(),
        "benchmark": "real_sources",
        "label": args.label,
        "includes": args.includes,
        "files": len(rows),
        "analysed": len(analysed),
        "tracebacks": sum(1 for r in rows if r.get("traceback")),
        "how": dict(how),
        "verdicts": dict(verdicts),
        "failures": dict(failures.most_common()),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", args.label)
    (out / f"real_sources-{name}.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"{args.label}: {len(analysed)} of {len(rows)} .cu files analysed ({dict(how)})")
    print(f"  kernels: {dict(verdicts)}; tracebacks: {document['tracebacks']}")
    for why, count in failures.most_common():
        print(f"  {count:>3} not analysed: {why}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
