"""Broker restarts seen from real notebooks: a real SIGTERM and a real ``kill -9``.

* a cell paused for a higher-priority one stays paused across the restart (the
  preemption is not lost), resumes when the other ends, and says "resumed";
* if the higher-priority cell ended while the broker was down, the paused cell is not
  left frozen: it runs on as soon as the new broker knows;
* a request queued when the broker went down is still answered by the next one;
* a lease granted on the new connection right after the restart is never mistaken for
  one lost in it, and the kernel keeps one connection.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from runtime_helpers import BrokerProcess, holding_cell, wait_for

from gpushare_ext.protocol import LeaseState

RESTARTS = [
    pytest.param(signal.SIGTERM, id="sigterm"),
    pytest.param(signal.SIGKILL, id="kill-9"),
]
LOST = ("revoked", "did not give the lease back", "did not keep this request")


def _looping_cell(progress: Path, stop: Path) -> str:
    """A low-priority training loop that records its progress and stops on request."""
    return (
        "%%gpu priority=low\n"
        "import os, time, gpushare_ext\n"
        "steps = 0\n"
        "print('looping', flush=True)\n"
        "deadline = time.time() + 150\n"
        f"while not os.path.exists({str(stop)!r}) and time.time() < deadline:\n"
        "    gpushare_ext.safe_point()\n"
        "    steps += 1\n"
        f"    open({str(progress)!r}, 'w').write(str(steps))\n"
        "    time.sleep(0.01)\n"
        "print('steps', steps)\n"
    )


def _steps(progress: Path) -> int:
    try:
        return int(progress.read_text() or 0)
    except (OSError, ValueError):
        return 0


def _states(broker: BrokerProcess, pid: int) -> list[LeaseState]:
    try:
        return [lease.state for lease in broker.leases_of(pid)]
    except Exception:  # the broker is between lives
        return []


def _restart(broker: BrokerProcess, how: int) -> None:
    assert broker.stop(how) == (0 if how == signal.SIGTERM else -how), broker.log_tail()
    broker.start()  # same socket, same journal


def _paused_pair(extra_broker, kernels, monkeypatch, tmp_path):
    broker: BrokerProcess = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    low, high = kernels(2)
    for kernel in (low, high):
        kernel.run("%load_ext gpushare_ext").ok()
    progress, stop, release = tmp_path / "progress", tmp_path / "stop", tmp_path / "release"
    loop = low.submit(_looping_cell(progress, stop))
    loop.wait_shown("looping")
    hold = high.submit(holding_cell(release, priority="high"))
    hold.wait_shown("holding since")
    loop.wait_shown("paused for a higher-priority session")
    wait_for(lambda: _states(broker, low.pid) == [LeaseState.PAUSED], "the low lease paused")
    return broker, low, high, loop, hold, progress, stop, release


def _does_not_move(progress: Path, seconds: float = 1.5) -> bool:
    import time

    before = _steps(progress)
    time.sleep(seconds)
    return _steps(progress) - before <= 1  # one step may have been on its way


@pytest.mark.parametrize("how", RESTARTS)
def test_a_paused_cell_stays_paused_over_a_restart_and_then_resumes(
    how, extra_broker, kernels, monkeypatch, tmp_path
):
    broker, low, high, loop, hold, progress, stop, release = _paused_pair(
        extra_broker, kernels, monkeypatch, tmp_path
    )
    assert _does_not_move(progress)

    _restart(broker, how)

    wait_for(
        lambda: (
            _states(broker, low.pid) == [LeaseState.PAUSED]
            and _states(broker, high.pid) == [LeaseState.RUNNING]
        ),
        "both sessions to reclaim their leases, the low one paused again",
        30,
    )
    wait_for(lambda: _does_not_move(progress), "the low cell to be held again", 20)

    release.touch()
    hold.ok(30)
    wait_for(lambda: _states(broker, low.pid) == [LeaseState.RUNNING], "the low lease to resume")
    loop.wait_shown("resumed after", 20)
    before = _steps(progress)
    wait_for(lambda: _steps(progress) > before + 5, "the low cell to make progress again")
    stop.touch()
    loop.ok(30)
    shown = loop.shown_text() + hold.shown_text()
    assert not any(word in shown for word in LOST), loop.describe() + hold.describe()
    # The pause line is not left saying "paused ..." (the receipt after it sums up).
    *lines, receipt = loop.final_text().splitlines()
    assert receipt.startswith("gpushare: cell done: ") and "paused" not in lines[-1], lines
    wait_for(lambda: not broker.leases(), "every lease released after the cells")


def test_a_paused_cell_is_not_left_frozen_when_the_other_ended_while_the_broker_was_down(
    extra_broker, kernels, monkeypatch, tmp_path
):
    broker, low, high, loop, hold, progress, stop, release = _paused_pair(
        extra_broker, kernels, monkeypatch, tmp_path
    )

    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
    release.touch()
    hold.ok(30)  # the high cell ends; its release reaches no broker
    broker.start()

    wait_for(
        lambda: _states(broker, low.pid) == [LeaseState.RUNNING],
        "the low lease to run once the broker learned the high one is gone",
        30,
    )
    wait_for(lambda: not _states(broker, high.pid), "the high kernel's old lease to end", 10)
    before = _steps(progress)
    wait_for(lambda: _steps(progress) > before + 10, "the low cell to run on", 20)
    stop.touch()
    loop.ok(30)
    assert not any(word in loop.shown_text() for word in LOST), loop.describe()


@pytest.mark.parametrize("how", RESTARTS)
def test_a_request_queued_when_the_broker_restarts_is_answered_by_the_next(
    how, extra_broker, kernels, monkeypatch, tmp_path
):
    broker: BrokerProcess = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    holder, waiter = kernels(2)
    for kernel in (holder, waiter):
        kernel.run("%load_ext gpushare_ext").ok()
    release = tmp_path / "release"
    hold = holder.submit(holding_cell(release, priority="normal", extra="mem=100GiB"))
    hold.wait_shown("holding since")
    wait = waiter.submit("%%gpu priority=normal mem=100GiB\nprint('the waiter ran')")
    wait.wait_shown("queued: position 1")

    _restart(broker, how)

    wait_for(
        lambda: (
            _states(broker, waiter.pid) == [LeaseState.QUEUED]
            and _states(broker, holder.pid) == [LeaseState.RUNNING]
        ),
        "the new broker to know the holder and the queued request",
        30,
    )
    release.touch()
    hold.ok(30)
    wait.ok(30)
    assert "the waiter ran" in wait.final_text()
    assert not any(word in wait.shown_text() for word in LOST), wait.describe()
    wait_for(lambda: not broker.leases(), "every lease released after the cells")


def test_a_lease_granted_right_after_a_restart_is_kept_and_the_kernel_has_one_connection(
    extra_broker, kernels, monkeypatch
):
    broker: BrokerProcess = extra_broker()
    monkeypatch.setenv("GPUSHARE_SOCKET", str(broker.socket))
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    kernel.run("%%gpu\nprint('connected')").ok()

    _restart(broker, signal.SIGTERM)
    # At once: before the session's own reconnect has run.
    cell = kernel.submit("%%gpu\nimport time\ntime.sleep(3)\nprint('cell done')")
    cell.ok(60)

    assert "cell done" in cell.final_text()
    assert not any(word in cell.shown_text() for word in LOST), cell.describe()
    count = kernel.run(
        "import gc\n"
        "from gpushare_ext.client import BrokerClient\n"
        "print('live', sum(1 for o in gc.get_objects()\n"
        "                  if isinstance(o, BrokerClient) and not o.closed.is_set()))"
    ).ok()
    assert count.stdout_value("live") == "1"
    wait_for(lambda: not broker.leases(), "the lease released after the cell")
