"""Other projects' own test suites, four ways: does code we did not write survive gpushare?

Each selection of a project's tests (CuPy's, read from a CuPy checkout at the installed
version; Numba's CUDA tests, which ship in numba-cuda; PyTorch's, from a checkout) runs
four ways on a real GPU:

* ``plain``    -- ``python -m pytest`` in a fresh process, no gpushare (the reference);
* ``unmarked`` -- inside a real ipykernel kernel started as the gpushare server extension
                  starts kernels (launch shim in ``LD_PRELOAD``, CuPy compiling to PTX),
                  after ``%load_ext gpushare_ext``, with ``pytest.main`` in a plain cell;
* ``lease``    -- the same, the cell under ``%%gpu priority=low``;
* ``chaos``    -- the same, while the broker pauses that kernel at random moments
                  (``gpushare chaos``: every 5-50 ms for 1-20 ms, at every ladder level
                  the GPU allows).

Per test, the outcome of each way (passed, failed, error, skipped, xfailed, xpassed) is
logged as it is known (``benchmarks/peer_plugin.py``); each way stops cleanly once its
budget is spent, and the ways are compared on the tests both reached: every test whose
outcome differs from ``plain`` is listed, so each can be explained (the ledger beside the
results says why, one entry per cause).  A way that outlives its deadline counts as a
hang: its Python and native stacks are dumped with ``py-spy`` when that is installed.

``python -m benchmarks.peer_suites --suite NAME --rootdir DIR --tests PATH ... --out DIR``
(``--tests`` as pytest takes them, relative to ``--rootdir``, or ``--pyargs`` module
names).  The ways run one after the other, or at once with ``--concurrent`` (each in its
own process on the same GPU).  The projects' tests never ship with gpushare.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.deadline_kernel import DeadlineKernel, kernel_environment
from benchmarks.stopping import exit_on_signals, track

WAYS = ("plain", "unmarked", "lease", "chaos")


def outcomes(log: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped / xfailed / xpassed, from the JSON
    lines ``benchmarks.peer_plugin`` wrote (the last word on a test counts)."""
    if not log.exists():
        return {}
    result = {}
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:  # a line cut by a killed run
            continue
        result[entry["test"]] = entry["outcome"]
    return result


def pytest_args(args: argparse.Namespace, log: Path) -> list[str]:
    return [
        *(["--pyargs"] if args.pyargs else []),
        *args.tests,
        "-q", "-p", "no:cacheprovider", "-p", "benchmarks.peer_plugin", "--capture=sys",
        f"--peer-log={log}", f"--peer-budget={args.budget}", f"--timeout={args.test_timeout}",
        *args.pytest_arg,
    ]  # fmt: skip


def environment(args: argparse.Namespace, way: str, socket: Path | None) -> dict[str, str]:
    return kernel_environment(
        shim=way != "plain", socket=socket, cache_prefix=f"gpushare-peer-{way}-"
    )


def run_plain(args: argparse.Namespace, out: Path) -> dict:
    log = out / f"{args.suite}-plain.jsonl"
    log.unlink(missing_ok=True)  # a folder used before must not mix two runs
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", *pytest_args(args, log)],
            cwd=args.rootdir, env=environment(args, "plain", None), capture_output=True,
            text=True, timeout=args.deadline,
        )  # fmt: skip
        tail, rc, hung = (done.stdout + done.stderr)[-3000:], done.returncode, False
    except subprocess.TimeoutExpired as exc:
        tail, rc, hung = str(exc.stdout or "")[-3000:], None, True
    return {"way": "plain", "rc": rc, "hung": hung, "seconds": time.perf_counter() - started,
            "tail": tail, "log": log.name}  # fmt: skip


def run_in_kernel(args: argparse.Namespace, way: str, out: Path, socket: Path) -> dict:
    log = out / f"{args.suite}-{way}.jsonl"
    log.unlink(missing_ok=True)
    kernel = DeadlineKernel(environment(args, way, socket))
    result: dict = {"way": way, "log": log.name, "kernel_pid": kernel.pid}
    started = time.perf_counter()
    try:
        status, text = kernel.run("%load_ext gpushare_ext\nimport os\nos.chdir("
                                  f"{str(args.rootdir)!r})", 120)  # fmt: skip
        if status != "ok":
            raise RuntimeError(f"setting up the kernel failed: {text[-2000:]}")
        magic = f"%%gpu priority=low mem={args.memory}\n" if way in ("lease", "chaos") else ""
        if way == "chaos":
            status, text = kernel.run(magic + "pass", 120)  # the session the broker pauses
            if status != "ok":
                raise RuntimeError(f"the first %%gpu cell failed: {text[-2000:]}")
            from gpushare_ext.client import BrokerClient

            with BrokerClient(socket, client="cli") as admin:
                result["chaos_started"] = admin.chaos(
                    kernel.pid, every_ms=args.chaos_every, pause_ms=args.chaos_pause,
                    levels=tuple(args.chaos_levels), seed=args.seed,
                )  # fmt: skip
        cell = (
            magic + "import pytest\n"
            f"rc = pytest.main({pytest_args(args, log)!r})\n"
            "print('PYTEST-RC', int(rc))\n"
            "from gpushare_ext.runtime import interpose, preemptible\n"
            "registry = preemptible.installed()\n"
            "print('SHIM', {'launched': getattr(registry, 'launched', None), "
            "'interrupted': getattr(registry, 'interrupted', None), "
            "'fallbacks': getattr(registry, 'fallbacks', None), 'said': "
            "list(getattr(registry, 'said', [])), 'stats': "
            "interpose.stats() if registry is not None else None})\n"
        )
        status, text = kernel.run(cell, args.deadline)
        result["hung"] = status == "timeout"
        if result["hung"]:
            result["stack"] = kernel.stack()
        for line in text.splitlines():
            if line.startswith("PYTEST-RC "):
                result["rc"] = int(line.split()[1])
            elif line.startswith("SHIM "):
                result["shim"] = line[5:]
        result["tail"] = text[-3000:]
        if way == "chaos":
            from gpushare_ext.client import BrokerClient

            with BrokerClient(socket, client="cli") as admin:
                result["chaos_ended"] = admin.chaos(kernel.pid, stop=True)
    except Exception as exc:  # one way failing must not lose the others' results
        result["error"] = str(exc)
    finally:
        result["seconds"] = time.perf_counter() - started
        kernel.close()
    return result


def compare(results: dict[str, dict[str, str]]) -> dict:
    """Each way against plain: counts, and every test both reached whose outcome differs
    (a way's budget may end before or after plain's)."""
    base = results.get("plain", {})
    summary = {}
    for way, seen in results.items():
        counts: dict[str, int] = {}
        for outcome in seen.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        both = set(base) & set(seen)
        differ = {
            test: {"plain": base[test], way: seen[test]}
            for test in sorted(both)
            if base[test] != seen[test]
        }
        summary[way] = {
            "counts": counts,
            "compared": len(both) if way != "plain" else len(seen),
            "differ": differ if way != "plain" else {},
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--suite", required=True, help="a name for the results (cupy, numba ...)")
    parser.add_argument("--rootdir", type=Path, default=Path.cwd(), help="where pytest runs")
    parser.add_argument("--tests", nargs="+", required=True)
    parser.add_argument("--pyargs", action="store_true", help="--tests are module names")
    parser.add_argument("--pytest-arg", action="append", default=[], help="passed on to pytest")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--budget", type=float, default=300.0,
        help="seconds a way runs tests before it stops cleanly after the test under way",
    )  # fmt: skip
    parser.add_argument(
        "--deadline", type=float, default=480.0,
        help="seconds after which a way that has not ended counts as hung",
    )  # fmt: skip
    parser.add_argument("--test-timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--memory", default="60GiB", help="the lease of the lease and chaos ways")
    parser.add_argument("--concurrent", action="store_true", help="run the ways at once")
    parser.add_argument("--chaos-every", type=_range, default=(5.0, 50.0), metavar="MS-MS")
    parser.add_argument("--chaos-pause", type=_range, default=(1.0, 20.0), metavar="MS-MS")
    parser.add_argument("--chaos-levels", type=_levels, default=(0, 1, 3), metavar="0,1,3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--simulate", metavar="NAME", default=None,
        help="a simulated inventory for the broker (only to try the harness without a GPU)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    ways = [w for w in args.ways.split(",") if w]
    if bad := [w for w in ways if w not in WAYS]:
        parser.error(f"unknown way {bad[0]!r}; choose from {', '.join(WAYS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    exit_on_signals()  # SIGTERM (timeout) too stops the broker and the kernels below
    from gpushare_ext.broker.edges.launch import BrokerProcess

    workdir = Path(tempfile.mkdtemp(prefix="gpushare-peer-", dir="/tmp"))
    broker = None
    if any(w != "plain" for w in ways):
        # The real GPU (NVML); --simulate only to try the harness where there is none.
        broker = track(BrokerProcess(workdir, simulate=args.simulate).start())
    socket = broker.socket if broker is not None else None
    runs: list[dict] = []
    try:

        def one(way: str) -> dict:
            print(f"peer_suites: {args.suite} {way} ...", file=sys.stderr, flush=True)
            if way == "plain":
                return run_plain(args, args.out)
            return run_in_kernel(args, way, args.out, socket)  # type: ignore[arg-type]

        if args.concurrent:
            # Daemon threads: a signal that ends the run must not wait for them.
            done: dict[str, dict] = {}
            threads = [
                threading.Thread(target=lambda w=way: done.update({w: one(w)}), daemon=True)
                for way in ways
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            runs = [done[way] for way in ways if way in done]
        else:
            runs = [one(way) for way in ways]
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    from benchmarks.environment import describe

    seen = {run["way"]: outcomes(args.out / run["log"]) for run in runs}
    summary = compare(seen)
    document = {**describe(), "benchmark": "peer_suites", "suite": args.suite,
                "tests": args.tests, "runs": runs, "summary": summary}  # fmt: skip
    (args.out / f"peer-{args.suite}.json").write_text(json.dumps(document, indent=2))
    print(f"{'way':<10}{'seconds':>9}{'hung':>6}{'passed':>8}{'failed':>8}{'error':>7}"
          f"{'skipped':>9}{'compared':>9}{'differ':>8}")  # fmt: skip
    for run in runs:
        counts = summary[run["way"]]["counts"]
        print(f"{run['way']:<10}{run['seconds']:9.0f}{'YES' if run.get('hung') else 'no':>6}"
              f"{counts.get('passed', 0):>8}{counts.get('failed', 0):>8}{counts.get('error', 0):>7}"
              f"{counts.get('skipped', 0):>9}{summary[run['way']]['compared']:>9}"
              f"{len(summary[run['way']]['differ']):>8}")  # fmt: skip
    return 0


def _range(text: str) -> tuple[float, float]:
    low, _, high = text.partition("-")
    try:
        return float(low), float(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a range of milliseconds like 5-50"
        ) from None


def _levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of ladder levels like 0,1,3"
        ) from None
    if not levels or any(not 0 <= level <= 4 for level in levels):
        raise argparse.ArgumentTypeError(f"ladder levels go from 0 to 4, not {text!r}")
    return levels


if __name__ == "__main__":
    sys.exit(main())
