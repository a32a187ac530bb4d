"""What a ``%%gpu`` cell shows when something in it is wrong, in a real ipykernel.

* An error in the cell's code reads as in a cell without ``%%gpu``: ``Cell In[N], line
  L``, N the cell's own number and L counted from the ``%%gpu`` line, with no frame of
  IPython's ``run_cell_magic`` or of gpushare.
* A syntax error is the cell's own, shown before the cell runs: no request reaches the
  broker, so a busy GPU does not keep the cell waiting for nothing.
* A size past what a request may carry names ``mem`` and the limit, never the broker's
  protocol text.
"""

from __future__ import annotations

import re

from runtime_helpers import holding_cell

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What a cell's traceback must not show: IPython's cell-magic call and gpushare's frames.
INTERNALS = ("run_cell_magic", "gpushare_ext", "gpu.py", "session.py", "skipping hidden")


def frames_of(trace: str) -> list[str]:
    """The frame headers of a traceback as IPython prints them ("Cell In[4], line 3")."""
    return [line.strip() for line in trace.splitlines() if re.match(r"\s*(Cell In\[|File )", line)]


def test_an_error_names_the_cells_number_and_its_line_counting_the_gpu_line(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    defined = kernel.run("def helper(v):\n    return 1 / v\n").ok()

    failed = kernel.run("%%gpu priority=high\nx = 1\nprint('before')\nhelper(x - 1)\n")

    assert failed.error is not None and failed.error["ename"] == "ZeroDivisionError"
    number, helper_cell = failed.reply["execution_count"], defined.reply["execution_count"]
    trace = ANSI.sub("", failed.error["traceback"])
    assert frames_of(trace) == [
        f"Cell In[{number}], line 4",
        f"Cell In[{helper_cell}], line 2, in helper(v)",
    ], trace
    assert "----> 4 helper(x - 1)" in trace and "1 %%gpu priority=high" in trace, trace
    assert not [word for word in INTERNALS if word in trace], trace
    assert "before" in failed.final_text()


def test_a_syntax_error_is_the_cells_own_and_no_request_is_made(on_broker, kernels, tmp_path):
    holder, kernel = kernels(2)
    for each in (holder, kernel):
        each.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release))  # the GPU is taken: a request would wait
    held.wait_shown("holding since")

    failed = kernel.run("%%gpu priority=low\nx = 1\ny = (x +\n", timeout=30)

    assert failed.error is not None and failed.error["ename"] == "SyntaxError", failed.describe()
    number = failed.reply["execution_count"]
    trace = ANSI.sub("", failed.error["traceback"])
    assert frames_of(trace) == [f"Cell In[{number}], line 3"], trace
    assert "y = (x +" in trace and not [word for word in INTERNALS if word in trace], trace
    assert not [text for _, text in failed.shown if text.startswith("queued")], failed.describe()
    assert not on_broker.leases_of(kernel.pid)
    release.touch()
    held.ok()
    # The same code without the error runs, under a lease, and shows its value.
    assert "42" in kernel.run("%%gpu\nx = 6\nx * 7").ok().final_text()


def test_a_size_past_the_limit_names_mem_and_the_limit_not_the_protocol(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()

    for magic in ("%%gpu mem=99999999999999999999999GiB\nside_effect = 1",
                  "%gpuconfig mem=99999999999999999999999GiB"):  # fmt: skip
        run = kernel.run(magic)
        assert run.status == "error", run.describe()
        (line,) = [line for line in run.stderr.splitlines() if line.strip()]
        name = magic.split(" ", 1)[0]
        assert line == (
            f"UsageError: {name}: bad value for mem: 99999999999999999999999GiB is more than "
            "1.0 PiB, the most a request may ask for (expected device memory, e.g. 8GiB, 512MiB)"
        ), run.describe()
        assert "invalid message" not in run.final_text() and "$." not in run.final_text()
    assert "NameError" in kernel.run("side_effect").final_text()
    assert not on_broker.leases_of(kernel.pid)
