"""The CUDA toolchain: everything that turns CUDA C++ into PTX (nvcc, NVRTC, options).

What it is for: compiling a kernel source string in-process with NVRTC
(:func:`compile_cuda`, what ``kernel(src, name)`` uses), and compiling a user's file as
it is (host code, ``main()``, system and toolkit headers, quoted includes next to the
file, ``-I``/``-D``/``-std``/``--arch``, templates instantiated by the host code) to PTX
with ``nvcc -ptx``, keeping the device
side's preprocessed source so that kernels can be named from what the user wrote
(:mod:`~gpushare_ext.kernels.signatures`).  A failure becomes one line that says what
to do (the header not found and the flag that adds its directory, the host compiler to
install, the first error and where), with the compiler's whole log kept on the error
for ``--verbose``.  Without nvcc a file that needs nothing but the device compiler is
compiled with NVRTC instead.

The tools come from the pip wheels (``nvidia-cuda-nvcc``, ``nvidia-cuda-runtime``,
``nvidia-cuda-cccl``), else ``$CUDA_HOME``/``$CUDA_PATH``, else ``PATH``.

What it must not do: analyse or rewrite PTX, adopt kernels for launching (the front
ends in :mod:`~gpushare_ext.kernels.frontends` do, on top of this), or touch a GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpushare_ext.kernels.hostcode import without_host_bodies
from gpushare_ext.kernels.ptx import KernelError
from gpushare_ext.kernels.signatures import strip_comments

__all__ = [
    "CompileOptions",
    "CompiledFile",
    "compile_cuda",
    "compile_file",
    "find_nvcc",
    "find_ptxas",
    "summarise_log",
]

DEFAULT_ARCH = "sm_90"
STANDARDS = ("c++03", "c++11", "c++14", "c++17", "c++20")
COMPILE_TIMEOUT_S = 300
LEGACY_TEXTURES = Path(__file__).with_name("legacy_textures.cuh")
_LEGACY_TEXTURES = re.compile(r"error: texture is not a template")
VERBOSE_HINT = "; --verbose shows the"  # ends a summary taken from a compiler's log
_WHEEL_DIRS = ("nvidia/cu13", "nvidia/cu12", "nvidia/cuda_nvcc")
_HEADER_WHEELS = ("nvidia/cu13/include", "nvidia/cuda_runtime/include", "nvidia/cuda_cccl/include")
# What makes a file more than a kernel source: NVRTC has no host compiler and no libc.
_HOST_CODE = re.compile(
    r"\bint\s+main\s*\(|<<<|^\s*#\s*include\s*<(?!cuda_fp16|cuda_bf16|cooperative_groups)",
    re.M,
)


@dataclass(frozen=True)
class CompileOptions:
    """What the user would pass to nvcc for this file."""

    include_dirs: tuple[Path, ...] = ()
    defines: tuple[str, ...] = ()  # NAME or NAME=VALUE
    std: str | None = None  # c++17 ...; None: the compiler's default
    arch: str = DEFAULT_ARCH
    force_includes: tuple[Path, ...] = ()  # headers read before the file (-include)

    def check(self) -> None:
        """Raise a one-line KernelError for an option nvcc would refuse."""
        if not re.fullmatch(r"(sm|compute)_\d{2,3}[af]?", self.arch):
            raise KernelError(
                "bad-option",
                f"--arch {self.arch!r} is not a GPU architecture such as sm_90 or sm_80",
                step="compile",
            )
        if self.std is not None and self.std not in STANDARDS:
            raise KernelError(
                "bad-option",
                f"-std {self.std!r} is not one of {', '.join(STANDARDS)}",
                step="compile",
            )
        for d in self.defines:
            if not re.fullmatch(r"[A-Za-z_]\w*(=.*)?", d, re.S):
                raise KernelError(
                    "bad-option", f"-D {d!r} is not NAME or NAME=VALUE", step="compile"
                )
        for d in self.include_dirs:
            if not d.is_dir():
                raise KernelError("bad-option", f"-I {d}: no such directory", step="compile")

    def flags(self) -> list[str]:
        # nvcc runs in a folder of its own: relative folders are the user's, so resolve them.
        out = [f"-I{d.resolve()}" for d in self.include_dirs]
        out += [f"-D{d}" for d in self.defines]
        if self.std:
            out.append(f"-std={self.std}")
        for header in self.force_includes:
            out += ["-include", str(header)]
        return out


@dataclass(frozen=True)
class CompiledFile:
    """The PTX of one file and what the kernels' names are read from."""

    path: Path
    ptx: str
    compiler: str  # "nvcc" or "nvrtc"
    preprocessed: str  # the device side's preprocessed source (line markers kept)
    log: str  # warnings, for --verbose
    note: str = ""  # what a report must say about how it was compiled


# ---------------------------------------------------------------------------------------
# Finding the tools
# ---------------------------------------------------------------------------------------


def _from_wheels(name: str) -> Path | None:
    for root in sys.path:
        for rel in _WHEEL_DIRS:
            candidate = Path(root) / rel / "bin" / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    return None


def _from_cuda_home(name: str) -> Path | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            candidate = Path(home) / "bin" / name
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    return None


def find_nvcc() -> Path | None:
    """nvcc from the wheels, ``$CUDA_HOME``, or PATH (None if there is none)."""
    found = _from_wheels("nvcc") or _from_cuda_home("nvcc")
    if found is None and (on_path := shutil.which("nvcc")):
        found = Path(on_path)
    return found


def find_ptxas() -> str:
    """ptxas: ``$GPUSHARE_PTXAS``, else the wheels, ``$CUDA_HOME``, or PATH."""
    env = os.environ.get("GPUSHARE_PTXAS")
    if env:
        return env
    found = _from_wheels("ptxas") or _from_cuda_home("ptxas")
    if found is not None:
        return str(found)
    on_path = shutil.which("ptxas")
    if on_path:
        return on_path
    raise KernelError(
        "no-ptxas",
        "ptxas not found: install the nvidia-cuda-nvcc wheel (pip install nvidia-cuda-nvcc) "
        "or set GPUSHARE_PTXAS",
        step="assemble",
    )


def find_host_compiler() -> str | None:
    """The C++ compiler nvcc will call: ``$NVCC_CCBIN``/``$CUDAHOSTCXX``, else g++/c++/clang++."""
    for var in ("NVCC_CCBIN", "CUDAHOSTCXX"):
        value = os.environ.get(var)
        if value:
            return value
    for name in ("g++", "c++", "clang++", "gcc"):
        found = shutil.which(name)
        if found:
            return found
    return None


def toolkit_include_dirs() -> list[Path]:
    """The wheels' header folders (cuda_runtime.h, cccl), for compilers that need them named."""
    dirs: list[Path] = []
    for root in sys.path:
        for rel in _HEADER_WHEELS:
            candidate = Path(root) / rel
            if candidate.is_dir() and candidate not in dirs:
                dirs.append(candidate)
    return dirs


# ---------------------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------------------


def needs_host_compiler(text: str) -> bool:
    """True if the file has host code or system headers (NVRTC cannot compile it)."""
    return bool(_HOST_CODE.search(text))


def compile_file(path: Path, text: str, options: CompileOptions) -> CompiledFile:
    """Compile one CUDA C++ file to PTX, as nvcc would build it, or raise KernelError.

    When the whole file does not compile, the device code is tried alone (host function
    bodies emptied): a program for an older CUDA or a missing host library still has
    kernels worth analysing, and the result's ``note`` says the host code was left out.
    """
    options.check()
    nvcc = find_nvcc()
    if nvcc is None:
        if needs_host_compiler(text):
            raise KernelError(
                "no-nvcc",
                f"{path}: has host code or system headers, which need nvcc: "
                "pip install 'gpushare-ext[toolchain]' (or put a CUDA toolkit's nvcc on PATH)",
                step="compile",
            )
        return _compile_with_nvrtc(path, text, options)
    try:
        return _compile_with_nvcc(nvcc, path, path, options)
    except KernelError as whole:
        if whole.code != "compile-failed":
            raise
        return _compile_kernels_alone(nvcc, path, text, options, whole)


def _compile_kernels_alone(
    nvcc: Path, path: Path, text: str, options: CompileOptions, whole: KernelError
) -> CompiledFile:
    """The kernels of a file whose whole does not compile, or ``whole`` raised.

    Texture references first get their stand-ins, the whole file compiled again; only
    if that still fails are the host bodies set aside, and the note quotes the error
    that was left, so that it never blames the host code for a texture."""
    notes = []
    failure = whole
    if _LEGACY_TEXTURES.search(whole.log):
        options = replace(options, force_includes=(*options.force_includes, LEGACY_TEXTURES))
        notes.append(
            "texture references (removed in CUDA 12) were given stand-ins: a kernel that "
            "fetches from one reads through a pointer the analysis cannot follow"
        )
        try:
            compiled = _compile_with_nvcc(nvcc, path, path, options)
            return replace(compiled, log=whole.log, note=notes[0])
        except KernelError as left:
            if left.code != "compile-failed":
                raise
            failure = left
    plain = strip_comments(text)
    device_only = without_host_bodies(plain)
    if device_only == plain:
        raise whole
    first = failure.message.split(VERBOSE_HINT, 1)[0]
    notes.insert(
        0,
        f"the host code does not compile ({first}): the device code was compiled alone, "
        "so template kernels launched only from host code are not instantiated",
    )
    try:
        compiled = _compile_device_code(nvcc, path, device_only, options)
    except KernelError:
        raise whole from None
    return replace(compiled, log=whole.log, note="; ".join(notes))


def _compile_device_code(
    nvcc: Path, path: Path, device_only: str, options: CompileOptions
) -> CompiledFile:
    """Compile ``device_only`` as if it were ``path`` (its folder, its name, its lines)."""
    with tempfile.TemporaryDirectory(prefix="gpushare-device-") as tmp:
        copy = Path(tmp) / path.name
        copy.write_text(f'#line 1 "{path.resolve()}"\n{device_only}')
        searched_first = replace(
            options, include_dirs=(path.resolve().parent, *options.include_dirs)
        )
        return _compile_with_nvcc(nvcc, copy, path, searched_first)


def _compile_with_nvcc(
    nvcc: Path, source: Path, path: Path, options: CompileOptions
) -> CompiledFile:
    """Compile ``source``; errors and results name ``path`` (the user's file)."""
    host = find_host_compiler()
    if host is None:
        raise KernelError(
            "no-host-compiler",
            f"{path}: nvcc needs a host C++ compiler and none is installed: "
            "apt install g++ (or set NVCC_CCBIN to one)",
            step="compile",
        )
    with tempfile.TemporaryDirectory(prefix="gpushare-nvcc-") as tmp:
        out = Path(tmp) / "out.ptx"
        argv = [
            str(nvcc), "-ptx", f"-arch={options.arch.replace('sm_', 'compute_')}",
            "-lineinfo", "-allow-unsupported-compiler", "-keep", "-keep-dir", tmp,
            "-ccbin", host,
            *options.flags(),
            *[f"-I{d}" for d in toolkit_include_dirs()],
            "-o", str(out), "-x", "cu", str(source.resolve()),
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, cwd=tmp
            )
        except subprocess.TimeoutExpired:
            raise KernelError(
                "compile-failed",
                f"{path}: nvcc did not finish in {COMPILE_TIMEOUT_S} s",
                step="compile",
            ) from None
        except OSError as exc:
            raise KernelError(
                "no-nvcc", f"{path}: cannot run {nvcc}: {exc.strerror or exc}", step="compile"
            ) from None
        log = (proc.stderr + proc.stdout).strip()
        if proc.returncode != 0 or not out.is_file():
            raise KernelError(
                "compile-failed", summarise_log(log, path, "nvcc"), step="compile", log=log
            )
        kept = sorted(Path(tmp).glob("*.cpp1.ii"))
        preprocessed = kept[0].read_text(errors="replace") if kept else ""
        return CompiledFile(path, out.read_text(), "nvcc", preprocessed, log)


def _compile_with_nvrtc(path: Path, text: str, options: CompileOptions) -> CompiledFile:
    flags = [f"-I{path.parent}", *options.flags(), *[f"-I{d}" for d in toolkit_include_dirs()]]
    try:
        ptx, _ = compile_cuda(text, arch=options.arch, options=flags, filename=str(path))
    except KernelError as exc:
        if exc.code != "compile-failed":
            raise
        raise KernelError(
            "compile-failed", summarise_log(exc.log, path, "NVRTC"), step="compile", log=exc.log
        ) from None
    return CompiledFile(path, ptx, "nvrtc", "", "")


# ---------------------------------------------------------------------------------------
# NVRTC: kernel sources without host code, compiled in-process
# ---------------------------------------------------------------------------------------


def _nvrtc_check(result: tuple, what: str, prog: Any = None) -> tuple:
    from cuda.bindings import nvrtc

    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _nvrtc_log(prog) if prog is not None else ""
        raise KernelError(
            "compile-failed", f"NVRTC {what} failed: {err.name}", step="compile", log=log
        )
    return result[1:]


def _nvrtc_log(prog: Any) -> str:
    from cuda.bindings import nvrtc

    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0").decode(errors="replace")


def compile_cuda(
    source: str,
    *,
    arch: str = DEFAULT_ARCH,
    names: Sequence[str] = (),
    options: Sequence[str] = (),
    filename: str = "kernel.cu",
) -> tuple[str, dict[str, str]]:
    """Compile CUDA C++ to PTX with NVRTC; returns (ptx, {name expression: lowered name})."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KernelError(
            "no-nvrtc",
            "cuda-bindings is not installed: pip install 'gpushare-ext[toolchain]'",
            step="compile",
        ) from exc
    compute = arch.replace("sm_", "compute_")
    (prog,) = _nvrtc_check(
        nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], []), "create"
    )
    try:
        for n in names:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"name {n!r}", prog)
        std = [] if any(o.startswith(("-std", "--std")) for o in options) else ["--std=c++17"]
        opts = [f"--gpu-architecture={compute}", "-lineinfo", *std, *options]
        opts_b = [o.encode() for o in opts]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts_b), opts_b)
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelError(
                "compile-failed",
                f"NVRTC could not compile {filename} for {arch}",
                step="compile",
                log=_nvrtc_log(prog),
            )
        (size,) = _nvrtc_check(nvrtc.nvrtcGetPTXSize(prog), "PTX size", prog)
        buf = b" " * size
        _nvrtc_check(nvrtc.nvrtcGetPTX(prog, buf), "get PTX", prog)
        lowered = {}
        for n in names:
            (low,) = _nvrtc_check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), "lowered name", prog)
            lowered[n] = low.decode()
        return buf.rstrip(b"\0").decode(), lowered
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


# ---------------------------------------------------------------------------------------
# One line out of a compiler's log
# ---------------------------------------------------------------------------------------

_MISSING_HEADER = (
    re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):\d+: fatal error: (?P<header>[^:\n]+): No such file"),
    re.compile(r'^(?P<file>[^(\n]+)\((?P<line>\d+)\): (?:catastrophic )?error: cannot open source file "(?P<header>[^"]+)"'),
)  # fmt: skip
_ERROR_LINE = re.compile(
    r"^(?P<file>[^(\n]+)\((?P<line>\d+)\): (?:catastrophic )?error: (?P<what>.+)$"
)
_GCC_ERROR = re.compile(r"^(?P<file>[^:\n]+):(?P<line>\d+):\d+: (?:fatal )?error: (?P<what>.+)$")
_TOOLKIT_HEADERS = ("cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "cub/", "thrust/", "cuda/")


def summarise_log(log: str, path: Path, compiler: str) -> str:
    """The one line a user needs from a failed compile, naming where and what to do."""
    lines = log.splitlines()
    return (
        _header_not_found(lines)
        or _host_compiler_missing(lines, path)
        or _bad_architecture(lines, path)
        or _first_error(lines, compiler)
        or _anything_fatal(lines, path, compiler)
    )


def _header_not_found(lines: list[str]) -> str | None:
    for pattern in _MISSING_HEADER:
        for line in lines:
            m = pattern.match(line)
            if m:
                return _missing_header(m.group("file"), m.group("line"), m.group("header"))
    return None


def _host_compiler_missing(lines: list[str], path: Path) -> str | None:
    if any("Failed to preprocess host compiler" in line for line in lines) or any(
        re.search(r"(g\+\+|gcc|c\+\+|clang\+\+): (No such file|not found)", line) for line in lines
    ):
        return (
            f"{path}: nvcc could not run its host C++ compiler: apt install g++ "
            "(or set NVCC_CCBIN to one)"
        )
    return None


def _bad_architecture(lines: list[str], path: Path) -> str | None:
    for line in lines:
        if "Unsupported gpu architecture" in line or "is not defined for option 'gpu-" in line:
            return f"{path}: {line.split(':', 1)[-1].strip()} (try --arch sm_90 or sm_80)"
    return None


def _first_error(lines: list[str], compiler: str) -> str | None:
    """The first error with its file and line, how many more, and a hint where one fits."""
    errors = [m for line in lines if (m := _ERROR_LINE.match(line) or _GCC_ERROR.match(line))]
    if not errors:
        return None
    first = errors[0]
    where = f"{Path(first.group('file')).name}:{first.group('line')}"
    what = first.group("what").strip()
    more = len(errors) - 1
    tail = f" ({more} more error{'s' if more != 1 else ''})" if more else ""
    return f"{where}: {what}{tail}{_hint_for(what)}{VERBOSE_HINT} {compiler} log"


def _anything_fatal(lines: list[str], path: Path, compiler: str) -> str:
    fatal = next((line for line in lines if "fatal" in line or "error" in line), "")
    text = fatal.strip() or "the compiler failed without saying why"
    return f"{path}: {compiler} failed: {text}{VERBOSE_HINT} log"


def _missing_header(file: str, line: str, header: str) -> str:
    where = f"{Path(file).name}:{line}"
    top = header.split("/", 1)[0]
    installed = any((d / top).exists() for d in toolkit_include_dirs())
    if header in _TOOLKIT_HEADERS or (header.startswith(_TOOLKIT_HEADERS) and not installed):
        return (
            f"{where}: the CUDA header {header} is not installed: "
            "pip install 'gpushare-ext[toolchain]' (or set CUDA_HOME to a CUDA toolkit)"
        )
    return f"{where}: cannot find the header {header}: add its directory with -I DIR"


def _hint_for(what: str) -> str:
    if "texture is not a template" in what or "surface is not a template" in what:
        return (
            "; texture and surface references were removed in CUDA 12: the file needs "
            "texture objects (cudaTextureObject_t)"
        )
    if re.search(r'identifier "(concept|requires)" is undefined|"requires" clause', what):
        return "; the file may need a newer C++ standard: try -std c++20"
    return ""
