"""The timeline the panel draws: spans from grant to end, pauses with their level."""

from __future__ import annotations

import re

from broker_wire import RawClient, evict_low_for_high, status_of

from gpushare_ext.broker.hands.timeline import Timeline
from gpushare_ext.broker.scheduler.core import Identity
from gpushare_ext.client import BrokerClient
from gpushare_ext.protocol import Granted, Release, Released
from gpushare_ext.status_view import status_text

GIB = 1024**3
ALICE = Identity(uid=1001, gid=1001, pid=11, user="alice")


def test_a_span_runs_from_grant_to_end_with_its_pauses_and_their_highest_level():
    timeline = Timeline(window_s=60)
    timeline.granted("L1", ALICE, 50, 0, now=100.0)
    timeline.paused("L1", 0, now=110.0)
    timeline.paused("L1", 3, now=110.5)  # the same pause, a rung higher
    timeline.resumed("L1", now=115.0)
    timeline.paused("L1", 4, now=120.0)

    (span,) = timeline.spans(0, now=121.0)
    assert (span.start, span.end) == (100.0, None)
    assert [(p.start, p.end, p.level) for p in span.pauses] == [(110.0, 115.0, 3), (120.0, None, 4)]

    timeline.ended("L1", now=130.0)
    assert [(p.end, p.level) for p in span.pauses][-1] == (130.0, 4)  # ended while paused
    assert span.end == 130.0
    assert timeline.spans(1, now=131.0) == []


def test_it_keeps_the_window_and_a_bounded_number_of_spans():
    timeline = Timeline(window_s=60, max_spans=3)
    for i in range(5):
        timeline.granted(f"L{i}", ALICE, 150, 0, now=float(i))
        timeline.ended(f"L{i}", now=i + 0.5)
    assert [s.lease_id for s in timeline.spans(0, now=10.0)] == ["L2", "L3", "L4"]
    assert timeline.spans(0, now=100.0) == []  # all ended more than 60 s ago
    timeline.ended("L9", now=1.0)  # an end of nothing known changes nothing
    timeline.paused("L9", 2, now=1.0)


def test_status_carries_each_devices_timeline_with_the_eviction_level(running_broker):
    with RawClient(running_broker.socket) as low, RawClient(running_broker.socket) as high:
        low.hello()
        high.hello()
        evict_low_for_high(low, high)
        low.send(Release(seq=3, lease_id="L1"))
        assert any(isinstance(m, Released) for m in low.recv_all(2))

        snapshot = status_of(running_broker.socket)

    assert snapshot.timeline_window_s == 600.0
    spans = {s.lease_id: s for s in snapshot.devices[0].timeline}
    low_span, high_span = spans["L1"], spans["L2"]
    assert low_span.priority == 50 and low_span.own and low_span.end is not None
    (pause,) = low_span.pauses
    # A simulated GPU is held by its gate, whatever rung was asked (status says the same).
    assert pause.level == 0 and pause.end == low_span.end
    assert pause.start <= high_span.start
    assert high_span.priority == 250 and high_span.end is None

    # The text of `gpushare status` and of `%gpu status` without widgets says the same,
    # one line a pause, within 80 columns.
    text = status_text(snapshot, width=80)
    _, _, rest = text.partition("pauses in the last 10 min:\n")
    assert rest, text
    (line,) = [x for x in rest.splitlines() if x.startswith("  GPU")]
    assert re.fullmatch(
        r"  GPU 0: L1 \(\w+, low\) paused \d+ s at level 0 \(gate\), \d+ s ago", line
    ), line
    assert max(len(x) for x in text.splitlines()) <= 80


def test_a_lease_that_ends_before_the_next_tick_keeps_its_label_on_the_dashboard(broker):
    """The label was set on the 5 s tick only: a short cell's lease had none in the
    dashboard's timeline, for its owner and for admins alike."""
    with BrokerClient(broker) as client:
        granted = client.request_lease(priority=150, memory_bytes=64 << 20, label="quick cell")
        assert isinstance(granted, Granted)
        client.release(granted.lease_id)
        history = client.history(device=0)

    (span,) = [s for d in history.devices for s in d.spans if s.lease_id == granted.lease_id]
    assert span.label == "quick cell" and span.end is not None
