"""How a transactional launch ends when Ctrl-C comes, without a GPU.

The slices here are scripted (no GPU on this machine): each "slice" returns the progress
record a real one would, and the test follows what the transaction does with it -- which
slices it launches next, with which flag, whether it waits, rolls back or finishes, and
what GPU time its report adds up from the slices' stamps.  The
same paths run for real on the H200 in ``tests/kernels/test_interrupt_gpu.py``.
"""

from __future__ import annotations

import struct
from dataclasses import replace
from types import SimpleNamespace

import pytest

import gpushare_ext.kernels.driver as driver
import gpushare_ext.kernels.progress as progress
import gpushare_ext.kernels.yield_flags as yield_flags
from gpushare_ext.kernels.arguments import BoundArgs
from gpushare_ext.kernels.launch import (
    LaunchHooks,
    LaunchMode,
    LaunchReport,
    LaunchShape,
    LaunchTransaction,
)
from gpushare_ext.kernels.report import Classification, Idempotence

SESSION_FLAG, ZERO_FLAG = 0x1000, 0x2000
TOTAL = 100


class Flag:
    device_ptr = SESSION_FLAG

    def __init__(self) -> None:
        self.value = 0

    def read(self) -> int:
        return self.value

    def set(self, value: int = 1) -> None:
        self.value = value


class Scripted(LaunchTransaction):
    """A transaction whose slices follow a script: ``(next, aborted)`` per slice."""

    def __init__(self, mode: LaunchMode, script: list[tuple[int, int]], hooks: LaunchHooks):
        verdict = (
            Idempotence.IDEMPOTENT if mode is LaunchMode.RESTART else Idempotence.NON_IDEMPOTENT
        )
        cls = Classification(verdict, ())
        variant = SimpleNamespace(saves_state=False, options=SimpleNamespace(abort_checks=True))
        kernel = SimpleNamespace(entry=SimpleNamespace(name="k"), last_launch=None)
        shape = LaunchShape((TOTAL, 1, 1), (128, 1, 1), 0, 0, None)
        bound = BoundArgs([b"\0" * 8], {"p": (0x9000, 64)}, {})
        super().__init__(kernel, variant, shape, bound, cls, mode, Flag(), hooks)
        self.out = LaunchReport("k", mode, cls, TOTAL, 4)
        self._head = [*bound.values, struct.pack("<Q", 0x5000), struct.pack("<Q", SESSION_FLAG)]
        self.script = list(script)
        self.slices: list[tuple[int, int]] = []  # (stop, flag the slice was given)
        self.rolled_back = 0
        self.stamps: list[tuple[int, int]] = []  # (start_ns, end_ns) per slice, else none

    def take_snapshot(self) -> None:
        self.snapshots.append((0x9000, None, 64))

    def roll_back(self) -> None:
        self.rolled_back += 1

    def write_record(self, start_block: int) -> None:
        pass

    def run_slice(self, stop: int) -> dict[str, int]:
        (flag,) = struct.unpack("<Q", self._head[len(self.bound.values) + 1])
        self.slices.append((stop, flag))
        nxt, aborted = self.script.pop(0) if self.script else (stop, 0)
        start_ns, end_ns = self.stamps.pop(0) if self.stamps else (0, 0)
        return {
            "next": nxt, "aborted": aborted, "lowest_aborted": nxt, "fenced": 0,
            "first_yield_ns": (1 << 64) - 1, "last_exit_ns": 0, "start_ns": start_ns,
            "end_ns": end_ns,
        }  # fmt: skip


@pytest.fixture(autouse=True)
def no_driver(monkeypatch):
    monkeypatch.setattr(progress, "PinnedSlot", lambda: SimpleNamespace(release=lambda: None))
    monkeypatch.setattr(driver, "wait_for_stream", lambda stream, on_tick=None: None)
    monkeypatch.setattr(
        yield_flags, "zero_flag", lambda context: SimpleNamespace(device_ptr=ZERO_FLAG)
    )


def _hooks(pressed_after_waits: int):
    """Hooks whose Ctrl-C comes during wait number ``pressed_after_waits`` (1-based)."""
    state = {"waits": 0, "exempt": []}

    def wait_for_resume(flag, interrupted):
        state["waits"] += 1

    def interrupted() -> bool:
        return state["waits"] >= pressed_after_waits

    hooks = LaunchHooks(
        wait_for_resume=wait_for_resume,
        interrupted=interrupted,
        exempt_from_hold=lambda on: state["exempt"].append(on),
    )
    return hooks, state


def test_ctrl_c_while_paused_rolls_a_snapshot_launch_back_at_once():
    hooks, state = _hooks(pressed_after_waits=1)
    tx = Scripted(LaunchMode.SNAPSHOT, [(40, 0)], hooks)  # the first slice yields at 40
    out = tx.run()
    assert tx.slices == [(TOTAL, SESSION_FLAG)]  # no slice after the Ctrl-C
    assert tx.rolled_back == 1 and out.interrupted == "rolled back"
    assert state["waits"] == 1 and state["exempt"] == []


def test_ctrl_c_while_paused_finishes_a_launch_with_nothing_to_roll_back():
    hooks, state = _hooks(pressed_after_waits=1)
    tx = Scripted(LaunchMode.RESTART, [(40, 0)], hooks)
    out = tx.run()
    # The rest runs at once with a flag nobody raises, not held, and never waits again.
    assert tx.slices == [(TOTAL, SESSION_FLAG), (TOTAL, ZERO_FLAG)]
    assert out.interrupted == "finished" and tx.rolled_back == 0
    assert state["waits"] == 1
    assert state["exempt"] == [True, False]  # the shim's hold is given back afterwards


def test_ctrl_c_after_an_abort_of_a_snapshot_launch_rolls_back_once():
    hooks, _ = _hooks(pressed_after_waits=0)  # pressed before the abort is handled
    tx = Scripted(LaunchMode.SNAPSHOT, [(30, 1)], hooks)
    out = tx.run()
    assert tx.rolled_back == 1 and out.interrupted == "rolled back"
    assert out.aborts == 0  # not also counted as an abort undone and retried
    assert len(tx.slices) == 1


def test_without_ctrl_c_a_yield_waits_and_the_launch_goes_on():
    hooks, state = _hooks(pressed_after_waits=99)
    tx = Scripted(LaunchMode.SNAPSHOT, [(40, 0)], hooks)
    out = tx.run()
    assert tx.slices == [(TOTAL, SESSION_FLAG), (TOTAL, SESSION_FLAG)]
    assert out.interrupted == "" and out.yields == 1 and tx.rolled_back == 0
    assert state["waits"] == 1


def test_a_flag_raised_for_a_pause_the_last_slice_outran_is_lowered():
    hooks = replace(LaunchHooks(), pause_requested=lambda: True)
    tx = Scripted(LaunchMode.RESTART, [], hooks)
    tx._raised = True  # raised while the slice ran, which finished anyway
    tx.flag.set(1)
    tx.run()
    assert tx.flag.value == 0


def test_the_report_adds_up_the_gpu_time_of_the_slices_with_both_stamps():
    hooks, _ = _hooks(pressed_after_waits=99)
    tx = Scripted(LaunchMode.SNAPSHOT, [(40, 0), (70, 0)], hooks)  # two yields: 3 slices
    # The second slice's start stamp was never written; the third's end is not after it.
    tx.stamps = [(1_000, 4_000), (progress.NO_STAMP, 9_000), (5_000, 5_000)]
    out = tx.run()
    assert len(tx.slices) == 3 and out.yields == 2
    assert out.gpu_ns == 3_000


def test_an_aborted_slice_counts_its_gpu_time_too():
    hooks, _ = _hooks(pressed_after_waits=99)
    tx = Scripted(LaunchMode.SNAPSHOT, [(30, 1)], hooks)  # aborted, rolled back, run again
    tx.stamps = [(100, 600), (1_000, 2_500)]
    out = tx.run()
    assert out.aborts == 1 and len(tx.slices) == 2
    assert out.gpu_ns == 500 + 1_500
