"""Saved aborts without a GPU: register liveness, which kernels may save their threads'
state, and the PTX that saves and reloads it (assembled with ptxas).

A thread that stops at a back-edge check must store exactly the registers a later
instruction still reads; the next slice reloads them and branches back behind the
check. The GPU tests (``test_kernels_gpu.py``) check that the bytes come out the same.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from corpus_specs import CORPUS
from numba_corpus import NUMBA_CASES

from gpushare_ext.kernels import Kernel, TransformOptions, assemble, kernel, make_preemptible
from gpushare_ext.kernels.dataflow import build_cfg
from gpushare_ext.kernels.frontends import compile_numba
from gpushare_ext.kernels.liveness import (
    live_before,
    recomputable_registers,
    register_file,
    uses_and_defs,
)
from gpushare_ext.kernels.ptx import parse_instruction, parse_ptx
from gpushare_ext.kernels.rewrite import SAVE_HEADER_CELLS

CUPY = Path(__file__).with_name("fixtures") / "cupy"

LOOP = """
.version 8.0
.target sm_90
.address_size 64
.visible .entry loop(.param .u64 out, .param .u32 n)
{
	.reg .pred %p<3>;
	.reg .b32 %r<8>;
	.reg .f32 %f<4>;
	.reg .b64 %rd<4>;
	ld.param.u64 %rd1, [out];
	ld.param.u32 %r1, [n];
	mov.u32 %r2, 0;
	mov.f32 %f1, 0f00000000;
	mov.u32 %r7, 99;
$L_top:
	add.f32 %f1, %f1, 0f3F800000;
	add.u32 %r2, %r2, 1;
	setp.lt.u32 %p1, %r2, %r1;
	@%p1 bra $L_top;
	cvta.to.global.u64 %rd2, %rd1;
	st.global.f32 [%rd2], %f1;
	ret;
}
"""


def _entry(text: str, name: str):
    module = parse_ptx(text)
    return module, module.entry(name)


def test_register_file_reads_ranges_and_types():
    _, entry = _entry(LOOP, "loop")
    regs = register_file(entry)
    assert regs.types["%p2"] == "pred" and "%p3" not in regs.types
    assert regs.types["%f0"] == "f32" and regs.types["%rd3"] == "b64"
    assert "%tid" not in regs


def test_live_at_the_back_edge_is_what_the_loop_and_its_exit_still_read():
    _, entry = _entry(LOOP, "loop")
    instrs = entry.instructions
    branch = next(i for i, ins in enumerate(instrs) if ins.base == "bra")
    live = live_before(instrs, build_cfg(entry), register_file(entry), [branch, len(instrs)])
    # %r7 is written and never read; %rd2 is written after the loop.
    assert live[branch] == {"%p1", "%r1", "%r2", "%f1", "%rd1"}
    assert live[len(instrs)] == frozenset()


def test_recomputable_registers_are_parameter_loads_and_pure_arithmetic_on_them():
    text = LOOP.replace("mov.u32 %r7, 99;", "mov.u32 %r7, %clock;\n\tadd.u32 %r6, %r1, 3;")
    _, entry = _entry(text, "loop")
    again = recomputable_registers(entry, register_file(entry))
    assert {"%r1", "%rd1", "%r6"} <= set(again)
    assert "%r7" not in again  # the clock is not the same when read again
    assert "%r2" not in again and "%f1" not in again  # written twice (in the loop)


def test_a_guarded_write_does_not_end_a_live_range():
    _, entry = _entry(LOOP, "loop")
    regs = register_file(entry)
    guarded = parse_instruction("@%p1 mov.u32 %r3, %r2;", 1)
    uses, defs = uses_and_defs(guarded, regs)
    assert defs == set() and uses == {"%p1", "%r2", "%r3"}
    store = parse_instruction("st.global.f32 [%rd2], %f1;", 1)
    assert uses_and_defs(store, regs) == ({"%rd2", "%f1"}, set())


def test_a_loop_kernel_saves_what_is_live_at_the_header_and_goes_on_there():
    module, _ = _entry(LOOP, "loop")
    variant = make_preemptible(module, "loop", TransformOptions(abort_checks=True))
    assert variant.saves_state, variant.save_refusal
    # Live at the header: %r1, %r2, %f1, %rd1 (%p1 is set in the loop before it is read).
    # The parameter copies %r1 and %rd1 are loaded again, not saved.
    assert set(variant.saved_registers) == {"%r2", "%f1"}
    assert variant.save_cells == SAVE_HEADER_CELLS + 2
    names = [p.name for p in variant.extra_params]
    assert names[:9] == ["__gs_progress", "__gs_yieldflag", "__gs_gridx", "__gs_gridy",
                         "__gs_gridz", "__gs_stop", "__gs_chunk", "__gs_save",
                         "__gs_savestride"]  # fmt: skip
    text = variant.ptx
    start = text.index("$__gs_save0:")
    save = text[start : text.index("bra $__gs_park;", start)]
    start = text.index("$__gs_restore0:")
    restore = text[start : text.index("bra $L_top;", start)]
    stored = set(re.findall(r"st\.global\.b\d+ \[%gs_sp\], (%\w+);", save))
    loaded = set(re.findall(r"ld\.global\.b\d+ (%\w+), \[%gs_sp\];", restore))
    assert stored == loaded == {"%r2", "%f1"}
    assert re.search(r"ld\.param\.u32\s+%r1, \[n\];", restore)
    assert re.search(r"ld\.param\.u64\s+%rd1, \[out\];", restore)
    # It parks only on its way back to the header (the back edge's own condition).
    assert re.search(
        r"and\.pred %gs_pa, %gs_pa, %p1;\s*\n\s*@%gs_pa bra \$__gs_save0;\s*\n"
        r"\$__gs_nocheck0:\s*\n\s*@%p1 bra\s+\$L_top;",
        text,
    )
    assemble(text, "sm_90")


def test_a_predicate_live_at_the_header_is_saved_through_a_word():
    loaded = (
        "cvta.to.global.u64 %rd3, %rd1;\n\tld.global.u32 %r7, [%rd3];\n\tsetp.eq.u32 %p2, %r7, 7;"
    )
    text = LOOP.replace("mov.u32 %r7, 99;", loaded).replace(
        "add.u32 %r2, %r2, 1;", "@%p2 add.u32 %r2, %r2, 1;\n\tadd.u32 %r2, %r2, 1;"
    )
    module, _ = _entry(text, "loop")
    variant = make_preemptible(module, "loop", TransformOptions(abort_checks=True))
    assert "%p2" in variant.saved_registers
    assert "selp.u32 %gs_t, 1, 0, %p2;" in variant.ptx
    assert "setp.ne.u32 %p2, %gs_t, 0;" in variant.ptx
    assemble(variant.ptx, "sm_90")


def test_without_save_state_the_abort_variant_is_undone_as_before():
    module, _ = _entry(LOOP, "loop")
    variant = make_preemptible(
        module, "loop", TransformOptions(abort_checks=True, save_state=False)
    )
    assert not variant.saves_state and variant.save_cells == 0
    assert "__gs_save" not in variant.ptx and "$__gs_park" not in variant.ptx
    assemble(variant.ptx, "sm_90")


def test_a_kernel_without_loops_has_nothing_to_save():
    k = kernel((CORPUS / "saxpy.cu").read_text(), "saxpy")
    variant = k.preemptible(abort_checks=True)
    assert not variant.saves_state and "__gs_save" not in variant.ptx


@pytest.mark.parametrize(
    ("file", "name", "refusal"),
    [
        ("matmul_tiled.cu", "matmul_tiled", "a loop has barriers"),
        ("reduce_atomic.cu", "reduce_sum", "a loop has barriers"),
        ("scan_block.cu", "block_scan", "a loop has barriers"),
    ],
)
def test_kernels_with_shared_state_are_refused_with_the_reason(file, name, refusal):
    variant = kernel((CORPUS / file).read_text(), name).preemptible(abort_checks=True)
    assert not variant.saves_state and variant.save_refusal == refusal
    assemble(variant.ptx, "sm_90")


SHARED_THEN_LOOP = r"""
extern "C" __global__ void shared_then_loop(const float* x, float* y, int n, int iters) {
    __shared__ float tile[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? x[i] : 0.0f;
    __syncthreads();
    float v = tile[(threadIdx.x + 1) & 255];
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.5f;
    if (i < n) y[i] = v;
}
"""


def test_a_loop_after_shared_memory_is_refused():
    variant = kernel(SHARED_THEN_LOOP, "shared_then_loop").preemptible(abort_checks=True)
    assert variant.save_refusal == "it uses shared memory or barriers"


def test_cupy_kernels_save_unless_they_use_local_memory():
    loopy = Kernel((CUPY / "loopy.ptx").read_text(), "loopy").preemptible(abort_checks=True)
    # The grid-stride index, the inner counter and the accumulator; the rest (strides,
    # bases, sizes) are parameter loads and arithmetic on them, run again on reload.
    assert loopy.saves_state and loopy.saved_registers == ("%f18", "%r11", "%rd36")
    assemble(loopy.ptx, "sm_90")
    inplace = Kernel((CUPY / "inplace_loopy.ptx").read_text(), "inplace_loopy")
    assert inplace.preemptible(abort_checks=True).saves_state  # not idempotent: no undo needed
    sin = Kernel((CUPY / "cupy_sin__float32_float32.ptx").read_text(), "cupy_sin__float32_float32")
    assert sin.preemptible(abort_checks=True).save_refusal == "it uses local memory"


@pytest.mark.parametrize(("name", "saves"), [("nb_grid_stride", True), ("nb_matmul_shared", False)])
def test_numba_kernels(name: str, saves: bool):
    fn, sig, *_ = NUMBA_CASES[name]
    variant = compile_numba(fn, sig).preemptible(abort_checks=True, fence=True)
    assert variant.saves_state is saves, variant.save_refusal
    assemble(re.sub(r"^\.target\s+sm_\d+", ".target sm_80", variant.ptx, flags=re.M), "sm_80")
