"""Chaos mode: an admin has the broker pause one process at random moments.

The schedule is pure (seeded; drawn from the times it is given), so it is checked
directly; the runner is checked against a real broker subprocess on the simulated H200,
watching the control block of a real session as its launch shim would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from support import is_root, run_as

from gpushare_ext.broker.hands.chaos import ChaosError, ChaosSchedule, ChaosSpec
from gpushare_ext.client import BrokerClient, BrokerError
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import ErrorCode, Granted, PreemptionLevel

GATE, YIELD, LOCK, EVICT = (
    PreemptionLevel.GATE,
    PreemptionLevel.YIELD,
    PreemptionLevel.LOCK,
    PreemptionLevel.EVICT,
)


def _pauses(schedule: ChaosSchedule, count: int, start: float = 0.0) -> list:
    pauses, now = [], start
    for _ in range(count):
        pause = schedule.next_pause(now)
        if pause is None:
            break
        pauses.append(pause)
        now = pause.ends_at
    return pauses


def test_the_schedule_keeps_to_the_ranges_asked_for():
    spec = ChaosSpec(pid=1, every_ms=(5, 50), pause_ms=(1, 20), seed=7)
    pauses = _pauses(ChaosSchedule(spec, started_at=0.0), 500)
    assert len(pauses) == 500
    previous_end = 0.0
    for pause in pauses:
        assert 0.005 <= pause.starts_at - previous_end <= 0.050 + 1e-9
        assert 0.001 <= pause.ends_at - pause.starts_at <= 0.020 + 1e-9
        previous_end = pause.ends_at
    # Every level asked for comes up.
    assert {p.level for p in pauses} == {GATE, YIELD, LOCK}


def test_the_same_seed_replays_the_same_pauses():
    spec = ChaosSpec(pid=1, seed=42)
    first = _pauses(ChaosSchedule(spec, started_at=10.0), 50, 10.0)
    again = _pauses(ChaosSchedule(spec, started_at=10.0), 50, 10.0)
    other = _pauses(ChaosSchedule(ChaosSpec(pid=1, seed=43), started_at=10.0), 50, 10.0)
    assert first == again and first != other


def test_only_levels_the_session_can_be_stopped_at_are_drawn():
    spec = ChaosSpec(pid=1, levels=(GATE, YIELD, LOCK), seed=1)
    without_flag = ChaosSchedule(spec, started_at=0.0, allowed=(GATE, LOCK, EVICT))
    assert {p.level for p in _pauses(without_flag, 200)} == {GATE, LOCK}
    # Nothing asked for is allowed: the deepest allowed level below what was asked.
    simulated = ChaosSchedule(
        ChaosSpec(pid=1, levels=(LOCK,), seed=1), started_at=0.0, allowed=(GATE,)
    )
    assert {p.level for p in _pauses(simulated, 20)} == {GATE}


def test_the_schedule_ends_with_its_duration():
    spec = ChaosSpec(pid=1, every_ms=(10, 10), pause_ms=(10, 10), duration_s=1.0)
    pauses = _pauses(ChaosSchedule(spec, started_at=100.0), 1000, 100.0)
    assert 45 <= len(pauses) <= 50  # a pause every 20 ms for one second
    assert all(p.starts_at < 101.0 for p in pauses)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (ChaosSpec(pid=1, every_ms=(0, 5)), "every must be a range"),
        (ChaosSpec(pid=1, pause_ms=(20, 1)), "pause must be a range"),
        (ChaosSpec(pid=1, levels=()), "at least one ladder level"),
        (ChaosSpec(pid=1, duration_s=-1), "duration must be"),
    ],
)
def test_a_request_that_makes_no_sense_is_refused_in_one_line(spec, says):
    with pytest.raises(ChaosError) as raised:
        spec.check()
    assert says in str(raised.value) and "\n" not in str(raised.value)


# ------------------------------------------------------------------ a real broker


def _flips(block: ControlBlock, seconds: float) -> tuple[int, int]:
    """(times the block went paused, times it went running) while watching it."""
    paused_seen = running_seen = 0
    was_paused = block.paused
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now_paused = block.paused
        if now_paused and not was_paused:
            paused_seen += 1
        elif was_paused and not now_paused:
            running_seen += 1
        was_paused = now_paused
        time.sleep(0.0002)
    return paused_seen, running_seen


def test_a_chaos_run_pauses_a_session_again_and_again_and_lets_it_go(broker):
    with BrokerClient(broker) as session, BrokerClient(broker, client="cli") as admin:
        block = ControlBlock.open(session.welcome.control_block)
        granted = session.request_lease(priority=50, memory_bytes=1 << 30)
        assert isinstance(granted, Granted)
        said = admin.chaos(
            os.getpid(), every_ms=(5, 20), pause_ms=(2, 10), levels=(0, 1, 3), duration_s=1.5
        )
        assert said.startswith("chaos: pid ") and "seed 0" in said
        paused, resumed = _flips(block, 2.5)
        # About 1.5 s / (12.5 ms + 6 ms) pauses; the watcher may miss a few short ones.
        assert paused >= 20 and abs(paused - resumed) <= 1, (paused, resumed)
        assert not block.paused and not block.gate_closed
        assert block.state is not None  # the lease still runs: the state word says so
        notes = " ".join(admin.status().notes)
        assert "chaos" not in notes  # it ended with its duration
        block.close()


def test_a_lease_that_ends_during_chaos_leaves_no_lease_in_the_block(broker):
    with BrokerClient(broker) as session, BrokerClient(broker, client="cli") as admin:
        block = ControlBlock.open(session.welcome.control_block)
        granted = session.request_lease(priority=50, memory_bytes=1 << 30)
        admin.chaos(os.getpid(), every_ms=(1, 2), pause_ms=(30, 40), levels=(0,))
        deadline = time.monotonic() + 5
        while not block.paused and time.monotonic() < deadline:
            time.sleep(0.001)
        assert block.paused
        session.release(granted.lease_id)
        time.sleep(0.2)
        stopped = admin.chaos(os.getpid(), stop=True)
        assert "pauses so far" in stopped
        assert block.state is None and not block.gate_closed  # no lease, nothing held
        block.close()


def _try_chaos(socket_path, pid: int) -> str:
    with BrokerClient(socket_path, client="cli") as client:
        try:
            return client.chaos(pid)
        except BrokerError as exc:
            return f"{exc.code.value}: {exc.message}"


@pytest.mark.skipif(not is_root(), reason="needs a second user (nobody) to be refused")
def test_only_admins_may_start_chaos(start_broker):
    running = start_broker(system=True)  # other users reach a system broker's socket
    with BrokerClient(running.socket) as session:
        session.request_lease(priority=50, memory_bytes=1 << 30)
        said = run_as("nobody", _try_chaos, running.socket, os.getpid())
    assert said.startswith(f"{ErrorCode.PERMISSION.value}: only admins may start chaos mode")


def _cli(socket_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "chaos", "--socket", str(socket_path), *argv],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_gpushare_chaos_starts_shows_in_status_and_stops(broker):
    with BrokerClient(broker) as session, BrokerClient(broker, client="cli") as viewer:
        session.request_lease(priority=50, memory_bytes=1 << 30)
        started = _cli(broker, str(os.getpid()), "--every", "5-10", "--pause", "1-2", "--seed", "3")
        assert started.returncode == 0, started.stderr
        assert "seed 3" in started.stdout
        assert any(note.startswith("chaos: pid ") for note in viewer.status().notes)
        time.sleep(0.3)
        stopped = _cli(broker, str(os.getpid()), "--stop")
        assert stopped.returncode == 0 and "pauses so far" in stopped.stdout
        assert int(stopped.stdout.split(" pauses so far")[0].rsplit(" ", 1)[1]) > 3
        assert not any(note.startswith("chaos:") for note in viewer.status().notes)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["abc"], "chaos needs a process id"),
        (["1", "--every", "x-y"], "--every takes milliseconds"),
        (["1", "--levels", "0,9"], "--levels takes ladder levels from 0 to 4"),
        (["1", "--levels", "a"], "--levels takes levels like 0,1,3"),
    ],
)
def test_gpushare_chaos_refuses_bad_arguments_in_one_line(broker, argv, says):
    done = _cli(broker, *argv)
    assert done.returncode == 2 and says in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
