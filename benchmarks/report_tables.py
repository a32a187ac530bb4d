"""The report's tables on preemptible long kernels: what one costs, where the cost goes,
how fast it stops, and the interactive tail beside third-party neighbours over repeated
runs.

Each table states device, driver and date, and under it the command and every missed
target with the figure measured.  A figure that was not measured shows "-", and one the
benchmark failed to measure says "failed"; neither is ever written as a number.  This
module only turns documents into markdown lines: it writes no files and draws no plots
(``report`` does both).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

from benchmarks.report_format import THIRD_PARTY_LABELS, fmt, load_result, portable, where

FRAMEWORKS = {
    "elementwise": "CuPy ElementwiseKernel",
    "reduction": "CuPy ReductionKernel (one block)",
    "histogram": "CuPy RawKernel, atomicAdd",
    "numba": "Numba @cuda.jit",
}
CHECK_COST_KERNELS = {
    "gps_cc_loop": "grid-stride FMA loop",
    "gps_cc_histogram": "loop feeding atomicAdd",
    "gps_cc_loop one block": "the FMA loop in one block of 512 threads",
}
UNCONTENDED_TARGET = 1.01
CONTENDED_TARGET = 1.10
STOP_P99_TARGET_US = 100.0
TAIL_P99_TARGET = 1.1
TAIL_KEPT_TARGET = 0.9
# The same kernel doing the same work cannot take less than half its plain time: a ratio
# below this means the timing saw no kernel (an older run timed Numba on the wrong stream).
IMPLAUSIBLY_FAST = 0.5


def _footer(commands: list[str], notes: dict[str, list[str]]) -> list[str]:
    """The line under a table: the commands that made it and, per kind of note (missed,
    failed), the figures."""
    shown = list(dict.fromkeys(portable(command) for command in commands if command))
    text = ("Command: `" + "`; `".join(shown) + "`") if shown else "Command not recorded"
    for kind, items in notes.items():
        if items:
            text += f"; {kind}: " + ", ".join(items)
    return [text + ".", ""]


def _cost_rows(doc: dict) -> dict[str, dict[str, dict]]:
    rows: dict[str, dict[str, dict]] = {}
    for row in doc.get("table", []):
        rows.setdefault(row["kind"], {})[row["way"]] = row
    return rows


def _ran_unrivalled(doc: dict) -> bool:
    """Whether every run of the ``rival`` way ran its long kernels as they are, so that
    its figures are not those of a contended kernel."""
    rival = [run for run in doc.get("runs", []) if run.get("way") == "rival" and "shim" in run]
    return bool(rival) and all(run["shim"].get("preemptible", 0) == 0 for run in rival)


def _ratio_cell(row: dict | None, target: float, unrivalled: bool = False) -> tuple[str, str]:
    """A way's ratio to plain (with its repeats' spread) and its verdict."""
    if row is None:
        return "-", "not measured"
    ratio = row.get("vs_plain")
    if not ratio or ratio < IMPLAUSIBLY_FAST:
        return "-", "failed"
    repeats = row.get("repeat_medians_vs_plain") or []
    spread = f" ({min(repeats):.3f}-{max(repeats):.3f})" if len(repeats) > 1 else ""
    if unrivalled:
        return f"{ratio:.3f}{spread}", "not contended (ran unrivalled)"
    return f"{ratio:.3f}{spread}", "met" if ratio <= target else f"missed ({ratio:.3f} x)"


def _transform_ms(doc: dict, kind: str) -> float | None:
    """What a contended kernel's second launch, the one the shim analyses and transforms,
    took over its later launches (the median over the runs); None without the launches."""
    extra = []
    for run in doc.get("runs", []):
        times = (run.get(kind) or {}).get("times_ms") or []
        if run.get("way") == "rival" and len(times) >= 2:
            extra.append(times[0] - statistics.median(times[1:]))
    return statistics.median(extra) if extra else None


def _uncontended_cell(alone: dict | None, before: dict[str, dict]) -> tuple[str, str, bool]:
    """The uncontended column: this run's figure, else an earlier run's (marked ``*``);
    with its verdict and whether it was borrowed."""
    alone_text, alone_verdict = _ratio_cell(alone, UNCONTENDED_TARGET)
    if alone is None and (before.get("alone") or before.get("unmarked")):
        alone_text, alone_verdict = _ratio_cell(
            before.get("alone") or before.get("unmarked"), UNCONTENDED_TARGET
        )
        return f"{alone_text} *", alone_verdict, True
    return alone_text, alone_verdict, False


def _cost_misses(kind: str, alone_verdict: str, rival_verdict: str) -> tuple[list[str], list[str]]:
    """A kernel kind's missed targets (with the figure) and its failed measurements."""
    missed, failed = [], []
    for label, verdict_text, target in (
        ("uncontended", alone_verdict, UNCONTENDED_TARGET),
        ("contended", rival_verdict, CONTENDED_TARGET),
    ):
        if verdict_text.startswith("missed"):
            figure = verdict_text.removeprefix("missed (").removesuffix(")")
            missed.append(f"{kind} {label} {figure} plain (target {target:.2f})")
        elif verdict_text == "failed":
            failed.append(f"{kind} {label}")
    return missed, failed


def _cost_row(
    doc: dict, kind: str, ways: dict[str, dict], before: dict[str, dict], unrivalled: bool
) -> tuple[str, list[str], list[str], bool]:
    """One kernel kind's line, its missed targets, its failed measurements, and whether
    its uncontended figure came from the earlier run."""
    plain = ways.get("plain")
    alone = ways.get("alone") or ways.get("unmarked")
    rival = ways.get("rival")
    alone_text, alone_verdict, borrowed = _uncontended_cell(alone, before)
    rival_text, rival_verdict = _ratio_cell(rival, CONTENDED_TARGET, unrivalled)
    first = " / ".join(fmt(w.get("first_ms"), 1) if w else "-" for w in (plain, rival))
    measured = [w for w in ways.values() if w is not None]
    same = "yes" if all(w.get("identical") for w in measured) else "**no**"
    plain_ms = fmt(plain and plain.get("median_ms"), 1)
    line = (
        f"| {kind} | {FRAMEWORKS.get(kind, kind)} | {plain_ms} | {alone_text} | {rival_text} "
        f"| {first} | {fmt(_transform_ms(doc, kind), 1)} | {same} | {alone_verdict} "
        f"| {rival_verdict} |"
    )
    return line, *_cost_misses(kind, alone_verdict, rival_verdict), borrowed


def cost_section(doc: dict, earlier: dict | None = None) -> list[str]:
    """What a long kernel costs against running it without gpushare, per kernel kind.
    ``earlier``: a run whose uncontended figures stand in where ``doc`` measured none
    (a run of the contended way alone), marked as such."""
    lines = [
        f"**What a long kernel costs** ({where(doc)}): GPU time of a launch in a real "
        "notebook kernel over the same launch without gpushare. *Uncontended*: a "
        "`%%gpu` cell no other session could preempt (else a cell without `%%gpu`); "
        "*contended*: the same while a high-priority notebook stays connected, so long "
        "kernels run ready to stop (in parentheses: the lowest and highest repeat's "
        "median). A first launch runs as it is, with the framework's compile; a contended "
        "kernel's second launch is analysed and transformed: *transform* is what that "
        "launch took over the later ones.",
        "",
        "| kernel | framework | plain ms | uncontended x plain | contended x plain "
        "| first launch ms, plain / contended | transform ms | bit-identical "
        f"| uncontended <= {UNCONTENDED_TARGET:.2f} | contended <= {CONTENDED_TARGET:.2f} |",
        "|---|---|---:|---:|---:|---:|---:|---|---|---|",
    ]
    unrivalled = _ran_unrivalled(doc)
    missed: list[str] = []
    failed: list[str] = []
    earlier_rows = _cost_rows(earlier) if earlier else {}
    borrowed = False
    for kind, ways in _cost_rows(doc).items():
        line, kind_missed, kind_failed, kind_borrowed = _cost_row(
            doc, kind, ways, earlier_rows.get(kind, {}), unrivalled
        )
        lines.append(line)
        missed += kind_missed
        failed += kind_failed
        borrowed = borrowed or kind_borrowed
    notes = {"missed": missed, "measurement failed": failed}
    if unrivalled:
        notes["not contended"] = ["the contended runs counted no preemptible launch"]
    if borrowed and earlier is not None:
        notes["*"] = [f"uncontended figures from an earlier run ({where(earlier)}, "
                      f"`{portable(earlier.get('command', ''))}`), which this one did not repeat"]  # fmt: skip
    return [*lines, "", *_footer([doc.get("command", "")], notes)]


def earlier_uncontended_cost(folders: list[Path]) -> dict | None:
    """The first ``long_kernel_cost.json`` after the first one that measured the
    uncontended way, when the first did not."""
    found = [doc for folder in folders if (doc := load_result(folder, "long_kernel_cost.json"))]
    if not found or any(r.get("way") in ("alone", "unmarked") for r in found[0].get("table", [])):
        return None
    return next(
        (doc for doc in found[1:]
         if any(r.get("way") in ("alone", "unmarked") for r in doc.get("table", []))),
        None,
    )  # fmt: skip


def check_cost_section(name: str, doc: dict) -> list[str]:
    """One row per variant of the transform, one column per kernel: its time over the
    original's in the same process."""
    rows = doc.get("rows", [])
    kernels = list(dict.fromkeys(row["kernel"] for row in rows))
    plain = {row["kernel"]: row.get("plain_ms") for row in rows}
    by_variant: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_variant.setdefault(row["variant"], {})[row["kernel"]] = row
    lines = [
        f"**Where the cost goes** ({where(doc)}; `{name}`): a ready-to-stop kernel's "
        "launch time over the original's, one part of the transform at a time, nobody "
        "raising the flag. *differs*: the result was not bit-identical to the original's.",
        "",
        "| variant | "
        + " | ".join(
            f"{CHECK_COST_KERNELS.get(kernel, kernel)}, {fmt(plain[kernel], 1)} ms plain"
            for kernel in kernels
        )
        + " |",
        "|---|" + "---:|" * len(kernels),
    ]
    for variant, cells in by_variant.items():
        texts = []
        for kernel in kernels:
            row = cells.get(kernel)
            text = "-" if row is None else fmt(row.get("x_plain"), 3)
            if row is not None and row.get("same_as_plain") is False:
                text += " (**differs**)"
            texts.append(text)
        lines.append(f"| {variant} | " + " | ".join(texts) + " |")
    return [*lines, "", *_footer([doc.get("command", "")], {})]


def _stop_header(doc: dict, split: bool, repeats: list[dict]) -> list[str]:
    """The stop table's title, its legend and its column heads."""
    raised_from = doc.get("raised_from")
    return [
        f"**How fast a long kernel stops** ({where(doc)}; on the GPU's clock): from the "
        "yield flag's raise to the last block's exit (*GPU free*), and from the first block "
        "that saw the flag to the last exit (*drain*). Of fewer than 100 stops the p99 is the "
        "largest. *Began flagged*: slices launched while the flag was up (counted apart, "
        "from their start: the GPU held none of their work at the raise)."
        + (
            f" The flag was raised from {raised_from}"
            + (", through its IPC handle, as the broker's actuator raises it."
               if raised_from == "another process" else ".")
            if raised_from else ""
        )
        + (" *Sight*: the raise to the first block that saw the flag." if split else "")
        + (f" *Repeats*: the p99 of {len(repeats)} more run(s)." if repeats else ""),
        "",
        "| kernel | stops | raise -> GPU free p50 / p99 / max µs | drain p99 µs "
        + ("| sight p50 / p99 µs " if split else "")
        + ("| repeats: p99 µs " if repeats else "")
        + f"| began flagged | p99 <= {STOP_P99_TARGET_US:.0f} µs |",
        "|---|---:|---|---:|" + ("---|" if split else "") + ("---|" if repeats else "")
        + "---:|---|",
    ]  # fmt: skip


def _stop_verdict(figures: list[float]) -> str:
    """Whether the p99 of the first run and of each repeat (``figures``) met the target."""
    worst, met = max(figures), sum(x <= STOP_P99_TARGET_US for x in figures)
    if met == len(figures):
        return "met" if len(figures) == 1 else f"met in {met} of {met} runs"
    if len(figures) == 1:
        return f"missed ({worst:.0f} µs)"
    return f"met in {met} of {len(figures)} runs (worst {worst:.0f} µs)"


def _stop_row(row: dict, repeats: list[dict], split: bool) -> tuple[str, str | None]:
    """One kernel's line, and its note when its worst p99 missed the target."""
    p99 = row["gpu_stop_us_p99"]
    again = [
        next((r.get("gpu_stop_us_p99") for r in run.get("rows", [])
              if r.get("kernel") == row["kernel"]), None)
        for run in repeats
    ]  # fmt: skip
    figures = [p99, *(x for x in again if x is not None)]
    worst = max(figures)
    note = f"`{row['kernel']}` {worst:.0f} µs" if worst > STOP_P99_TARGET_US else None
    sight = (
        f"| {fmt(row.get('sight_us_p50'), 0)} / {fmt(row.get('sight_us_p99'), 0)} "
        if split else ""
    )  # fmt: skip
    repeated = f"| {' / '.join(fmt(x, 0) for x in again)} " if repeats else ""
    line = (
        f"| `{row['kernel']}` | {row.get('gpu_stops', '-')} | "
        f"{fmt(row.get('gpu_stop_us_p50'), 0)} / {fmt(p99, 0)} / "
        f"{fmt(row.get('gpu_stop_us_max'), 0)} | {fmt(row.get('drain_us_p99'), 0)} "
        f"{sight}{repeated}| {row.get('began_flagged', '-')} | {_stop_verdict(figures)} |"
    )
    return line, note


def stop_section(doc: dict, repeats: list[dict] | None = None) -> list[str]:
    """How fast a preemptible long kernel lets the GPU go, on the GPU's own clock; nothing
    when the run predates those figures.  ``repeats``: later runs of the same benchmark,
    whose p99 per kernel is shown beside the first's and counts in the verdict."""
    rows = [row for row in doc.get("rows", []) if row.get("gpu_stop_us_p99") is not None]
    if not rows:
        return []
    repeats = repeats or []
    split = any(row.get("sight_us_p50") is not None for row in rows)
    lines = _stop_header(doc, split, repeats)
    notes = []
    for row in rows:
        line, note = _stop_row(row, repeats, split)
        lines.append(line)
        if note is not None:
            notes.append(note)
    return [*lines, "", *_footer([doc.get("command", "")], {"missed p99": notes})]


def preemptible_repeats(folders: list[Path]) -> list[dict]:
    """The repeats (``preemptible-run<N>.json``) beside the first ``preemptible.json``."""
    for folder in folders:
        if (folder / "preemptible.json").is_file():
            paths = sorted(folder.glob("preemptible-run*.json"), key=_run_number)
            return [json.loads(path.read_text()) for path in paths]
    return []


def _kept_text(kept: float | None) -> str:
    """Rounded down, so that a share just under the target never reads as meeting it."""
    if kept is None or math.isnan(kept):
        return "-"
    return f"{math.floor(kept * 1000 + 1e-9) / 10:.1f} %"


def _tail_row(
    low: str, label: str, runs: list[dict[tuple[str, str], dict]]
) -> tuple[str, list[str]]:
    """One neighbour's line over the runs, and its missed targets with their figures."""
    columns: list[list[str]] = [[], [], [], [], []]
    met, measured, missed = 0, 0, []
    for number, rows in enumerate(runs, start=1):
        slicing, ours = rows.get((low, "timeslice")), rows.get((low, "shim"))
        columns[0].append(fmt(slicing and slicing.get("p99_ratio")))
        if ours is None:
            for column in columns[1:]:
                column.append("-")
            continue
        p99, kept = ours.get("p99_ratio"), ours.get("low_retained")
        columns[1].append(fmt(p99))
        columns[2].append(fmt(ours.get("cell_p90_ratio")))
        columns[3].append(fmt(ours.get("grant_p50_ms"), 1))
        columns[4].append(_kept_text(kept))
        measured += 1
        p99_ok = p99 is not None and p99 <= TAIL_P99_TARGET
        kept_ok = kept is not None and kept >= TAIL_KEPT_TARGET
        met += p99_ok and kept_ok
        if not p99_ok:
            missed.append(f"{low} run {number} p99 {fmt(p99, 3)} x")
        if not kept_ok:
            missed.append(
                f"{low} run {number} kept {'-' if kept is None else f'{kept * 100:.2f} %'}"
            )
    verdict_text = f"met in {met} of {measured} runs" if measured else "not measured"
    cells = " | ".join(" / ".join(column) for column in columns)
    return f"| {label} | {cells} | {verdict_text} |", missed


def tail_section(documents: list[dict]) -> list[str]:
    """Time-slicing against gpushare beside third-party neighbours, over repeated runs
    of ``benchmarks.third_party`` (``third_party-run1.json``, ...)."""
    first_day, last_day = ((doc.get("date") or "?")[:10] for doc in (documents[0], documents[-1]))
    count = f"{len(documents)} run" + ("" if len(documents) == 1 else "s")
    lines = [
        f"**Beside third-party neighbours, {count}** ({where(documents[0])}"
        f"{'' if last_day == first_day else ' to ' + last_day}): "
        "high priority: cells of 20 fp32 4096^2 matmuls, 10 ms think time. Per run, "
        "separated by /: the high tenant's p99 and cell p90 over running alone in the same "
        "run, its request -> grant p50, and *kept*: the neighbour's throughput in the GPU "
        "time the high tenant left, against its own rate alone.",
        "",
        "| low-priority neighbour | time-slicing p99 x alone | gpushare p99 x alone "
        "| gpushare cell p90 x alone | grant p50 ms | kept "
        f"| p99 <= {TAIL_P99_TARGET}, kept >= {TAIL_KEPT_TARGET:.0%} |",
        "|---|---|---|---|---|---|---|",
    ]
    indexed = [{(row["low"], row["mode"]): row for row in doc.get("rows", [])} for doc in documents]
    seen = dict.fromkeys(row["low"] for doc in documents for row in doc.get("rows", []))
    lows = [low for low in THIRD_PARTY_LABELS if low in seen]
    lows += [low for low in seen if low not in THIRD_PARTY_LABELS and low != "none"]
    notes: dict[str, list[str]] = {"missed": [], "failed": []}
    for low in lows:
        line, missed = _tail_row(low, THIRD_PARTY_LABELS.get(low, low), indexed)
        lines.append(line)
        notes["missed"] += missed
    for number, doc in enumerate(documents, start=1):
        for error in doc.get("errors", []):
            notes["failed"].append(f"run {number} {error.get('low_kind')} / {error.get('mode')}")
    return [*lines, "", *_footer([doc.get("command", "") for doc in documents], notes)]


def _run_number(path: Path) -> tuple[int, str]:
    found = re.search(r"(\d+)$", path.stem)
    return (int(found.group(1)) if found else 0, path.name)


def newest_check_cost(folders: list[Path]) -> tuple[str, dict] | None:
    """The first folder's ``check_cost.json`` or, among its ``check_cost-*.json``, the
    newest run; later folders only when the earlier hold none."""
    for folder in folders:
        found = [
            (path.name, json.loads(path.read_text())) for path in folder.glob("check_cost*.json")
        ]
        if found:
            named = [entry for entry in found if entry[0] == "check_cost.json"]
            return named[0] if named else max(found, key=lambda entry: entry[1].get("date") or "")
    return None


def third_party_runs(folders: list[Path]) -> list[dict]:
    """The repeated runs (``third_party-run<N>.json``) of the first folder holding any,
    in run order."""
    for folder in folders:
        paths = sorted(folder.glob("third_party-run*.json"), key=_run_number)
        if paths:
            return [json.loads(path.read_text()) for path in paths]
    return []


def long_kernel_tables(folders: list[Path], documents: dict[str, dict]) -> list[str]:
    """Every table of this module that ``folders`` have results for, in the report's
    order: ``documents`` holds the suites already loaded (``long_kernel_cost``,
    ``preemptible``), the earlier folders' first."""
    sections = []
    if "long_kernel_cost" in documents:
        sections += cost_section(documents["long_kernel_cost"], earlier_uncontended_cost(folders))
    if check_cost := newest_check_cost(folders):
        sections += check_cost_section(*check_cost)
    if "preemptible" in documents:
        sections += stop_section(documents["preemptible"], preemptible_repeats(folders))
    if runs := third_party_runs(folders):
        sections += tail_section(runs)
    return sections
