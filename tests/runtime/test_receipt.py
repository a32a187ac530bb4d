"""The receipt a ``%%gpu`` cell ends with, in a real ipykernel: the cell's last line,
after what it printed, its result and its traceback; the time running told apart from
the time paused; the time queued said when it is zero; a revoked lease gets one too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

from runtime_helpers import ME, holding_cell, loaded, wait_for

from gpushare_ext.protocol import LeaseState

RECEIPT = "gpushare: cell done: "


def receipt_of(run) -> str:
    """The cell's receipt, which must be its last output, and its only one."""
    receipts = [o for o in run.outputs if o["kind"] == "data" and o["text"].startswith(RECEIPT)]
    assert len(receipts) == 1, run.describe()
    assert run.outputs[-1] is receipts[0], run.describe()
    assert "\n" not in receipts[0]["text"]
    return receipts[0]["text"]


def seconds(line: str, before: str) -> float:
    """The number of seconds ``line`` says right after ``before``."""
    match = re.search(re.escape(before) + r"(\d+\.\d) s", line)
    assert match, (before, line)
    return float(match.group(1))


def test_the_receipt_comes_after_the_cells_output_and_its_traceback(on_broker, kernels):
    (kernel,) = loaded(kernels, 1)

    failed = kernel.run(
        "%%gpu\nimport sys\nprint('printed')\nprint('warned', file=sys.stderr)\n1 / 0"
    )

    kinds = [o.get("name", o["kind"]) for o in failed.outputs]
    assert kinds == ["stdout", "stderr", "error", "data"], failed.describe()
    assert re.fullmatch(r"gpushare: cell done: queued 0\.\d s, ran 0\.\d s, never paused",
                        receipt_of(failed)), failed.describe()  # fmt: skip
    valued = kernel.run("%%gpu\nprint('printed')\n6 * 7").ok()
    assert [o["text"].strip() for o in valued.outputs[:2]] == ["printed", "42"]
    receipt_of(valued)


def test_a_paused_cells_receipt_tells_running_from_paused(on_broker, kernels, tmp_path):
    low, high = loaded(kernels, 2)
    release = tmp_path / "release"
    paused = low.submit(holding_cell(release, priority="low"))
    paused.wait_shown("holding since")
    urgent = high.submit("%%gpu priority=high\nimport time\ntime.sleep(3)")
    paused.wait_shown("gpushare: paused for a higher-priority session")
    urgent.ok()
    wait_for(
        lambda: any(v.state == LeaseState.RUNNING for v in on_broker.leases_of(low.pid)),
        "the low cell to run again",
    )
    release.touch()
    paused.ok()

    line = receipt_of(paused)
    assert re.fullmatch(
        r"gpushare: cell done: queued \d+\.\d s, ran \d+\.\d s, paused \d+\.\d s for "
        rf"{re.escape(ME)} \(gate\)",
        line,
    ), line
    ran, paused_s = seconds(line, "ran "), seconds(line, "paused ")
    held = float(paused.stdout_value("released at")) - float(paused.stdout_value("holding since"))
    assert paused_s >= 2.5, line  # the high cell's 3 s
    assert abs(ran + paused_s - held) < 1.0, (line, held)  # together: the time it held


def test_a_cell_whose_lease_an_admin_cancels_gets_a_receipt(on_broker, kernels, tmp_path):
    (kernel,) = loaded(kernels, 1)
    release = tmp_path / "release"
    cell = kernel.submit(holding_cell(release, priority="normal"))
    cell.wait_shown("holding since")
    (lease,) = on_broker.leases_of(kernel.pid)
    cancel = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "admin", "cancel", lease.lease_id,
         "--socket", str(on_broker.socket)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cancel.returncode == 0, cancel.stderr
    cell.wait_shown("gpushare: lease revoked")
    time.sleep(1.5)  # the cell runs on without its lease a while
    release.touch()
    cell.ok()

    line = receipt_of(cell)
    assert re.fullmatch(
        r"gpushare: cell done: queued \d+\.\d s, ran \d+\.\d s, never paused; lease revoked "
        r"\(cancelled by an admin\): the last \d+\.\d s ran without a lease",
        line,
    ), line
    assert 1.5 <= seconds(line, "the last ") <= seconds(line, "ran "), line
