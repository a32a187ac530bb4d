"""The magics in a real ipykernel: what a notebook user types and what they see.

Each test starts real kernels (jupyter_client, IPC transport) talking to this module's
broker on the simulated H200.
"""

from __future__ import annotations

import re

from runtime_helpers import ME, holding_cell, wait_for

from gpushare_ext.protocol import PRIORITY_CLASSES

GIB = 1024**3
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_usage_error_line(run) -> str:
    """The cell failed with exactly one error line ``UsageError: ...``, no traceback.

    (A queue line shown while the cell waited may stay above it.)"""
    assert run.status == "error", run.describe()
    assert "Traceback" not in run.final_text(), run.describe()
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.describe()
    assert lines[0].startswith("UsageError: "), run.describe()
    return lines[0]


def test_a_bad_argument_is_one_line_and_the_cell_does_not_run(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()

    run = kernel.run("%%gpu priority=bogus\nside_effect = 'the body ran'")

    line = one_usage_error_line(run)
    assert line.startswith("UsageError: %%gpu: bad value for priority: "), line
    assert "low | normal | high" in line
    assert "NameError" in kernel.run("side_effect").final_text()
    assert not on_broker.leases_of(kernel.pid), "a bad cell must not ask for a lease"

    for bad, named in [("mem=8XB", "mem"), ("timeout=soon", "timeout"), ("colour=red", "colour")]:
        line = one_usage_error_line(kernel.run(f"%%gpu {bad}\nside_effect = 1"))
        assert named in line, line
    line = one_usage_error_line(kernel.run("%gpuconfig share=2"))
    assert line.startswith("UsageError: %gpuconfig: bad value for share"), line


def test_gpu_help_explains_the_arguments(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()

    run = kernel.run("%%gpu?").ok()

    help_text = ANSI.sub("", "\n".join(run.pages) or run.final_text())
    for word in ("priority", "mem", "timeout", "device", "slice", "share", "queued: position"):
        assert word in help_text, f"{word!r} missing from the help:\n{help_text}"
    assert "{keys}" not in help_text


def test_gpuconfig_sets_the_defaults_of_later_cells(on_broker, kernels, tmp_path):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()

    kernel.run("%gpuconfig priority=low mem=2GiB").ok()
    shown = kernel.run("%gpuconfig").ok().final_text()

    assert "priority=low" in shown and "mem=2.0 GiB" in shown, shown
    release = tmp_path / "release"
    cell = kernel.submit(holding_cell(release, priority="low").replace("priority=low", "", 1))
    cell.wait_shown("holding since")
    (lease,) = on_broker.leases_of(kernel.pid)
    assert (lease.priority, lease.memory_bytes) == (PRIORITY_CLASSES["low"], 2 * GIB)
    release.touch()
    cell.ok()


def test_a_cell_returns_its_value_and_errors_release_the_lease(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()

    value = kernel.run("%%gpu\nx = 6\nx * 7").ok()
    assert "42" in value.final_text(), value.describe()

    failed = kernel.run("%%gpu priority=high\n1 / 0")
    assert failed.error is not None and failed.error["ename"] == "ZeroDivisionError"
    wait_for(lambda: not on_broker.leases_of(kernel.pid), "the failed cell's lease to be released")


def test_unload_ext_removes_the_magics_and_releases_leases(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    kernel.run(
        "import gpushare_ext\n"
        "scope = gpushare_ext.lease(priority='high')\n"
        "held = scope.__enter__()  # a lease held across cells"
    ).ok()
    assert [lease.state.value for lease in on_broker.leases_of(kernel.pid)] == ["running"]

    kernel.run("%unload_ext gpushare_ext").ok()

    wait_for(lambda: not on_broker.leases_of(kernel.pid), "unload to release the held lease")
    gone = kernel.run("%gpuconfig")
    assert "not found" in gone.final_text(), gone.describe()
    gone = kernel.run("%%gpu\nside_effect = 1")
    assert "not found" in gone.final_text(), gone.describe()
    # Nor does a %%gpu cell's code get looked at before it runs (a syntax error in it).
    gone = kernel.run("%%gpu\nside_effect = (")
    assert "not found" in gone.final_text() and gone.error is None, gone.describe()
    kernel.run("%load_ext gpushare_ext").ok()  # and it comes back
    assert "priority=normal" in kernel.run("%gpuconfig").ok().final_text()


def test_timeout_gives_one_line_and_withdraws_the_request(on_broker, kernels, tmp_path):
    holder, waiter = kernels(2)
    holder.run("%load_ext gpushare_ext").ok()
    waiter.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release))
    held.wait_shown("holding since")

    run = waiter.run("%%gpu timeout=1s\nside_effect = 'the body ran'")

    line = one_usage_error_line(run)
    assert line == (
        "UsageError: gpushare: no GPU within 1 s (still at position 1); "
        "the request was withdrawn and the cell did not run"
    ), line
    assert f"waiting for {ME} (priority high)" in run.shown_text(), run.describe()
    assert "NameError" in waiter.run("side_effect").final_text()
    assert not on_broker.leases_of(waiter.pid), "the timed-out request must be withdrawn"
    release.touch()
    held.ok()


def test_gpu_line_magic_release_and_unknown_command(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    assert "no lease was held" in kernel.run("%gpu release").ok().final_text()
    kernel.run("import gpushare_ext\nscope = gpushare_ext.lease()\nheld = scope.__enter__()").ok()
    (lease,) = on_broker.leases_of(kernel.pid)

    released = kernel.run("%gpu release").ok().final_text()

    assert f"released {lease.lease_id}" in released
    wait_for(lambda: not on_broker.leases_of(kernel.pid), "%gpu release to release the lease")
    line = one_usage_error_line(kernel.run("%gpu frobnicate"))
    assert "unknown command 'frobnicate'" in line
