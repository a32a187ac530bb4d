"""CUDA files in the shapes real projects have, compiled as they are and classified.

The corpus under ``sources/`` (written for these tests) has whole programs with
``main()``, system and toolkit headers, helpers reached by relative includes and by
``-I``, kernels in included headers, templates with and without instantiations, macros
set by ``-D``, namespaced kernels and comments inside signatures.  Each kernel's label
and the reason that decided it are asserted; no kernel may be called idempotent when
it is not.  nvcc and its host compiler are the real ones (the toolchain wheels and the
system's g++).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from gpushare_ext.kernels import kernel, toolchain
from gpushare_ext.kernels.cli import classify_file, classify_main
from gpushare_ext.kernels.toolchain import CompileOptions

SOURCES = Path(__file__).parent / "sources"
APP = SOURCES / "app"
INCLUDE = SOURCES / "include"

pytestmark = pytest.mark.skipif(
    toolchain.find_nvcc() is None or toolchain.find_host_compiler() is None,
    reason="needs nvcc (the toolchain extra) and a host C++ compiler",
)


@functools.cache
def analysed(file: str, defines: tuple[str, ...] = (), std: str | None = None):
    options = CompileOptions(include_dirs=(INCLUDE,), defines=defines, std=std)
    return classify_file(APP / file, options=options)


def report(file: str, name: str, defines: tuple[str, ...] = (), std: str | None = None):
    found = [r for r in analysed(file, defines, std).reports.values() if r.display_name == name]
    assert len(found) == 1, [r.display_name for r in analysed(file, defines, std).reports.values()]
    return found[0]


# (file, -D macros, -std, kernel as a report names it, label, the decisive reason,
#  parameter names as written)
CASES = [
    (
        "nbody_step.cu", (), None,
        "compute_forces(Body const*, float3*, int, float)", "idempotent",
        "no buffer is both read and written (written: `accel`; read: `bodies`)",
        ["bodies", "accel", "n", "softening"],
    ),
    (
        "nbody_step.cu", (), None,
        "integrate(Body*, float3*, float3 const*, float, int)", "non-idempotent",
        "parameter `bodies` is read at source line 48",
        ["bodies", "velocity", "accel", "dt", "n"],
    ),
    (
        "normalize.cu", (), None,
        "normalize(float const*, float*, float, float, int)", "idempotent",
        "(written: `out`; read: `in`)", ["in", "out", "lo", "hi", "n"],
    ),
    (
        "normalize.cu", (), None,
        "clamp_inplace(float*, float, float, int)", "non-idempotent",
        "parameter `data` is read at source line 12", ["data", "lo", "hi", "n"],
    ),
    (
        "normalize.cu", (), None,
        "fill(float*, float, int)", "idempotent", "(written: `out`)", ["out", "value", "n"],
    ),
    (
        "kernels_header_user.cu", (), None,
        "fill(float*, float, int)", "idempotent", "(written: `out`)", ["out", "value", "n"],
    ),
    (
        "templates.cu", (), None,
        "axpby<float>(float const*, float const*, float*, float, float, unsigned long)",
        "idempotent", "(written: `out`; read: `x`, `y`)", ["x", "y", "out", "a", "b", "n"],
    ),
    (
        "templates.cu", (), None,
        "axpby<double>(double const*, double const*, double*, double, double, unsigned long)",
        "idempotent", "(written: `out`; read: `x`, `y`)", ["x", "y", "out", "a", "b", "n"],
    ),
    (
        "templates.cu", (), None,
        "scale_inplace<int, 2>(int*, unsigned long)", "non-idempotent",
        "parameter `data` is read at source line 22", ["data", "n"],
    ),
    (
        "bias.cu", (), None,
        "dense(float const*, float const*, float*, int, int)", "idempotent",
        "(written: `y`; read: `x`, `w`)", ["x", "w", "y", "rows", "cols"],
    ),
    (
        "bias.cu", ("WITH_BIAS", "ACCUMULATE=1", "BLOCK=128"), None,
        "dense(float const*, float const*, float const*, float*, int, int)", "non-idempotent",
        "parameter `y` is read at source line 20", ["x", "w", "bias", "y", "rows", "cols"],
    ),
    (
        "namespaces.cu", (), None,
        "physics::fluid::step(float const*, float*, float, int)", "idempotent",
        "(written: `pressure`; read: `density`)", ["density", "pressure", "k", "n"],
    ),
    (
        "namespaces.cu", (), None,
        "physics::solid::step(float*, float const*, float, int)", "non-idempotent",
        "parameter `stress` is read at source line 20", ["stress", "strain", "modulus", "n"],
    ),
    (
        "namespaces.cu", (), None,
        "(anonymous namespace)::tally(unsigned int*, int const*, int)", "non-idempotent",
        # the atomicAdd is inlined from a toolkit header: the line is the kernel's call
        "atomic add on parameter `bins` at source line 32 (", ["bins", "values", "n"],
    ),
    (
        "own_writes.cu", (), None,
        "two_pass(float*, float const*, float*, int)", "idempotent",
        "`out` read back only where written", ["out", "a", "scratch", "n"],
    ),
    (
        "own_writes.cu", (), None,
        "maybe_then_read(float*, float const*, int)", "non-idempotent",
        "parameter `out` is read at source line 14", ["out", "a", "n"],
    ),
    (
        "pointer_table.cu", (), None,
        "gather_rows(float* const*, int const*, float*, int, int)", "unknown",
        "2 accesses through pointers loaded from memory, e.g. at source line 11",
        ["rows", "picks", "out", "cols", "n"],
    ),
    (
        "pointer_table.cu", (), None,
        "batched_scale(Batch, float, int)", "idempotent",
        "(written: `batch@32`, `batch@40`, `batch@48`, `batch@56`; read: `batch@0`",
        ["batch", "a", "n"],
    ),
    (
        "concepts.cu", (), "c++20",
        "square<float>(float const*, float*, int)", "idempotent",
        "(written: `out`; read: `in`)", ["in", "out", "n"],
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    ("file", "defines", "std", "name", "label", "reason", "params"),
    CASES,
    ids=[f"{c[0]}:{c[3].split('(')[0]}{':' + ','.join(c[1]) if c[1] else ''}" for c in CASES],
)
def test_each_kernel_gets_its_label_and_decisive_reason(
    file, defines, std, name, label, reason, params
):
    r = report(file, name, defines, std)

    assert r.classification.verdict.value == label, r.classification.reasons
    assert reason in r.summary(), r.summary()
    assert [r.entry.display_name(p.name) for p in r.entry.params] == params


def test_the_whole_program_is_compiled_by_nvcc_with_its_host_code():
    result = analysed("nbody_step.cu")

    assert result.compiled.compiler == "nvcc"
    assert len(result.reports) == 2  # main() and the host helpers are not kernels


def test_each_instantiation_of_a_template_is_analysed_and_named():
    result = analysed("templates.cu")

    found = {d.name: names for d, names in result.instantiations().items()}
    assert found == {
        "axpby": ["axpby<float>", "axpby<double>"],
        "scale_inplace": ["scale_inplace<int, 2>"],
    }
    (missing,) = result.uninstantiated
    assert (missing.name, Path(missing.file).name, missing.line) == (
        "block_sum",
        "templates.cu",
        27,
    )


def test_a_template_never_instantiated_is_reported_with_how_to_add_one(capsys):
    assert classify_main([str(APP / "templates.cu"), "--brief"]) == 0

    out = capsys.readouterr().out
    assert "template kernel axpby (templates.cu:6): 2 instantiations analysed" in out
    assert (
        "not analysed: the template kernel block_sum (templates.cu:27) is never instantiated; "
        "add an explicit instantiation with the template arguments you use, e.g. "
        "`template __global__ void block_sum<float, 1>(const float* in, float* out);`"
    ) in out


def test_a_file_of_templates_only_is_an_error_saying_how_to_instantiate(capsys):
    assert classify_main([str(APP / "only_templates.cu")]) == 2

    err = capsys.readouterr().err
    assert err.startswith(f"gpushare classify: {APP / 'only_templates.cu'}: no kernel to analyse: ")
    assert (
        "`template __global__ void copy_n<float>(const float* __restrict__ in, "
        "float* __restrict__ out, int n);`"
    ) in err
    assert err.count("\n") == 1


def test_one_summary_line_per_kernel_then_a_table_each(capsys):
    assert classify_main([str(APP / "namespaces.cu"), "-I", str(INCLUDE)]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{APP / 'namespaces.cu'}: 3 kernels (compiled with nvcc)"
    assert out[1].startswith("physics::fluid::step(float const*, float*, float, int): idempotent")
    assert out[2].startswith("physics::solid::step(float*, float const*, float, int): non-idem")
    assert out[3].startswith("(anonymous namespace)::tally(")
    assert any("┃ parameter" in line for line in out)


def test_quoted_includes_are_found_next_to_the_file_whatever_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)

    assert classify_main([str(APP / "normalize.cu"), "-I", str(INCLUDE), "--brief"]) == 0
    assert "3 kernels" in capsys.readouterr().out


def test_a_relative_include_folder_is_the_users_working_directorys(monkeypatch, capsys):
    monkeypatch.chdir(SOURCES)

    assert classify_main(["app/normalize.cu", "-I", "include", "--brief"]) == 0
    assert "3 kernels" in capsys.readouterr().out


def test_a_kernel_only_header_is_compiled_as_cuda(capsys):
    assert classify_main([str(SOURCES / "common" / "vec_helpers.cuh"), "--brief"]) == 0
    assert "fill(float*, float, int): idempotent" in capsys.readouterr().out


# -- launch-level truth ----------------------------------------------------------------


def test_an_in_place_call_of_an_idempotent_kernel_is_not_idempotent(capsys):
    argv = [str(APP / "normalize.cu"), "-I", str(INCLUDE), "--kernel", "normalize"]

    assert classify_main([*argv, "--same-buffer", "in,out", "--brief"]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("normalize(float const*, float*, float, float, int): idempotent")
    assert out[2] == (
        "  with `in` and `out` one buffer: non-idempotent: parameters `in` and `out` overlap "
        "in memory: `in` is read and `out` is written, so this launch updates a buffer in place"
    )


def test_one_buffer_for_two_read_parameters_changes_nothing(capsys):
    argv = [str(APP / "templates.cu"), "--kernel", "axpby<float>", "--same-buffer", "x,y"]

    assert classify_main([*argv, "--brief"]) == 0

    assert "  with `x` and `y` one buffer: still idempotent" in capsys.readouterr().out


def test_same_buffer_in_json(capsys):
    argv = [str(APP / "templates.cu"), "--kernel", "axpby<double>", "--same-buffer", "x=out"]

    assert classify_main([*argv, "--json"]) == 0

    (k,) = json.loads(capsys.readouterr().out)["kernels"]
    assert k["verdict"] == "idempotent"
    assert k["launch"]["verdict"] == "non-idempotent"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("x", "--same-buffer 'x': expected two parameter names, e.g. x,y"),
        ("x,x", "--same-buffer 'x,x': expected two parameter names, e.g. x,y"),
        ("p,q", "--same-buffer p,q: no kernel has buffer parameters of those names"),
    ],
)
def test_a_bad_same_buffer_is_one_line(value, message, capsys):
    assert classify_main([str(APP / "templates.cu"), "--same-buffer", value]) == 2
    assert capsys.readouterr().err == f"gpushare classify: {message}\n"


def test_a_name_two_kernels_share_must_be_qualified(capsys):
    assert classify_main([str(APP / "namespaces.cu"), "--kernel", "step"]) == 2
    err = capsys.readouterr().err
    assert "'step' names more than one kernel; say which: physics::fluid::step(" in err

    assert classify_main([str(APP / "namespaces.cu"), "--kernel", "physics::solid::step"]) == 0
    assert "1 kernel" in capsys.readouterr().out.splitlines()[0]


# -- bad input: one line, exit status 2 ------------------------------------------------


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("empty.cu", "  \n", "{path}: is empty; expected a .cu, .cuh, .h, .hpp or .ptx file with kernels in it"),
        ("prog.cu", b"\x7fELF\x02\x01\x01\0\0\0", "{path}: is a binary file, not source; expected a .cu, .cuh, .h, .hpp or .ptx file"),
        ("host.cu", "int main() { return 0; }\n", "{path}: no kernels (__global__ functions) in this file"),
        (
            "broken.cu", "__global__ void f(float* x) {\n  x[0] = undefined_name;\n  x[1] = also_bad;\n}\n",
            'broken.cu:2: identifier "undefined_name" is undefined (1 more error); --verbose shows the nvcc log',
        ),
        (
            "needs.cu", '#include "missing_helpers.cuh"\n__global__ void f(float* x) { x[0] = 1; }\n',
            "needs.cu:1: cannot find the header missing_helpers.cuh: add its directory with -I DIR",
        ),
        (
            "sys.cu", "#include <no_such_system_header.h>\n",
            "sys.cu:1: cannot find the header no_such_system_header.h: add its directory with -I DIR",
        ),
    ],
)  # fmt: skip
def test_bad_input_is_one_clear_line(name, content, expected, tmp_path, capsys):
    path = _write(tmp_path, name, content)

    assert classify_main([str(path)]) == 2

    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"gpushare classify: {expected.format(path=path)}\n"


def test_a_legacy_texture_reference_gets_a_stand_in_and_the_kernel_is_unknown(capsys):
    assert classify_main([str(APP / "legacy_texture.cu"), "--brief"]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "note: texture references (removed in CUDA 12) were given stand-ins: a kernel that "
        "fetches from one reads through a pointer the analysis cannot follow"
    )
    assert out[2] == (
        "sample(float*, int): unknown: read through a pointer loaded from memory at source "
        "line 6 (PTX line 47, ld.global.f32): its buffer is not a parameter"
    )


def test_a_texture_reference_in_a_file_that_does_not_compile_says_what_replaced_it(
    tmp_path, capsys
):
    text = (APP / "legacy_texture.cu").read_text() + "__global__ void broken() { nope(); }\n"
    path = _write(tmp_path, "tex.cu", text)

    assert classify_main([str(path)]) == 2

    err = capsys.readouterr().err
    assert err.startswith("gpushare classify: tex.cu:2: texture is not a template (")
    assert "; texture and surface references were removed in CUDA 12: the file needs " in err
    assert err.count("\n") == 1


def test_a_file_that_needs_a_newer_standard_says_which_flag(capsys):
    assert classify_main([str(APP / "concepts.cu")]) == 2
    assert "try -std c++20" in capsys.readouterr().err


def test_verbose_adds_the_compilers_whole_log(tmp_path, capsys):
    path = _write(tmp_path, "broken.cu", "__global__ void f(float* x) { x[0] = nope; }\n")

    assert classify_main([str(path), "--verbose"]) == 2

    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith('gpushare classify: broken.cu:1: identifier "nope" is undefined')
    assert any(line.startswith(f'{path}(1): error: identifier "nope"') for line in lines[1:])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--arch", "ampere"], "--arch 'ampere' is not a GPU architecture such as sm_90 or sm_80"),
        (["-D", "1BAD"], "-D '1BAD' is not NAME or NAME=VALUE"),
        (["-I", "/no/such/dir"], "-I /no/such/dir: no such directory"),
    ],
)
def test_a_bad_option_is_one_line(args, message, capsys):
    assert classify_main([str(APP / "bias.cu"), *args]) == 2
    assert capsys.readouterr().err == f"gpushare classify: {message}\n"


def test_no_host_compiler_gets_a_hint_not_a_log(monkeypatch, tmp_path, capsys):
    # A PATH with nothing on it but nvcc's own folder: no g++, no cc.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("NVCC_CCBIN", raising=False)
    monkeypatch.delenv("CUDAHOSTCXX", raising=False)

    assert classify_main([str(APP / "bias.cu")]) == 2

    assert capsys.readouterr().err == (
        f"gpushare classify: {APP / 'bias.cu'}: nvcc needs a host C++ compiler and none is "
        "installed: apt install g++ (or set NVCC_CCBIN to one)\n"
    )


def test_a_host_compiler_that_cannot_run_gets_a_hint(monkeypatch, tmp_path, capsys):
    broken = tmp_path / "g++"
    broken.write_text("#!/bin/sh\nexit 127\n")
    broken.chmod(0o755)
    monkeypatch.setenv("NVCC_CCBIN", str(broken))

    assert classify_main([str(APP / "bias.cu")]) == 2

    assert capsys.readouterr().err == (
        f"gpushare classify: {APP / 'bias.cu'}: nvcc could not run its host C++ compiler: "
        "apt install g++ (or set NVCC_CCBIN to one)\n"
    )


def test_without_nvcc_a_kernel_only_file_is_compiled_by_nvrtc(monkeypatch, capsys):
    monkeypatch.setattr(toolchain, "find_nvcc", lambda: None)

    assert classify_main([str(APP / "namespaces.cu"), "--brief"]) == 2  # it has <<<...>>>
    assert "which need nvcc: pip install 'gpushare-ext[toolchain]'" in capsys.readouterr().err

    assert classify_main([str(APP / "own_writes.cu"), "--brief"]) == 0
    out = capsys.readouterr().out
    assert "2 kernels (compiled with NVRTC)" in out
    assert "two_pass(float*, float const*, float*, int): idempotent" in out


# -- the Python API --------------------------------------------------------------------


def test_kernel_takes_a_file_and_a_cxx_name():
    k = kernel(APP / "templates.cu", "axpby<double>")

    assert k.report.display_name.startswith("axpby<double>(")
    assert [b.name for b in k.bindings] == ["x", "y", "out", "a", "b", "n"]
    assert k.report.classification.idempotent


def test_kernel_takes_macros_and_include_folders():
    k = kernel(APP / "bias.cu", "dense", defines=["WITH_BIAS", "ACCUMULATE=1"])
    assert [b.name for b in k.bindings] == ["x", "w", "bias", "y", "rows", "cols"]
    assert not k.report.classification.idempotent

    k = kernel(APP / "normalize.cu", "clamp_inplace", include_dirs=[INCLUDE])
    assert [b.name for b in k.bindings] == ["data", "lo", "hi", "n"]


def test_kernel_source_strings_get_names_through_comments_and_namespaces():
    src = (APP / "namespaces.cu").read_text().split("void launch_tally")[0]

    k = kernel(src, "physics::fluid::step")

    assert [b.name for b in k.bindings] == ["density", "pressure", "k", "n"]


def test_demangled_names_are_the_cxx_names():
    from gpushare_ext.kernels.signatures import demangle

    assert (
        demangle("_ZN7physics5fluid4stepEPKfPffi")
        == "physics::fluid::step(float const*, float*, float, int)"
    )
    assert demangle("saxpy") == "saxpy"


# -- host code that does not compile, kernels in files meant to be included ------------


def test_kernels_of_a_program_whose_host_code_is_for_an_older_cuda_are_analysed(capsys):
    assert classify_main([str(APP / "old_host_api.cu"), "--brief"]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        'note: the host code does not compile (old_host_api.cu:23: class "cudaDeviceProp" has '
        'no member "deviceOverlap" (1 more error)): the device code was compiled alone, so '
        "template kernels launched only from host code are not instantiated"
    )
    assert out[2].startswith("relu_inplace(float*, int): non-idempotent: parameter `x` is read")
    assert out[3].startswith("squares(float const*, float*, int): idempotent")


def test_a_kernel_file_meant_to_be_included_names_the_file_that_includes_it(capsys):
    assert classify_main([str(APP / "stencil_part.cu")]) == 2
    assert capsys.readouterr().err == (
        'gpushare classify: stencil_part.cu:2: identifier "real" is undefined (1 more error); '
        f"stencil_part.cu is meant to be #included (by {APP / 'stencil_main.cu'}): classify "
        "that file; --verbose shows the nvcc log\n"
    )

    assert classify_main([str(APP / "stencil_main.cu"), "--brief"]) == 0
    assert "smooth(float const*, float*, int): idempotent" in capsys.readouterr().out


def test_windows_line_ends_change_nothing(tmp_path, capsys):
    crlf = _write(tmp_path, "old.cu", (APP / "old_host_api.cu").read_text().replace("\n", "\r\n"))

    assert classify_main([str(crlf), "--brief"]) == 0

    out = capsys.readouterr().out
    assert "note: the host code does not compile (old.cu:23:" in out
    assert "squares(float const*, float*, int): idempotent" in out


def test_host_bodies_are_emptied_and_device_code_kept_line_for_line():
    from gpushare_ext.kernels.hostcode import without_host_bodies

    text = (
        "#include <cstdio>\n"
        "#define CHECK(x) do { x; } while (0)\n"
        "struct P { int a; float f() const { return 1; } };\n"
        "namespace ns {\n"
        "__global__ void k(float* x) { x[0] = 1; }\n"
        "int helper(int v) { cudaThreadSynchronize(); return v; }\n"
        "}\n"
        "__host__ __device__ float both(float v) { return v; }\n"
        'extern "C" void run() {\n  k<<<1, 1>>>(nullptr);\n}\n'
        "static const int table[] = {1, 2};\n"
    )

    out = without_host_bodies(text)

    assert out.count("\n") == text.count("\n")
    lines = out.splitlines()
    assert lines[:5] == text.splitlines()[:5]
    assert lines[5].startswith("int helper(int v) {") and "cuda" not in lines[5]
    assert lines[7] == "__host__ __device__ float both(float v) { return v; }"
    assert lines[8] == 'extern "C" void run() {' and lines[9].strip() == ""
    assert lines[11] == "static const int table[] = {1, 2};"
    assert without_host_bodies("__global__ void k() {}\n") == "__global__ void k() {}\n"


def test_a_texture_reference_is_not_blamed_on_host_code_that_compiles(tmp_path, capsys):
    text = (APP / "legacy_texture.cu").read_text() + "int host_helper(int v) { return v + 1; }\n"
    path = _write(tmp_path, "tex_and_host.cu", text)

    assert classify_main([str(path), "--brief"]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out[1] == (
        "note: texture references (removed in CUDA 12) were given stand-ins: a kernel that "
        "fetches from one reads through a pointer the analysis cannot follow"
    )
    assert out[2].startswith("sample(float*, int): unknown")
