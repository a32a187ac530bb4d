"""What the session's long kernels got, as ``gpushare status`` shows it: the runtime
writes a line into its control block, the broker adds it to a paused lease's note."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpushare_ext.broker.hands.actuators import Ladder, Target
from gpushare_ext.control_block import SESSION_NOTE_SIZE, ControlBlock
from gpushare_ext.protocol import LeaseState, PreemptionLevel
from gpushare_ext.runtime import interpose, preemptible

CUPY_PTX = Path(__file__).parents[1] / "kernels" / "fixtures" / "cupy"


class FlagAndLockControl:
    kind = "cuda"

    def lock(self, pid, device, timeout_ms): ...

    def write_yield_flag(self, device, handle, offset, value): ...


def test_the_note_is_one_line_of_plain_text_cut_to_fit(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "s.cb")
    block.write_session_note("3 long kernel launches preemptible\n\x1b[31mred\x1b[0m\u202e")
    assert block.session_note == "3 long kernel launches preemptible␤␛[31mred␛[0m<U+202E>"
    block.write_session_note("x" * 1000)
    assert block.session_note == "x" * (SESSION_NOTE_SIZE - 1)
    block.close()


def test_a_paused_lease_note_carries_what_the_session_said(tmp_path: Path):
    block = ControlBlock.create(tmp_path / "s.cb")
    block.write_session_note(
        "2 long kernel launches preemptible, 0 yields, 9 stops that kept their work"
    )
    target = Target(
        lease_id="L1", pid=4242, device_index=0, control_block=block, yield_flag=("00", 0)
    )
    applied = asyncio.run(
        Ladder(FlagAndLockControl()).apply(target, PreemptionLevel.LOCK, "hi", LeaseState.PAUSED)
    )
    assert applied.note == (
        "stopped by: launches held, yield flag, process lock; the session says: "
        "2 long kernel launches preemptible, 0 yields, 9 stops that kept their work"
    )
    block.close()


def test_the_registry_reports_a_kernel_that_runs_unmodified(tmp_path: Path, monkeypatch):
    """A long kernel the analysis cannot take: the note names it and why."""
    lines: list[str] = []
    monkeypatch.setattr(interpose, "track_function", lambda function, mode: None)
    monkeypatch.setattr(preemptible, "_registry", preemptible.Registry())
    preemptible.report_to(lines.append)
    try:
        registry = preemptible._registry
        ptx = (CUPY_PTX / "loopy.ptx").read_bytes().replace(b".entry loopy", b".entry other")
        registry.twins[7] = preemptible.Twin(name="loopy", module=1, ptx=ptx)
        registry.on_launch(7, None, 0, 0, None)
        assert registry.fallbacks == 1
    finally:
        preemptible.report_to(None)
    assert len(lines) == 1 and lines[0].startswith("`loopy` runs unmodified ("), lines
    assert lines[0].endswith("; 0 long kernel launches preemptible, 1 run unmodified"), lines
