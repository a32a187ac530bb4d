"""The ``gpushare`` command's own checks, run as a user runs it (a real subprocess):
a bad argument gets one line (or the sub-command's usage and error) and an exit status,
before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpushare_ext.broker.hands.inventory import shipped_fixtures


def gpushare(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_demo_with_an_unknown_inventory_names_it_and_the_choices():
    result = gpushare("demo", "--simulate", "nosuch")

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "gpushare demo: --simulate: no inventory file 'nosuch'; give a JSON path or one of "
        f"the shipped fixtures: {', '.join(shipped_fixtures())}\n"
    )


def _output(kind: str, tmp_path: Path) -> tuple[str, str]:
    if kind == "in /proc":
        return "/proc/nope", (
            "--out /proc/nope: cannot write there (No such file or directory); "
            "give a folder you can write to"
        )
    file = tmp_path / "results"
    file.write_text("a file, not a folder\n")
    return str(file), f"--out {file} is not a folder; give a folder to keep the results in"


@pytest.mark.parametrize("kind", ["in /proc", "a file"])
def test_demo_refuses_an_output_folder_it_cannot_write_before_it_starts(kind, tmp_path):
    out, message = _output(kind, tmp_path)
    started = time.monotonic()

    result = gpushare("demo", "--simulate", "h200", "--steps", "4", "--out", out, timeout=30)

    assert result.returncode == 2
    assert result.stdout == ""  # no broker, no session: nothing ran
    assert result.stderr == f"gpushare demo: {message}\n"
    assert time.monotonic() - started < 20


def test_checking_an_output_folder_leaves_nothing_behind(tmp_path):
    from gpushare_ext.demo import output_problem

    assert output_problem(tmp_path / "a" / "b") is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (["status", "--bogus"], "usage: gpushare status ", "gpushare status: error: "
         "unrecognized arguments: --bogus"),
        (["admin", "drain", "0", "extra"], "usage: gpushare admin ", "gpushare admin: error: "
         "unrecognized arguments: extra"),
        (["--bogus", "status"], "usage: gpushare [", "gpushare: error: "
         "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_an_unknown_argument_is_reported_by_the_command_it_was_given_to(argv, usage, error):
    result = gpushare(*argv)

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith(usage), result.stderr
    assert result.stderr.splitlines()[-1] == error


def test_a_broker_with_an_unknown_inventory_is_bad_usage_naming_the_fixtures(tmp_path):
    result = gpushare(
        "broker", "--simulate", "nosuch",
        "--socket", str(tmp_path / "b.sock"), "--journal", str(tmp_path / "j.sqlite"),
    )  # fmt: skip

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        "gpushare: --simulate: no inventory file 'nosuch'; give a JSON path or one of "
        f"the shipped fixtures: {', '.join(shipped_fixtures())}\n"
    )
    assert list(tmp_path.iterdir()) == []  # no socket, no journal: nothing started


@pytest.mark.parametrize(
    "argv",
    [
        # more than a pipe buffer's worth: the write itself fails
        ["mig", "plan", "--simulate", "h200-mig-mixed", "--demand", "8GiB,40GiB", "--json"],
        # a few lines, still buffered when the command returns: the flush fails
        ["mig", "plan", "--simulate", "h200-mig-empty", "--demand", "8GiB"],
        # printed by argparse, which then exits
        ["--version"],
    ],
    ids=["json", "text", "version"],
)
def test_output_into_a_closed_pipe_ends_quietly_with_the_sigpipe_status(argv):
    reader, writer = os.pipe()
    os.close(reader)  # the reader has gone before the first byte (as ``| head -c 0`` would)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "gpushare_ext.cli", *argv],
            stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(writer)

    assert result.stderr == ""
    assert result.returncode == 141


def test_status_at_80_columns_keeps_every_line_within_them_and_reasons_whole(broker):
    from gpushare_ext.client import BrokerClient
    from gpushare_ext.protocol import PRIORITY_CLASSES

    with BrokerClient(broker, client="bench") as holder, BrokerClient(broker) as waiter:
        holder.request_lease(priority=PRIORITY_CLASSES["high"], memory_bytes=120 << 30)
        queued = waiter.request_lease(priority=PRIORITY_CLASSES["low"], memory_bytes=60 << 30)
        env = {**os.environ, "COLUMNS": "80", "GPUSHARE_SOCKET": str(broker)}
        shown = subprocess.run(
            [sys.executable, "-m", "gpushare_ext.cli", "status"],
            capture_output=True, text=True, env=env, timeout=30, check=True,
        ).stdout  # fmt: skip
    assert max(len(line) for line in shown.splitlines()) <= 80, shown
    assert f"{queued.lease_id}: {queued.reason}" in shown  # on one line, after the table
