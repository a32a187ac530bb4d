"""Kernels other frameworks generate, through the analysis and transform (no GPU).

The PTX under ``fixtures/cupy`` is what CuPy 14.2 (with ``CUPY_COMPILE_WITH_PTX=1``)
loaded on an H200 for array operations, two user ``ElementwiseKernel`` s (one in place)
and a ``RawKernel``, captured by the launch shim's module hook.  CuPy passes each array
as a struct by value (``CArray``: data pointer at byte 0, then size, shape and strides),
so the analysis must follow the pointer field of a struct parameter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare_ext.kernels import Idempotence, Kernel, TransformOptions, assemble
from gpushare_ext.kernels.dataflow import struct_pointer_fields
from gpushare_ext.kernels.launch import FINISH_BOUND_US, LaunchMode, decide_launch
from gpushare_ext.kernels.rewrite import RecordLayout

CUPY = Path(__file__).with_name("fixtures") / "cupy"

# kernel -> (verdict, {buffer: access})
EXPECTED = {
    "cupy_add__float32_float_float32": ("idempotent", {"_param_0@0": "read", "_param_2@0": "written"}),
    "cupy_arange__float_float_float32": ("idempotent", {"_param_2@0": "written"}),
    "cupy_copy__float32_float32": ("idempotent", {"_param_0@0": "read", "_param_1@0": "written"}),
    "cupy_sin__float32_float32": ("idempotent", {"_param_0@0": "read", "_param_1@0": "written"}),
    "cupy_true_divide__float32_float_float32": (
        "idempotent", {"_param_0@0": "read", "_param_2@0": "written"},
    ),
    "loopy": ("idempotent", {"_param_0@0": "read", "_param_2@0": "written"}),
    "inplace_loopy": ("non-idempotent", {"_param_1@0": "read-written"}),
    "rawk": ("idempotent", {"_param_0": "read", "_param_1": "written"}),
}  # fmt: skip


def cupy_kernel(name: str) -> Kernel:
    return Kernel((CUPY / f"{name}.ptx").read_text(), name)


def test_every_captured_kernel_has_an_expectation():
    assert sorted(p.stem for p in CUPY.glob("*.ptx")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cupy_kernels_are_classified_through_their_array_structs(name: str):
    kernel = cupy_kernel(name)
    verdict, buffers = EXPECTED[name]
    report = kernel.report
    assert report.classification.verdict.value == verdict, report.classification.reasons
    assert {p.removeprefix(name): b.access.value for p, b in report.buffers.items()} == buffers


def test_only_the_pointer_fields_of_a_struct_become_buffers():
    kernel = cupy_kernel("loopy")
    # It loads each array's data pointer (byte 0) and stride (byte 24), and the indexer's
    # size (param 3, byte 0): 64-bit fields the analysis must tell apart.
    # In parameter order, then byte order.
    assert struct_pointer_fields(kernel.entry) == [
        "loopy_param_0@0", "loopy_param_0@24", "loopy_param_2@0", "loopy_param_2@24",
        "loopy_param_3@0",
    ]  # fmt: skip
    assert sorted(kernel.report.buffers) == ["loopy_param_0@0", "loopy_param_2@0"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_cupy_kernels_transform_with_abort_checks_and_assemble(name: str):
    kernel = cupy_kernel(name)
    variant = kernel.preemptible(abort_checks=bool(kernel.report.loops))
    assert variant.options == TransformOptions(abort_checks=bool(kernel.report.loops))
    assemble(variant.ptx, "sm_90")  # ptxas accepts it (raises with the log otherwise)


def test_an_abort_records_the_lowest_block_it_left_for_a_restart():
    variant = cupy_kernel("loopy").preemptible(abort_checks=True)
    abort = variant.ptx.split("$__gs_abort:")[1].split("exit;")[0]
    assert f"red.global.min.u32 [%gs_prog+{RecordLayout.LOWEST_ABORTED}], %gs_id;" in abort


def shim_mode(kernel: Kernel, extents: dict, longest_us: float = 0.0) -> LaunchMode:
    """The mode a launch the shim took gets (timed at ``longest_us`` per launch)."""
    return decide_launch(kernel, extents, for_shim=True, longest_us=longest_us).mode


def test_the_launch_mode_follows_the_buffers_actually_passed():
    kernel = cupy_kernel("loopy")
    x, y = "loopy_param_0@0", "loopy_param_2@0"
    apart = {x: (0x1000, 4096), y: (0x9000, 4096)}
    same = {x: (0x1000, 4096), y: (0x1000, 4096)}  # loopy(a, out=a): in place
    assert shim_mode(kernel, apart) is LaunchMode.RESTART
    assert shim_mode(kernel, same) is LaunchMode.SNAPSHOT
    # A kernel long enough that finishing it after a Ctrl-C would keep the user waiting
    # gets a snapshot even where it is idempotent: the Ctrl-C rolls it back at once.
    assert shim_mode(kernel, apart, longest_us=FINISH_BOUND_US) is LaunchMode.SNAPSHOT
    assert shim_mode(kernel, apart, longest_us=FINISH_BOUND_US - 1) is LaunchMode.RESTART
    inplace = cupy_kernel("inplace_loopy")
    assert shim_mode(inplace, {"inplace_loopy_param_1@0": (0x1000, 64)}) is LaunchMode.SNAPSHOT
    # Outside the shim the same rule resumes an idempotent launch rather than restarting it.
    assert decide_launch(kernel, apart).mode is LaunchMode.RESUME
    assert decide_launch(kernel, apart, longest_us=FINISH_BOUND_US).mode is LaunchMode.SNAPSHOT


def test_a_kernel_the_analysis_cannot_follow_runs_as_it_is_under_the_shim():
    ptx = (CUPY / "rawk.ptx").read_text()
    # Take the input pointer from memory instead of a parameter: unknown.
    original = "ld.param.u64 \t%rd2, [rawk_param_0];"
    assert original in ptx
    kernel = Kernel(ptx.replace(original, "ld.global.u64 \t%rd2, [%rd3];", 1), "rawk")
    assert kernel.report.classification.verdict is Idempotence.UNKNOWN
    assert shim_mode(kernel, {"rawk_param_1": (0x1000, 64)}) is LaunchMode.OFF
    # A launch asked for as preemptible outside the shim snapshots what it may write.
    assert decide_launch(kernel, {"rawk_param_1": (0x1000, 64)}).mode is LaunchMode.SNAPSHOT
