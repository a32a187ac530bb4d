"""Turn a results folder into PNG plots and a markdown table; optionally update a document
(``docs/benchmarks.md``) between its bench marks.

Reads whatever suites the folder holds (``control_plane.json``, ``kernels_bench.json``,
``contention.json``, ``checkpoint.json``, ``fuzz_frames.json``, ``crash_soak.json``, and
those ``report_tables`` writes tables for: ``long_kernel_cost.json``, ``check_cost*.json``,
``preemptible.json``, ``third_party-run*.json``), states device, driver and date for each, and marks every target as met or not -- an
unmet target stays in the table.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.report_format import REPEATED_TAIL_LOWS, THIRD_PARTY_LABELS
from benchmarks.report_format import fmt as _fmt
from benchmarks.report_format import load_result as _load
from benchmarks.report_format import portable as _portable
from benchmarks.report_format import verdict as _verdict
from benchmarks.report_format import where as _where
from benchmarks.report_tables import long_kernel_tables

MARK_START = "<!-- bench:start -->"
MARK_END = "<!-- bench:end -->"
# Where ``python -m benchmarks`` runs: the command written into a document names its
# folders from here.
REPO_ROOT = Path(__file__).resolve().parents[1]


def _save(plt: ModuleType, fig: Any, folder: Path, name: str) -> str:
    """Lay ``fig`` out, write it to ``folder / name`` and close it; returns ``name``."""
    fig.tight_layout()
    fig.savefig(folder / name, dpi=120)
    plt.close(fig)
    return name


def _plot_control(plt: ModuleType, folder: Path, control: dict | None) -> str | None:
    """Request -> grant latency against concurrent clients (the closed-loop runs)."""
    if not control:
        return None
    rows = [r for r in control["results"] if r.get("mode", "closed loop") == "closed loop"]
    clients = [r["clients"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(clients, [r["grant_ms"]["p50"] for r in rows], "o-", label="p50")
    ax.plot(clients, [r["grant_ms"]["p99"] for r in rows], "s--", label="p99")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("request -> grant (ms)")
    ax.set_title("control plane")
    ax.legend()
    return _save(plt, fig, folder, "control_plane.png")


def _contention_bars(
    ax: Any,
    rows: list[dict],
    labels: list[tuple[str, str]],
    kinds: list[str],
    key: str,
    width: float,
) -> None:
    """One bar of ``key`` per request kind, grouped by (neighbour, mode)."""
    for k, kind in enumerate(kinds):
        values = []
        for low, mode in labels:
            match = [
                r for r in rows if r["low"] == low and r["mode"] == mode and r["request"] == kind
            ]
            values.append(match[0][key] if match else 0)
        ax.bar([i + k * width for i in range(len(labels))], values, width, label=kind)


def _plot_contention(plt: ModuleType, folder: Path, contention: dict | None) -> str | None:
    """The high tenant's p50 and p99 over alone, per neighbour, mode and request."""
    if not (contention and contention.get("rows")):
        return None
    import matplotlib.ticker

    rows = [r for r in contention["rows"] if r["mode"] != "alone"]
    labels = sorted({(r["low"], r["mode"]) for r in rows})
    kinds = sorted({r["request"] for r in rows})
    fig, axes = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    width = 0.8 / max(1, len(kinds))
    for ax, key, title in ((axes[0], "p50_ratio", "p50"), (axes[1], "p99_ratio", "p99")):
        _contention_bars(ax, rows, labels, kinds, key, width)
        ax.axhline(1.03, color="green", linestyle=":", label="1.03 (p99 target, instrumented)")
        ax.axhline(1.3, color="orange", linestyle=":", label="1.3 (p99 target, uninstrumented)")
        ax.set_ylabel(f"{title} latency / alone")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yticks([0.5, 1, 1.3, 2, 3, 4])
    axes[1].set_xticks([i + width * (len(kinds) - 1) / 2 for i in range(len(labels))])
    axes[1].set_xticklabels([f"{low}\n{mode}" for low, mode in labels], fontsize=7)
    axes[0].set_title("high-priority latency beside a saturating low-priority tenant")
    axes[0].legend(fontsize=7, ncol=2)
    return _save(plt, fig, folder, "contention.png")


def _plot_checkpoint(plt: ModuleType, folder: Path, checkpoint: dict | None) -> str | None:
    """Lock, evict and restore times against resident memory (the sizes that worked)."""
    if not checkpoint:
        return None
    rows = [r for r in checkpoint["rows"] if "error" not in r]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2))
    sizes = [r["size_gib"] for r in rows]
    ax.plot(sizes, [r["checkpoint_s"] for r in rows], "o-", label="evict (checkpoint)")
    ax.plot(sizes, [r["restore_s"] for r in rows], "s-", label="restore")
    ax.plot(sizes, [r["lock_ms"] / 1e3 for r in rows], "^-", label="lock")
    ax.set_xlabel("resident device memory (GiB)")
    ax.set_ylabel("seconds")
    ax.set_title("level 3/4 actuators")
    ax.legend()
    return _save(plt, fig, folder, "checkpoint.png")


def _plot_drain(plt: ModuleType, folder: Path, kernels: dict | None) -> str | None:
    """Flag write -> drained against the logical block's length (in-process raises)."""
    if not (kernels and kernels.get("drain_in_process")):
        return None
    fig, ax = plt.subplots(figsize=(5, 3.2))
    series = kernels["drain_in_process"]
    blocks = [v["logical_block_us"] for v in series.values()]
    for key, style in (("p50", "o-"), ("p99", "s--"), ("p99_9", "^:")):
        ax.plot(
            blocks,
            [v["end_to_end_us"][key] for v in series.values()],
            style,
            label=f"end to end {key}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("logical block (us)")
    ax.set_ylabel("flag write -> drained (us)")
    ax.set_title("yield latency (level 1)")
    ax.legend(fontsize=7)
    return _save(plt, fig, folder, "kernels_drain.png")


def _plots(folder: Path, documents: dict[str, dict]) -> list[str]:
    """Draw the plots ``documents`` have figures for into ``folder``; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = (
        _plot_control(plt, folder, documents.get("control")),
        _plot_contention(plt, folder, documents.get("contention")),
        _plot_checkpoint(plt, folder, documents.get("checkpoint")),
        _plot_drain(plt, folder, documents.get("kernels")),
    )
    return [name for name in drawn if name]


def _control_section(doc: dict) -> list[str]:
    gpu = "" if doc.get("gpu_count") else "no GPU, simulated H200 inventory; "
    cpus = f"{doc.get('cpu_count', '?')} CPUs"
    if doc.get("host_cpu_count") not in (None, doc.get("cpu_count")):
        cpus = f"{doc['cpu_count']} of its {doc['host_cpu_count']} CPUs"
    lines = [
        f"**Control plane** ({doc.get('host', '?')}, {cpus}, {gpu}"
        f"{doc.get('date', '?')[:10]}; request -> grant, each client its own connection)",
        "",
        "| clients | loop | p50 ms | p99 ms | messages/s | target | verdict |",
        "|---:|---|---:|---:|---:|---|---|",
    ]
    for row in doc["results"]:
        mode = row.get("mode", "closed loop")
        if mode == "open loop":
            mode = f"open, {row['rate_per_session_hz']:g}/s each, held {row['hold_s']:g} s"
        lines.append(
            f"| {row['clients']} | {mode} | {_fmt(row['grant_ms']['p50'])} | "
            f"{_fmt(row['grant_ms']['p99'])} | {row['messages_per_s']:.0f} | "
            f"{row.get('target', '-')} | {_verdict(row.get('met'))} |"
        )
    if doc.get("core"):
        lines += [
            "",
            "*The scheduler core alone*, µs per event (a release, a request, a tick) on one "
            "GPU: every lease running time-sliced, and 1 GiB leases of which ~140 fit and "
            "the rest wait (each release lets the first in and moves every waiter behind it "
            "up one; the first ten and those whose place, rounded up past 10, changes are "
            "told).  *waiting*: that many requests wait for GPU 0 of two "
            "while events on GPU 1 and at the back of the queue leave their places alone.",
            "",
            "| leases (waiting) | workload | running | µs per event | target | verdict |",
            "|---:|---|---:|---:|---|---|",
        ]
        for row in doc["core"]:
            count = row["leases"] if "leases" in row else f"({row['waiters']})"
            lines.append(
                f"| {count} | {row['workload']} | {row['running']} | "
                f"{_fmt(row['us_per_event'], 1)} | {row.get('target', '-')} | "
                f"{_verdict(row.get('met'))} |"
            )
    if doc.get("notes"):
        lines += ["", *(f"- {note}" for note in doc["notes"])]
    return [*lines, ""]


def _contention_section(
    doc: dict, title: str = "Interactive latency under contention"
) -> list[str]:
    rows = doc["rows"]
    lines = [
        f"**{title}** ({_where(doc)}): the high-priority tenant's "
        "latency over running alone in the same run",
        "",
        "| low-priority neighbour | mode | request | p50 ms | p99 ms | p50 x alone | p99 x alone | low kept | target | verdict |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        if row["mode"] == "alone":
            continue
        target, ok = "-", None
        if row["mode"] == "full" and row["low"] == "instrumented":
            target, ok = "p99 <= 1.03", row["p99_ratio"] <= 1.03
        elif row["mode"] in ("levels03", "full", "shim"):
            target, ok = "p99 <= 1.3", row["p99_ratio"] <= 1.3
        kept = row.get("low_retained")
        kept_text = (
            "-" if kept is None or (isinstance(kept, float) and math.isnan(kept)) else f"{kept:.0%}"
        )
        if kept is not None and row["mode"] != "timeslice" and not math.isnan(kept):
            target += ", kept >= 90 %"
            ok = (ok if ok is not None else True) and kept >= 0.9
        lines.append(
            f"| {row['low']} | {row['mode']} | {row['request']} | {_fmt(row['p50_ms'])} | "
            f"{_fmt(row['p99_ms'])} | {_fmt(row['p50_ratio'])} | {_fmt(row['p99_ratio'])} | {kept_text} | "
            f"{target} | {_verdict(ok)} |"
        )
    for error in doc.get("errors", []):
        lines.append(
            f"| {error['low_kind']} | {error['mode']} | - | - | - | - | - | - | - | failed: {error['error'][:80]} |"
        )
    return [*lines, ""]


def _checkpoint_section(doc: dict) -> list[str]:
    lines = [
        f"**Lock / evict / restore** ({_where(doc)}), through the broker's actuator",
        "",
        "| resident GiB | lock ms | evict s | MiB left on device | restore s | unlock ms | data intact |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in doc["rows"]:
        if "error" in row:
            lines.append(f"| {row['size_gib']} | failed: {row['error'][:60]} | | | | | |")
            continue
        lines.append(
            f"| {row['size_gib']} | {_fmt(row['lock_ms'], 1)} | {_fmt(row['checkpoint_s'])} | "
            f"{row['after_checkpoint_mib']} | {_fmt(row['restore_s'])} | {_fmt(row['unlock_ms'], 1)} | "
            f"{'yes' if row['data_intact'] else '**no**'} |"
        )
    return [*lines, ""]


def _parking_section(doc: dict) -> list[str]:
    result = doc["results"]
    restores = result.get("restores", [])
    identical = all(r.get("bit_identical") for r in restores) and bool(restores)
    lines = [
        f"**Parking idle notebooks** ({_where(doc)}): {result['notebooks']} idle notebooks "
        f"holding {result['idle_gib']} GiB of CuPy arrays each, a high request of "
        f"{result['ask_gib']} GiB that fits only once both are parked",
        "",
        "| parked | park (to the grant) | out | restore (next plain cell) | back | arrays after |",
        "|---:|---:|---:|---:|---:|---|",
        f"| {_fmt(result.get('parked_gib'), 1)} GiB in {len(result.get('parked', []))} sessions "
        f"| {_fmt(result.get('park_s'), 1)} s | {_fmt(result.get('park_gib_per_s'))} GiB/s "
        f"| {', '.join(_fmt(r.get('restore_line_s'), 1) + ' s' for r in restores)} "
        f"| {_fmt(result.get('restore_gib_per_s'))} GiB/s "
        f"| {'bit-identical' if identical else '**changed**'} |",
        "",
        f"The request was granted and {result.get('granted_allocation_gib')} GiB allocated "
        "with no out-of-memory error.",
        "",
    ]
    return lines


def _kernels_section(doc: dict) -> list[str]:
    lines = [
        f"**Preemptible kernels** ({_where(doc)})",
        "",
        "| measure | figure | target | verdict |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("overhead_realistic_summary", "realistic sizes (>= 1 ms)"),
        ("overhead_summary", "tiny sizes (10-25 us)"),
    ):
        summary = doc.get(key)
        if summary:
            median = summary["median"]
            lines.append(
                f"| overhead, {label}: median / worst | {median:+.1%} / {summary['worst']:+.1%} | median <= 3 % | "
                f"{_verdict(median <= 0.03)} |"
            )
            if "fence_median" in summary:
                lines.append(
                    f"| fencing overhead, {label}: median | {summary['fence_median']:+.1%} | - | - |"
                )
    for name, series in (
        ("in-process write", doc.get("drain_in_process", {})),
        ("broker write via IPC", doc.get("drain_ipc", {})),
    ):
        for entry in series.values():
            block = entry["logical_block_us"]
            device = entry.get("first_seen_to_last_exit_us", {})
            e2e = entry.get("end_to_end_us", {})
            target, ok = "-", None
            if block <= 10 and device.get("p99_9") is not None:
                target, ok = "device p99.9 <= 18 us", device["p99_9"] <= 18
            lines.append(
                f"| drain, {block} us blocks, {name}: device p50/p99/p99.9 | "
                f"{_fmt(device.get('p50'), 1)} / {_fmt(device.get('p99'), 1)} / {_fmt(device.get('p99_9'), 1)} us; "
                f"end to end p50/p99.9 {_fmt(e2e.get('p50'), 0)} / {_fmt(e2e.get('p99_9'), 0)} us | {target} | {_verdict(ok)} |"
            )
    for row in doc.get("snapshot", []):
        lines.append(
            f"| snapshot / rollback, {row['mib']} MiB | {row['snapshot_gbps']:.0f} / {row['rollback_gbps']:.0f} GB/s "
            f"(copy ceiling {row['copy_ceiling_gbps']:.0f}) | - | - |"
        )
    return [*lines, ""]


def _interposer_runs(doc: dict) -> dict[str, dict]:
    """The runs by scenario; the two drains apart, by whether their work was bounded."""
    runs = {}
    for run in doc["runs"]:
        key = run["scenario"]
        if key == "drain":
            key = "drain_unbounded" if "no bound" in run.get("bound", "") else "drain_bounded"
        runs[key] = run
    return runs


def _interposer_count_rows(runs: dict[str, dict]) -> list[str]:
    count = runs.get("count")
    if not count:
        return []
    return [
        f"| launches seen: CuPy ({count['cupy_ops']} operations) / PyTorch "
        f"({count['torch_ops']}) | {count['cupy_launches_seen']} / "
        f"{count['torch_launches_seen']} | every one | "
        f"{_verdict(count['cupy_launches_seen'] >= count['cupy_ops'] and count['torch_launches_seen'] >= count['torch_ops'])} |"
    ]


def _interposer_hold_rows(runs: dict[str, dict]) -> list[str]:
    lines = []
    for key, what in (
        ("hold", "a paused CuPy loop"),
        ("hold_torch", "a paused PyTorch training loop"),
    ):
        hold = runs.get(key)
        if hold and "launches_while_paused" in hold:
            lines.append(
                f"| {what}: launches during a 1 s pause; result identical | "
                f"{hold['launches_while_paused']}; {'yes' if hold['identical_to_undisturbed'] else 'no'} | "
                f"0; yes | {_verdict(hold['launches_while_paused'] == 0 and hold['identical_to_undisturbed'])} |"
            )
    return lines


def _interposer_drain_rows(runs: dict[str, dict]) -> list[str]:
    bounded, unbounded = runs.get("drain_bounded"), runs.get("drain_unbounded")
    if not (bounded and unbounded):
        return []
    return [
        f"| drain after a pause, 300 queued 4096^2 matmuls: bounded / unbounded | "
        f"{bounded['drain_ms']:.1f} ms ({bounded['drain_in_matmuls']} matmuls) / "
        f"{unbounded['drain_ms']:.0f} ms ({unbounded['drain_in_matmuls']}) | a few kernels | "
        f"{_verdict(bounded['drain_in_matmuls'] <= 8)} |"
    ]


def _interposer_lock_rows(runs: dict[str, dict]) -> list[str]:
    lock = runs.get("lock")
    if not lock:
        return []
    ok = all(lock.get(k) == "CUDA_SUCCESS" for k in ("lock", "checkpoint", "restore", "unlock"))
    return [
        f"| checkpoint lock, checkpoint, restore, unlock of a held process; data intact | "
        f"{'all succeed' if ok else lock.get('lock')}; {'yes' if lock.get('data_intact') else 'no'} | "
        f"all succeed; yes | {_verdict(ok and lock.get('data_intact'))} |"
    ]


def _interposer_overhead_rows(runs: dict[str, dict]) -> list[str]:
    lines = []
    summary = runs.get("overhead_summary", {})
    for loop, label, target in (
        ("resnet18_train_step", "ResNet-18 training step (batch 64)", 2.0),
        ("cupy_kmeans_step", "CuPy k-means step", None),
    ):
        entry = summary.get(loop)
        if entry:
            pct = entry["overhead_pct_with"]
            lines.append(
                f"| overhead, nobody pausing: {label}, median {entry['median_ms_without']:.2f} ms alone | "
                f"{pct:+.1f}% (paired {entry.get('overhead_pct_with_paired', float('nan')):+.1f}%; "
                f"no bound: {entry['overhead_pct_unbounded']:+.1f}%) | "
                f"{'<= 2 %' if target else '-'} | {_verdict(pct <= target) if target else 'n/a'} |"
            )
    return lines


def _interposer_section(doc: dict) -> list[str]:
    runs = _interposer_runs(doc)
    lines = [
        f"**Launch shim** ({_where(doc)}; preloaded as the server extension starts kernels)",
        "",
        "| measure | figure | target | verdict |",
        "|---|---|---|---|",
        *_interposer_count_rows(runs),
        *_interposer_hold_rows(runs),
        *_interposer_drain_rows(runs),
        *_interposer_lock_rows(runs),
        *_interposer_overhead_rows(runs),
    ]
    return [*lines, ""]


def _third_party_section(doc: dict) -> list[str]:
    """Time-slicing against gpushare beside third-party neighbours, one run."""
    lines = [
        f"**Beside third-party neighbours** ({_where(doc)}; `{_portable(doc.get('command', ''))}`). "
        "High priority: cells of 20 fp32 4096^2 matmuls, 10 ms think time. Ratios are "
        "against the high tenant alone in the same run; *kept*: the neighbour's throughput "
        "in the GPU time the high tenant left, against its own rate alone.",
        "",
        "| low-priority neighbour | time-slicing p99 / cell p90 | gpushare p99 / cell p90 "
        "| kept | targets 1.3 / 1.1 / 90 % |",
        "|---|---|---|---|---|",
    ]
    rows = {(r["low"], r["mode"]): r for r in doc["rows"]}
    for low, label in THIRD_PARTY_LABELS.items():
        if low in REPEATED_TAIL_LOWS:
            continue
        slice_row, ours = rows.get((low, "timeslice")), rows.get((low, "shim"))
        if not slice_row or not ours:
            continue
        kept = ours.get("low_retained")
        latency_ok = ours["p99_ratio"] <= 1.3 and ours.get("cell_p90_ratio", 9) <= 1.1
        kept_ok = kept is not None and kept >= 0.9
        verdict = (
            "met"
            if latency_ok and kept_ok
            else "latency met, kept missed"
            if latency_ok
            else "missed"
        )
        lines.append(
            f"| {label} | {slice_row['p99_ratio']:.2f}x / {_fmt(slice_row.get('cell_p90_ratio'))}x "
            f"| {ours['p99_ratio']:.2f}x / {_fmt(ours.get('cell_p90_ratio'))}x "
            f"| {'-' if kept is None else f'{kept:.0%}'} | {verdict} |"
        )
    return [*lines, ""]


def _preemptible_section(doc: dict) -> list[str]:
    """Long kernels made preemptible at load time: stop latency, work kept, correctness."""
    lines = [
        f"**Long kernels made preemptible at load time** ({_where(doc)}; the yield flag "
        "raised for 2 ms every 10 ms). *Stops*: aborts undone (restart or rollback) / "
        "stops whose threads saved their state / yields between logical blocks; *work "
        "kept*: the kernel time the launches needed over the GPU time the flag left free.",
        "",
        "| kernel | launch alone / transformed | stop after the flag (p50 / max) "
        "| preempted launches | stops | work kept | bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        transformed = row.get("transformed_ms")
        alone = f"{row['kernel_ms']:.1f}" + (f" / {transformed:.1f}" if transformed else "")
        kept = row.get("work_kept")
        lines.append(
            f"| `{row['kernel']}` | {alone} ms | {_fmt(row['stop_ms_p50'])} / "
            f"{_fmt(row['stop_ms_max'])} ms | {row['preemptible_launches']} | {row['aborts']} / "
            f"{row.get('saves', 0)} / {row['yields']} | {'-' if kept is None else f'{kept:.0%}'} "
            f"| {'yes' if row['bit_identical'] else 'NO'} |"
        )
    return [*lines, ""]


def _when(document: dict | None) -> str:
    return (document or {}).get("date", "?")[:10]


def _robustness_section(fuzz: dict | None, soak: dict | None) -> list[str]:
    some = fuzz or soak or {}
    dates = (
        _when(fuzz)
        if not soak or _when(soak) == _when(fuzz)
        else (f"fuzz {_when(fuzz)}, soak {_when(soak)}" if fuzz else _when(soak))
    )
    lines = [
        f"**Robustness** ({some.get('host', '?')}, {some.get('cpu_count', '?')} CPUs, "
        f"{dates}; simulated H200, real broker processes)",
        "",
        "| run | measure | figure | target | verdict |",
        "|---|---|---:|---|---|",
    ]
    if fuzz:
        f = fuzz["summary"]
        rows = [
            ("frames sent", f["frames_sent"], ">= 1,000,000", f["frames_sent"] >= 1_000_000),
            ("frames left unanswered", f["unanswered"], "0", f["unanswered"] == 0),
            ("connections closed unasked", f["closed_unasked"], "0", f["closed_unasked"] == 0),
            ("broker crashes", 0 if f["broker_alive_at_end"] else 1, "0", f["broker_alive_at_end"]),
            ("internal errors / tracebacks", f"{f['internal_errors']} / {f['tracebacks_in_log']}",
             "0 / 0", f["internal_errors"] == 0 and f["tracebacks_in_log"] == 0),
            ("broker RSS before -> after (MiB)",
             f"{f['broker_rss_mib_before']} -> {f['broker_rss_mib_after']}", "-", None),
            ("broker RSS growth over the second half (MiB)",
             _fmt(f.get("broker_rss_mib_second_half_growth"), 1), "flat", None),
            ("frames per second", f["frames_per_second"], "-", None),
        ]  # fmt: skip
        for measure, figure, target, ok in rows:
            lines.append(f"| fuzz | {measure} | {figure} | {target} | {_verdict(ok)} |")
    if soak:
        k = soak["summary"]
        rows = [
            ("broker kill -9s", k["broker_kills"], ">= 100", k["broker_kills"] >= 100),
            ("requests (granted)", f"{k['requests']} ({k['granted']})", "-", None),
            ("leases paused by preemption / reclaimed after a kill",
             f"{k['leases_paused_by_preemption']} / {k['leases_reclaimed_after_a_kill']}", "-", None),
            ("live leases lost", k["live_leases_lost"], "0", k["live_leases_lost"] == 0),
            ("requests left unanswered", k["unanswered_requests"], "0", k["unanswered_requests"] == 0),
            ("client errors", k["client_errors"], "0", k["client_errors"] == 0),
            ("sessions left paused at the end", k["sessions_held_at_end"], "0",
             k["sessions_held_at_end"] == 0),
            ("actuations left applied after the stop", k["pending_actuations_after_stop"], "0",
             k["pending_actuations_after_stop"] == 0),
            ("broker exits not ours / tracebacks",
             f"{k['broker_exits_not_ours']} / {k['tracebacks_in_log']}", "0 / 0",
             k["broker_exits_not_ours"] == 0 and k["tracebacks_in_log"] == 0),
            *_soak_extras(k),
        ]  # fmt: skip
        for measure, figure, target, ok in rows:
            lines.append(f"| soak | {measure} | {figure} | {target} | {_verdict(ok)} |")
    return [*lines, ""]


def _soak_extras(k: dict) -> list[tuple]:
    """The rows only a soak that also killed clients and probed status has."""
    if "client_kills" not in k:
        return []
    zero = (
        ("requests failed at once (broker unavailable)", "failed_at_once_broker_unavailable"),
        ("granted twice", "granted_twice"),
        ("memory over capacity (status probes, journal at each kill)", "memory_over_capacity"),
        ("killed clients' leases kept past 5 s", "killed_clients_leases_kept"),
        ("journal integrity_check not ok", "journal_not_intact"),
    )
    return [
        ("client kill -9s", k["client_kills"], "-", None),
        *((measure, k[key], "0", k[key] == 0) for measure, key in zero if key in k),
        ("reclaim after a restart p50 / p99 (s)",
         f"{_fmt(k.get('reclaim_s_p50'), 2)} / {_fmt(k.get('reclaim_s_p99'), 2)}", "-", None),
    ]  # fmt: skip


# The suites a report reads, by the key its sections know them by.
RESULT_FILES = {
    "control": "control_plane.json",
    "kernels": "kernels_bench.json",
    "contention": "contention.json",
    "checkpoint": "checkpoint.json",
    "fuzz": "fuzz_frames.json",
    "soak": "crash_soak.json",
    "interposer": "interposer.json",
    "third_party": "third_party.json",
    "preemptible": "preemptible.json",
    "parking": "parking.json",
    "long_kernel_cost": "long_kernel_cost.json",
}


def _load_documents(folders: list[Path]) -> dict[str, dict]:
    """Each suite's result from the first folder that holds one."""
    documents: dict[str, dict] = {}
    for folder in folders:
        for key, name in RESULT_FILES.items():
            if key not in documents and (document := _load(folder, name)):
                documents[key] = document
    return documents


def _newest_control(folders: list[Path]) -> dict | None:
    """The control plane is measured on the CPU machine, which any folder may hold: the
    newest run is the one to show."""
    runs = [doc for folder in folders if (doc := _load(folder, RESULT_FILES["control"]))]
    return max(runs, key=lambda doc: doc.get("date") or "") if runs else None


def _shim_contention(folders: list[Path], shown: dict | None) -> dict | None:
    """A later contention run than ``shown`` that measured the launch shim: it gets a
    table of its own."""
    for folder in folders:
        shim_run = _load(folder, "contention.json")
        if (
            shim_run
            and shim_run is not shown
            and shim_run != shown
            and any(row.get("mode") == "shim" for row in shim_run.get("rows", []))
        ):
            return shim_run
    return None


def _contention_shim_section(doc: dict) -> list[str]:
    return _contention_section(
        doc, "Interactive latency with the launch shim (neighbours held on the host)"
    )


# The sections of one document each, in the report's order (the long-kernel tables,
# the control plane and robustness follow them).
DOCUMENT_SECTIONS = (
    ("contention", _contention_section),
    ("contention_shim", _contention_shim_section),
    ("kernels", _kernels_section),
    ("checkpoint", _checkpoint_section),
    ("parking", _parking_section),
    ("interposer", _interposer_section),
    ("third_party", _third_party_section),
    ("preemptible", _preemptible_section),
)


def _report_sections(documents: dict[str, dict], kernel_tables: list[str]) -> list[str]:
    """Every table ``documents`` hold figures for, in the report's order."""
    sections = []
    for key, section in DOCUMENT_SECTIONS:
        if key in documents:
            sections += section(documents[key])
    sections += kernel_tables
    if "control" in documents:
        sections += _control_section(documents["control"])
    if "fuzz" in documents or "soak" in documents:
        sections += _robustness_section(documents.get("fuzz"), documents.get("soak"))
    return sections


def build_report(folders: list[Path], doc_file: Path | None = None) -> int:
    """Report on ``folders`` (later ones fill in suites the earlier lack); plots and
    ``report.md`` go into the first folder, and the tables into ``doc_file`` between
    its bench marks."""
    documents = _load_documents(folders)
    kernel_tables = long_kernel_tables(folders, documents)
    if not documents and not kernel_tables:
        print(f"no results in {', '.join(map(str, folders))}")
        return 1
    if control := _newest_control(folders):
        documents["control"] = control
    if shim_run := _shim_contention(folders, documents.get("contention")):
        documents["contention_shim"] = shim_run
    target = folders[0]
    images = _plots(target, documents)
    body = "\n".join(_report_sections(documents, kernel_tables))
    (target / "report.md").write_text(
        body + "\n" + "\n".join(f"![{i}]({i})" for i in images) + "\n"
    )
    print(body)
    if doc_file is not None:
        return update_doc_file(doc_file, folders, target, images, body)
    return 0


def _as_in_a_command(path: Path) -> str:
    """``path`` as a command run from the repository's root names it (absolute outside)."""
    resolved = path.resolve()
    return (
        str(resolved.relative_to(REPO_ROOT))
        if resolved.is_relative_to(REPO_ROOT)
        else str(resolved)
    )


def update_doc_file(
    doc_file: Path, folders: list[Path], target: Path, images: list[str], body: str
) -> int:
    """Replace what lies between ``doc_file``'s bench marks with ``body``, the command that
    made it and the plots in ``target`` (linked from the file's own folder)."""
    text = doc_file.read_text()
    if MARK_START not in text or MARK_END not in text:
        print(
            f"{doc_file} has no {MARK_START} ... {MARK_END} to put the tables between",
            file=sys.stderr,
        )
        return 1
    shown = " ".join(_as_in_a_command(folder) for folder in folders)
    relative = Path(os.path.relpath(target.resolve(), doc_file.resolve().parent))
    gallery = " ".join(f"![{i}]({relative / i})" for i in images)
    block = (
        f"{MARK_START}\nGenerated by `python -m benchmarks report {shown} "
        f"--doc {_as_in_a_command(doc_file)}`.\n\n{body}\n{gallery}\n{MARK_END}"
    )
    text = re.sub(
        re.escape(MARK_START) + r".*?" + re.escape(MARK_END), lambda _: block, text, flags=re.S
    )
    doc_file.write_text(text)
    return 0
