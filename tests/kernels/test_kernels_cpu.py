"""Kernel pipeline without a GPU: parse -> analyse -> classify -> transform -> assemble.

Uses NVRTC, Numba's compile_ptx and ptxas from the toolchain wheels; a missing tool is a
failure here, not a skip (CI installs them).
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from corpus_specs import CASES, CORPUS, TRANSFORMABLE, Case
from numba_corpus import NUMBA_CASES

from gpushare_ext.kernels import (
    Idempotence,
    KernelError,
    TransformOptions,
    assemble,
    classify_launch,
    compile_cuda,
    find_ptxas,
    kernel,
    make_preemptible,
    parse_ptx,
)
from gpushare_ext.kernels.arguments import array_extent, bind_arguments, param_array
from gpushare_ext.kernels.cli import classify_main
from gpushare_ext.kernels.frontends import compile_numba
from gpushare_ext.kernels.progress import (
    CHUNK_MAX,
    BlockTimes,
    choose_chunk,
    fit_chunk,
    initial_record,
    parse_record,
    slice_gpu_ns,
)
from gpushare_ext.kernels.rewrite import PROGRESS_RECORD_BYTES, RecordLayout

VARIANTS = [
    TransformOptions(),
    TransformOptions(abort_checks=True),
    TransformOptions(fence=True),
    TransformOptions(abort_checks=True, fence=True),
]


@cache
def load(file: str, name: str, arch: str = "sm_90"):
    return kernel((CORPUS / file).read_text(), name, arch=arch)


def entry_text(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    return ptx[start : ptx.index("\n}\n", start) + 3]


# -- parsing -------------------------------------------------------------------------


def test_parser_reads_params_labels_and_lines():
    k = load("saxpy.cu", "saxpy")
    e = k.entry
    assert [p.type for p in e.params] == ["f32", "u64", "u64", "u32"]
    assert [e.display_name(p.name) for p in e.params] == ["a", "x", "y", "n"]
    labels = [s.text for s in e.body if s.kind == "label"]
    assert labels and all(lab.startswith("$L__BB") for lab in labels)
    lines = k.ptx.splitlines()
    for ins in e.instructions:
        assert ins.opcode in lines[ins.line - 1], (ins.line, ins.opcode)
    st = next(i for i in e.instructions if i.opcode.startswith("st.global"))
    assert st.src_line == 4  # the .loc of "y[i] = a * x[i] + y[i];"


def test_parser_rejects_non_ptx():
    with pytest.raises(KernelError) as exc:
        parse_ptx("int main() { return 0; }")
    assert exc.value.code == "bad-ptx"


def test_module_with_several_entries_and_mangled_names():
    src = (
        "template<typename T> __global__ void twice(const T* a, T* b) { b[threadIdx.x] = 2 * a[threadIdx.x]; }\n"
        "template __global__ void twice<float>(const float*, float*);\n"
    )
    k = kernel(src, "twice<float>")
    assert k.entry.name.startswith("_Z5twiceIfE")
    assert {b.display for b in k.report.buffers.values()} == {"a", "b"}


# -- classification ------------------------------------------------------------------


def test_corpus_has_at_least_twenty_kernels():
    assert len(CASES) >= 20
    assert len({c.file for c in CASES}) >= 15


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_classification_matches_expectation(case: Case):
    k = load(case.file, case.kernel)
    r = k.report
    assert r.classification.verdict.value == case.verdict, r.describe()
    got = {b.display: b.access.value for b in r.buffers.values()}
    assert got == case.access, r.describe()
    assert bool(r.loops) == case.loops, r.loops
    assert bool(r.barriers) == case.barriers
    assert bool(r.atomics) == case.atomics
    if case.early_return:  # (`if (i < n) {...}` and `if (i >= n) return;` are the same PTX)
        assert r.early_exits, "early return not found"
    if case.refuse is None:
        assert r.uses_ctaid <= case.uses_ctaid
    if case.verdict != "idempotent":
        # The reasons name the parameter and a PTX line.
        culprit = [p for p, a in case.access.items() if a == "read-written"] or ["rows"]
        text = " ".join(r.classification.reasons)
        assert any(f"`{p}`" in text for p in culprit) or "loaded from memory" in text, text
        assert re.search(r"PTX line \d+", text), text


def test_reasons_point_at_the_offending_instructions():
    k = load("saxpy.cu", "saxpy")
    (reason,) = k.report.classification.reasons
    lines = k.ptx.splitlines()
    read_line, write_line = (int(x) for x in re.findall(r"PTX line (\d+)", reason))
    assert lines[read_line - 1].strip().startswith("ld.global.f32")
    assert lines[write_line - 1].strip().startswith("st.global.f32")
    assert "`y`" in reason and "`x`" not in reason


def test_pointer_loaded_from_memory_is_unknown():
    r = load("pointer_table.cu", "pointer_table").report
    assert r.classification.verdict is Idempotence.UNKNOWN
    assert r.loaded_pointers and all(a.origin == "loaded" for a in r.loaded_pointers)
    assert {a.kind for a in r.loaded_pointers} == {"read", "write"}


def test_spin_loop_is_detected_as_grid_sync():
    r = load("spin_barrier.cu", "spin_barrier").report
    assert not r.resumable
    assert "spin loop on global memory" in r.grid_sync[0]


def test_replay_safe_atomic_max_is_idempotent():
    r = load("atomic_max.cu", "max_reduce").report
    assert r.classification.idempotent
    assert "replay-safe" in " ".join(r.classification.reasons)


def test_aliasing_at_launch_turns_idempotent_into_in_place():
    r = load("copy_shift.cu", "copy_shift").report
    src, dst, _ = (p.name for p in r.entry.params)
    assert classify_launch(r, {src: (0x1000, 400), dst: (0x9000, 400)}).idempotent
    same = classify_launch(r, {src: (0x1000, 400), dst: (0x1000, 400)})
    assert same.verdict is Idempotence.NON_IDEMPOTENT
    assert "`src`" in same.reasons[0] and "`dst`" in same.reasons[0]
    overlap = classify_launch(r, {src: (0x1000, 400), dst: (0x1100, 400)})
    assert overlap.verdict is Idempotence.NON_IDEMPOTENT
    touching = classify_launch(r, {src: (0x1000, 0x100), dst: (0x1100, 400)})
    assert touching.idempotent


@pytest.mark.parametrize("name", sorted(NUMBA_CASES))
def test_numba_kernels_classify_and_transform(name: str):
    fn, sig, verdict, access = NUMBA_CASES[name]
    k = compile_numba(fn, sig)
    r = k.report
    assert r.classification.verdict.value == verdict, r.describe()
    assert {b.display: b.access.value for b in r.buffers.values()} == access
    for opts in VARIANTS:
        assemble(k.preemptible(abort_checks=opts.abort_checks, fence=opts.fence).ptx, "sm_90")


# -- transform: structure ------------------------------------------------------------


@pytest.mark.parametrize("case", TRANSFORMABLE, ids=lambda c: c.id)
def test_transformed_entry_structure(case: Case):
    k = load(case.file, case.kernel)
    pk = k.preemptible()
    body = entry_text(pk.ptx, k.entry.name)
    # Block ids and grid dims come from the logical id, never from the hardware.
    assert not re.search(r"%n?ctaid\.[xyz]", body), "hardware block ids left in the body"
    # One ret, at the uniform exit; original returns branch to the end of the block.
    assert body.count("ret;") == 1 and "\tret;\n}" in body
    exit_ = _section(body, "$__gs_exit:", "ret;")
    assert "bra" not in exit_ and f"[%gs_prog+{RecordLayout.END_NS}]" in exit_
    # The leader checks the flag before it claims a chunk of ids.
    flag = body.index("ld.volatile.global.u32 %gs_flagv, [%gs_flag]")
    grab = body.index("atom.global.add.u32 %gs_base, [%gs_prog+0], %gs_chunk")
    assert flag < grab
    assert body.index("@!%gs_leader bra $__gs_wait") < flag
    # The base reaches every thread through shared memory after a barrier; exit is uniform.
    wait = body.index("$__gs_wait:")
    assert body.index("barrier.sync 0;", wait) < body.index("ld.shared.u32 %gs_base, [%gs_sa]")
    assert "setp.ge.u32 %gs_pend, %gs_base, %gs_stop;" in body
    # The chunk is clipped at stop, and the next dispatch's barrier closes it.
    assert "sub.u32 %gs_t, %gs_stop, %gs_base;" in body
    assert "min.u32 %gs_t, %gs_t, %gs_chunk;" in body
    done = body.index("$__gs_done:")
    assert body.index("bra $__gs_block;", done) < body.index("bra $__gs_next;", done)
    assert body.index("bra $__gs_next;", done) < body.index("$__gs_exit:")
    # Extra parameters, in the documented order, after the original ones.
    names = [p.name for p in pk.extra_params]
    assert names == [
        "__gs_progress",
        "__gs_yieldflag",
        "__gs_gridx",
        "__gs_gridy",
        "__gs_gridz",
        "__gs_stop",
        "__gs_chunk",
    ]
    assert [p.name for p in pk.original_params] == [p.name for p in k.entry.params]
    # .version and .target are the input's.
    assert re.search(r"^\.version (\S+)", pk.ptx, re.M).group(1) == k.module.version
    assert re.search(r"^\.target (\S+)", pk.ptx, re.M).group(1) == k.module.target


def _section(body: str, start: str, end: str) -> str:
    a = body.index(start)
    return body[a : body.index(end, a)]


@pytest.mark.parametrize("case", TRANSFORMABLE, ids=lambda c: c.id)
def test_chunk_loop_checks_the_flag_and_claims_once_per_chunk(case: Case):
    k = load(case.file, case.kernel)
    body = entry_text(k.preemptible().ptx, k.entry.name)
    flag_load = "ld.volatile.global.u32 %gs_flagv, [%gs_flag];"
    claim = "atom.global.add.u32 %gs_base, [%gs_prog+0], %gs_chunk;"
    # Exactly one flag load and one claim in the whole kernel (yield mode), both in the
    # dispatch (between $__gs_next and $__gs_wait), outside the per-block loop.
    assert body.count(flag_load) == 1 and body.count(claim) == 1
    assert body.count("atom.global.add.u32 %gs_") == 1
    dispatch = _section(body, "$__gs_next:", "$__gs_wait:")
    assert flag_load in dispatch and claim in dispatch
    per_block = _section(body, "$__gs_block:", "$__gs_chunkend:")
    assert flag_load not in per_block and "%gs_prog+0]" not in per_block
    # The per-block loop: the id advances and branches back while below the chunk's end.
    tail = _section(body, "$__gs_done:", "$__gs_chunkend:")
    assert "add.u32 %gs_id, %gs_id, 1;" in tail
    assert "setp.lt.u32 %gs_pmore, %gs_id, %gs_lim;" in tail
    assert "bra $__gs_block;" in tail
    # The logical id is decomposed inside the loop, once per logical block.
    assert "rem.u32 %gs_cx, %gs_id, %gs_nx;" in _section(body, "$__gs_block:", "$__gs_done:")
    # One barrier per chunk in the dispatch; a barrier between logical blocks only for
    # kernels with barriers or shared memory.
    assert "barrier.sync" not in dispatch
    assert _section(body, "$__gs_wait:", "$__gs_block:").count("barrier.sync 0;") == 1
    pk = k.preemptible()
    needs = bool(k.report.barriers) or ".shared" in k.ptx.split(f".entry {k.entry.name}(")[1]
    assert pk.chunk_sync == needs, (case.id, pk.chunk_sync)
    assert tail.count("barrier.sync 0;") == (1 if needs else 0), tail


def test_chunk_barrier_only_where_shared_memory_or_barriers_are_used():
    plain = ["vector_add.cu:vector_add", "saxpy.cu:saxpy", "early_return.cu:clamp_copy",
             "grids.cu:fill_3d", "copy_shift.cu:copy_shift"]  # fmt: skip
    synced = ["matmul_tiled.cu:matmul_tiled", "dynamic_shared.cu:reverse_blocks",
              "stencil.cu:stencil_1d", "scan_block.cu:block_scan"]  # fmt: skip
    for ident in plain + synced:
        file, name = ident.split(":")
        k = load(file, name)
        for opts in VARIANTS:
            pk = k.preemptible(abort_checks=opts.abort_checks, fence=opts.fence)
            tail = _section(entry_text(pk.ptx, k.entry.name), "$__gs_done:", "$__gs_chunkend:")
            assert ("barrier.sync 0;" in tail) == (ident in synced), (ident, opts.key)
            assert pk.chunk_sync == (ident in synced)


def test_original_returns_become_branches_to_the_block_end():
    k = load("early_return.cu", "clamp_copy")
    n_ret = sum(1 for i in k.entry.instructions if i.base == "ret")
    body = entry_text(k.preemptible().ptx, k.entry.name)
    assert body.count("bra\t$__gs_done;") + body.count("bra $__gs_done;") >= n_ret


def test_ctaid_decomposition_for_3d_grids():
    body = entry_text(load("grids.cu", "fill_3d").preemptible().ptx, "fill_3d")
    assert "rem.u32 %gs_cx, %gs_id, %gs_nx;" in body
    assert "rem.u32 %gs_cy, %gs_t, %gs_ny;" in body
    assert "div.u32 %gs_cz, %gs_id, %gs_nxy;" in body
    for reg in ("%gs_cx", "%gs_cy", "%gs_cz", "%gs_nx", "%gs_ny", "%gs_nz"):
        assert re.search(rf"mov\.u32\s+%r\d+, {reg};", body), reg


def test_back_edge_checks_per_loop_and_uniform_where_loops_have_barriers():
    k = load("matmul_tiled.cu", "matmul_tiled")
    body = entry_text(k.preemptible(abort_checks=True).ptx, k.entry.name)
    assert body.count("back-edge yield check") == len(k.report.loops) == 2
    # The tile loop has barriers: its check is block-uniform. The inner k loop has none.
    assert body.count("block-uniform: the loop has barriers") == 1
    assert body.count("(per thread, every") == 1
    k2 = load("long_loop.cu", "long_loop")
    b2 = entry_text(k2.preemptible(abort_checks=True).ptx, k2.entry.name)
    assert b2.count("(per thread, every") == len(k2.report.loops) >= 1
    assert "$__gs_abort:" in b2 and f"[%gs_prog+{RecordLayout.ABORTED}]" in b2
    # Plain yield mode has no back-edge checks.
    assert "back-edge" not in entry_text(k2.preemptible().ptx, k2.entry.name)


def test_fencing_neutralises_the_planted_out_of_bounds_store():
    k = load("oob_store.cu", "oob_store")
    pk = k.preemptible(fence=True)
    assert pk.fenced_params == (k.entry.params[0].name,)
    body = entry_text(pk.ptx, "oob_store")
    lines = body.splitlines()
    stores = [
        i
        for i, ln in enumerate(lines)
        if ln.strip().startswith("st.global") and "%gs_prog" not in ln
    ]
    assert len(stores) == 2  # a[i] = 1 and the planted a[n + bad] = 42
    for i in stores:
        assert "[%gs_fa]" in lines[i], lines[i]
        window = "\n".join(lines[max(0, i - 12) : i])
        assert "sub.s64 %gs_fo, %gs_fa, %gs_fg0;" in window  # offset from a's base
        assert "setp.lt.u64 %gs_fok, %gs_fo, %gs_fs0;" in window  # below a's size
        assert "setp.lt.and.u64 %gs_fok, %gs_fe, %gs_fs0, %gs_fok;" in window  # last byte too
        assert "selp.b64 %gs_fa, %gs_fa, %gs_scratch_g, %gs_fok;" in window  # else: scratch
        assert f"@%gs_fbad red.global.add.u64 [%gs_prog+{RecordLayout.FENCED}], 1;" in window
    assert [p.name for p in pk.extra_params][-2:] == ["__gs_fbase0", "__gs_fsize0"]
    assemble(pk.ptx, "sm_90")


@pytest.mark.parametrize("case", TRANSFORMABLE, ids=lambda c: c.id)
def test_every_global_access_is_fenced(case: Case):
    k = load(case.file, case.kernel)
    body = entry_text(k.preemptible(fence=True).ptx, k.entry.name)
    for ln in body.splitlines():
        s = ln.strip()
        if (
            re.match(r"(@!?%\w+\s+)?(ld|st|atom|red)\.global", s)
            and "%gs_prog" not in s
            and "%gs_flag" not in s
        ):
            assert "[%gs_fa]" in s, s


def test_guarded_fenced_access_counts_only_when_it_would_run():
    ptx = compile_cuda((CORPUS / "vector_add.cu").read_text())[0]
    # Make the store conditional through a guard and check the count honours it.
    m = parse_ptx(ptx.replace("st.global.f32", "@%p1 st.global.f32"))
    body = entry_text(
        make_preemptible(m, "vector_add", TransformOptions(fence=True)).ptx, "vector_add"
    )
    assert "and.pred %gs_fbad, %gs_fbad, %p1;" in body


# -- transform: assembling -----------------------------------------------------------


def test_ptxas_comes_from_the_toolchain_wheel_when_installed():
    path = find_ptxas()
    assert path.endswith("ptxas")


@pytest.mark.parametrize("case", TRANSFORMABLE, ids=lambda c: c.id)
@pytest.mark.parametrize("opts", VARIANTS, ids=lambda o: o.key)
def test_transformed_kernels_assemble_for_sm90(case: Case, opts: TransformOptions):
    k = load(case.file, case.kernel)
    assemble(k.preemptible(abort_checks=opts.abort_checks, fence=opts.fence).ptx, "sm_90")


SM80 = ["vector_add.cu:vector_add", "matmul_tiled.cu:matmul_tiled", "reduce_atomic.cu:reduce_sum",
        "grids.cu:fill_3d", "long_loop.cu:long_loop_inplace", "oob_store.cu:oob_store"]  # fmt: skip


@pytest.mark.parametrize("case", [c for c in TRANSFORMABLE if c.id in SM80], ids=lambda c: c.id)
@pytest.mark.parametrize("opts", VARIANTS, ids=lambda o: o.key)
def test_transformed_kernels_assemble_for_sm80(case: Case, opts: TransformOptions):
    k = load(case.file, case.kernel, "sm_80")
    pk = k.preemptible(abort_checks=opts.abort_checks, fence=opts.fence)
    assert ".target sm_80" in pk.ptx
    assemble(pk.ptx, "sm_80")


@pytest.mark.parametrize("case", [c for c in TRANSFORMABLE if c.id not in SM80], ids=lambda c: c.id)
def test_every_transformed_kernel_assembles_for_sm80(case: Case):
    k = load(case.file, case.kernel, "sm_80")
    assemble(k.preemptible().ptx, "sm_80")
    assemble(k.preemptible(abort_checks=True, fence=True).ptx, "sm_80")


@pytest.mark.parametrize("name", sorted(NUMBA_CASES))
def test_numba_kernels_assemble_for_sm80(name: str):
    fn, sig, *_ = NUMBA_CASES[name]
    k = compile_numba(fn, sig)
    for opts in VARIANTS:
        ptx = k.preemptible(abort_checks=opts.abort_checks, fence=opts.fence).ptx
        assemble(re.sub(r"^\.target\s+sm_\d+", ".target sm_80", ptx, flags=re.M), "sm_80")


@pytest.mark.parametrize("case", [c for c in CASES if c.refuse], ids=lambda c: c.id)
def test_transform_refuses_with_the_failing_step(case: Case):
    k = load(case.file, case.kernel)
    with pytest.raises(KernelError) as exc:
        k.preemptible()
    assert exc.value.code == case.refuse
    assert exc.value.step == "preemptible[yield]:check-supported"


def test_ptxas_failure_carries_the_log_and_the_line():
    k = load("vector_add.cu", "vector_add")
    broken = k.preemptible().ptx.replace("barrier.sync 0;", "barrier.sync %nope;", 1)
    with pytest.raises(KernelError) as exc:
        assemble(broken, "sm_90")
    assert exc.value.code == "ptxas-failed" and exc.value.step == "assemble"
    assert "%nope" in exc.value.log


# -- launch-side logic that needs no GPU ---------------------------------------------


class FakeArray:
    """Enough of a CuPy array for argument binding: the CUDA array interface."""

    def __init__(self, ptr, shape, typestr="<f4", strides=None):
        self.__cuda_array_interface__ = {
            "data": (ptr, False), "shape": shape, "typestr": typestr, "strides": strides, "version": 3,
        }  # fmt: skip


def test_binding_packs_pointers_and_scalars_in_ptx_order():
    k = load("saxpy.cu", "saxpy")
    x, y = FakeArray(0x7000, (100,)), FakeArray(0x9000, (100,))
    bound = bind_arguments(k, (2.5, x, y, 100))
    assert bound.values == [struct.pack("<f", 2.5), struct.pack("<Q", 0x7000),
                            struct.pack("<Q", 0x9000), struct.pack("<I", 100)]  # fmt: skip
    names = {k.entry.display_name(p): e for p, e in bound.extents.items()}
    assert names == {"x": (0x7000, 400), "y": (0x9000, 400)}
    with pytest.raises(KernelError, match="takes 4 arguments"):
        bind_arguments(k, (x, y))


def test_binding_flattens_numba_arrays():
    fn, sig, *_ = NUMBA_CASES["nb_add_2d"]
    k = compile_numba(fn, sig)
    a = FakeArray(0x10000, (4, 8), "<f4", None)
    out = FakeArray(0x20000, (4, 8), "<f4", (32, 4))
    bound = bind_arguments(k, (a, out))
    q = lambda v: struct.pack("<Q", v)  # noqa: E731
    # meminfo, parent, nitems, itemsize, data, shape[0..1], strides[0..1]
    assert bound.values[:9] == [q(0), q(0), q(32), q(4), q(0x10000), q(4), q(8), q(32), q(4)]
    assert bound.extents[k.bindings[1].data_param] == (0x20000, 128)


def test_extent_of_strided_views():
    assert array_extent(FakeArray(1000, (10,), "<f4", (-4,))) == (964, 40)
    assert array_extent(FakeArray(1000, (3, 4), "<f4", (32, 4))) == (1000, 80)
    assert array_extent(FakeArray(1000, (0,), "<f4", None)) == (1000, 0)


def test_initial_progress_record_layout():
    raw = initial_record(7)
    assert len(raw) == PROGRESS_RECORD_BYTES
    assert struct.unpack_from("<I", raw, RecordLayout.NEXT_BLOCK) == (7,)
    assert struct.unpack_from("<Q", raw, RecordLayout.FIRST_YIELD_NS) == ((1 << 64) - 1,)
    assert struct.unpack_from("<Q", raw, RecordLayout.FENCED) == (0,)


def test_record_header_round_trip_and_parse():
    state = parse_record(initial_record(42)[: RecordLayout.SCRATCH])
    assert state["next"] == 42 and state["first_yield_ns"] == (1 << 64) - 1
    assert state["fenced"] == state["aborted"] == state["finished"] == 0


def test_record_start_stamp_starts_at_max_for_the_min_reduction():
    raw = initial_record(0)
    assert struct.unpack_from("<Q", raw, RecordLayout.START_NS) == ((1 << 64) - 1,)
    assert struct.unpack_from("<Q", raw, RecordLayout.END_NS) == (0,)
    assert RecordLayout.END_NS + 8 <= RecordLayout.SCRATCH


def test_a_slice_gpu_time_needs_both_stamps_in_order():
    assert slice_gpu_ns({"start_ns": 1_000, "end_ns": 3_500}) == 2_500
    assert slice_gpu_ns({"start_ns": (1 << 64) - 1, "end_ns": 3_500}) == 0  # no block started
    assert slice_gpu_ns({"start_ns": 3_500, "end_ns": 3_500}) == 0
    assert slice_gpu_ns({"start_ns": 4_000, "end_ns": 0}) == 0  # no leader exited
    assert slice_gpu_ns(parse_record(initial_record(0)[: RecordLayout.SCRATCH])) == 0


def test_chunk_choice():
    # First launch: 8 when there are >= 64 logical blocks per persistent block, else 1.
    assert choose_chunk(64 * 100, 100, None) == 8
    assert choose_chunk(64 * 100 - 1, 100, None) == 1
    # Measured: about target / time per block, clamped to [1, CHUNK_MAX].
    assert choose_chunk(10**7, 100, 1000.0, target_us=4) == 4
    assert choose_chunk(10**7, 100, 500.0, target_us=32) == CHUNK_MAX
    assert choose_chunk(10**7, 100, 10**6, target_us=4) == 1  # long blocks: one at a time
    # ... and to ceil(logical / (4 persistent)): every persistent block gets >= 4 chunks.
    assert choose_chunk(1000, 100, 10.0, target_us=4) == 3
    assert choose_chunk(128, 132, 10.0) == 1
    # The counter may overshoot by one chunk per persistent block: never past 2^32 - 1.
    assert fit_chunk(64, 1000, 100) == 64
    assert fit_chunk(64, (1 << 32) - 2000, 100) == 16
    with pytest.raises(KernelError):
        fit_chunk(1, (1 << 32) - 50, 100)


def test_block_time_estimate_from_record_stamps():
    BlockTimes.clear()
    key = ("k",)
    BlockTimes.record(key, 10, 100, 150)  # too few blocks per persistent block: ignored
    assert BlockTimes.get(key) is None
    BlockTimes.record(key, 1_000_000, 100, 100_000)  # 1 ms, 1000 blocks each: 1 us/block
    assert BlockTimes.get(key) == pytest.approx(1000.0)
    BlockTimes.record(key, 3_000_000, 100, 100_000)
    assert BlockTimes.get(key) == pytest.approx(2000.0)  # smoothed
    BlockTimes.clear()


def _simulate_launch(rng, total, persistent, chunk, cuts, flag_steps):
    """The chunk protocol of the persistent loop and the launcher's resume loop, on the
    CPU: persistent blocks step in random order; a leader checks the flag, then claims
    ``chunk`` ids with one fetch-add, then runs [base, min(base + chunk, stop)) one id a
    step. The flag is raised at the given global steps (and cleared after a while).
    Returns how many times each logical id ran and the number of yields."""
    runs = [0] * total
    start, yields, step = 0, 0, 0
    pending = sorted(c for c in cuts if 0 < c < total)
    flag_at = sorted(flag_steps)
    while start < total:
        stop = pending.pop(0) if pending and pending[0] > start else total
        while pending and pending[0] <= start:
            pending.pop(0)
        counter = start
        blocks = [None] * persistent  # None: at the dispatch; else [id, lim]
        live = set(range(persistent))
        flag = False
        while live:
            step += 1
            while flag_at and flag_at[0] <= step:
                flag_at.pop(0)
                flag = True
            b = int(rng.choice(sorted(live)))
            if blocks[b] is None:
                if flag:  # flag first: nothing claimed
                    live.discard(b)
                    continue
                base, counter = counter, counter + chunk  # atom.add counter, chunk
                if base >= stop:
                    live.discard(b)
                    continue
                blocks[b] = [base, min(base + chunk, stop)]
            cur = blocks[b]
            runs[cur[0]] += 1
            cur[0] += 1
            if cur[0] >= cur[1]:
                blocks[b] = None
        done_to = min(counter, stop)
        if done_to < stop or stop < total:
            yields += 1
        start = done_to
    return runs, yields


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunk_protocol_resumes_every_id_exactly_once(chunk: int):
    import numpy as np

    rng = np.random.default_rng(chunk)
    for total, persistent in ((1000, 7), (97, 3), (5, 8), (1, 1), (4096, 33)):
        for trial in range(4):
            cuts = rng.integers(1, total + 1, size=trial * 3).tolist() if total > 1 else []
            flags = rng.integers(1, 4 * total, size=trial).tolist()
            runs, yields = _simulate_launch(rng, total, persistent, chunk, cuts, flags)
            assert runs == [1] * total, (total, persistent, chunk, trial, yields)


def test_param_array_points_at_each_value():
    import ctypes

    values = [struct.pack("<Q", 0xDEADBEEF12), struct.pack("<f", 1.5), b"\x01", bytes(range(16))]
    ptrs, keep = param_array(values)
    for i, v in enumerate(values):
        assert ptrs[i] % 16 == 0, "each value starts 16-byte aligned"
        assert ctypes.string_at(ptrs[i], len(v)) == v
    del keep


# -- CLI -----------------------------------------------------------------------------


def test_classify_cli_prints_a_table_per_kernel(capsys):
    assert classify_main([str(CORPUS / "saxpy.cu")]) == 0
    out = capsys.readouterr().out
    assert "saxpy" in out and "saxpy_out" in out
    assert "non-idempotent" in out and "read-written" in out


def test_classify_cli_json(capsys, tmp_path):
    ptx = load("histogram.cu", "histogram").ptx
    f = tmp_path / "h.ptx"
    f.write_text(ptx)
    assert classify_main([str(f), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (k,) = data["kernels"]
    assert k["verdict"] == "non-idempotent"
    assert {p["access"] for p in k["parameters"]} == {"read", "read-written"}
    assert k["atomics"] == 1


def test_classify_cli_errors(capsys, tmp_path):
    assert classify_main([str(tmp_path / "missing.cu")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" __global__ void f(float* x) { x[0] = undefined_name; }')
    assert classify_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == (
        'gpushare classify: bad.cu:1: identifier "undefined_name" is undefined; '
        "--verbose shows the nvcc log\n"
    )
    other = tmp_path / "k.txt"
    other.write_text("hello")
    assert classify_main([str(other)]) == 2
    assert "expected a .cu, .cuh, .h, .hpp or .ptx file" in capsys.readouterr().err


def gpushare_classify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpushare_ext.cli", "classify", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _bad_path(kind: str, tmp_path: Path) -> Path:
    if kind == "directory":
        return tmp_path
    if kind == "missing":
        return tmp_path / "missing.cu"
    if kind == "dangling link":
        (tmp_path / "gone.ptx").symlink_to(tmp_path / "never-there.ptx")
        return tmp_path / "gone.ptx"
    if kind == "not a regular file":
        return Path("/dev/null")
    if kind == "unreadable":
        return Path("/proc/self/mem")  # a read fails for root too (EIO at address 0)
    path = tmp_path / ("notes.txt" if kind == "not source" else "fake.ptx")
    path.write_text("hello\n")
    return path


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("directory", "is a directory; expected a .cu, .cuh, .h, .hpp or .ptx file"),
        ("missing", "no such file; expected a .cu, .cuh, .h, .hpp or .ptx file"),
        ("dangling link", "no such file; expected a .cu, .cuh, .h, .hpp or .ptx file"),
        (
            "not a regular file",
            "is not a regular file; expected a .cu, .cuh, .h, .hpp or .ptx file",
        ),
        (
            "unreadable",
            "cannot read it (Input/output error); expected a .cu, .cuh, .h, .hpp or .ptx file you can read",
        ),
        ("not source", "expected a .cu, .cuh, .h, .hpp or .ptx file (got '.txt')"),
        ("not PTX", "not PTX: no .version/.target directive found"),
    ],
)
def test_classify_cli_a_bad_path_gets_one_line_naming_it(kind, message, tmp_path):
    path = _bad_path(kind, tmp_path)

    result = gpushare_classify(str(path))

    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == f"gpushare classify: {path}: {message}\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_classify_cli_a_file_without_read_permission_gets_one_line(tmp_path):
    path = tmp_path / "secret.ptx"
    path.write_text(".version 8.0\n.target sm_90\n")
    path.chmod(0)

    result = gpushare_classify(str(path))

    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"gpushare classify: {path}: cannot read it (Permission denied); "
        "expected a .cu, .cuh, .h, .hpp or .ptx file you can read"
    )


def test_classify_cli_counts_one_atomic_and_one_loop_in_the_singular():
    result = gpushare_classify(str(CORPUS / "reduce_atomic.cu"))

    assert result.returncode == 0, result.stderr
    assert "  1 atomic, 2 barriers, 1 loop\n" in result.stdout
