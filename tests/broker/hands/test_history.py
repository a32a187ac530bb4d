"""The dashboard's hour: samples and spans kept bounded, kept across a restart, and
anonymised for other viewers as the status snapshot is."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from gpushare_ext.broker.edges.history_view import REPLY_BUDGET_BYTES, history_for
from gpushare_ext.broker.edges.views import OTHER_PROCESSES, anonymous_name, display_user
from gpushare_ext.broker.hands.history import (
    MAX_SAMPLES,
    OTHER_PROCESSES_UID,
    History,
    HistoryStore,
    Holding,
    Sample,
    history_path,
)
from gpushare_ext.broker.hands.timeline import Timeline
from gpushare_ext.broker.scheduler.core import Identity
from gpushare_ext.client import BrokerClient
from gpushare_ext.devices import DeviceInfo
from gpushare_ext.protocol import encode_json

ALICE = Identity(uid=1001, gid=1001, pid=11, user="alice")
BOB = Identity(uid=1002, gid=1002, pid=12, user="bob")
GIB = 1024**3


def sample(at: float, device: int = 0, *memory: Holding) -> Sample:
    return Sample(
        at=at, device_index=device, utilization_pct=int(at) % 100, queued=1, memory=memory
    )


def test_samples_older_than_the_window_are_forgotten_and_a_device_keeps_a_bounded_number():
    history = History(every_s=5.0, keep_s=60.0)
    for at in range(0, 200, 5):
        assert history.due(float(at))
        history.record([sample(float(at))], now=float(at))
        assert not history.due(at + 1.0)
    assert [s.at for s in history.samples(0, now=195.0)] == [float(t) for t in range(135, 200, 5)]
    assert history.samples(1, now=195.0) == []

    unbounded = History(every_s=0.0, keep_s=1e9)
    for at in range(MAX_SAMPLES + 50):
        unbounded.record([sample(float(at))], now=float(at))
    assert len(unbounded.samples(0, now=float(MAX_SAMPLES + 50))) == MAX_SAMPLES


def test_a_new_history_on_the_same_file_starts_with_the_last_hour(tmp_path: Path):
    path = history_path(tmp_path / "journal.sqlite")
    assert path == tmp_path / "journal-history.sqlite"
    now = 10_000.0
    store = HistoryStore(path)
    history = History(store, now=now - 4000)
    timeline = Timeline(store=store, now=now - 4000)
    held = Holding(ALICE.uid, "alice", "leased", 1024)
    history.record([sample(now - 3700, 0, held)], now=now - 3700)  # older than the hour
    history.record([sample(now - 10, 0, held), sample(now - 10, 1)], now=now - 10)
    timeline.granted("L1", ALICE, 50, 0, now=now - 30)
    timeline.labelled("L1", "train")
    timeline.paused("L1", 3, now=now - 20)
    timeline.resumed("L1", now=now - 15)
    timeline.granted("L2", BOB, 250, 0, now=now - 20)
    timeline.ended("L2", now=now - 5)
    assert store.load_spans(0.0) == []  # written when the broker's tick flushes
    timeline.flush()
    store.close()

    reopened = HistoryStore(path)
    again = History(reopened, now=now)
    assert [(s.at, s.memory) for s in again.samples(0, now)] == [(now - 10, (held,))]
    assert [s.at for s in again.samples(1, now)] == [now - 10]
    spans = {s.lease_id: s for s in Timeline(store=reopened, now=now).spans_kept(0, now)}
    first, second = spans["L1"], spans["L2"]
    assert (first.identity.uid, first.label, first.end) == (ALICE.uid, "train", None)
    assert [(p.start, p.end, p.level) for p in first.pauses] == [(now - 20, now - 15, 3)]
    assert (second.identity.user, second.priority, second.end) == ("bob", 250, now - 5)

    reopened.prune(now + 3600)  # an hour later, only the open span is left
    assert reopened.load_samples(0.0) == []
    assert [s.lease_id for s in reopened.load_spans(0.0)] == ["L1"]
    reopened.close()


def test_a_store_that_cannot_be_opened_leaves_the_history_in_memory(tmp_path: Path):
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "journal-history.sqlite"
    link.symlink_to(target)
    history = History(HistoryStore(link), every_s=1.0)
    history.record([sample(5.0)], now=5.0)
    assert [s.at for s in history.samples(0, now=6.0)] == [5.0]
    assert target.read_text() == ""


def fake_broker(now: float) -> SimpleNamespace:
    device = DeviceInfo(
        index=0,
        name="H200",
        uuid="GPU-0",
        memory_total_mib=143_771,
        multiprocessor_count=132,
        compute_capability=(9, 0),
        driver_version="test",
        mig_enabled=False,
        mig_pending=False,
        compute_mode=0,
    )
    history = History(every_s=5.0)
    timeline = Timeline()
    history.record(
        [
            sample(
                now - 5,
                0,
                Holding(ALICE.uid, "alice", "leased", 2048),
                Holding(BOB.uid, "bob", "outside", 512),
                Holding(BOB.uid, "bob", "parked", 256),
                Holding(OTHER_PROCESSES_UID, "", "outside", 100),
            )
        ],
        now=now - 5,
    )
    timeline.granted("L1", BOB, 50, 0, now=now - 30)
    timeline.labelled("L1", "<b>bob's secret</b>")
    timeline.paused("L1", 0, now=now - 20)
    timeline.granted("L2", ALICE, 250, 0, now=now - 20)
    return SimpleNamespace(
        devices=[device],
        readings={},
        scheduler=None,
        timeline=timeline,
        gpu_history=history,
        salt="pepper",
    )


def viewed_by(broker: SimpleNamespace, viewer: SimpleNamespace):
    def seen_as(identity: Identity | None) -> str:
        return OTHER_PROCESSES if identity is None else display_user(broker, identity, viewer)  # type: ignore[arg-type]

    return history_for(broker, viewer, None, seen_as)  # type: ignore[arg-type]


def test_other_users_are_anonymised_and_their_labels_left_out_as_in_the_snapshot():
    broker = fake_broker(time.time())
    alice = SimpleNamespace(uid=ALICE.uid, user="alice", is_admin=False)
    reply = viewed_by(broker, alice)
    (device,) = reply.devices
    bob_seen = anonymous_name("pepper", BOB.uid)
    users = {(s.user, s.kind, s.own, s.mib[-1]) for s in device.memory}
    assert users == {
        ("alice", "leased", True, 2048),
        (bob_seen, "outside", False, 512),
        (bob_seen, "parked", False, 256),
        (OTHER_PROCESSES, "outside", False, 100),
    }
    spans = {s.lease_id: s for s in device.spans}
    assert (spans["L1"].user, spans["L1"].label, spans["L1"].own) == (bob_seen, "", False)
    assert spans["L1"].pauses[0].level == 0 and spans["L2"].own
    assert "bob" not in encode_json(reply).decode().replace(bob_seen, "")

    admin = SimpleNamespace(uid=0, user="root", is_admin=True)
    seen = {s.lease_id: s for s in viewed_by(broker, admin).devices[0].spans}
    assert (seen["L1"].user, seen["L1"].label) == ("bob", "<b>bob's secret</b>")


def test_a_reply_for_a_full_hour_of_many_users_is_thinned_to_fit_a_frame():
    now = time.time()
    broker = fake_broker(now)
    broker.gpu_history = History(every_s=5.0)
    many = tuple(Holding(2000 + u, f"user{u}", "leased", 1000 + u) for u in range(100))
    for at in range(720):
        broker.gpu_history.record([sample(now - 3600 + at * 5, 0, *many)], now=now - 3600 + at * 5)
    reply = viewed_by(broker, SimpleNamespace(uid=0, user="root", is_admin=True))
    assert len(encode_json(reply)) <= REPLY_BUDGET_BYTES
    assert reply.sample_every_s > 5.0
    assert reply.devices[0].times[-1] == now - 3600 + 719 * 5  # the latest stays


def test_a_broker_serves_its_hour_and_a_restarted_one_serves_it_again(start_broker):
    broker = start_broker()
    client = BrokerClient(broker.socket)
    grant = client.request_lease(priority=50, memory_bytes=10 * GIB, label="train")
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        history = client.history()
        device = history.devices[0]
        if device.spans and device.spans[0].label and any(s.mib[-1] for s in device.memory):
            break
        time.sleep(0.5)
    assert history.window_s == 3600.0 and history.you
    assert device.name and device.times and len(device.times) == len(device.utilization_pct)
    (span,) = device.spans
    assert (span.lease_id, span.label, span.own, span.end) == (grant.lease_id, "train", True, None)
    leased = [s for s in device.memory if s.kind == "leased"]
    assert leased and leased[0].own and leased[0].mib[-1] == 10 * 1024
    before = device.times
    client.release(grant.lease_id)
    client.close()
    broker.stop()

    again = start_broker(directory=broker.directory)
    with BrokerClient(again.socket) as later:
        device = later.history(device=0).devices[0]
    assert [s.lease_id for s in device.spans] == [grant.lease_id]
    assert device.spans[0].end is not None
    assert before[0] in device.times  # the first broker's samples, served by the second
