"""The report's tables on long kernels, built from copies of committed result folders:
each row is checked against the figures of the JSON it came from (read here), a missed
target names its figure, a failed measurement says "failed" and never 0.00, and
repeated third-party runs are counted as "met in k of n runs".  No GPU needed."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest

from benchmarks.report import MARK_END, MARK_START, build_report

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def copied(tmp_path: Path, name: str) -> Path:
    source = RESULTS / name
    if not source.is_dir():
        pytest.skip(f"{name} is not in this checkout")
    target = tmp_path / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.tgz", "*.gz", "*.txt"))
    return target


def report(tmp_path: Path, *names: str) -> str:
    folders = [copied(tmp_path, name) for name in names]
    assert build_report(folders) == 0
    return (folders[0] / "report.md").read_text()


def table(text: str, title: str) -> tuple[list[list[str]], str]:
    """The body rows (as cells) of the table under the heading that starts with ``title``,
    and the line written under it."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(f"**{title}"))
    rows, k = [], start + 4  # heading, blank line, column names, alignment
    while lines[k].startswith("|"):
        rows.append([cell.strip() for cell in lines[k].strip("|").split("|")])
        k += 1
    return rows, lines[k + 1]


def cost_rows(document: dict) -> dict[str, dict[str, dict]]:
    rows: dict[str, dict[str, dict]] = {}
    for row in document["table"]:
        rows.setdefault(row["kind"], {})[row["way"]] = row
    return rows


def test_the_cost_table_shows_failed_numba_and_an_unrivalled_rival_as_such(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200")
    document = json.loads((RESULTS / "2026-12-03-h200" / "long_kernel_cost.json").read_text())
    rows, footer = table(text, "What a long kernel costs")
    by_kind = {row[0]: row for row in rows}
    assert list(by_kind) == ["elementwise", "reduction", "histogram", "numba"]
    for kind, ways in cost_rows(document).items():
        cells = by_kind[kind]
        assert cells[2] == f"{ways['plain']['median_ms']:.1f}"
        assert cells[5] == f"{ways['plain']['first_ms']:.1f} / {ways['rival']['first_ms']:.1f}"
        assert cells[7] == "yes"
        if kind == "numba":  # timed on the wrong stream in this run: ratios of 0.0002
            assert cells[3] == cells[4] == "-"
            assert cells[8] == cells[9] == "failed"
            assert "0.00" not in " ".join(cells)
            continue
        alone = ways["alone"]
        repeats = alone["repeat_medians_vs_plain"]
        assert cells[3] == (f"{alone['vs_plain']:.3f} ({min(repeats):.3f}-{max(repeats):.3f})")
        assert cells[8] == (
            "met" if alone["vs_plain"] <= 1.01 else f"missed ({alone['vs_plain']:.3f} x)"
        )
        assert cells[4].startswith(f"{ways['rival']['vs_plain']:.3f}")
        # Every rival run counted 0 preemptible launches: the rival's figures are no
        # contended figures.
        assert cells[9] == "not contended (ran unrivalled)"
    assert footer.startswith(
        "Command: `python -m benchmarks.long_kernel_cost --out DIR --ways plain,alone,rival"
    )
    assert "measurement failed: numba uncontended, numba contended" in footer
    assert "NVIDIA H200, driver 580.159.04, 2026-12-03" in text


def test_the_cost_table_states_a_missed_target_with_its_figure(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200-cost-rival")
    document = json.loads(
        (RESULTS / "2026-12-03-h200-cost-rival" / "long_kernel_cost.json").read_text()
    )
    rows, footer = table(text, "What a long kernel costs")
    by_kind = {row[0]: row for row in rows}
    missed = []
    for kind, ways in cost_rows(document).items():
        cells, ratio = by_kind[kind], ways["rival"]["vs_plain"]
        assert cells[3] == "-" and cells[8] == "not measured"  # plain and rival only
        assert cells[4].startswith(f"{ratio:.3f} (")
        if ratio <= 1.10:
            assert cells[9] == "met"
        else:
            assert cells[9] == f"missed ({ratio:.3f} x)"
            missed.append(f"{kind} contended {ratio:.3f} x plain (target 1.10)")
    assert missed, "this run missed the contended target for the reduction"
    assert footer.endswith("; missed: " + ", ".join(missed) + ".")


def test_the_cost_table_shows_what_the_analysis_and_transform_added_to_a_launch(
    tmp_path: Path,
):
    text = report(tmp_path, "2026-12-03-h200-cost-stop-tail")
    document = json.loads(
        (RESULTS / "2026-12-03-h200-cost-stop-tail" / "long_kernel_cost.json").read_text()
    )
    rows, _ = table(text, "What a long kernel costs")
    by_kind = {row[0]: row for row in rows}
    for kind in by_kind:
        # The second launch of each contended run, over the median of its later ones.
        extra = sorted(
            run[kind]["times_ms"][0] - statistics.median(run[kind]["times_ms"][1:])
            for run in document["runs"]
            if run["way"] == "rival"
        )
        assert by_kind[kind][6] == f"{statistics.median(extra):.1f}"
        assert statistics.median(extra) > 0  # the transform is paid once, and shows


def test_where_the_cost_goes_shows_the_newest_check_cost_run(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200-cost-and-stops")
    runs = [
        json.loads(path.read_text())
        for path in (RESULTS / "2026-12-03-h200-cost-and-stops").glob("check_cost*.json")
    ]
    newest = max(runs, key=lambda run: run["date"])
    rows, footer = table(text, "Where the cost goes")
    figures = {(row["variant"], row["kernel"]): row["x_plain"] for row in newest["rows"]}
    variants = list(dict.fromkeys(row["variant"] for row in newest["rows"]))
    assert [row[0] for row in rows] == variants
    for row in rows:
        assert row[1] == f"{figures[(row[0], 'gps_cc_loop')]:.3f}"
        assert row[2] == f"{figures[(row[0], 'gps_cc_histogram')]:.3f}"
    assert footer == "Command: `python -m benchmarks.check_cost --out DIR`."


def test_the_stop_table_gives_each_kernels_latency_and_verdict(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200-stop-atomics")
    document = json.loads(
        (RESULTS / "2026-12-03-h200-stop-atomics" / "preemptible.json").read_text()
    )
    rows, footer = table(text, "How fast a long kernel stops")
    assert [row[0] for row in rows] == [f"`{row['kernel']}`" for row in document["rows"]]
    missed = []
    for cells, row in zip(rows, document["rows"], strict=True):
        p99 = row["gpu_stop_us_p99"]
        assert cells[1] == str(row["gpu_stops"])
        assert cells[2] == (
            f"{row['gpu_stop_us_p50']:.0f} / {p99:.0f} / {row['gpu_stop_us_max']:.0f}"
        )
        assert cells[3] == f"{row['drain_us_p99']:.0f}"
        # Slices launched while the flag was up are counted apart (older runs: "-").
        assert cells[4] == str(row.get("began_flagged", "-"))
        assert cells[5] == ("met" if p99 <= 100 else f"missed ({p99:.0f} µs)")
        if p99 > 100:
            missed.append(f"`{row['kernel']}` {p99:.0f} µs")
    assert "met" in [row[5] for row in rows] and missed
    assert footer.startswith("Command: `python -m benchmarks.preemptible --out DIR`")
    assert footer.endswith("missed p99: " + ", ".join(missed) + ".")
    # The existing table on the same file is still there, before this one.
    assert text.index("**Long kernels made preemptible") < text.index("**How fast a long")


def test_a_run_without_gpu_stop_figures_writes_no_stop_table(tmp_path: Path):
    text = report(tmp_path, "2026-12-01-h200")
    assert "**Long kernels made preemptible" in text
    assert "How fast a long kernel stops" not in text


def test_the_stop_table_counts_slices_that_began_with_the_flag_up(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200-cost-stop-tail")
    document = json.loads(
        (RESULTS / "2026-12-03-h200-cost-stop-tail" / "preemptible.json").read_text()
    )
    rows, _ = table(text, "How fast a long kernel stops")
    assert [row[4] for row in rows] == [str(row["began_flagged"]) for row in document["rows"]]
    assert any(row["began_flagged"] for row in document["rows"])


def test_a_cost_run_without_the_uncontended_way_shows_the_earlier_runs_marked(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200-unroll32", "2026-12-03-h200-cost-stop-tail")
    earlier = json.loads(
        (RESULTS / "2026-12-03-h200-cost-stop-tail" / "long_kernel_cost.json").read_text()
    )
    current = json.loads(
        (RESULTS / "2026-12-03-h200-unroll32" / "long_kernel_cost.json").read_text()
    )
    assert not any(row["way"] == "alone" for row in current["table"])
    rows, footer = table(text, "What a long kernel costs")
    alone = {row["kind"]: row for row in earlier["table"] if row["way"] == "alone"}
    rival = {row["kind"]: row for row in current["table"] if row["way"] == "rival"}
    for cells in rows:
        assert cells[3].startswith(f"{alone[cells[0]]['vs_plain']:.3f}") and cells[3].endswith("*")
        assert cells[4].startswith(f"{rival[cells[0]]['vs_plain']:.3f}")
    assert "*: uncontended figures from an earlier run" in footer
    alone_only = report(tmp_path / "b", "2026-12-03-h200-cost-stop-tail")
    assert "from an earlier run" not in alone_only


def test_the_stop_table_shows_the_sight_and_the_repeats_p99_in_its_verdict(tmp_path: Path):
    """Two runs of the split stop figures: the first run's row, its sight columns, the
    second run's p99 beside it, and a verdict over both."""
    source = RESULTS / "2026-12-03-h200-stop-split"
    if not source.is_dir():
        pytest.skip("2026-12-03-h200-stop-split is not in this checkout")
    folder = tmp_path / "split"
    folder.mkdir()
    first = json.loads((source / "preemptible-run1.json").read_text())
    second = json.loads((source / "preemptible-run2.json").read_text())
    (folder / "preemptible.json").write_text(json.dumps(first))
    (folder / "preemptible-run2.json").write_text(json.dumps(second))
    assert build_report([folder]) == 0
    rows, footer = table((folder / "report.md").read_text(), "How fast a long kernel stops")
    again = {row["kernel"]: row["gpu_stop_us_p99"] for row in second["rows"]}
    missed = []
    for cells, row in zip(rows, first["rows"], strict=True):
        assert cells[4] == f"{row['sight_us_p50']:.0f} / {row['sight_us_p99']:.0f}"
        assert cells[5] == f"{again[row['kernel']]:.0f}"
        figures = [row["gpu_stop_us_p99"], again[row["kernel"]]]
        worst, met = max(figures), sum(x <= 100 for x in figures)
        assert cells[7] == (
            "met in 2 of 2 runs" if met == 2 else f"met in {met} of 2 runs (worst {worst:.0f} µs)"
        )
        if worst > 100:
            missed.append(f"`{row['kernel']}` {worst:.0f} µs")
    assert missed, "run 1 has p99 over 100 µs for some kernel"
    assert footer.endswith("missed p99: " + ", ".join(missed) + ".")


def tail_expectations(folder: Path) -> dict[str, list[tuple[float, float] | None]]:
    """Per neighbour, each run's gpushare p99 and kept (None where it was not run)."""
    runs = [
        json.loads(path.read_text())
        for path in sorted(folder.glob("third_party-run*.json"), key=lambda p: p.name)
    ]
    lows = dict.fromkeys(r["low"] for run in runs for r in run["rows"] if r["low"] != "none")
    found: dict[str, list[tuple[float, float] | None]] = {}
    for low in lows:
        found[low] = []
        for run in runs:
            ours = next((r for r in run["rows"] if r["low"] == low and r["mode"] == "shim"), None)
            found[low].append(ours and (ours["p99_ratio"], ours["low_retained"]))
    return found


LABELS = {
    "transformer": "PyTorch transformer-encoder training",
    "long_gemm": "cuBLAS fp32 GEMMs, 8192^2 (~20 ms each)",
}


@pytest.mark.parametrize("name", ["2026-12-03-h200-grant-wait", "2026-12-03-h200-first-stop"])
def test_the_tail_table_counts_the_runs_that_met_both_targets(tmp_path: Path, name: str):
    text = report(tmp_path, name)
    expected = tail_expectations(RESULTS / name)
    rows, footer = table(text, "Beside third-party neighbours, ")
    by_label = {row[0]: row for row in rows}
    assert set(by_label) == {LABELS[low] for low in expected}
    for low, runs in expected.items():
        cells = by_label[LABELS[low]]
        measured = [run for run in runs if run is not None]
        met = sum(p99 <= 1.1 and kept >= 0.9 for p99, kept in measured)
        assert cells[-1] == f"met in {met} of {len(measured)} runs"
        assert cells[2] == " / ".join("-" if run is None else f"{run[0]:.2f}" for run in runs)
        for number, run in enumerate(runs, start=1):
            if run is not None and run[0] > 1.1:
                assert f"{low} run {number} p99 {run[0]:.3f} x" in footer
            if run is not None and run[1] < 0.9:
                assert f"{low} run {number} kept {run[1] * 100:.2f} %" in footer
    assert footer.startswith("Command: `python -m benchmarks.third_party --lows transformer")


def test_a_kept_share_just_under_the_target_never_reads_as_met(tmp_path: Path):
    text = report(tmp_path, "2026-12-03-h200-grant-wait")
    rows, _ = table(text, "Beside third-party neighbours, ")
    transformer = next(row for row in rows if row[0] == LABELS["transformer"])
    assert transformer[5].startswith("89.9 % / 89.5 %")  # 0.8997 and 0.8959


def test_the_earlier_folder_wins_for_the_repeated_runs(tmp_path: Path):
    full = copied(tmp_path, "2026-12-03-h200-grant-wait")
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(full / "third_party-run2.json", single / "third_party-run1.json")
    assert build_report([single, full]) == 0
    assert "**Beside third-party neighbours, 1 run**" in (single / "report.md").read_text()
    assert build_report([full, single]) == 0
    assert "**Beside third-party neighbours, 3 runs**" in (full / "report.md").read_text()


def test_the_document_gets_the_new_tables_between_its_marks(tmp_path: Path):
    folder = copied(tmp_path, "2026-12-03-h200-stop-atomics")
    document = tmp_path / "docs" / "benchmarks.md"
    document.parent.mkdir()
    document.write_text(f"intro\n{MARK_START}\nold\n{MARK_END}\nafter\n")
    assert build_report([folder], document) == 0
    text = document.read_text()
    inside = text[text.index(MARK_START) : text.index(MARK_END)]
    assert "**How fast a long kernel stops**" in inside and "old" not in inside
    assert text.startswith("intro\n") and text.endswith(f"{MARK_END}\nafter\n")
    # The line under the mark is the command that makes the tables again.
    assert inside.splitlines()[1] == (
        f"Generated by `python -m benchmarks report {folder.resolve()} --doc {document.resolve()}`."
    )


def test_the_plots_are_linked_from_the_documents_own_folder(tmp_path: Path):
    folder = copied(tmp_path, "2026-12-02-h200-host-control-plane")
    document = tmp_path / "docs" / "benchmarks.md"
    document.parent.mkdir()
    document.write_text(f"{MARK_START}\n{MARK_END}\n")
    assert build_report([folder], document) == 0
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", document.read_text())
    assert links == ["../2026-12-02-h200-host-control-plane/control_plane.png"]
    assert all((document.parent / link).is_file() for link in links)


def test_a_document_without_marks_is_left_as_it_is_and_the_report_fails(tmp_path: Path):
    folder = copied(tmp_path, "2026-12-03-h200-stop-atomics")
    document = tmp_path / "README.md"
    document.write_text("a README whose tables moved to docs/\n")
    assert build_report([folder], document) == 1
    assert document.read_text() == "a README whose tables moved to docs/\n"


def test_the_committed_benchmarks_page_holds_the_tables_and_the_readme_none():
    root = RESULTS.parents[1]
    page = (root / "docs" / "benchmarks.md").read_text()
    assert MARK_START in page and MARK_END in page
    assert MARK_START not in (root / "README.md").read_text()
    generated_by = page[page.index(MARK_START) :].splitlines()[1]
    assert generated_by.endswith("--doc docs/benchmarks.md`.")
    block = page[page.index(MARK_START) : page.index(MARK_END)]
    for link in re.findall(r"!\[[^]]*\]\(([^)]+)\)", block):
        assert (root / "docs" / link).is_file(), link
