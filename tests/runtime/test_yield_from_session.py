"""The session raises its own yield flag when the broker's control block asks for a
pause at the yield level, and lowers it once the broker has published the resume.

The flag here is a host stand-in for the device word (no GPU on this machine): the
logic under test reads and writes it only through ``read``/``set``, as it does the real
``YieldFlag``. The GPU path is covered by ``benchmarks.third_party`` on the H200.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from gpushare_ext.control_block import ControlBlock
from gpushare_ext.lease_state import LeaseState
from gpushare_ext.protocol import PreemptionLevel
from gpushare_ext.runtime.paused import asked_to_yield, wait_until_resumed


class HostFlag:
    def __init__(self, value: int = 0) -> None:
        self.value = value
        self.writes: list[int] = []

    def read(self) -> int:
        return self.value

    def set(self, value: int = 1) -> None:
        self.value = value
        self.writes.append(value)


@pytest.fixture
def block(tmp_path: Path):
    b = ControlBlock.create(tmp_path / "s.cb")
    yield b
    b.close()


@pytest.mark.parametrize(
    ("state", "level", "asked"),
    [
        (LeaseState.RUNNING, None, False),
        (LeaseState.PAUSED, PreemptionLevel.GATE, False),  # hold new launches only
        (LeaseState.PAUSED, PreemptionLevel.YIELD, True),
        (LeaseState.PAUSED, PreemptionLevel.LOCK, True),
        (LeaseState.EVICTED, PreemptionLevel.EVICT, True),
    ],
)
def test_only_a_pause_at_the_yield_level_or_above_asks_kernels_to_stop(block, state, level, asked):
    block.publish(gate_closed=True, state=state, level=None if level is None else int(level))
    assert asked_to_yield(block) is asked


def test_no_control_block_never_asks():
    assert asked_to_yield(None) is False


def _later(seconds: float, action) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_the_session_lowers_its_own_flag_once_the_broker_resumes(block):
    block.publish(gate_closed=False, state=LeaseState.PAUSED, level=int(PreemptionLevel.YIELD))
    flag = HostFlag(1)  # raised by the session when it saw the pause
    resume = _later(0.05, lambda: block.publish(gate_closed=False, state=LeaseState.RUNNING))
    started = time.monotonic()
    wait_until_resumed(lambda: block, flag)
    resume.join()
    assert time.monotonic() - started >= 0.04  # it waited for the resume
    assert flag.value == 0 and flag.writes == [0]


def test_a_flag_the_broker_raised_at_the_gate_level_is_left_to_the_broker(block):
    block.publish(gate_closed=True, state=LeaseState.PAUSED, level=int(PreemptionLevel.GATE))
    flag = HostFlag(1)
    lower = _later(0.05, lambda: flag.set(0))  # the broker's own write
    wait_until_resumed(lambda: block, flag)
    lower.join()
    assert flag.writes == [0]  # only the broker's write: the session did not touch it


def test_running_with_a_clear_flag_returns_at_once(block):
    block.publish(gate_closed=False, state=LeaseState.RUNNING)
    flag = HostFlag(0)
    wait_until_resumed(lambda: block, flag)
    assert flag.writes == []
