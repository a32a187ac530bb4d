"""The relay that keeps a gang's workers' control block in step with the session's
block after a broker restart (two real mapped blocks, a real thread)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from gpushare_ext.control_block import IPC_IMPORTS_OFFSET, ControlBlock
from gpushare_ext.protocol import LeaseState
from gpushare_ext.runtime.gate import GateRelay


def _eventually(predicate, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.001)
    return bool(predicate())


def _blocks(tmp_path: Path) -> tuple[ControlBlock, ControlBlock]:
    followed = ControlBlock.create(tmp_path / "before-restart.cb")
    followed.publish(gate_closed=False, state=LeaseState.RUNNING)
    return followed, ControlBlock.create(tmp_path / "after-restart.cb")


def _relay_threads() -> int:
    return sum(thread.name == "gpushare-gate-relay" for thread in threading.enumerate())


def test_no_thread_runs_until_the_session_has_a_new_block(tmp_path):
    followed, _ = _blocks(tmp_path)
    before = _relay_threads()
    relay = GateRelay(followed)
    relay.follow(followed)  # the session's block is still the one the workers map
    assert _relay_threads() == before
    relay.close()


def test_every_change_of_the_new_block_reaches_the_followed_one(tmp_path):
    followed, current = _blocks(tmp_path)
    relay = GateRelay(followed)
    relay.follow(current)
    try:
        # At once: what the new broker has written so far (a fresh block: open, idle).
        assert _eventually(lambda: followed.state is None)
        current.publish(gate_closed=True, state=LeaseState.PAUSED, level=3, reason="for L9")
        assert _eventually(lambda: followed.gate_closed and followed.state == LeaseState.PAUSED)
        assert (followed.level, followed.reason) == (3, "for L9")
        current.publish(gate_closed=False, state=LeaseState.RUNNING)
        assert _eventually(lambda: not followed.gate_closed)
        assert (followed.state, followed.level, followed.reason) == (LeaseState.RUNNING, None, "")
    finally:
        relay.close()


def test_a_second_restart_moves_the_relay_to_the_newest_block(tmp_path):
    followed, second = _blocks(tmp_path)
    third = ControlBlock.create(tmp_path / "after-second-restart.cb")
    relay = GateRelay(followed)
    relay.follow(second)
    relay.follow(third)
    try:
        second.publish(gate_closed=True, state=LeaseState.PAUSED)  # the dead broker's block
        third.publish(gate_closed=False, state=LeaseState.RUNNING)
        assert _eventually(lambda: followed.state == LeaseState.RUNNING)
        time.sleep(0.05)
        assert not followed.gate_closed
    finally:
        relay.close()


def test_the_workers_imports_are_counted_in_the_block_the_broker_reads(tmp_path):
    followed, current = _blocks(tmp_path)
    relay = GateRelay(followed)
    relay.follow(current)
    try:
        current.add_ipc_imports(2)  # the kernel's own shim counted two
        for count in (1, 3):  # a worker's shim counts in the block it maps
            followed._write(IPC_IMPORTS_OFFSET, count)
            assert _eventually(lambda count=count: current.ipc_imports == 2 + count)
    finally:
        relay.close()


def test_after_close_nothing_more_is_copied(tmp_path):
    followed, current = _blocks(tmp_path)
    relay = GateRelay(followed)
    relay.follow(current)
    assert _eventually(lambda: followed.state is None)
    relay.close()
    current.publish(gate_closed=True, state=LeaseState.PAUSED)
    time.sleep(0.05)
    assert not followed.gate_closed
    assert not any(t.name == "gpushare-gate-relay" and t.is_alive() for t in threading.enumerate())
