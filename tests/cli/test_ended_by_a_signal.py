"""A benchmark or the demo ended by a signal leaves no process behind.

Each runs as a user runs it (a real subprocess).  Once its broker answers (for the
demo: once a notebook kernel runs too), it gets SIGTERM (what ``timeout`` sends),
SIGINT (Ctrl-C) or SIGHUP (a closed terminal); then it must exit soon, and the broker
and everything else it started must be gone: the broker's pid, its socket's answer,
every process it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpushare_ext.client import BrokerClient, BrokerError

ROOT = Path(__file__).resolve().parents[2]
EXIT_S = 15.0  # to exit after the signal; the broker itself stops within a second or two


def _start(argv: list[str], tmp_path: Path) -> subprocess.Popen:
    def signals_as_a_terminal_gives_them() -> None:  # not ignored, as in a background job
        for signum in (signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)

    return subprocess.Popen(
        [sys.executable, *argv], cwd=ROOT, stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "stderr.txt").open("wb"),
        env={**os.environ, "TMPDIR": str(tmp_path)}, preexec_fn=signals_as_a_terminal_gives_them,
    )  # fmt: skip


def _descendants(process: subprocess.Popen) -> list[psutil.Process]:
    with contextlib.suppress(psutil.NoSuchProcess):
        return psutil.Process(process.pid).children(recursive=True)
    return []


def _argv(child: psutil.Process) -> list[str]:
    with contextlib.suppress(psutil.Error):  # it may have ended meanwhile
        return child.cmdline()
    return []


def _broker_of(process: subprocess.Popen, timeout: float = 60) -> tuple[psutil.Process, Path]:
    """The broker ``process`` started, and its socket, once it answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"it ended early ({process.returncode})"
        for child in _descendants(process):
            argv = _argv(child)
            if "gpushare_ext.cli" in argv and "broker" in argv:
                socket = Path(argv[argv.index("--socket") + 1])
                if _answers(socket):
                    return child, socket
        time.sleep(0.1)
    raise AssertionError("no broker answered")


def _answers(socket: Path) -> bool:
    try:
        with BrokerClient(socket, client="cli", connect_timeout=1) as client:
            client.status()
    except BrokerError:
        return False
    return True


def _gone(child: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return child.status() == psutil.STATUS_ZOMBIE
    return True


def _ends_cleanly(process: subprocess.Popen, sig: int, started: list[psutil.Process]) -> None:
    try:
        process.send_signal(sig)
        process.wait(timeout=EXIT_S)
        deadline = time.monotonic() + 5  # what it stopped may take a moment to be reaped
        while time.monotonic() < deadline and not all(_gone(child) for child in started):
            time.sleep(0.1)
        left = [f"{child.pid} {' '.join(child.cmdline())[:120]}" for child in started if not _gone(child)]  # fmt: skip
        assert not left, f"left running after {signal.Signals(sig).name}: {left}"
    finally:  # whatever the outcome, nothing of this test stays
        process.kill()
        process.wait()
        for child in started:
            with contextlib.suppress(psutil.Error):
                child.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_the_control_plane_benchmark_stops_its_broker_and_workers(sig, tmp_path):
    process = _start(
        ["-m", "benchmarks.control_plane", "--clients", "1", "--requests", "1000000",
         "--workers", "1", "--out", str(tmp_path / "results")],
        tmp_path,
    )  # fmt: skip
    broker, socket = _broker_of(process)
    deadline = time.monotonic() + 30  # the load generator's worker is running too
    while len(_descendants(process)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # and has measured enough that what it sends back fills a pipe

    _ends_cleanly(process, sig, _descendants(process))

    assert _gone(broker)
    assert not _answers(socket)


def test_the_demo_stops_its_broker_and_its_notebook_kernels(tmp_path):
    process = _start(["-m", "gpushare_ext.cli", "demo", "--simulate", "h200", "--steps", "400"], tmp_path)  # fmt: skip
    broker, socket = _broker_of(process)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until a notebook kernel runs beside the broker
        kernels = [c for c in _descendants(process) if "ipykernel_launcher" in _argv(c)]
        if kernels:
            break
        time.sleep(0.1)
    assert kernels, "no notebook kernel started"

    _ends_cleanly(process, signal.SIGTERM, _descendants(process))

    assert _gone(broker)
    assert not _answers(socket)
    # Its folders (the broker's socket, journal and log; the kernels' channels) are gone.
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("gpushare-"))
    assert left == [], left
