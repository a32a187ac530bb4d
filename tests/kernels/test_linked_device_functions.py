"""A kernel that calls a device function linked in from PTX (no GPU).

Numba's ``@cuda.jit(link=[ptx_file])`` kernel that calls a ``cuda.declare_device``
function only declares it (``.extern .func``); its body is in the linked PTX.  With the
linked text handed over, the body goes into the kernel's module (``linking.py``): the
analysis sees it, steps over a callee that touches no memory (``callees.py``), and the
twin assembles without a linker.  A callee that touches memory, or one with no body,
keeps the kernel unknown with a reason that names it.

The Numba pair is the one ``benchmarks/long_neighbours.py`` ``numba_linked`` builds
(``float32(float32)``, C ABI); the hand-written PTX is in Numba's style.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from numba_corpus import linked_relax_pair

from gpushare_ext.kernels import Idempotence, Kernel, KernelError, assemble
from gpushare_ext.kernels.back_edges import UNROLL
from gpushare_ext.kernels.callees import call_target
from gpushare_ext.kernels.linking import link_device_functions
from gpushare_ext.kernels.ptx import parse_instruction, parse_ptx


def linked_kernel(ptx: str, name: str, *linked: str) -> Kernel:
    return Kernel(link_device_functions(ptx, linked).text, name)


# ---- Numba's link= kernel, as the benchmark builds it


def test_alone_the_kernel_calls_a_body_it_does_not_have_and_stays_unknown():
    ptx, name, _ = linked_relax_pair()
    classification = Kernel(ptx, name).report.classification
    assert classification.verdict is Idempotence.UNKNOWN
    reason = classification.reasons[0]
    assert "call to gps_relax at PTX line" in reason
    assert "has no body in the kernel's PTX nor in PTX it is linked with" in reason


def test_with_its_linked_ptx_the_kernel_is_classified_by_its_own_accesses():
    ptx, name, callee = linked_relax_pair()
    linked = link_device_functions(ptx, [callee])
    assert linked.resolved == ("gps_relax",) and linked.notes == ()
    report = Kernel(linked.text, name).report
    # x is updated in place: read then written, as the unlinked Numba kernel would be.
    assert report.classification.verdict is Idempotence.NON_IDEMPOTENT
    assert not any("call to" in r for r in report.classification.reasons)
    assert [b.access.value for b in report.buffers.values()] == ["read-written"]


def test_the_twin_holds_the_callee_body_and_no_unresolved_declaration():
    ptx, name, callee = linked_relax_pair()
    variant = linked_kernel(ptx, name, callee).preemptible(abort_checks=True)
    module = parse_ptx(variant.ptx)
    assert [f.name for f in module.functions] == ["gps_relax"]
    assert module.declarations == []
    assert ".extern" not in variant.ptx
    # Defined before the kernel that calls it, so one PTX text assembles; ptxas (whole
    # program, as the driver's JIT) rejects an unresolved extern function.
    assert variant.ptx.index(".func") < variant.ptx.index(".entry")
    assemble(variant.ptx, "sm_90")
    with pytest.raises(KernelError) as unlinked:
        assemble(ptx, "sm_90")
    assert "Unresolved extern function 'gps_relax'" in unlinked.value.log
    # And the transform refuses the kernel without its callee's body.
    with pytest.raises(KernelError, match="call to gps_relax"):
        Kernel(ptx, name).preemptible(abort_checks=True)


def test_a_call_into_a_pure_callee_still_lets_a_stopping_thread_save_its_state():
    ptx, name, callee = linked_relax_pair()
    variant = linked_kernel(ptx, name, callee).preemptible(abort_checks=True)
    # The callee's frame is gone at every back-edge check: registers are the state.
    assert variant.saves_state, variant.save_refusal


def test_a_numba_abi_callee_writes_its_result_through_a_pointer_and_stays_refused():
    # Numba's own ABI returns the value through a pointer into the caller's frame: a
    # store the analysis does not follow into a device function.
    ptx, name, callee = linked_relax_pair("numba")
    linked = link_device_functions(ptx, [callee])
    assert linked.resolved == ("gps_relax",)
    classification = Kernel(linked.text, name).report.classification
    assert classification.verdict is Idempotence.UNKNOWN
    reason = classification.reasons[0]
    assert reason.startswith("call to gps_relax at PTX line")
    assert "writes memory (st." in reason and "does not follow" in reason


def test_a_declaration_of_another_abi_is_not_linked_and_the_note_says_so():
    ptx, _, _ = linked_relax_pair("numba")  # the kernel declares the Numba ABI ...
    _, _, c_callee = linked_relax_pair("c")  # ... the linked PTX defines the C one
    linked = link_device_functions(ptx, [c_callee])
    assert linked.resolved == () and linked.text == ptx
    assert "Numba-ABI declaration of a C-ABI function" in linked.notes[0]


def test_the_benchmark_declares_the_callee_with_the_abi_it_was_compiled_with():
    # A Numba-ABI declaration of a C-ABI function links (by name) and runs garbage.
    source = (Path(__file__).parents[2] / "benchmarks" / "long_neighbours.py").read_text()
    assert 'abi="c", abi_info={"abi_name": "gps_relax"}' in source
    assert 'cuda.declare_device("gps_relax", "float32(float32)", abi="c")' in source


# ---- hand-written PTX in Numba's style

HEADER = ".version 8.0\n.target sm_90\n.address_size 64\n\n"

KERNEL = (
    HEADER
    + """.extern .func  (.param .b32 func_retval0) {callee}
(
	.param .b64 {callee}_param_0,
	.param .b32 {callee}_param_1
)
;

.visible .entry linked_kernel(
	.param .u64 linked_kernel_param_0,
	.param .u64 linked_kernel_param_1,
	.param .u32 linked_kernel_param_2
)
{{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<2>;
	.reg .b32 	%r<8>;
	.reg .b64 	%rd<8>;

	ld.param.u64 	%rd1, [linked_kernel_param_0];
	ld.param.u64 	%rd2, [linked_kernel_param_1];
	ld.param.u32 	%r1, [linked_kernel_param_2];
	mov.u32 	%r2, %tid.x;
	mov.u32 	%r3, %ntid.x;
	mov.u32 	%r4, %ctaid.x;
	mad.lo.s32 	%r5, %r3, %r4, %r2;
	cvta.to.global.u64 	%rd3, %rd1;
	mul.wide.s32 	%rd5, %r5, 4;
	add.s64 	%rd6, %rd3, %rd5;
	add.s64 	%rd7, %rd2, %rd5;
	ld.global.f32 	%f1, [%rd6];
	mov.u32 	%r6, 0;

$L__BB0_1:
	{{ // callseq 0, 0
	.param .b64 param0;
	st.param.b64 	[param0+0], %rd7;
	.param .b32 param1;
	st.param.f32 	[param1+0], %f1;
	.param .b32 retval0;
	call.uni (retval0),
	{callee},
	(
	param0,
	param1
	);
	ld.param.f32 	%f1, [retval0+0];
	}} // callseq 0
	add.s32 	%r6, %r6, 1;
	setp.lt.s32 	%p1, %r6, %r1;
	@%p1 bra 	$L__BB0_1;

	ret;

}}
"""
)


def callee_ptx(name: str, body: str, helpers: str = "") -> str:
    """A linked PTX file defining ``name(pointer, float) -> float`` with ``body``
    (the pointer in %rd1, the float in %f1; it returns %f2)."""
    return (
        HEADER
        + helpers
        + f""".visible .func  (.param .b32 func_retval0) {name}(
	.param .b64 {name}_param_0,
	.param .b32 {name}_param_1
)
{{
	.reg .pred 	%p<2>;
	.reg .f32 	%f<4>;
	.reg .b32 	%r<4>;
	.reg .b64 	%rd<4>;
	ld.param.u64 	%rd1, [{name}_param_0];
	ld.param.f32 	%f1, [{name}_param_1];
{body}
	st.param.f32 	[func_retval0+0], %f2;
	ret;
}}
"""
    )


PURE = "\tfma.rn.f32 \t%f2, %f1, 0f3F7FBE77, 0f3E800000;"
# The helper and the function calling it, as NVVM emits a callee that was not inlined.
HELPER = """.func  (.param .b32 func_retval0) gps_half(
	.param .b32 gps_half_param_0
)
{
	.reg .f32 	%f<3>;
	ld.param.f32 	%f1, [gps_half_param_0];
	mul.rn.f32 	%f2, %f1, 0f3F000000;
	st.param.f32 	[func_retval0+0], %f2;
	ret;
}

"""
CALLS_HELPER = """	{ // callseq 1, 0
	.param .b32 param0;
	st.param.f32 	[param0+0], %f1;
	.param .b32 retval0;
	call.uni (retval0), gps_half, (param0);
	ld.param.f32 	%f2, [retval0+0];
	} // callseq 1"""


def hand_kernel(callee: str, body: str, helpers: str = "") -> Kernel:
    return linked_kernel(
        KERNEL.format(callee=callee), "linked_kernel", callee_ptx(callee, body, helpers)
    )


def test_a_pure_hand_written_callee_is_stepped_over_and_assembles():
    kernel = hand_kernel("gps_pure", PURE)
    assert kernel.report.classification.verdict is Idempotence.IDEMPOTENT
    variant = kernel.preemptible(abort_checks=True)
    # A tight loop around the call is unrolled like any other: each copy keeps its own
    # call sequence's scope.
    assert variant.ptx.count("call.uni") == UNROLL and variant.saves_state
    assemble(variant.ptx, "sm_90")


def test_a_callee_that_writes_through_a_pointer_stays_refused_with_the_reason():
    kernel = hand_kernel("gps_store", "\tst.f32 \t[%rd1], %f1;\n\tmov.f32 \t%f2, %f1;")
    classification = kernel.report.classification
    assert classification.verdict is Idempotence.UNKNOWN
    reason = classification.reasons[0]
    assert re.fullmatch(
        r"call to gps_store at PTX line \d+: it writes memory \(st\.f32 at PTX line \d+\): "
        r"the analysis does not follow a device function's memory accesses",
        reason,
    ), reason


def test_a_callee_that_reads_a_buffer_stays_refused_too():
    kernel = hand_kernel("gps_load", "\tld.global.f32 \t%f2, [%rd1];")
    assert kernel.report.classification.verdict is Idempotence.UNKNOWN
    assert "it reads memory (ld.global.f32" in kernel.report.classification.reasons[0]


def test_a_callee_may_use_its_own_local_frame():
    frame = """	.local .align 4 .b8 	__local_depot1[4];
	.reg .b64 	%SP;
	.reg .b64 	%SPL;
	mov.u64 	%SPL, __local_depot1;
	cvta.local.u64 	%SP, %SPL;
	add.u64 	%rd2, %SP, 0;
	st.f32 	[%rd2], %f1;
	ld.f32 	%f2, [%rd2];"""
    kernel = hand_kernel("gps_frame", frame)
    assert kernel.report.classification.verdict is Idempotence.IDEMPOTENT


def test_the_functions_a_callee_calls_come_along_before_it():
    kernel = hand_kernel("gps_outer", CALLS_HELPER, HELPER)
    assert kernel.report.classification.verdict is Idempotence.IDEMPOTENT
    assert [f.name for f in kernel.module.functions] == ["gps_half", "gps_outer"]
    assemble(kernel.preemptible(abort_checks=True).ptx, "sm_90")


def test_a_callee_whose_own_callee_writes_memory_is_refused_naming_both():
    writer = HELPER.replace(
        "\tmul.rn.f32 \t%f2, %f1, 0f3F000000;",
        "\tmov.f32 \t%f2, %f1;\n\tmov.u64 \t%rd1, 4096;\n\tst.global.f32 \t[%rd1], %f1;",
    ).replace(".reg .f32 \t%f<3>;", ".reg .f32 \t%f<3>;\n\t.reg .b64 \t%rd<2>;")
    assert "st.global.f32" in writer and "%rd<2>" in writer
    kernel = hand_kernel("gps_outer", CALLS_HELPER, writer)
    reason = kernel.report.classification.reasons[0]
    assert re.match(r"call to gps_outer at PTX line \d+: it calls gps_half, which writes", reason)


def test_a_callee_that_reads_the_block_index_is_refused():
    kernel = hand_kernel("gps_block", "\tmov.u32 \t%r1, %ctaid.x;\n\tcvt.rn.f32.u32 \t%f2, %r1;")
    assert kernel.report.classification.verdict is Idempotence.UNKNOWN
    assert "it reads the block index" in kernel.report.classification.reasons[0]


def test_a_callee_with_a_warp_collective_is_classified_but_saves_no_state():
    shuffle = "\tmov.b32 \t%r1, %f1;\n\tshfl.sync.bfly.b32 \t%r2, %r1, 1, 31, -1;\n"
    shuffle += "\tmov.b32 \t%f2, %r2;"
    kernel = hand_kernel("gps_shuffle", shuffle)
    assert kernel.report.classification.verdict is Idempotence.IDEMPOTENT
    variant = kernel.preemptible(abort_checks=True)
    assert not variant.saves_state
    assert variant.save_refusal == (
        "it calls gps_shuffle, which uses the warp collective shfl.sync.bfly.b32"
    )


def test_a_function_of_the_kernels_own_module_that_writes_memory_is_refused():
    # Before linking existed such a call was stepped over unseen.
    own = callee_ptx("gps_own", "\tst.global.f32 \t[%rd1], %f1;\n\tmov.f32 \t%f2, %f1;")
    body = own[own.index(".visible .func") :]
    ptx = re.sub(r"\.extern \.func[^;]*;", lambda _: body, KERNEL.format(callee="gps_own"))
    classification = Kernel(ptx, "linked_kernel").report.classification
    assert classification.verdict is Idempotence.UNKNOWN
    assert "call to gps_own" in classification.reasons[0]


def test_what_cannot_be_linked_stays_declared_with_a_note():
    ptx = KERNEL.format(callee="gps_pure")
    newer = callee_ptx("gps_pure", PURE).replace(".target sm_90", ".target sm_100")
    assert "targets sm_100, the kernel sm_90" in link_device_functions(ptx, [newer]).notes[0]
    with_var = callee_ptx("gps_pure", "\tld.global.f32 \t%f2, [gps_table];")
    with_var = with_var.replace(".address_size 64\n", ".address_size 64\n.global .f32 gps_table;\n")
    assert "uses the module variable gps_table" in link_device_functions(ptx, [with_var]).notes[0]
    broken = link_device_functions(ptx, ["not ptx at all"])
    assert broken.text == ptx and broken.notes[0].startswith("linked PTX 1 could not be read")
    elsewhere = link_device_functions(ptx, [callee_ptx("gps_other", PURE)])
    assert elsewhere.text == ptx and elsewhere.notes == ()


def test_a_newer_linked_ptx_raises_the_version_of_the_whole():
    ptx = KERNEL.format(callee="gps_pure")
    newer = callee_ptx("gps_pure", PURE).replace(".version 8.0", ".version 8.5")
    assert parse_ptx(link_device_functions(ptx, [newer]).text).version == "8.5"


@pytest.mark.parametrize(
    ("call", "target"),
    [
        ("call.uni (retval0), f, (param0);", "f"),
        ("call.uni f, (param0);", "f"),
        ("call g;", "g"),
        ("call (retval0), %rd4, (param0), prototype_0;", ""),
    ],
)
def test_the_function_a_call_names(call: str, target: str):
    assert call_target(parse_instruction(call.rstrip(";"), 1)) == target
