"""How often a thread reads the yield flag at a loop's back edge: about once per
``CHECK_INSTRUCTIONS`` instructions of the loop, whatever a pass holds (a stop waits for
each thread's next read).  CPU: the rule, and the PTX of real CuPy and Numba loops."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpushare_ext.kernels import back_edges, kernel

FIXTURES = Path(__file__).parent / "fixtures" / "cupy"


@given(st.integers(min_value=0, max_value=100_000))
def test_the_passes_between_reads_are_the_fewest_power_of_two_that_hold_the_budget(size):
    every = back_edges.thread_check_every(size)
    assert every >= 1 and every & (every - 1) == 0
    assert every * max(1, size) >= back_edges.CHECK_INSTRUCTIONS
    assert every == 1 or (every // 2) * max(1, size) < back_edges.CHECK_INSTRUCTIONS


def _read_masks(ptx: str) -> set[int]:
    """The pass counts of the per-thread checks of a variant (its ``and`` masks + 1)."""
    return {int(m) + 1 for m in re.findall(r"and\.b32 %gs_bm, %gs_bc, (\d+);", ptx)}


def _abort_variant(ptx: str):
    name = re.search(r"\.entry\s+(\S+)\s*\(", ptx).group(1)
    return kernel(ptx, name).preemptible(abort_checks=True)


def test_a_cupy_fma_loop_and_a_numba_one_read_the_flag_after_similar_work():
    """CuPy's loop (NVVM's four iterations in a pass of 7 instructions, 32 copies a
    round) reads the flag once in 8 rounds; Numba's (17 instructions a pass) once in 2:
    some 1,100-1,800 instructions apart in both, where a fixed count of iterations left
    Numba's four times further apart."""
    assert back_edges.UNROLL == 32 and back_edges.CHECK_INSTRUCTIONS == 1024
    from numba import cuda

    from benchmarks.tenant import numba_relax

    relax = numba_relax().py_func  # the stop benchmarks' Numba kernel, as Python
    numba_ptx, _ = cuda.compile_ptx(relax, "float32[::1], float32[::1], int32", cc=(9, 0))
    cupy = _abort_variant((FIXTURES / "loopy.ptx").read_text())
    numba = _abort_variant(numba_ptx)
    assert 8 in _read_masks(cupy.ptx)
    assert 2 in _read_masks(numba.ptx) and 8 not in _read_masks(numba.ptx)


def test_the_budget_is_what_the_transform_uses(monkeypatch):
    ptx = (FIXTURES / "loopy.ptx").read_text()
    monkeypatch.setattr(back_edges, "CHECK_INSTRUCTIONS", 4 * back_edges.CHECK_INSTRUCTIONS)
    assert 32 in _read_masks(_abort_variant(ptx).ptx)


def test_a_counted_loop_runs_long_rounds_then_short_ones_then_single_passes():
    """NVVM's counted FMA loop: rounds of ``UNROLL`` copies with the check, rounds of
    ``UNROLL_REST`` while that many passes are left, the rest one at a time; ptxas takes
    it for sm_80 and sm_90."""
    from gpushare_ext.kernels.transform import assemble

    ptx = _abort_variant((FIXTURES / "loopy.ptx").read_text()).ptx
    rest_at = re.search(r"^\$__gs_looprest\d+:", ptx, re.M).start()
    slow_at = re.search(r"^\$__gs_loopslow\d+:", ptx, re.M).start()
    long_round = ptx[ptx.index("setp.lt.s32 %gs_pf") : rest_at]
    rest_round = ptx[rest_at:slow_at]
    fma = "fma.rn.ftz.f32"
    pass_fmas = 4  # NVVM's pass holds four iterations
    assert long_round.count(fma) == back_edges.UNROLL * pass_fmas
    assert rest_round.count(fma) == back_edges.UNROLL_REST * pass_fmas
    assert "gs_flagv" in long_round and "gs_flagv" not in rest_round
    assemble(ptx, "sm_90")
    assemble(re.sub(r"^\.target\s+sm_\d+", ".target sm_80", ptx, flags=re.M), "sm_80")
