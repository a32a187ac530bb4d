"""Ending a wait, in a real ipykernel: each way ends in one line, and at once.

* Interrupting a queued cell: its queue line says the request was withdrawn, and the
  interrupt is one line, ``KeyboardInterrupt: the cell did not run``, within a second.
* With the broker gone, ``timeout=2s`` is kept: the cell's live "the broker is
  restarting; reconnecting" line becomes "stopped waiting for the broker after 2 s (timed
  out)" and the cell ends with one error line; an interrupt ends the wait within a
  second, the line saying so.
"""

from __future__ import annotations

import time

from runtime_helpers import holding_cell, loaded

INTERRUPTED = "KeyboardInterrupt: the cell did not run"
EXCLUSIVE = '[broker]\nsharing = "exclusive"\n'


def shown_at(run, text: str) -> float:
    """When (``time.time()``) a text containing ``text`` was first shown."""
    return next(when for when, shown in run.shown if text in shown)


def lines_of(run) -> list[str]:
    return [line for line in run.final_text().splitlines() if line.strip()]


def interrupted_within_a_second(kernel, run) -> None:
    """Interrupt ``kernel`` and require its one-line interrupt within a second."""
    asked = time.time()
    kernel.interrupt()
    run.wait(timeout=30)
    assert run.error is not None and run.error["ename"] == "KeyboardInterrupt", run.describe()
    assert run.error["traceback"] == INTERRUPTED, run.error["traceback"]
    assert shown_at(run, INTERRUPTED) - asked < 1.0, run.describe()


def test_interrupting_a_queued_cell_is_one_line_after_its_withdrawn_line(
    extra_broker, kernels, monkeypatch, tmp_path
):
    monkeypatch.setenv("GPUSHARE_SOCKET", str(extra_broker(EXCLUSIVE).socket))
    holder, waiter = loaded(kernels, 2)
    release = tmp_path / "release"
    held = holder.submit(holding_cell(release, priority="high"))
    held.wait_shown("holding since")
    waiting = waiter.submit("%%gpu priority=low\nside_effect = 'the body ran'")
    waiting.wait_shown("queued: position 1")

    interrupted_within_a_second(waiter, waiting)

    withdrawn, last = lines_of(waiting)
    assert withdrawn.startswith("gpushare: request withdrawn after "), waiting.describe()
    assert withdrawn.endswith(" s in the queue (interrupted)"), waiting.describe()
    assert last == INTERRUPTED
    assert "NameError" in waiter.run("side_effect").final_text()
    release.touch()
    held.ok()


def test_with_the_broker_gone_the_cells_timeout_is_kept(extra_broker, kernels, monkeypatch):
    broker = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    (kernel,) = loaded(kernels, 1)
    kernel.run("%%gpu\nx = 1").ok()  # the kernel knows its broker
    broker.stop()

    started = time.time()
    run = kernel.run("%%gpu timeout=2s\nside_effect = 'the body ran'", timeout=60)

    took = run.finished_at - started
    assert 2.0 <= took < 3.5, f"{took:.1f} s\n{run.describe()}"
    assert run.status == "error", run.describe()
    stopped, error = lines_of(run)
    assert stopped == "gpushare: stopped waiting for the broker after 2 s (timed out)"
    assert error == (
        f"UsageError: gpushare: no GPU within 2 s: the broker on {broker.socket} went away "
        "and was not back in time; the request was not made and the cell did not run"
    ), run.describe()
    assert "reconnecting -- 2 s" in run.shown_text()  # it counted while it waited
    assert not [text for _, text in run.shown if "reconnecting -- 3 s" in text]
    assert "NameError" in kernel.run("side_effect").final_text()


def test_with_the_broker_gone_an_interrupt_ends_the_wait_in_one_line(
    extra_broker, kernels, monkeypatch
):
    broker = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    (kernel,) = loaded(kernels, 1)
    kernel.run("%%gpu\nx = 1").ok()
    broker.stop()
    run = kernel.submit("%%gpu\nside_effect = 'the body ran'")
    run.wait_shown("gpushare: the broker is restarting; reconnecting -- 1 s")

    interrupted_within_a_second(kernel, run)

    stopped, last = lines_of(run)
    assert stopped.startswith("gpushare: stopped waiting for the broker after ")
    assert stopped.endswith(" s (interrupted)"), run.describe()  # not left "reconnecting"
    assert last == INTERRUPTED
    assert "NameError" in kernel.run("side_effect").final_text()
