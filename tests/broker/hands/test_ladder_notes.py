"""What status says stopped a victim: the rungs of the ladder actually applied."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from scheduler_helpers import HIGH, LOW, YIELDING, Hub, h200_devices, only

from gpushare_ext.broker.hands.actuators import (
    Applied,
    Ladder,
    SimulatedProcessControl,
    Target,
    _what_stopped,
)
from gpushare_ext.broker.scheduler import core
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import LeaseState, PreemptionLevel, applied_level


class RecordingControl:
    """A process control that records what it was asked (kind "cuda" as on a GPU host),
    so the ladder's choices and its note can be checked without a GPU."""

    kind = "cuda"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def lock(self, pid, device, timeout_ms):
        self.calls.append(("lock", pid))

    def unlock(self, pid, device):
        self.calls.append(("unlock", pid))

    def checkpoint(self, pid, device):
        self.calls.append(("checkpoint", pid))

    def restore(self, pid, device):
        self.calls.append(("restore", pid))

    def open_yield_flag(self, device, handle, offset):
        self.calls.append(("open", handle))

    def write_yield_flag(self, device, handle, offset, value):
        self.calls.append(("flag", value))


def test_a_locked_session_with_a_flag_reports_every_rung(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "s.cb")
    control = RecordingControl()
    ladder = Ladder(control, lock_timeout_ms=1000)
    target = Target(
        lease_id="L1", pid=4242, device_index=0, control_block=block, yield_flag=("00", 0)
    )
    applied = asyncio.run(
        ladder.apply(target, PreemptionLevel.LOCK, "a high cell", LeaseState.PAUSED)
    )
    # The flag is raised before the lock, so the lock finds preemptible kernels gone.
    assert [c[0] for c in control.calls] == ["flag", "lock"]
    assert applied.note == "stopped by: launches held, yield flag, process lock"
    assert applied.level == PreemptionLevel.LOCK
    block.close()


def test_a_registered_flag_is_opened_ahead_so_a_pause_only_writes_it():
    control = RecordingControl()
    ladder = Ladder(control)
    assert asyncio.run(ladder.open_yield_flag(0, ("ab" * 64, 0)))
    assert control.calls == [("open", "ab" * 64)]
    # The session registers the same flag with its next lease: already open.
    assert asyncio.run(ladder.open_yield_flag(0, ("ab" * 64, 0)))
    assert control.calls == [("open", "ab" * 64)]


def test_a_flag_that_cannot_be_opened_ahead_is_left_to_the_pause():
    # A simulated GPU has no flags: the open says no and nothing is raised.
    assert (
        asyncio.run(Ladder(SimulatedProcessControl()).open_yield_flag(0, ("ab" * 64, 0))) is False
    )


def test_without_a_control_block_or_flag_only_the_lock_is_named():
    target = Target(lease_id="L2", pid=1, device_index=0, control_block=None)
    assert _what_stopped(target, PreemptionLevel.LOCK, True) == ["process lock"]
    assert _what_stopped(target, PreemptionLevel.EVICT, True) == [
        "process lock",
        "checkpoint to host",
    ]
    assert _what_stopped(target, PreemptionLevel.GATE, False) == ["nothing (no way to stop it)"]


@pytest.mark.parametrize("level", list(PreemptionLevel)[1:], ids=lambda level: level.name)
def test_on_a_simulated_gpu_every_level_above_the_gate_is_said_to_have_gated(
    level: PreemptionLevel, tmp_path: Path
):
    block = ControlBlock.create(tmp_path / "s.cb")
    ladder = Ladder(SimulatedProcessControl())
    # this very process: the simulated lock wants a live pid, and touches none
    target = Target(lease_id="L1", pid=os.getpid(), device_index=0, control_block=block)

    applied = asyncio.run(ladder.apply(target, level, "a high cell", LeaseState.PAUSED))

    assert applied.note == "simulated GPU: the process was gated, not locked"
    assert applied_level(level, simulated=True) == PreemptionLevel.GATE
    assert block.gate_closed  # the one rung that is real there
    asyncio.run(ladder.undo(target, level))
    block.close()


def test_on_a_simulated_gpu_the_gate_asked_is_the_gate_applied(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "s.cb")
    target = Target(lease_id="L1", pid=os.getpid(), device_index=0, control_block=block)

    applied = asyncio.run(
        Ladder(SimulatedProcessControl()).apply(target, PreemptionLevel.GATE, "", LeaseState.PAUSED)
    )

    assert applied == Applied(
        level=PreemptionLevel.GATE, held_by=PreemptionLevel.GATE, note="stopped by: launches held"
    )
    block.close()


def test_a_yield_asked_without_a_flag_is_applied_and_recorded_as_the_lock(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "s.cb")
    control = RecordingControl()
    target = Target(lease_id="low", pid=4242, device_index=0, control_block=block)

    applied = asyncio.run(
        Ladder(control).apply(target, PreemptionLevel.YIELD, "a high cell", LeaseState.PAUSED)
    )

    assert control.calls == [("lock", 4242)]
    assert applied.level == PreemptionLevel.LOCK
    assert applied.note.startswith("no yield flag registered: locked instead")
    block.close()

    # The core keeps what was applied, not what it asked: status says "lock".
    hub = Hub()
    trainer, explorer = hub.open("trainer"), hub.open("explorer")
    hub.request(trainer, "low", priority=LOW, capabilities=YIELDING)
    pause = only(hub.request(explorer, "high", priority=HIGH), core.PauseLease)
    assert pause.level == PreemptionLevel.YIELD
    hub.handle(
        core.PreemptionApplied(
            now=hub.now, lease_id="low", level=pause.level, applied_level=applied.level
        )
    )
    lease = hub.lease("low")
    assert (lease.applied_level, lease.pending_level) == (PreemptionLevel.LOCK, None)
    assert hub.scheduler.book.rung_holding(lease.stop.in_force) == PreemptionLevel.LOCK
    simulated = core.Scheduler(h200_devices(), simulated_control=True)
    assert simulated.book.rung_holding(lease.stop.in_force) == PreemptionLevel.GATE  # the gate
