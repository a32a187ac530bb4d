"""The ladder parks a session's parkable memory through its shim's park service before
it locks the process, and brings it back after the unlock: a real session process (the
shim preloaded before the stand-in driver, parkable memory on) following a real control
block, and a process control that records what it was asked."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

from notebook_fixtures import fake_driver  # noqa: F401 - a fixture of this module
from runtime_helpers import DRIVER_ENTRIES, preloaded_env

from gpushare_ext.broker.hands import park_service
from gpushare_ext.broker.hands.actuators import Ladder, Target
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import LeaseState, PreemptionLevel

MIB = 1 << 20

SESSION = (
    DRIVER_ENTRIES
    + r"""
import json, sys
from gpushare_ext.control_block import ControlBlock
from gpushare_ext.runtime import parkable
u64 = ctypes.c_uint64
alloc = entry(b"cuMemAlloc", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(u64), ctypes.c_size_t))
cuda.fake_physical_bytes.restype = ctypes.c_ulonglong
block = ControlBlock.open(sys.argv[1])
held = []
for _ in range(3):
    x = u64()
    assert alloc(ctypes.byref(x), 4 << 20) == 0
    held.append(x)
print(json.dumps({"serving": parkable.serve_parks_at(block.address())}), flush=True)
for line in sys.stdin:
    if line.strip() != "look":
        break
    print(json.dumps({"physical_mib": cuda.fake_physical_bytes() >> 20}), flush=True)
"""
)


class RecordingControl:
    """Records each lock, checkpoint, restore and unlock with the parkable memory the
    session's block said was resident at that moment."""

    kind = "cuda"

    def __init__(self, block: ControlBlock) -> None:
        self.block = block
        self.calls: list[tuple[str, int]] = []

    def _note(self, what: str) -> None:
        self.calls.append((what, self.block.parkable_resident_bytes // MIB))

    def lock(self, pid, device, timeout_ms):
        self._note("lock")

    def unlock(self, pid, device):
        self._note("unlock")

    def checkpoint(self, pid, device):
        self._note("checkpoint")

    def restore(self, pid, device):
        self._note("restore")


def _start_session(driver: Path, block: ControlBlock):
    """A session process holding three parkable allocations of 4 MiB, its park service
    following ``block``; and a way to read the stand-in GPU memory it holds (MiB)."""
    session = subprocess.Popen(
        [sys.executable, "-c", SESSION, str(block.path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=preloaded_env(driver, GPUSHARE_PARKABLE_MEMORY="1"),
    )
    assert session.stdin is not None and session.stdout is not None
    assert json.loads(session.stdout.readline()) == {"serving": True}

    def physical_mib() -> int:
        session.stdin.write("look\n")
        session.stdin.flush()
        return json.loads(session.stdout.readline())["physical_mib"]

    return session, physical_mib


def _stop(session: subprocess.Popen, block: ControlBlock) -> None:
    assert session.stdin is not None
    session.stdin.write("quit\n")
    session.stdin.flush()
    session.wait(timeout=10)
    block.close()


def test_an_eviction_parks_through_the_session_before_the_lock_and_restores_after(
    fake_driver,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
):
    block = ControlBlock.create(tmp_path / "session.cb")
    session, physical_mib = _start_session(fake_driver, block)
    try:
        control = RecordingControl(block)
        ladder = Ladder(control)
        target = Target(lease_id="L1", pid=session.pid, device_index=0, control_block=block)
        applied = asyncio.run(
            ladder.apply(target, PreemptionLevel.EVICT, "parked", LeaseState.EVICTED)
        )
        assert control.calls == [("lock", 0), ("checkpoint", 0)]
        assert physical_mib() == 0
        assert "12.0 MiB parked by the session" in applied.note
        assert asyncio.run(ladder.undo(target, PreemptionLevel.EVICT)) is True
        assert control.calls[2:] == [("restore", 0), ("unlock", 0)]
        assert block.parkable_resident_bytes == 12 * MIB and physical_mib() == 12
    finally:
        _stop(session, block)


def test_a_partial_eviction_parks_only_that_much_and_takes_no_checkpoint(
    fake_driver,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
):
    block = ControlBlock.create(tmp_path / "session.cb")
    session, physical_mib = _start_session(fake_driver, block)
    try:
        control = RecordingControl(block)
        ladder = Ladder(control)
        target = Target(
            lease_id="L1", pid=session.pid, device_index=0, control_block=block,
            park_bytes=5 * MIB,
        )  # fmt: skip
        applied = asyncio.run(
            ladder.apply(target, PreemptionLevel.EVICT, "parked", LeaseState.EVICTED)
        )
        assert control.calls == [("lock", 4)]  # two allocations of 4 MiB cover 5 MiB
        assert physical_mib() == 4 and "checkpoint" not in applied.note
        assert asyncio.run(ladder.undo(target, PreemptionLevel.EVICT)) is True
        assert control.calls[1:] == [("unlock", 4)]  # nothing was checkpointed
        assert physical_mib() == 12
    finally:
        _stop(session, block)


def test_a_session_without_parkable_memory_is_not_asked(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "session.cb")
    assert park_service.park(block) is None  # nothing resident: no request written
    assert block.park_answer(1) is None
    block.close()


def test_an_unanswered_request_is_given_up_on_within_its_deadline(tmp_path: Path, monkeypatch):
    block = ControlBlock.create(tmp_path / "session.cb")
    monkeypatch.setattr(park_service, "MARGIN_S", 0.05)
    assert park_service.restore(block, parked_bytes=0) is None  # nobody serves this block
    block.close()
