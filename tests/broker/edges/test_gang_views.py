"""A gang in what users read: the status snapshot names each rank's request, and the
text of ``gpushare status`` shows the ranks as one request (one row, one queue place,
one pause line per GPU), with each state counted when the ranks differ."""

from __future__ import annotations

import re
import subprocess
import sys

from broker_wire import start_holder, status_of, wait_for

from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, Queued, Snapshot, TimelinePause, TimelineSpan
from gpushare_ext.status_view import requests_of, status_text, timeline_rows

GIB = 1024**3
HIGH, LOW = 250, 50


def lease_rows(text: str) -> list[str]:
    """The body rows of the leases table in ``status_text`` (rich's box drawing)."""
    _, _, table = text.partition("leases and queue")
    return [line for line in table.splitlines() if re.match(r"^│ \S", line)]


def row_of(text: str, lease_id: str) -> list[str]:
    """The cells of the leases table's row for ``lease_id``."""
    (row,) = [r for r in lease_rows(text) if r.split("│")[1].strip() == lease_id]
    return [cell.strip() for cell in row.strip("│").split("│")]


def test_each_view_of_a_gang_names_its_request_and_rank_and_the_text_shows_one_row(broker):
    with BrokerClient(broker, notebook="ddp.ipynb") as trainer, BrokerClient(broker) as other:
        gang = trainer.request_lease(
            priority=150, memory_bytes=20 * GIB, sm_share=0.25, ranks=2, label="ddp"
        )
        single = other.request_lease(priority=150, memory_bytes=10 * GIB, sm_share=0.25)
        assert isinstance(gang, Granted) and isinstance(single, Granted)

        snapshot = trainer.status()

    views = {v.lease_id: v for v in snapshot.leases}
    assert {k: (v.gang, v.rank) for k, v in views.items()} == {
        f"{gang.lease_id}.0": (gang.lease_id, 0),
        f"{gang.lease_id}.1": (gang.lease_id, 1),
        single.lease_id: ("", None),
    }
    spans = {s.lease_id: (s.gang, s.rank) for s in snapshot.devices[0].timeline}
    assert spans == {k: (v.gang, v.rank) for k, v in views.items()}

    text = status_text(snapshot, width=200)
    assert [r.split("│")[1].strip() for r in lease_rows(text)] == [gang.lease_id, single.lease_id]
    _, _, _, state, where, memory, sms, _, why = row_of(text, gang.lease_id)
    assert (state, where, memory, sms, why) == (
        "running", "2 ranks on GPU 0", "40.0 GiB", "25% each", "ddp"
    )  # fmt: skip
    assert row_of(text, single.lease_id)[3:7] == ["running", "GPU 0", "10.0 GiB", "25%"]
    assert f"{gang.lease_id}.0" not in text


def test_a_queued_gang_is_one_request_with_one_place_in_the_queue(broker):
    holder, held = start_holder(broker, priority=150, memory_gib=100)
    try:
        assert held["granted"]
        with BrokerClient(broker) as trainer:
            queued = trainer.request_lease(priority=150, memory_bytes=30 * GIB, ranks=2)
            assert isinstance(queued, Queued)
            text = status_text(trainer.status(), width=200)
    finally:
        holder.kill()
        holder.wait(timeout=5)

    _, _, _, state, where, memory, _, _, why = row_of(text, queued.lease_id)
    assert (state, where, memory) == ("queued #1", "2 ranks", "60.0 GiB")
    assert why and not why.startswith("rank")  # the request's reason, said once
    assert len(lease_rows(text)) == 2  # the holder and the gang


def test_a_gang_on_two_gpus_is_one_row_and_one_bar_on_each_gpu(start_broker):
    running = start_broker(simulate="h200-x2")
    with BrokerClient(running.socket) as trainer:
        gang = trainer.request_lease(priority=150, memory_bytes=40 * GIB, ranks=2)
        assert isinstance(gang, Granted)
        snapshot = trainer.status()

    (request,) = requests_of(snapshot.leases)
    assert request.lease_id == gang.lease_id and len(request.leases) == 2
    assert row_of(status_text(snapshot, width=200), gang.lease_id)[4] == "2 ranks on GPU 0, GPU 1"
    for device in snapshot.devices:
        ((span, ranks),) = timeline_rows(device.timeline)
        assert (span.lease_id, span.rank, ranks) == (gang.lease_id, None, 1)


def _sleepers(count: int) -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        for _ in range(count)
    ]


def _ranks_settled(broker, members: set[str]) -> Snapshot | None:
    snapshot = status_of(broker)
    states = sorted(v.state.value for v in snapshot.leases if v.lease_id in members)
    return snapshot if states == ["paused", "running"] else None


def test_a_gang_whose_ranks_differ_in_state_counts_each_state_and_says_why(broker):
    """Rank 0's worker is gone when a high cell comes: its lock fails and it keeps
    running, while rank 1 is paused.  The row counts both states and names the rank
    that could not be paused; the pause line is where both were paused."""
    workers = _sleepers(2)
    try:
        with BrokerClient(broker, notebook="ddp.ipynb") as trainer:
            gang = trainer.request_lease(priority=LOW, memory_bytes=10 * GIB, ranks=2)
            assert isinstance(gang, Granted)
            trainer.attach_ranks(gang.lease_id, [w.pid for w in workers])
            workers[0].kill()
            workers[0].wait(timeout=5)
            explorer, high = start_holder(broker, priority=HIGH, memory_gib=8)
            try:
                assert high["granted"]
                members = {r.lease_id for r in gang.ranks}
                snapshot = wait_for(lambda: _ranks_settled(broker, members))
                assert snapshot is not None
            finally:
                explorer.kill()
                explorer.wait(timeout=5)
    finally:
        for worker in workers:
            worker.kill()
            worker.wait(timeout=5)

    text = status_text(snapshot, width=250)
    _, _, _, state, where, memory, _, _, why = row_of(text, gang.lease_id)
    assert (state, where, memory) == ("paused 1, running 1", "2 ranks on GPU 0", "20.0 GiB")
    assert why.startswith(f"rank 0: could not be paused: process {workers[0].pid} is gone")
    assert "; rank 1: " in why
    pause_lines = [line for line in text.splitlines() if line.startswith("  GPU 0:")]
    assert all(not line.startswith(f"  GPU 0: {gang.lease_id}.") for line in pause_lines)
    assert any(line.startswith(f"  GPU 0: {gang.lease_id} ×2 (") for line in pause_lines)


def _span(lease_id: str, start: float, end: float | None, pauses: list[tuple]) -> TimelineSpan:
    gang, _, rank = lease_id.partition(".")
    return TimelineSpan(
        lease_id=lease_id, user="alice", own=True, priority=LOW, start=start, end=end,
        pauses=[TimelinePause(start=a, end=b, level=level) for a, b, level in pauses],
        gang=gang if rank else "", rank=int(rank) if rank else None,
    )  # fmt: skip


def test_a_gangs_bar_spans_all_its_ranks_and_is_paused_where_all_of_them_were():
    spans = [
        _span("L3", 90.0, 95.0, [(91.0, 92.0, 0)]),
        _span("L7.0", 100.0, None, [(110.0, 120.0, 0), (130.0, None, 3)]),
        _span("L7.1", 101.0, 140.0, [(112.0, 125.0, 3), (135.0, 140.0, 0)]),
    ]

    single, gang = timeline_rows(spans)

    assert single == (spans[0], 1)
    merged, ranks = gang
    assert (merged.lease_id, merged.gang, merged.rank, ranks) == ("L7", "L7", None, 2)
    assert (merged.start, merged.end) == (100.0, None)  # rank 0 still holds the GPU
    assert [(p.start, p.end, p.level) for p in merged.pauses] == [
        (112.0, 120.0, 3),  # both paused, the costlier rung named
        (135.0, 140.0, 3),
    ]


def test_a_gang_that_cannot_be_paused_is_one_note_naming_it_and_its_ranks(broker):
    from gpushare_ext.protocol import Capabilities

    unlockable = Capabilities(lockable=False)  # MPS clients, with no gate to hold them
    with BrokerClient(broker) as trainer, BrokerClient(broker) as other:
        gang = trainer.request_lease(
            priority=LOW, memory_bytes=4 * GIB, ranks=2, capabilities=unlockable
        )
        single = other.request_lease(priority=LOW, memory_bytes=4 * GIB, capabilities=unlockable)
        assert isinstance(gang, Granted) and isinstance(single, Granted)
        notes = [n for n in trainer.status().notes if "cannot be paused" in n]

    assert sorted(notes) == [
        f"gang {gang.lease_id} (2 ranks) cannot be paused (checkpoint lock unsupported, "
        "e.g. an MPS client): it time-slices",
        f"lease {single.lease_id} cannot be paused (checkpoint lock unsupported, "
        "e.g. an MPS client): it time-slices",
    ]
