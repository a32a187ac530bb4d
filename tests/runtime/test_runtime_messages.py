"""What the broker tells a session, as the cell shows it: each notice once, one line, true.

Real kernels (jupyter_client, IPC transport) against real ``gpushare broker --simulate
h200`` subprocesses:

* a priority the policy lowered is said in the cell, whether the grant came at once or
  after a wait in the queue, and with the built-in policy a 299 cell runs at 250;
* a pause on the simulated GPU says the rung the broker applied (the gate), the level
  it was asked for, and agrees with ``gpushare status``;
* an admin's cancel is one line: its own in a running cell, and in a waiting cell the
  error the cell ends with (not that and a second line saying the same).
"""

from __future__ import annotations

import re
import subprocess
import sys

from runtime_helpers import ME, cli_status_json, holding_cell, loaded, wait_for

from gpushare_ext.protocol import PRIORITY_CLASSES, LeaseState

LOWERING_POLICY = """
[broker]
sharing = "exclusive"

[defaults]
max_priority = "normal"
"""


def lines_with(run, text: str) -> list[str]:
    """The lines of the cell's final output that contain ``text``."""
    return [line for line in run.final_text().splitlines() if text in line]


def times_shown(run, text: str) -> int:
    """How many displays (first shows and updates) carried ``text``."""
    return sum(1 for _, shown in run.shown if text in shown)


def test_a_priority_the_policy_lowered_is_one_line_in_the_cell_granted_at_once_or_later(
    extra_broker, kernels, monkeypatch, tmp_path
):
    broker = extra_broker(LOWERING_POLICY)
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    holder, waiter = loaded(kernels, 2)
    notice = "gpushare: priority lowered from high to normal by policy"
    release = tmp_path / "release"

    held = holder.submit(holding_cell(release, priority="high"))
    held.wait_shown("holding since")
    waiting = waiter.submit("%%gpu priority=high\nprint('ran')")
    waiting.wait_shown("queued: position 1")
    waiting.wait_shown(notice)  # said while it waits, not only at its grant
    (queued,) = [lease for lease in broker.leases() if lease.state == LeaseState.QUEUED]
    assert queued.priority == PRIORITY_CLASSES["normal"]
    release.touch()

    held.ok()
    waiting.ok()
    for run in (held, waiting):  # granted at once, and granted after the queue
        assert lines_with(run, "priority lowered") == [notice], run.describe()
        assert times_shown(run, "priority lowered") == 1, run.describe()
    assert "ran" in waiting.final_text()


def test_a_request_the_policy_lowered_keeps_its_work_in_flight_short(
    extra_broker, kernels, monkeypatch
):
    """The launch shim's queue bound follows the priority granted, not the one asked for:
    a high request lowered to normal can be paused, so it must drain fast."""
    broker = extra_broker(LOWERING_POLICY)
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    run = kernel.run(
        "%%gpu priority=high\n"
        "from gpushare_ext.runtime.leases import queue_is_bounded\n"
        "from gpushare_ext.runtime.session import current_session\n"
        "(handle,) = current_session().leases.values()\n"
        "print(handle.options.priority, handle.granted_priority, queue_is_bounded(handle))"
    ).ok()
    high, normal = PRIORITY_CLASSES["high"], PRIORITY_CLASSES["normal"]
    assert f"{high} {normal} True" in run.final_text(), run.describe()


def test_with_the_built_in_policy_a_299_cell_runs_at_250_and_says_so(on_broker, kernels, tmp_path):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"

    cell = kernel.submit(holding_cell(release, priority="299"))

    cell.wait_shown("holding since")
    (lease,) = on_broker.leases_of(kernel.pid)
    assert lease.priority == PRIORITY_CLASSES["high"] == 250
    release.touch()
    cell.ok()
    assert lines_with(cell, "priority lowered") == [
        "gpushare: priority lowered from high (299) to high by policy"
    ], cell.describe()


def test_a_pause_on_the_simulated_gpu_says_the_rung_applied_as_status_does(
    on_broker, kernels, tmp_path
):
    low, high = loaded(kernels, 2)
    low_release, high_release = tmp_path / "low", tmp_path / "high"
    paused = low.submit(holding_cell(low_release, priority="low"))
    paused.wait_shown("holding since")

    urgent = high.submit(holding_cell(high_release, priority="high"))
    urgent.wait_shown("holding since")

    line = paused.wait_shown("gpushare: paused for a higher-priority session")
    (view,) = wait_for(
        lambda: [
            lease
            for lease in on_broker.leases_of(low.pid)
            if lease.state == LeaseState.PAUSED and "gated, not locked" in lease.reason
        ],
        "gpushare status to say what the ladder applied to the paused cell",
    )
    assert view.preemption_level == 0  # the rung that holds it: the gate ...
    assert "simulated GPU: the process was gated, not locked" in view.reason
    # ... and the cell says both, as status does: asked the lock, the gate holds it.
    assert line.startswith(
        "gpushare: paused for a higher-priority session (" + ME + ") at ladder level 0, the "
        "gate (level 3, the process lock, was asked; a simulated GPU is gated, not locked)"
    ), line
    assert "\n" not in line
    high_release.touch()
    urgent.ok()
    low_release.touch()
    paused.ok()
    resumed = lines_with(paused, "resumed after")
    assert len(resumed) == 1 and "at ladder level 0, the gate (" in resumed[0], paused.describe()


def test_every_pause_of_a_cell_is_counted_in_its_one_line(on_broker, kernels, tmp_path):
    """Paused twice: the cell's line ends naming both pauses and their sum, not only the
    last one."""
    low, high = loaded(kernels, 2)
    low_release = tmp_path / "low-release"
    paused = low.submit(holding_cell(low_release, priority="low"))
    paused.wait_shown("holding since")
    for round_ in range(2):
        release = tmp_path / f"high-{round_}"
        urgent = high.submit(holding_cell(release, priority="high"))
        urgent.wait_shown("holding since")
        paused.wait_shown("gpushare: paused for a higher-priority session")
        release.touch()
        urgent.ok()
        wait_for(
            lambda: any(v.state == LeaseState.RUNNING for v in on_broker.leases_of(low.pid)),
            "the low cell to run again",
        )
    low_release.touch()
    paused.ok()
    (line,) = lines_with(paused, "resumed")
    assert "paused twice in this cell (" in line and " s in all)" in line, line
    assert sum(1 for _, shown in paused.shown if "(paused once before) ..." in shown) >= 1
    # The cell's last line, its receipt: queued, ran, each pause for whom and at which rung.
    (receipt,) = lines_with(paused, "cell done")
    assert paused.final_text().rstrip().endswith(receipt), paused.describe()
    assert re.fullmatch(
        r"gpushare: cell done: queued \d+\.\d s, ran \d+\.\d s, paused \d+\.\d s \(twice: "
        rf"\d+\.\d s for {re.escape(ME)} \(gate\), \d+\.\d s for {re.escape(ME)} \(gate\)\)",
        receipt,
    ), receipt


def admin_cancel(broker, lease_id: str) -> None:
    """``gpushare admin cancel LEASE`` as an admin runs it (root is one)."""
    cancel = subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "admin", "cancel", lease_id,
         "--socket", str(broker.socket)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout == f"lease {lease_id} cancelled\n"


def test_an_admin_cancel_of_a_running_cell_is_one_line_in_it(on_broker, kernels, tmp_path):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    cell = kernel.submit(holding_cell(release, priority="normal"))
    cell.wait_shown("holding since")
    (lease,) = on_broker.leases_of(kernel.pid)

    admin_cancel(on_broker, lease.lease_id)

    line = cell.wait_shown("gpushare: lease revoked")
    assert line == (
        "gpushare: lease revoked: cancelled by an admin; the cell goes on without a lease"
    ), line
    assert not [
        entry for entry in cli_status_json(on_broker.socket)["leases"] if entry["pid"] == kernel.pid
    ]
    release.touch()
    cell.ok()
    assert len(lines_with(cell, "gpushare: lease revoked")) == 1, cell.describe()
    assert times_shown(cell, "gpushare: lease revoked") == 1, cell.describe()
    # The receipt comes after it, last, and says so too.
    assert "; lease revoked (cancelled by an admin): " in lines_with(cell, "cell done")[0]


def test_an_admin_cancel_of_a_paused_cell_replaces_its_pause_line(on_broker, kernels, tmp_path):
    low, high = loaded(kernels, 2)
    release = tmp_path / "release"
    paused = low.submit(holding_cell(release, priority="low"))
    paused.wait_shown("holding since")
    urgent = high.submit("%%gpu priority=high\nimport time\ntime.sleep(4)")
    paused.wait_shown("gpushare: paused for a higher-priority session")
    (lease,) = on_broker.leases_of(low.pid)

    admin_cancel(on_broker, lease.lease_id)

    paused.wait_shown("gpushare: lease revoked while paused")
    release.touch()
    paused.ok()
    urgent.ok()
    revoked, receipt = lines_with(paused, "gpushare:")
    assert revoked == (
        "gpushare: lease revoked while paused: cancelled by an admin; the cell goes on "
        "without a lease"
    ), paused.describe()
    assert receipt.startswith("gpushare: cell done: "), paused.describe()
    assert "; lease revoked (cancelled by an admin): " in receipt, receipt
    assert lines_with(paused, "released at"), paused.describe()


def test_an_admin_cancel_of_a_waiting_cell_is_its_one_error_line(on_broker, kernels, tmp_path):
    holder, waiter = loaded(kernels, 2)
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release, priority="high"))
    held.wait_shown("holding since")
    waiting = waiter.submit("%%gpu priority=low\nside_effect = 'the body ran'")
    waiting.wait_shown("queued: position 1")
    (request,) = on_broker.leases_of(waiter.pid)

    admin_cancel(on_broker, request.lease_id)

    waiting.wait()
    assert waiting.status == "error", waiting.describe()
    assert lines_with(waiting, "revoked") == [
        "UsageError: gpushare: request revoked: cancelled by an admin"
    ], waiting.describe()
    assert "NameError" in waiter.run("side_effect").final_text()
    release.touch()
    held.ok()


def test_an_error_in_a_gpu_cell_shows_its_source_line(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    failed = kernel.run("%%gpu\nx = 1\ny = x / 0\n")
    assert failed.error is not None and failed.error["ename"] == "ZeroDivisionError"
    trace = re.sub(r"\x1b\[[0-9;]*m", "", failed.error["traceback"])
    assert "----> 3 y = x / 0" in trace, trace  # line 3: the %%gpu line is line 1
    assert "Could not get source" not in trace


def test_interrupting_a_queued_cell_says_withdrawn_in_its_line_and_nothing_more(
    extra_broker, kernels, monkeypatch, tmp_path
):
    broker = extra_broker('[broker]\nsharing = "exclusive"\n')
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    holder, waiter = loaded(kernels, 2)
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release, priority="high"))
    held.wait_shown("holding since")
    waiting = waiter.submit("%%gpu priority=low\nprint('ran')")
    waiting.wait_shown("queued: position 1")
    waiter.interrupt()
    waiting.wait(timeout=30)
    release.touch()
    held.ok()
    assert waiting.error is not None and waiting.error["ename"] == "KeyboardInterrupt"
    # One line: no trace through the magic or the queue's waits.
    assert waiting.error["traceback"] == "KeyboardInterrupt: the cell did not run"
    (line,) = lines_with(waiting, "gpushare: request withdrawn after")
    assert line.endswith("s in the queue (interrupted)"), line
    assert not lines_with(waiting, "interrupt the kernel to withdraw")  # not left frozen
