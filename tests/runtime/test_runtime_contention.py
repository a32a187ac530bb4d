"""Two (or three) notebook kernels contend for the simulated H200, as users would see it.

Kernels are real ipykernel processes; the example notebooks run under nbclient with
their ``parameters`` cell replaced, exactly as ``gpushare demo`` runs them.  A holder
keeps its lease until the test creates a file, so nothing depends on how fast the
machine is.
"""

from __future__ import annotations

import ast
import os
import time

from runtime_helpers import (
    ME,
    cli_status_json,
    holding_cell,
    reference_checksum,
    run_example,
    wait_for,
)

from gpushare_ext.protocol import PRIORITY_CLASSES, LeaseState


def printed_time(run, key: str) -> float:
    value = run.stdout_value(key)
    assert value is not None, f"the cell printed no {key!r}\n{run.describe()}"
    return float(value.split()[0])


def test_a_queued_low_priority_notebook_shows_its_place_and_runs_after_the_holder(
    on_broker, kernels, tmp_path
):
    (holder,) = kernels(1)
    holder.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release, priority="high"))
    held.wait_shown("holding since")
    parameters = {"steps": 8, "step_seconds": 0.01, "size": 64, "use_gpu": False, "seed": 3}

    low = run_example("training_low.ipynb", parameters)

    line = low.wait_shown("queued: position 1, waiting for", timeout=90)
    assert f"waiting for {ME} (priority high)" in line, line
    assert "interrupt the kernel to withdraw" in line, line
    # it keeps waiting while the holder holds: the live line counts the seconds
    low.wait_shown("-- 1 s", timeout=30)
    queued = [lease for lease in on_broker.leases() if lease.state == LeaseState.QUEUED]
    assert [(q.priority, q.position) for q in queued] == [(PRIORITY_CLASSES["low"], 1)]
    released_at = time.time()
    release.touch()

    low.wait(120)
    held.ok()
    final = low.cell_text()
    assert "gpushare: granted after" in final and "s in the queue" in final, final
    first_step = ast.literal_eval(low.value("timeline"))[0]
    assert first_step >= released_at - 0.05, (first_step, released_at, low.describe())
    assert low.value("checksum") == reference_checksum(parameters)


def test_a_high_priority_waiter_is_granted_before_an_earlier_low_one(
    extra_broker, kernels, monkeypatch, tmp_path
):
    # One running lease per GPU, so that a high request queues behind a high holder too.
    exclusive = extra_broker('[broker]\nsharing = "exclusive"\n')
    monkeypatch.setenv("GPUSHARE_SOCKET", str(exclusive.socket))
    holder, low, high = kernels(3)
    for kernel in (holder, low, high):
        kernel.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release, priority="high"))
    held.wait_shown("holding since")
    body = (
        "import time\nprint('started', time.time())\ntime.sleep(0.3)\nprint('ended', time.time())"
    )

    low_cell = low.submit(f"%%gpu priority=low\n{body}")
    low_cell.wait_shown("queued: position 1")
    high_cell = high.submit(f"%%gpu priority=high\n{body}")

    assert "queued: position 1" in high_cell.wait_shown("queued: position")
    low_cell.wait_shown("queued: position 2")  # the later, higher request went ahead of it
    release.touch()
    held.ok()
    high_cell.ok()
    low_cell.ok()
    assert printed_time(high_cell, "started") < printed_time(low_cell, "started")
    assert printed_time(low_cell, "started") >= printed_time(high_cell, "ended") - 0.05


def test_a_low_priority_loop_is_paused_for_a_high_priority_cell_and_resumes_intact(
    on_broker, kernels
):
    (high,) = kernels(1)  # ready before the low one runs, so the preemption lands mid-loop
    high.run("%load_ext gpushare_ext").ok()
    parameters = {"steps": 100, "step_seconds": 0.04, "size": 64, "use_gpu": False, "seed": 11}

    low = run_example("training_low.ipynb", parameters)

    wait_for(
        lambda: any(
            lease.state == LeaseState.RUNNING and lease.priority == PRIORITY_CLASSES["low"]
            for lease in on_broker.leases()
        ),
        "the low-priority loop to run",
        timeout=90,
    )
    time.sleep(0.3)  # a few steps in
    urgent = high.run(
        "%%gpu priority=high\nimport time\nprint('began', time.time())\n"
        "time.sleep(1.5)\nprint('finished', time.time())"
    ).ok()
    low.wait(120)

    # No queue line (its receipt says "queued 0.0 s": no wait is an answer too).
    assert not [text for _, text in urgent.shown if text.startswith("queued")], urgent.describe()
    final = low.cell_text()
    assert "gpushare: paused for a higher-priority session" in final, low.describe()
    assert "resumed after" in final, low.describe()
    pause_shown = [t for t, _, text in low.shown if "paused for a higher-priority" in text]
    resume_shown = [t for t, _, text in low.shown if "resumed after" in text]
    assert pause_shown and resume_shown and pause_shown[0] < resume_shown[-1], low.describe()
    # no step of the low loop began while the high cell ran (one in flight may finish)
    began, finished = printed_time(urgent, "began"), printed_time(urgent, "finished")
    steps = ast.literal_eval(low.value("timeline"))
    assert len(steps) == parameters["steps"]
    during = [t for t in steps if began + 0.2 < t < finished]
    assert not during, f"low steps ran during the high cell: {during}\n{low.describe()}"
    assert low.value("checksum") == reference_checksum(parameters)


def test_interrupting_a_waiting_cell_withdraws_its_request(on_broker, kernels, tmp_path):
    holder, waiter = kernels(2)
    holder.run("%load_ext gpushare_ext").ok()
    waiter.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release))
    held.wait_shown("holding since")
    waiting = waiter.submit("%%gpu priority=low\nside_effect = 'the body ran'")
    waiting.wait_shown("queued: position 1")
    (request,) = [
        lease for lease in cli_status_json(on_broker.socket)["leases"] if lease["pid"] == waiter.pid
    ]
    assert request["state"] == "queued"

    waiter.interrupt()

    waiting.wait(30)
    assert waiting.error is not None and waiting.error["ename"] == "KeyboardInterrupt", (
        waiting.describe()
    )
    wait_for(
        lambda: all(
            lease["lease_id"] != request["lease_id"]
            for lease in cli_status_json(on_broker.socket)["leases"]
        ),
        "gpushare status to stop listing the withdrawn request",
        timeout=10,
    )
    assert "NameError" in waiter.run("side_effect").final_text()
    release.touch()
    held.ok()
    # the kernel is still usable and gets the GPU next time
    assert "ok" in waiter.run("%%gpu priority=low\nprint('ok')").ok().final_text()


def test_interrupting_a_running_cell_releases_its_lease(on_broker, kernels, tmp_path):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    running = kernel.submit(holding_cell(tmp_path / "never"))
    running.wait_shown("holding since")
    assert [lease.state for lease in on_broker.leases_of(kernel.pid)] == [LeaseState.RUNNING]

    kernel.interrupt()

    running.wait(30)
    assert running.error is not None and running.error["ename"] == "KeyboardInterrupt"
    wait_for(lambda: not on_broker.leases_of(kernel.pid), "the interrupted cell's lease to go")


def test_a_kernel_killed_mid_lease_frees_it_for_the_next_in_line(on_broker, kernels, tmp_path):
    holder, waiter = kernels(2)
    holder.run("%load_ext gpushare_ext").ok()
    waiter.run("%load_ext gpushare_ext").ok()
    held = holder.submit(holding_cell(tmp_path / "never"))
    held.wait_shown("holding since")
    waiting = waiter.submit("%%gpu priority=low\nimport time\nprint('granted at', time.time())")
    waiting.wait_shown("queued: position 1")
    assert on_broker.leases_of(holder.pid)

    killed_at = time.monotonic()
    killed_wall = time.time()
    holder.kill()

    wait_for(lambda: not on_broker.leases_of(holder.pid), "the dead kernel's lease to go", 10)
    assert time.monotonic() - killed_at < 2.5, "a dead tenant must lose its lease at once"
    waiting.ok(30)
    assert printed_time(waiting, "granted at") >= killed_wall
    assert not _alive(holder.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie until jupyter_client reaps it
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False
