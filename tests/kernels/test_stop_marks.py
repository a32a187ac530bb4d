"""A stopping thread's marks in the progress record are written once per converged
group of a warp, not by every thread (the stop's drain on the GPU), and the transformed
kernels still assemble.  CPU: the PTX text and ptxas, no GPU."""

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
    end = re.search(r"^\s*(exit;|bra \$__gs_next;)", rest, re.M)
    assert end is not None
    return rest[: end.start()]


def test_an_abort_writes_its_marks_from_the_lowest_active_lane_only():
    ptx = _abort_variant_ptx()
    for label in ("$__gs_abort", "$__gs_park"):
        section = _section(ptx, label)
        assert "activemask.b32 %gs_am;" in section, label
        atomics = [line.strip() for line in section.splitlines() if "red.global" in line]
        assert len(atomics) == 3, (label, atomics)
        assert all(line.startswith("@%gs_lead ") for line in atomics), (label, atomics)
        store = [line.strip() for line in section.splitlines() if "st.global" in line]
        assert store and all(line.startswith("@%gs_lead ") for line in store), (label, store)
    assemble(ptx, "sm_90")
    assemble(re.sub(r"^\.target\s+sm_\d+", ".target sm_80", ptx, flags=re.M), "sm_80")


def test_a_module_older_than_activemask_keeps_one_write_per_thread():
    assert not groups_stop_together(SimpleNamespace(module=SimpleNamespace(version="6.0")))
    assert groups_stop_together(SimpleNamespace(module=SimpleNamespace(version="6.2")))
    assert groups_stop_together(SimpleNamespace(module=SimpleNamespace(version="8.7")))
    marks = stop_marks(grouped=False)
    assert not any("activemask" in line or "%gs_lead" in line for line in marks)
    assert sum("red.global" in line for line in marks) == 3
