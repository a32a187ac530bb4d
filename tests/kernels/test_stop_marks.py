"""A stop's marks in the progress record: an aborting thread's once per converged group
of a warp, a parked block's once per block (the stop's drain on the GPU), and the
transformed kernels still assemble.  CPU: the PTX text and ptxas, no GPU."""

from __future__ import annotations

import re
from types import SimpleNamespace

from corpus_specs import CORPUS

from gpushare_ext.kernels import kernel
from gpushare_ext.kernels.persistent import groups_stop_together, stop_marks
from gpushare_ext.kernels.transform import assemble


def _abort_variant_ptx() -> str:
    k = kernel((CORPUS / "long_loop.cu").read_text(), "long_loop")
    return k.preemptible(abort_checks=True).ptx


def _section(ptx: str, label: str) -> str:
    """The instructions from ``label`` to where the path leaves (``exit``, or a park's
    branch back to the dispatch)."""
    start = ptx.index(f"{label}:")
    rest = ptx[start + len(label) + 1 :]
    end = re.search(r"^\s*(exit;|bra \$__gs_next;|bra \$__gs_publish;)", rest, re.M)
    assert end is not None
    return rest[: end.start()]


def _lines(section: str, word: str) -> list[str]:
    return [line.strip() for line in section.splitlines() if word in line]


def test_an_abort_writes_its_marks_from_the_lowest_active_lane_only():
    ptx = _abort_variant_ptx()
    section = _section(ptx, "$__gs_abort")
    assert "activemask.b32 %gs_am;" in section
    atomics = _lines(section, "red.global")
    assert len(atomics) == 3, atomics
    assert all(line.startswith("@%gs_lead ") for line in atomics), atomics
    store = _lines(section, "st.global")
    assert store and all(line.startswith("@%gs_lead ") for line in store), store
    assemble(ptx, "sm_90")
    assemble(re.sub(r"^\.target\s+sm_\d+", ".target sm_80", ptx, flags=re.M), "sm_80")


def test_a_parking_thread_marks_its_block_only_and_the_leader_writes_the_record_once():
    ptx = _abort_variant_ptx()
    assert "$__gs_park:" in ptx, "long_loop's abort variant saves its threads' state"
    park = _section(ptx, "$__gs_park")
    assert not _lines(park, ".global"), park
    shared = _lines(park, "red.shared")
    assert len(shared) == 2 and all(line.startswith("@%gs_lead ") for line in shared), shared
    assert _lines(park, "st.shared.u32 [__gs_stopped]")
    stop = _section(ptx, "$__gs_blockstop")
    assert len(_lines(stop, "red.global")) == 3 and len(_lines(stop, "st.global")) == 1, stop
    # Reached from the leader's part of the dispatch only, after the barrier that every
    # parked thread waits at: one write of each mark per block.
    leader_part = ptx[ptx.index("@!%gs_leader bra $__gs_wait;") : ptx.index("$__gs_wait:")]
    assert "bra $__gs_blockstop;" in leader_part
    assert ptx.count("bra $__gs_blockstop;") == 1
    # The block's slots are reset before the barrier that precedes any parking.
    prologue = ptx[: ptx.index("$__gs_next:")]
    reset = prologue.index("st.shared.u64 [__gs_firstseen]")
    assert reset < prologue.index("barrier.sync 0;", prologue.index("[__gs_lowstop]"))


def test_a_module_older_than_activemask_keeps_one_write_per_thread():
    assert not groups_stop_together(SimpleNamespace(module=SimpleNamespace(version="6.0")))
    assert groups_stop_together(SimpleNamespace(module=SimpleNamespace(version="6.2")))
    assert groups_stop_together(SimpleNamespace(module=SimpleNamespace(version="8.7")))
    marks = stop_marks(grouped=False)
    assert not any("activemask" in line or "%gs_lead" in line for line in marks)
    assert sum("red.global" in line for line in marks) == 3
