"""Text rendering of a broker snapshot for terminals and notebooks (rich tables).

Used by ``gpushare status`` and by ``%gpu status`` when no widget front end is
available.  It only formats; the snapshot already carries what the viewer may see.
"""

from __future__ import annotations

from io import StringIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpushare_ext.protocol import PARKED_LABEL, LeaseState, Snapshot, describe_priority
from gpushare_ext.units import format_size

_STATE_STYLE = {
    LeaseState.RUNNING: "bold green",
    LeaseState.QUEUED: "yellow",
    LeaseState.PAUSED: "magenta",
    LeaseState.EVICTED: "red",
}


def _sparkline(values: list[int]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    return "".join(bars[min(len(bars) - 1, v * len(bars) // 101)] for v in values[-30:])


def _outside_leases(per_user: dict[str, int]) -> str:
    """Memory held beyond the leases, biggest first: "ada 12 GiB, other processes 1 GiB"."""
    if not per_user:
        return "-"
    biggest = sorted(per_user.items(), key=lambda item: (-item[1], item[0]))
    return ", ".join(f"{who} {format_size(mib << 20)}" for who, mib in biggest)


# Below this many columns the reasons leave the leases table and follow it, one line
# each: a table column that narrow wraps a sentence one word a line.
WIDE_COLUMNS = 110


def build_tables(snapshot: Snapshot, width: int = WIDE_COLUMNS) -> list[Table]:
    head = Table(
        title=f"gpushare on {snapshot.node} ({snapshot.mode} broker, {snapshot.inventory})",
        show_header=True,
        header_style="bold",
    )
    columns = ("GPU", "name", "memory used / leased / total", "outside leases", "SMs", "util")
    for column in (*columns, "MIG", "state"):
        head.add_column(column)
    for device in snapshot.devices:
        info = device.info
        mig = "on" if info.mig_enabled else "off"
        if info.mig_enabled:
            mig += f": {len(info.instances)} instance(s)"
        head.add_row(
            str(info.index),
            info.name + (" (simulated)" if info.simulated else ""),
            f"{format_size(device.memory_used_mib << 20)} / {format_size(device.memory_leased_mib << 20)}"
            f" / {format_size(info.memory_total_mib << 20)}",
            _outside_leases(device.memory_outside_leases_mib),
            str(info.multiprocessor_count),
            f"{device.utilization_pct}% {_sparkline(device.utilization_history)}",
            mig,
            "drained" if device.drained else "open",
        )
    tables = [head]
    for device in snapshot.devices:
        info = device.info
        profiles = Table(
            title=f"GPU {info.index}: MIG profiles"
            + (" (instances below)" if info.instances else " (MIG off: whole GPU)")
        )
        for column in ("id", "profile", "slices", "memory", "SMs", "max instances"):
            profiles.add_column(column)
        for profile in info.profiles:
            profiles.add_row(
                str(profile.id),
                profile.name,
                str(profile.slice_count),
                format_size(profile.memory_mib << 20),
                str(profile.multiprocessor_count),
                str(profile.instance_count),
            )
        tables.append(profiles)
        if info.instances:
            instances = Table(title=f"GPU {info.index}: MIG instances")
            for column in ("uuid", "profile", "memory", "SMs", "placement"):
                instances.add_column(column)
            for inst in info.instances:
                instances.add_row(
                    inst.uuid,
                    inst.name,
                    format_size(inst.memory_mib << 20),
                    str(inst.multiprocessor_count),
                    f"{inst.start}+{inst.size}",
                )
            tables.append(instances)
    tables.append(_lease_table(snapshot, wide=width >= WIDE_COLUMNS))
    return tables


def _lease_table(snapshot: Snapshot, *, wide: bool) -> Table:
    leases = Table(title="leases and queue")
    columns = ["lease", "user", "priority", "state", "where", "memory", "SMs", "for"]
    for column in columns + (["why / label"] if wide else []):
        leases.add_column(column, no_wrap=column != "why / label")
    for lease in snapshot.leases:
        where = "-" if lease.device_index is None else f"GPU {lease.device_index}"
        if lease.mig_uuid:
            where += f" {lease.mig_uuid[:14]}…"
        parked = lease.label == PARKED_LABEL and lease.state == LeaseState.EVICTED
        state = "parked" if parked else lease.state.value
        state += f" #{lease.position}" if lease.position else ""
        user = Text(lease.user + (" (you)" if lease.own else ""), style="bold" if lease.own else "")
        row = [
            lease.lease_id,
            user,
            describe_priority(lease.priority),
            Text(state, style=_STATE_STYLE.get(lease.state, "")),
            where,
            format_size(lease.memory_bytes),
            "all" if lease.sm_share >= 1.0 else f"{lease.sm_share:.0%}",
            f"{lease.since_s:.1f}s",
        ]
        leases.add_row(*row, *([lease.reason or lease.label] if wide else []))
    if not snapshot.leases:
        leases.add_row("-", "-", "-", "idle", "-", "-", "-", "-", *(["no leases"] if wide else []))
    return leases


def reasons_below(snapshot: Snapshot) -> list[str]:
    """Each lease's reason or label on a line of its own, for a narrow terminal."""
    return [
        f"{lease.lease_id}: {lease.reason or lease.label}"
        for lease in snapshot.leases
        if lease.reason or lease.label
    ]


LEVEL_NAMES = ("gate", "yield", "abort", "lock", "evict")


def _ago(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds} s ago" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s ago"


def recent_pauses(snapshot: Snapshot) -> list[str]:
    """The timeline as text: each pause of the last minutes, newest last, one line each
    ("GPU 0: L1 (alice, low) paused 3 s at level 0 (gate), 2 min 5 s ago")."""
    lines = []
    for device in snapshot.devices:
        for span in device.timeline:
            for pause in span.pauses:
                end = pause.end if pause.end is not None else snapshot.time
                when = "still paused" if pause.end is None else _ago(snapshot.time - end)
                level = LEVEL_NAMES[pause.level] if 0 <= pause.level < 5 else "?"
                lines.append(
                    (
                        pause.start,
                        f"GPU {device.info.index}: {span.lease_id} ({span.user}, "
                        f"{describe_priority(span.priority)}) paused {round(end - pause.start)} s "
                        f"at level {pause.level} ({level}), {when}",
                    )
                )
    return [line for _, line in sorted(lines)]


def render_status(snapshot: Snapshot, console: Console | None = None) -> None:
    console = console or Console()
    for table in build_tables(snapshot, console.width):
        console.print(table)
    if console.width < WIDE_COLUMNS:
        for line in reasons_below(snapshot):
            console.print(line, highlight=False)
    pauses = recent_pauses(snapshot)
    if pauses:
        minutes = round(snapshot.timeline_window_s / 60)
        console.print(f"pauses in the last {minutes} min:", highlight=False)
        for line in pauses[-10:]:
            console.print(f"  {line}", highlight=False, soft_wrap=False)
    for note in snapshot.notes:
        console.print(f"[dim]note: {note}[/dim]")


def status_text(snapshot: Snapshot, width: int = 110) -> str:
    buffer = StringIO()
    render_status(
        snapshot, Console(file=buffer, width=width, force_terminal=False, color_system=None)
    )
    return buffer.getvalue()
