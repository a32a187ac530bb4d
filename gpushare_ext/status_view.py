"""Text rendering of a broker snapshot for terminals and notebooks (rich tables).

Used by ``gpushare status`` and by ``%gpu status`` when no widget front end is
available.  It only formats; the snapshot already carries what the viewer may see.
A gang's ranks are shown as the one request they are (:func:`requests_of`,
:func:`timeline_rows`), as the widget and the panel show them.

Labels, reasons, notes and names are other people's words: every string of the snapshot
goes through :func:`gpushare_ext.plain_text.plain_text` first (whichever broker sent it),
and reaches rich only as ``Text``, never as markup, so "[/]" or an escape sequence in a
label shows as those characters.  A lease is one row of the leases table; below
:data:`WIDE_COLUMNS` its reason is one line, cut at the terminal's edge.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from io import StringIO

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import (
    PARKED_LABEL,
    LeaseState,
    LeaseView,
    Snapshot,
    TimelinePause,
    TimelineSpan,
    describe_priority,
    level_word,
)
from gpushare_ext.units import format_size

_STATE_STYLE = {
    LeaseState.RUNNING: "bold green",
    LeaseState.QUEUED: "yellow",
    LeaseState.PAUSED: "magenta",
    LeaseState.EVICTED: "red",
}


# ---- a gang as one request (occupancy.js groups the same way for the widget and panel)

# From furthest from running to running: a gang trains only while every rank runs, so a
# gang's row takes the state of the rank that holds the others back.
_HOLDING_BACK = (LeaseState.QUEUED, LeaseState.EVICTED, LeaseState.PAUSED, LeaseState.RUNNING)


def _holding_back(state: LeaseState) -> int:
    return _HOLDING_BACK.index(state) if state in _HOLDING_BACK else -1


@dataclass(frozen=True)
class Request:
    """One row of the leases table: a single lease, or every rank of a gang under the
    gang's id.  It only reads the views it was given; it must not hide a rank's state
    or reason behind another's (ranks that differ are counted and named)."""

    lease_id: str
    leases: tuple[LeaseView, ...]  # a gang's ranks in the order the snapshot lists them

    @property
    def lease(self) -> LeaseView:
        """The first rank: user, priority, queue position and label are the gang's."""
        return self.leases[0]

    @property
    def state(self) -> LeaseState:
        return min((lease.state for lease in self.leases), key=_holding_back)

    def states(self) -> str:
        """``running``, or, where the ranks differ, each state with its count."""
        counts = Counter(lease.state for lease in self.leases)
        if len(counts) == 1:
            return self.state.value
        return ", ".join(f"{s.value} {counts[s]}" for s in sorted(counts, key=_holding_back))

    @property
    def memory_bytes(self) -> int:
        return sum(lease.memory_bytes for lease in self.leases)

    def why(self) -> str:
        """The reason (or label) to show.  Ranks in one state share the request's reason
        (a queued gang's is its first rank's); ranks in different states each say why,
        named by their rank."""
        if len({lease.state for lease in self.leases}) == 1:
            reasons = dict.fromkeys(lease.reason for lease in self.leases if lease.reason)
            return "; ".join(reasons) or self.lease.label
        return "; ".join(
            f"rank {lease.rank}: {lease.reason}" for lease in self.leases if lease.reason
        )


def requests_of(leases: Iterable[LeaseView]) -> list[Request]:
    """The leases as requests, in the order of each request's first lease: a gang's
    ranks (same ``gang``) become one request under the gang's id."""
    grouped: dict[str, list[LeaseView]] = {}
    for lease in leases:
        grouped.setdefault(lease.gang or lease.lease_id, []).append(lease)
    return [Request(lease_id, tuple(members)) for lease_id, members in grouped.items()]


def _common_pauses(spans: list[TimelineSpan]) -> list[TimelinePause]:
    """When every one of ``spans`` was paused at once, at the highest level any was held.

    The intersection, not the union: a rank that kept running (one that could not be
    paused) still used the device, so a pause is drawn only where all of them gave it
    up; the level is the costliest rung any of them paid."""
    common = [(p.start, math.inf if p.end is None else p.end, p.level) for p in spans[0].pauses]
    for span in spans[1:]:
        theirs = [(p.start, math.inf if p.end is None else p.end, p.level) for p in span.pauses]
        common = sorted(
            (max(a, c), min(b, d), max(level, other))
            for a, b, level in common
            for c, d, other in theirs
            if max(a, c) < min(b, d)
        )
    return [
        TimelinePause(start=start, end=None if end == math.inf else end, level=level)
        for start, end, level in common
    ]


def timeline_rows(spans: Iterable[TimelineSpan]) -> list[tuple[TimelineSpan, int]]:
    """One device's timeline as requests: each span with its rank count (1 for a single
    lease); a gang's spans become one, from its first rank's start to its last rank's
    end (open while any is held), under the gang's id, paused where all were."""
    # Keyed by place outside gangs: a lease granted twice keeps both its spans.
    grouped: dict[str | int, list[TimelineSpan]] = {}
    for place, span in enumerate(spans):
        grouped.setdefault(span.gang or place, []).append(span)
    rows = []
    for members in grouped.values():
        first = members[0]
        if not first.gang:
            rows.append((first, 1))
            continue
        ends = [span.end for span in members]
        merged = msgspec.structs.replace(
            first,
            lease_id=first.gang,
            start=min(span.start for span in members),
            end=None if None in ends else max(e for e in ends if e is not None),
            pauses=_common_pauses(members),
            rank=None,
        )
        rows.append((merged, len(members)))
    return rows


def _span_name(span: TimelineSpan, ranks: int) -> str:
    """``L7 ×2`` for a gang's ranks on one device, the lease id for a single lease."""
    return f"{span.lease_id} ×{ranks}" if span.gang else span.lease_id


def _where(request: Request) -> str:
    """``GPU 0``; for a gang ``2 ranks on GPU 0, GPU 1`` (``2 ranks`` while queued)."""
    places = []
    for lease in request.leases:
        if lease.device_index is None:
            continue
        place = f"GPU {lease.device_index}"
        if lease.mig_uuid:
            place += f" {lease.mig_uuid[:14]}…"
        places.append(place)
    unique = list(dict.fromkeys(places))
    if len(request.leases) == 1:
        return unique[0] if unique else "-"
    return f"{len(request.leases)} ranks" + (f" on {', '.join(unique)}" if unique else "")


def _share(request: Request) -> str:
    """A lease's share of the SMs; a gang's per rank (``25% each``)."""
    shares = sorted({lease.sm_share for lease in request.leases})
    texts = ["all" if share >= 1.0 else f"{share:.0%}" for share in shares]
    each = " each" if len(request.leases) > 1 and shares[0] < 1.0 else ""
    return ", ".join(texts) + each


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
# The widest the user column gets: an account name with " (you)" fits; a longer one
# ends in "…" there (``--json`` has it whole).
USER_COLUMN = 24


def _plain(value: object) -> object:
    """``value`` (the builtins of a snapshot) with every string, keys too, as plain text."""
    if isinstance(value, str):
        return plain_text(value, SENTENCE_LIMIT)
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def shown_as_plain_text(snapshot: Snapshot) -> Snapshot:
    """``snapshot`` with every string in it as :func:`plain_text` makes it.

    A broker of this version sends plain text already; this makes the view true of a
    snapshot from any broker (or a file), whatever someone typed into a label."""
    return msgspec.convert(_plain(msgspec.to_builtins(snapshot)), Snapshot)


def _add_row(table: Table, *cells: str | Text) -> None:
    """A row of text shown as it is: rich would read a plain string as markup."""
    table.add_row(*(cell if isinstance(cell, Text) else Text(cell) for cell in cells))


def build_tables(snapshot: Snapshot, width: int = WIDE_COLUMNS) -> list[Table]:
    """The tables of ``snapshot`` (one :func:`shown_as_plain_text` made)."""
    head = Table(
        title=Text(f"gpushare on {snapshot.node} ({snapshot.mode} broker, {snapshot.inventory})"),
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
        _add_row(
            head,
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
            title=Text(
                f"GPU {info.index}: MIG profiles"
                + (" (instances below)" if info.instances else " (MIG off: whole GPU)")
            )
        )
        for column in ("id", "profile", "slices", "memory", "SMs", "max instances"):
            profiles.add_column(column)
        for profile in info.profiles:
            _add_row(
                profiles,
                str(profile.id),
                profile.name,
                str(profile.slice_count),
                format_size(profile.memory_mib << 20),
                str(profile.multiprocessor_count),
                str(profile.instance_count),
            )
        tables.append(profiles)
        if info.instances:
            instances = Table(title=Text(f"GPU {info.index}: MIG instances"))
            for column in ("uuid", "profile", "memory", "SMs", "placement"):
                instances.add_column(column)
            for inst in info.instances:
                _add_row(
                    instances,
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
        # A name is cut at USER_COLUMN: a long one would squeeze every other column.
        leases.add_column(
            column,
            no_wrap=column != "why / label",
            max_width=USER_COLUMN if column == "user" else None,
        )
    for request in requests_of(snapshot.leases):
        lease = request.lease
        parked = lease.label == PARKED_LABEL and request.state == LeaseState.EVICTED
        state = "parked" if parked else request.states()
        state += f" #{lease.position}" if lease.position else ""
        user = Text(lease.user + (" (you)" if lease.own else ""), style="bold" if lease.own else "")
        row = [
            request.lease_id,
            user,
            describe_priority(lease.priority),
            Text(state, style=_STATE_STYLE.get(request.state, "")),
            _where(request),
            format_size(request.memory_bytes),
            _share(request),
            f"{min(member.since_s for member in request.leases):.1f}s",
        ]
        _add_row(leases, *row, *([request.why()] if wide else []))
    if not snapshot.leases:
        _add_row(
            leases, "-", "-", "-", "idle", "-", "-", "-", "-", *(["no leases"] if wide else [])
        )
    return leases


def reasons_below(snapshot: Snapshot) -> list[str]:
    """Each request's reason or label on a line of its own, for a narrow terminal (the
    lines of a snapshot :func:`shown_as_plain_text` made have no line breaks)."""
    return [
        f"{request.lease_id}: {request.why()}"
        for request in requests_of(snapshot.leases)
        if request.why()
    ]


def _ago(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds} s ago" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s ago"


def recent_pauses(snapshot: Snapshot) -> list[str]:
    """The timeline as text: each pause of the last minutes, newest last, one line each
    ("GPU 0: L1 (alice, low) paused 3 s at level 0 (gate), 2 min 5 s ago"; a gang's
    ranks on a device are one line, "GPU 0: L7 ×2 (...) paused ...")."""
    lines = []
    for device in snapshot.devices:
        for span, ranks in timeline_rows(device.timeline):
            for pause in span.pauses:
                end = pause.end if pause.end is not None else snapshot.time
                when = "still paused" if pause.end is None else _ago(snapshot.time - end)
                level = level_word(pause.level)
                lines.append(
                    (
                        pause.start,
                        f"GPU {device.info.index}: {_span_name(span, ranks)} ({span.user}, "
                        f"{describe_priority(span.priority)}) paused {round(end - pause.start)} s "
                        f"at level {pause.level} ({level}), {when}",
                    )
                )
    return [line for _, line in sorted(lines)]


def render_status(snapshot: Snapshot, console: Console | None = None) -> None:
    """Print ``snapshot`` on ``console`` (a terminal's by default), its text as text."""
    console = console or Console()
    snapshot = shown_as_plain_text(snapshot)
    for table in build_tables(snapshot, console.width):
        console.print(table)
    if console.width < WIDE_COLUMNS:
        # One line a request, cut at the edge: a wrapped reason's second line would
        # start where the next request's line does, and could pass for one.
        for line in reasons_below(snapshot):
            console.print(Text(line), no_wrap=True, overflow="ellipsis")
    pauses = recent_pauses(snapshot)
    if pauses:
        minutes = round(snapshot.timeline_window_s / 60)
        console.print(Text(f"pauses in the last {minutes} min:"))
        for line in pauses[-10:]:  # one line a pause, as above: a user's name is in it
            console.print(Text(f"  {line}"), no_wrap=True, overflow="ellipsis")
    for note in snapshot.notes:
        console.print(Text(f"note: {note}", style="dim"))


def status_text(snapshot: Snapshot, width: int = 110) -> str:
    buffer = StringIO()
    render_status(
        snapshot,
        Console(
            file=buffer, width=width, force_terminal=False, force_jupyter=False, color_system=None
        ),
    )
    return buffer.getvalue()
