"""A user's CUDA file, as it is, through the kernel pipeline: compile, name, analyse.

What it is for: ``gpushare classify prog.cu -I include -D USE_BIAS`` and
``kernel(Path("prog.cu"), "scale<float>")``.  The file is compiled the way the user
builds it (:mod:`~gpushare_ext.kernels.toolchain`), every kernel gets its C++ name and
the parameter names written in its definition (:mod:`~gpushare_ext.kernels.signatures`),
and the template kernels the file never instantiates are listed so that a report can
say how to add an instantiation instead of "no kernels".

What it must not do: print, or decide how a report reads (the CLI does); launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpushare_ext.kernels.analysis import analyse_module
from gpushare_ext.kernels.hostcode import includers
from gpushare_ext.kernels.ptx import Entry, KernelError, PtxModule, parse_ptx
from gpushare_ext.kernels.report import KernelReport
from gpushare_ext.kernels.signatures import (
    KernelDefinition,
    base_name,
    kernel_definitions,
    kernel_name,
    name_entries,
    strip_comments,
    uninstantiated_templates,
)
from gpushare_ext.kernels.toolchain import (
    VERBOSE_HINT,
    CompiledFile,
    CompileOptions,
    compile_file,
)

__all__ = ["AnalysedFile", "analyse_file", "find_entry"]


@dataclass(frozen=True)
class AnalysedFile:
    path: Path
    compiled: CompiledFile
    module: PtxModule
    reports: dict[str, KernelReport]  # PTX entry name -> report, in file order
    uninstantiated: tuple[KernelDefinition, ...]  # template kernels with no instance
    definitions: dict[str, KernelDefinition]  # PTX entry name -> where it is written

    def instantiations(self) -> dict[KernelDefinition, list[str]]:
        """Each template kernel that was compiled, and the names of its instances."""
        out: dict[KernelDefinition, list[str]] = {}
        for entry_name, d in self.definitions.items():
            if d.template:
                out.setdefault(d, []).append(kernel_name(entry_name).split("(", 1)[0])
        return out


def _is_user_file(path: str) -> bool:
    """Not a system or toolkit header (what a report may ask the user to change)."""
    norm = os.path.normpath(path)
    if norm.startswith(("/usr/", "/opt/cuda")) or "/site-packages/" in norm:
        return False
    homes = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    return not any(h and norm.startswith(os.path.normpath(h) + os.sep) for h in homes)


def analyse_file(path: Path, text: str, options: CompileOptions) -> AnalysedFile:
    """Compile ``path`` (whose text is ``text``) and analyse every kernel in it."""
    try:
        compiled = compile_file(path, text, options)
    except KernelError as exc:
        if exc.code != "compile-failed":
            raise
        found = includers(path)
        if not found:
            raise
        names = ", ".join(str(f) for f in found[:3])
        head, hint, tail = exc.message.partition(VERBOSE_HINT)
        raise KernelError(
            exc.code,
            f"{head}; {path.name} is meant to be #included (by {names}): classify that file"
            + hint
            + tail,
            step=exc.step,
            log=exc.log,
        ) from None
    try:
        module = parse_ptx(compiled.ptx)
    except KernelError as exc:
        raise KernelError(exc.code, f"{path}: {exc.message}", step="parse") from None
    source = compiled.preprocessed or strip_comments(text)
    definitions = kernel_definitions(source, str(path))
    found = name_entries(module, definitions)
    bases = [base_name(kernel_name(e.name)) for e in module.entries]
    missing = uninstantiated_templates(definitions, bases, _is_user_file)
    return AnalysedFile(path, compiled, module, analyse_module(module), tuple(missing), found)


def find_entry(module: PtxModule, wanted: str) -> Entry:
    """The entry a user means by ``wanted``: the PTX name, the C++ name with or without
    its parameter types (``scale<float>``), a qualified name (``ns::inc``), or the plain
    name when only one kernel has it."""
    entries = module.entries
    for e in entries:
        if e.name == wanted or kernel_name(e.name) == wanted:
            return e
    without_args = [e for e in entries if kernel_name(e.name).split("(", 1)[0] == wanted]
    if len(without_args) == 1:
        return without_args[0]
    plain = [e for e in entries if base_name(kernel_name(e.name)) == wanted]
    if len(plain) == 1:
        return plain[0]
    names = ", ".join(kernel_name(e.name) for e in entries) or "none"
    if len(plain) > 1 or len(without_args) > 1:
        raise KernelError(
            "ambiguous-kernel",
            f"{wanted!r} names more than one kernel; say which: {names}",
            step="compile",
        )
    raise KernelError(
        "no-such-kernel", f"no kernel {wanted!r} in the file (kernels: {names})", step="compile"
    )
