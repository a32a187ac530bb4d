"""``gpushare demo`` on the simulated H200 shows what it is for: session A's training loop
paused for session B's high-priority cell, A's result bit-identical to an undisturbed
run; and a demo that could not show a pause says so and exits 1.

These run the real demo (a broker and three real notebook kernels), as ``make demo``
does on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpushare_ext.demo as demo

ROOT = Path(__file__).resolve().parents[2]
DEMO_TIMEOUT_S = 300  # about 10 s on an idle 2-core machine; kernels start slowly when busy


def _demo_environment() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200")  # one row a line: the table is read back
    env.pop("GPUSHARE_SOCKET", None)
    return env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One run of ``gpushare demo --simulate h200 --out DIR``: what it printed, and DIR."""
    out = tmp_path_factory.mktemp("demo") / "out"
    result = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "demo", "--simulate", "h200", "--out", str(out)],
        capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=_demo_environment(), cwd=ROOT,
    )  # fmt: skip
    return result, out


def test_the_demo_shows_session_a_paused_for_session_b_and_the_same_result(demo_run):
    result, out = demo_run

    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "a SIMULATED GPU" in result.stdout
    assert re.search(
        r"session A \(low\) preempted\s*│ yes: paused for a higher-priority", result.stdout
    )
    assert re.search(r"identical to an undisturbed run\s*│ yes \(sha256 match\)", result.stdout)
    report = json.loads((out / "timeline.json").read_text())
    assert report["low_paused"] and report["result_identical"]
    states = [(event["lease"], event["state"]) for event in report["events"]]
    low = states[0][0]
    high = next(lease for lease, _ in states if lease != low)
    # A ran, was paused for B, ran again once B was granted, and ended after B.
    at = {state: states.index(state) for state in states}  # the first of each
    resumed = len(states) - 1 - states[::-1].index((low, "running"))
    assert at[(low, "running")] < at[(low, "paused")] < resumed, states
    assert at[(high, "running")] < resumed, states
    assert at[(high, "released")] < at[(low, "released")], states


def test_the_summary_has_no_empty_header_row(demo_run):
    result, _ = demo_run

    summary = result.stdout[result.stdout.index(" summary ") :].splitlines()
    assert summary[1].startswith("┌"), summary[:3]  # the frame, then the first row
    assert summary[2].startswith("│ session B"), summary[:3]
    assert not [line for line in result.stdout.splitlines() if re.fullmatch(r"[┃│ ]+", line)]


def test_a_contender_that_comes_after_the_loop_ended_is_reported_and_exits_1(monkeypatch, capsys):
    # Session B is let in only once A's lease has gone: nothing is left to preempt.
    monkeypatch.setattr(demo, "head_start_s", lambda low_params, use_gpu: 600.0)
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.delenv("GPUSHARE_SOCKET", raising=False)

    status = demo.run_demo(simulate="h200", steps=4)

    shown = capsys.readouterr().out
    assert status == 1
    assert shown.rstrip().splitlines()[-1] == (
        "gpushare demo: session A's lease was released before session B's cell started: "
        "nothing left to preempt; run it with more --steps"
    )
    assert "session B (priority high): interactive cell arrives" not in shown


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (type("CellExecutionError", (Exception,), {"ename": "NameError", "evalue": "x"})(
            "\x1b[0;31mTraceback ...\x1b[0m"), "NameError: x"),
        (RuntimeError("the kernel died"), "the kernel died"),
    ],
)  # fmt: skip
def test_a_failed_notebook_is_told_in_one_line_without_its_coloured_traceback(error, line):
    assert demo.error_line(error) == line
