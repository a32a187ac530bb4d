"""``gpushare classify FILE [-I DIR] [-D NAME[=VALUE]] [-std c++17] [--arch sm_90] ...``.

What it is for: letting a user (or CI) see, per kernel of a file, whether it is
idempotent, which parameters it reads and writes, and why, before ever launching it.
The file is compiled as the user builds it (a whole program with ``main()``, system and
toolkit headers, includes next to it, templates instantiated by its host code): one
summary line per kernel with the reason that decided it, then a table per kernel.
``--same-buffer x,y`` says what a launch that passes one buffer as both ``x`` and ``y``
(an in-place call) changes.  The lead's ``gpushare`` CLI wires :func:`classify_main`
in as a subcommand.

What it must not do: launch kernels or need a GPU (nvcc, NVRTC and the analysis run on
the CPU); print a traceback for a bad input (every one is a line and exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpushare_ext.kernels.analysis import analyse_module
from gpushare_ext.kernels.classification import classify_launch
from gpushare_ext.kernels.ptx import KernelError, parse_ptx
from gpushare_ext.kernels.report import Classification, Idempotence, KernelReport
from gpushare_ext.kernels.signatures import KernelDefinition, example_instantiation
from gpushare_ext.kernels.sourcefile import AnalysedFile, analyse_file, find_entry
from gpushare_ext.kernels.toolchain import DEFAULT_ARCH, STANDARDS, CompileOptions

__all__ = ["build_parser", "classify_file", "classify_main"]

CUDA_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")
EXPECTED = "expected a .cu, .cuh, .h, .hpp or .ptx file"


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="gpushare classify",
        description=(
            "Classify the kernels of a CUDA C++ file (compiled with nvcc as a whole "
            "program, or NVRTC when there is no nvcc) or a PTX file as idempotent (safe "
            "to kill and re-run), non-idempotent (needs a snapshot of what it writes) or "
            "unknown, with the reasons: which parameter, which instruction, which line."
        ),
    )
    p.add_argument("file", help="a .cu/.cuh/.h/.hpp (CUDA C++) or .ptx file")
    p.add_argument(
        "-I", dest="include_dirs", action="append", default=[], metavar="DIR",
        help="add DIR to the include path (the file's own folder is searched first)",
    )  # fmt: skip
    p.add_argument(
        "-D", dest="defines", action="append", default=[], metavar="NAME[=VALUE]",
        help="define a macro, as for nvcc",
    )  # fmt: skip
    p.add_argument(
        "-std", "--std", dest="std", choices=STANDARDS, default=None,
        help="C++ standard (default: the compiler's)",
    )  # fmt: skip
    p.add_argument(
        "--arch", default=DEFAULT_ARCH, help=f"GPU architecture (default {DEFAULT_ARCH})"
    )
    p.add_argument(
        "--kernel", action="append", default=[], metavar="NAME",
        help="only this kernel (its name, C++ name or PTX name); may be repeated",
    )  # fmt: skip
    p.add_argument(
        "--same-buffer", action="append", default=[], metavar="A,B",
        help=(
            "a launch passes one buffer as parameters A and B (an in-place call): say what "
            "that changes; may be repeated"
        ),
    )  # fmt: skip
    p.add_argument("--brief", action="store_true", help="one line per kernel, no tables")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--verbose", action="store_true", help="show the compiler's whole log on an error"
    )
    return p


# ---------------------------------------------------------------------------------------
# Reading and analysing
# ---------------------------------------------------------------------------------------


def _read_source(path: Path) -> str:
    """The file's text, or a KernelError naming the path and what it should have been."""
    try:
        # A directory, a FIFO or a device would fail to read, block, or never end.
        if path.exists() and not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file"
            raise KernelError("not-a-file", f"{path}: is {what}; {EXPECTED}", step="classify")
        data = path.read_bytes()
    except FileNotFoundError:
        raise KernelError(
            "no-such-file", f"{path}: no such file; {EXPECTED}", step="classify"
        ) from None
    except OSError as exc:
        raise KernelError(
            "unreadable",
            f"{path}: cannot read it ({exc.strerror or exc}); {EXPECTED} you can read",
            step="classify",
        ) from None
    if not data.strip():
        raise KernelError(
            "empty-file", f"{path}: is empty; {EXPECTED} with kernels in it", step="classify"
        )
    if b"\0" in data[:65536]:
        raise KernelError(
            "binary-file", f"{path}: is a binary file, not source; {EXPECTED}", step="classify"
        )
    try:
        text = data.decode()
    except UnicodeDecodeError:
        text = data.decode("latin-1")  # source in a legacy encoding: the code is ASCII
    return text.replace("\r\n", "\n")  # files from Windows: one kind of line end


def classify_file(
    path: Path, arch: str = DEFAULT_ARCH, options: CompileOptions | None = None
) -> AnalysedFile:
    """Compile (or parse) and analyse every kernel of a file; KernelError names the path."""
    text = _read_source(path)
    suffix = path.suffix.lower()
    options = options or CompileOptions(arch=arch)
    if suffix == ".ptx" or (suffix not in CUDA_SUFFIXES and _looks_like_ptx(text)):
        from gpushare_ext.kernels.toolchain import CompiledFile

        try:
            module = parse_ptx(text)
        except KernelError as exc:
            # The parser does not know which file it read; the user needs to.
            raise KernelError(
                exc.code, f"{path}: {exc.message}", step=exc.step, log=exc.log
            ) from None
        compiled = CompiledFile(path, text, "ptx", "", "")
        return AnalysedFile(path, compiled, module, analyse_module(module), (), {})
    if suffix in CUDA_SUFFIXES:
        return analyse_file(path, text, options)
    raise KernelError(
        "unknown-extension",
        f"{path}: {EXPECTED} (got {suffix or 'no extension'!r})",
        step="classify",
    )


def _looks_like_ptx(text: str) -> bool:
    from gpushare_ext.kernels.frontends import is_ptx

    return is_ptx(text)


def _no_kernels(analysed: AnalysedFile) -> KernelError:
    if analysed.uninstantiated:
        d = analysed.uninstantiated[0]
        others = len(analysed.uninstantiated) - 1
        more = f" (and {others} more template kernel{'s' if others != 1 else ''})" if others else ""
        return KernelError(
            "no-kernels",
            f"{analysed.path}: no kernel to analyse: {_template_hint(d)}{more}",
            step="classify",
        )
    return KernelError(
        "no-kernels",
        f"{analysed.path}: no kernels (__global__ functions) in this file",
        step="classify",
    )


def _template_hint(d: KernelDefinition) -> str:
    where = f"{Path(d.file).name}:{d.line}"
    return (
        f"the template kernel {d.name} ({where}) is never instantiated; add an explicit "
        f"instantiation with the template arguments you use, e.g. "
        f"`{example_instantiation(d)}`, or launch it from host code"
    )


def _parse_same_buffer(values: list[str]) -> list[tuple[str, str]]:
    pairs = []
    for value in values:
        names = [n.strip() for n in value.replace("=", ",").split(",")]
        if len(names) != 2 or not all(names) or names[0] == names[1]:
            raise KernelError(
                "bad-option",
                f"--same-buffer {value!r}: expected two parameter names, e.g. x,y",
                step="classify",
            )
        pairs.append((names[0], names[1]))
    return pairs


def _param_by_name(report: KernelReport, name: str) -> str | None:
    for b in report.buffers.values():
        if name in (b.display, b.param):
            return b.param
    return None


def _with_same_buffers(report: KernelReport, pairs: list[tuple[str, str]]) -> Classification | None:
    """The classification of a launch where each pair shares one buffer (None: no pair
    names two buffer parameters of this kernel)."""
    groups: dict[str, int] = {p: i for i, p in enumerate(report.buffers)}
    used = False
    for a, b in pairs:
        pa, pb = _param_by_name(report, a), _param_by_name(report, b)
        if pa is None or pb is None:
            continue
        used = True
        old, new = groups[pb], groups[pa]
        for p, g in groups.items():
            if g == old:
                groups[p] = new
    if not used:
        return None
    size = 1 << 20
    extents = {p: ((g + 1) * size * 4, size) for p, g in groups.items()}
    return classify_launch(report, extents)


def _selected(analysed: AnalysedFile, wanted: list[str]) -> list[KernelReport]:
    if not wanted:
        return list(analysed.reports.values())
    return [analysed.reports[find_entry(analysed.module, w).name] for w in wanted]


# ---------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _launch_line(report: KernelReport, launch: Classification, pairs: list[tuple[str, str]]) -> str:
    shared = "; ".join(f"`{a}` and `{b}`" for a, b in pairs)
    before = report.classification.verdict
    if before is not Idempotence.IDEMPOTENT:
        return f"  with {shared} one buffer: still {before.value} (the overlap changes nothing)"
    if launch.verdict is Idempotence.IDEMPOTENT:
        return f"  with {shared} one buffer: still idempotent (no parameter read there is written)"
    return f"  with {shared} one buffer: {launch.verdict.value}: {launch.reasons[0]}"


def report_json(report: KernelReport, launch: Classification | None = None) -> dict:
    c = report.classification
    out = {
        "kernel": report.name,
        "name": report.display_name,
        "verdict": c.verdict.value,
        "summary": report.summary(),
        "reasons": list(c.reasons),
        "resumable": report.resumable,
        "parameters": [
            {
                "name": b.display,
                "ptx_name": b.param,
                "access": b.access.value,
                "read_lines": [a.instr.line for a in b.reads],
                "write_lines": [a.instr.line for a in b.writes],
                "atomic_lines": [a.instr.line for a in b.atomics],
                "own_read_lines": [a.instr.line for a in b.own_reads],
            }
            for b in report.buffers.values()
        ],
        "atomics": len(report.atomics),
        "barriers": len(report.barriers),
        "loops": len(report.loops),
        "grid_sync": report.grid_sync,
        "loaded_pointers": [a.instr.line for a in report.loaded_pointers],
        "early_returns": [i.line for i in report.early_exits],
    }
    if launch is not None:
        out["launch"] = {"verdict": launch.verdict.value, "reasons": list(launch.reasons)}
    return out


def _print_table(console, r: KernelReport) -> None:
    from rich.table import Table

    colour = {"idempotent": "green", "non-idempotent": "yellow", "unknown": "red"}
    v = r.classification.verdict.value
    table = Table(title=f"{r.display_name}  [{colour[v]}]{v}[/]", title_justify="left")
    table.add_column("parameter")
    table.add_column("access")
    table.add_column("PTX lines (r / w / atomic)")
    for b in r.buffers.values():
        lines = " / ".join(
            ",".join(str(a.instr.line) for a in group) or "-"
            for group in (b.reads, b.writes, b.atomics)
        )
        table.add_row(b.display, b.access.value, lines)
    console.print(table)
    facts = []
    if r.atomics:
        facts.append(_count(len(r.atomics), "atomic"))
    if r.barriers:
        facts.append(_count(len(r.barriers), "barrier"))
    if r.loops:
        facts.append(_count(len(r.loops), "loop"))
    if r.grid_sync:
        facts.append("blocks communicate: not resumable")
    if facts:
        console.print("  " + ", ".join(facts))
    for reason in r.classification.reasons:
        console.print(f"  - {reason}", markup=False, highlight=False, soft_wrap=True)
    console.print()


def _print_text(
    analysed: AnalysedFile,
    reports: list[KernelReport],
    launches: dict[str, Classification],
    pairs: list[tuple[str, str]],
    brief: bool,
) -> None:
    from rich.console import Console

    console = Console(highlight=False)
    how = {"nvcc": "compiled with nvcc", "nvrtc": "compiled with NVRTC", "ptx": "PTX"}
    console.print(
        f"{analysed.path}: {_count(len(reports), 'kernel')} ({how[analysed.compiled.compiler]})",
        markup=False,
        soft_wrap=True,
    )
    if analysed.compiled.note:
        console.print(f"note: {analysed.compiled.note}", markup=False, soft_wrap=True)
    for r in reports:
        console.print(r.summary(), markup=False, soft_wrap=True)
        if r.name in launches:
            console.print(_launch_line(r, launches[r.name], pairs), markup=False, soft_wrap=True)
    for d, names in analysed.instantiations().items():
        console.print(
            f"template kernel {d.name} ({Path(d.file).name}:{d.line}): "
            f"{_count(len(names), 'instantiation')} analysed: {', '.join(names)}",
            markup=False,
            soft_wrap=True,
        )
    for d in analysed.uninstantiated:
        console.print(f"not analysed: {_template_hint(d)}", markup=False, soft_wrap=True)
    if brief:
        return
    console.print()
    for r in reports:
        _print_table(console, r)


def classify_main(argv: list[str]) -> int:
    """Entry point of ``gpushare classify``; returns the exit status (0 ok, 2 error)."""
    args = build_parser().parse_args(argv)
    path = Path(args.file)
    options = CompileOptions(
        include_dirs=tuple(Path(d) for d in args.include_dirs),
        defines=tuple(args.defines),
        std=args.std,
        arch=args.arch,
    )
    try:
        pairs = _parse_same_buffer(args.same_buffer)
        analysed = classify_file(path, options=options)
        if not analysed.reports:
            raise _no_kernels(analysed)
        reports = _selected(analysed, args.kernel)
        launches = {}
        for r in reports:
            launch = _with_same_buffers(r, pairs) if pairs else None
            if launch is not None:
                launches[r.name] = launch
        if pairs and not launches:
            names = ", ".join(f"{a},{b}" for a, b in pairs)
            raise KernelError(
                "bad-option",
                f"--same-buffer {names}: no kernel has buffer parameters of those names",
                step="classify",
            )
    except KernelError as exc:
        print(f"gpushare classify: {exc.message}", file=sys.stderr)
        if exc.log and args.verbose:
            print(exc.log.rstrip(), file=sys.stderr)
        return 2
    if args.json:
        document = {
            "file": str(path),
            "compiler": analysed.compiled.compiler,
            "note": analysed.compiled.note,
            "kernels": [report_json(r, launches.get(r.name)) for r in reports],
            "templates": [
                {"name": d.name, "file": d.file, "line": d.line, "instantiations": names}
                for d, names in analysed.instantiations().items()
            ],
            "uninstantiated_templates": [
                {"name": d.name, "file": d.file, "line": d.line} for d in analysed.uninstantiated
            ],
        }
        print(json.dumps(document, indent=2))
    else:
        _print_text(analysed, reports, launches, pairs, args.brief)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(classify_main(sys.argv[1:]))
