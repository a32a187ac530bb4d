"""``gpushare classify FILE.cu|FILE.ptx [--json] [--arch sm_90]``: the analysis as a table.

What it is for: letting a user (or CI) see, per kernel of a file, whether it is
idempotent, which parameters it reads and writes, and why, before ever launching it.
The lead's ``gpushare`` CLI wires :func:`classify_main` in as a subcommand.

What it must not do: launch kernels or need a GPU (NVRTC and the analysis run on CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gpushare_ext.kernels.analysis import KernelReport, analyse_module
from gpushare_ext.kernels.frontends import DEFAULT_ARCH, compile_cuda, is_ptx
from gpushare_ext.kernels.ptx import KernelError, parse_ptx

__all__ = ["build_parser", "classify_file", "classify_main"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(
        prog="gpushare classify",
        description=(
            "Classify the kernels of a CUDA C++ (.cu, compiled with NVRTC) or PTX (.ptx) file "
            "as idempotent (safe to kill and re-run), non-idempotent (needs a snapshot of what "
            "it writes) or unknown, with the reasons: which parameter, which instruction, "
            "which PTX line."
        ),
    )
    p.add_argument("file", help="a .cu/.cuh (CUDA C++) or .ptx file")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument(
        "--arch", default=DEFAULT_ARCH, help=f"GPU architecture for NVRTC (default {DEFAULT_ARCH})"
    )
    return p


def classify_file(path: Path, arch: str = DEFAULT_ARCH) -> dict[str, KernelReport]:
    """Analyse every kernel of a file. Raises KernelError with a clear message."""
    text = _read_source(path)
    suffix = path.suffix.lower()
    if suffix == ".ptx" or (suffix not in (".cu", ".cuh") and is_ptx(text)):
        try:
            module = parse_ptx(text)
        except KernelError as exc:
            # The parser does not know which file it read; the user needs to.
            raise KernelError(
                exc.code, f"{path}: {exc.message}", step=exc.step, log=exc.log
            ) from None
        names: dict[str, dict[str, str]] = {}
    elif suffix in (".cu", ".cuh"):
        ptx, _ = compile_cuda(text, arch=arch, filename=path.name)
        module = parse_ptx(ptx)
        names = _names_from_source(text, module)
    else:
        raise KernelError(
            "unknown-extension",
            f"{path}: expected a .cu, .cuh or .ptx file (got {suffix or 'no extension'!r})",
            step="classify",
        )
    for e in module.entries:
        e.source_names.update(names.get(e.name, {}))
    return analyse_module(module)


def _read_source(path: Path) -> str:
    """The file's text, or a KernelError naming the path and what it should have been."""
    expected = "expected a .cu, .cuh or .ptx file"
    try:
        # A directory, a FIFO or a device would fail to read, block, or never end.
        if path.exists() and not path.is_file():
            what = "a directory" if path.is_dir() else "not a regular file"
            raise KernelError("not-a-file", f"{path}: is {what}; {expected}", step="classify")
        return path.read_text(errors="replace")
    except FileNotFoundError:
        raise KernelError(
            "no-such-file", f"{path}: no such file; {expected}", step="classify"
        ) from None
    except OSError as exc:
        raise KernelError(
            "unreadable",
            f"{path}: cannot read it ({exc.strerror or exc}); {expected} you can read",
            step="classify",
        ) from None


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _names_from_source(text: str, module) -> dict[str, dict[str, str]]:
    from gpushare_ext.kernels.frontends import _source_param_names

    out = {}
    for e in module.entries:
        plain = e.name
        if plain.startswith("_Z"):  # _Z3tmmIfEv... -> tmm
            import re

            m = re.match(r"_Z(\d+)", plain)
            plain = plain[len(m.group(0)) : len(m.group(0)) + int(m.group(1))] if m else plain
        names = _source_param_names(text, plain)
        if names and len(names) == len(e.params):
            out[e.name] = {p.name: n for p, n in zip(e.params, names, strict=True)}
    return out


def report_json(report: KernelReport) -> dict:
    c = report.classification
    return {
        "kernel": report.name,
        "verdict": c.verdict.value,
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


def _print_tables(reports: dict[str, KernelReport], path: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    colour = {"idempotent": "green", "non-idempotent": "yellow", "unknown": "red"}
    for r in reports.values():
        v = r.classification.verdict.value
        table = Table(title=f"{r.name}  [{colour[v]}]{v}[/]", title_justify="left")
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
            console.print(f"  - {reason}", markup=False, highlight=False)
        console.print()
    if not reports:
        console.print(f"{path}: no kernels (.entry) found")


def classify_main(argv: list[str]) -> int:
    """Entry point of ``gpushare classify``; returns the exit status (0 ok, 2 error)."""
    args = build_parser().parse_args(argv)
    path = Path(args.file)
    try:
        reports = classify_file(path, args.arch)
    except KernelError as exc:
        print(f"gpushare classify: {exc.message}", file=sys.stderr)
        if exc.log:
            print(exc.log.rstrip(), file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {"file": str(path), "kernels": [report_json(r) for r in reports.values()]}, indent=2
            )
        )
    else:
        _print_tables(reports, path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(classify_main(sys.argv[1:]))
