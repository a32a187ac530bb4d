"""The broker's side of the dashboard: samples taken on the tick, and the hour a viewer may see.

What it is for: :func:`record_tick` reads what the tick already has (the readings, the
scheduler's leases, the queue) into one :class:`~gpushare_ext.broker.hands.history.Sample`
per GPU every few seconds, and :func:`history_for` answers a
:class:`~gpushare_ext.protocol.HistoryRequest` from the kept hour.  What leaves here is
anonymised by the caller's ``seen_as`` (the request handler passes the status
snapshot's own :func:`~gpushare_ext.broker.edges.views.display_user`: other users are
``user-xxxx``, admins see names) and labels are sent only to their owner and to
admins, as plain text.  A reply stays within a frame: the samples of many
GPUs are thinned and the oldest spans left out until it fits.

What it must not do: change broker state (it only reads it, and records into the
history and the timeline's labels), block the loop (a sample is a pass over the active
leases once every few seconds, never per request), or import the broker's server or
views: it reads the broker through :class:`HistorySource`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from gpushare_ext.broker.hands.history import (
    OTHER_PROCESSES_UID,
    History,
    Holding,
    HoldingKind,
    Sample,
)
from gpushare_ext.broker.hands.inventory import MIB, DeviceReading
from gpushare_ext.broker.hands.peers import Connection
from gpushare_ext.broker.hands.timeline import Span, Timeline
from gpushare_ext.broker.scheduler import core
from gpushare_ext.devices import DeviceInfo
from gpushare_ext.plain_text import plain_text
from gpushare_ext.protocol import (
    MAX_FRAME_BYTES,
    DeviceHistory,
    GpuHistory,
    HistorySpan,
    LeaseState,
    MemorySeries,
    TimelinePause,
    encode_json,
    split_member_id,
)

__all__ = [
    "REPLY_BUDGET_BYTES",
    "HistorySource",
    "SeenAs",
    "close_history",
    "history_for",
    "record_tick",
    "take_samples",
]

# How a viewer sees the user of an identity (None: processes of no session).
SeenAs = Callable[[core.Identity | None], str]


class HistorySource(Protocol):
    """What of the broker the history reads (the broker itself, in practice)."""

    devices: list[DeviceInfo]
    readings: dict[int, DeviceReading]
    scheduler: core.Scheduler
    timeline: Timeline
    gpu_history: History


REPLY_BUDGET_BYTES = MAX_FRAME_BYTES * 3 // 4  # room for the envelope and a margin
ANY_DEVICE = ("", "auto", "any")


def _queued_for(broker: HistorySource) -> dict[int, int]:
    """Requests waiting (a gang once) that name each GPU or any GPU."""
    indexes = [d.index for d in broker.devices]
    counts = dict.fromkeys(indexes, 0)
    seen: set[str] = set()
    for lease in broker.scheduler.queue():
        request = lease.gang or lease.lease_id
        if lease.state != LeaseState.QUEUED or request in seen:
            continue
        seen.add(request)
        wish = lease.device_wish.strip().lower()
        for index in indexes if wish in ANY_DEVICE else [i for i in indexes if str(i) == wish]:
            counts[index] += 1
    return counts


def _holdings(broker: HistorySource) -> dict[int, tuple[Holding, ...]]:
    """The memory each user holds on each GPU, by kind, in MiB."""
    scheduler = broker.scheduler
    held: dict[int, dict[tuple[int, str, HoldingKind], int]] = {d.index: {} for d in broker.devices}

    def add(device: int, identity: core.Identity | None, kind: HoldingKind, size: int) -> None:
        uid, user = (OTHER_PROCESSES_UID, "") if identity is None else (identity.uid, identity.user)
        per_device = held.setdefault(device, {})
        per_device[uid, user, kind] = per_device.get((uid, user, kind), 0) + size

    for lease in scheduler.active_leases():
        slot = scheduler.slots.get(lease.slot or "")
        if slot is None:
            continue
        if lease.parks_session:
            add(slot.device_index, lease.identity, "parked", lease.memory_bytes)
        elif lease.state in (LeaseState.RUNNING, LeaseState.PAUSED):
            add(slot.device_index, lease.identity, "leased", lease.memory_bytes)
    identities: dict[int, core.Identity] | None = None
    for device in broker.devices:
        for slot in scheduler.slots_of_device(device.index):
            outside = scheduler.unleased_by_pid(slot.key)
            if outside and identities is None:
                identities = {r.identity.pid: r.identity for r in scheduler.sessions.values()}
            for pid, size in outside.items():
                add(device.index, (identities or {}).get(pid), "outside", size)
    return {
        device: tuple(
            Holding(uid, user, kind, size // MIB)
            for (uid, user, kind), size in sorted(per_device.items())
            if size >= MIB
        )
        for device, per_device in held.items()
    }


def take_samples(broker: HistorySource, now: float) -> list[Sample]:
    """One sample per GPU of the broker, as it is at ``now``."""
    queued = _queued_for(broker)
    holdings = _holdings(broker)
    samples = []
    for device in broker.devices:
        reading = broker.readings.get(device.index)
        samples.append(
            Sample(
                at=round(now, 3),
                device_index=device.index,
                utilization_pct=reading.utilization_pct if reading else 0,
                queued=queued.get(device.index, 0),
                memory=holdings.get(device.index, ()),
            )
        )
    return samples


def record_tick(broker: HistorySource, now: float) -> None:
    """The tick's part: the timeline's changes to the store; every few seconds, a sample
    per GPU, open spans get their lease's label, and spans a previous broker left open
    end if their lease is gone."""
    history = broker.gpu_history
    broker.timeline.flush()
    if not history.due(now):
        return
    leases = broker.scheduler.leases
    for lease_id in broker.timeline.open_lease_ids():
        lease = leases.get(lease_id)
        if lease is None:
            broker.timeline.ended(lease_id, now)
        elif lease.label:
            broker.timeline.labelled(lease_id, lease.label)
    history.record(take_samples(broker, now), now)
    broker.timeline.flush()  # the labels and ends just set


def close_history(broker: HistorySource) -> None:
    """The broker stops: what the timeline has not written yet goes to the store first."""
    broker.timeline.flush()
    broker.gpu_history.close()


def _series_of(
    samples: list[Sample], viewer: Connection | None, seen_as: SeenAs
) -> list[MemorySeries]:
    """Each (user as the viewer sees them, kind) as a column aligned with the samples."""
    columns: dict[tuple[str, HoldingKind], MemorySeries] = {}
    for i, sample in enumerate(samples):
        for holding in sample.memory:
            identity = None
            if holding.uid != OTHER_PROCESSES_UID:
                identity = core.Identity(uid=holding.uid, gid=0, pid=0, user=holding.user)
            user = seen_as(identity)
            series = columns.get((user, holding.kind))
            if series is None:
                own = identity is not None and viewer is not None and viewer.uid == identity.uid
                series = columns[user, holding.kind] = MemorySeries(
                    user=user, own=own, kind=holding.kind, mib=[0] * len(samples)
                )
            series.mib[i] += holding.mib
    return sorted(columns.values(), key=lambda s: (s.kind, not s.own, s.user))


def _rounded(at: float | None) -> float | None:
    return None if at is None else round(at, 3)


def _span_view(span: Span, viewer: Connection | None, seen_as: SeenAs) -> HistorySpan:
    own = viewer is not None and viewer.uid == span.identity.uid
    gang, rank = split_member_id(span.lease_id) or ("", None)
    pauses = [
        TimelinePause(start=round(p.start, 3), end=_rounded(p.end), level=p.level)
        for p in span.pauses
    ]
    return HistorySpan(
        lease_id=span.lease_id,
        user=seen_as(span.identity),
        own=own,
        priority=span.priority,
        start=round(span.start, 3),
        end=_rounded(span.end),
        pauses=pauses,
        gang=gang,
        rank=rank,
        label=plain_text(span.label) if viewer is None or own or viewer.is_admin else "",
    )


def _device_history(
    broker: HistorySource,
    device: DeviceInfo,
    view: tuple[Connection | None, SeenAs],
    now: float,
    thinning: tuple[int, int],
) -> DeviceHistory:
    viewer, seen_as = view
    step, spans = thinning
    samples = broker.gpu_history.samples(device.index, now)
    if step > 1:  # thinned from the newest back, so the latest sample is always there
        samples = samples[::-1][::step][::-1]
    kept = broker.timeline.spans_kept(device.index, now)[-spans:]
    return DeviceHistory(
        index=device.index,
        name=device.name,
        memory_total_mib=device.memory_total_mib,
        times=[s.at for s in samples],
        utilization_pct=[s.utilization_pct for s in samples],
        queued=[s.queued for s in samples],
        memory=_series_of(samples, viewer, seen_as),
        spans=[_span_view(span, viewer, seen_as) for span in kept],
    )


MOST_THINNING = 64  # at most every 64th sample (one each 5 min): still an hour's shape


def history_for(
    broker: HistorySource, viewer: Connection | None, device: int | None, seen_as: SeenAs
) -> GpuHistory:
    """The last hour of every GPU (or of ``device``) as ``viewer`` may see it (names as
    ``seen_as`` gives them), thinned until it fits a frame."""
    now = time.time()
    history = broker.gpu_history
    devices = [d for d in broker.devices if device is None or d.index == device]
    step, spans = 1, broker.timeline.keep_spans
    while True:
        reply = GpuHistory(
            time=now,
            window_s=history.keep_s,
            sample_every_s=history.every_s * step,
            you=plain_text(viewer.user) if viewer else "",
            is_admin=bool(viewer and viewer.is_admin),
            devices=[
                _device_history(broker, d, (viewer, seen_as), now, (step, spans)) for d in devices
            ],
        )
        if len(encode_json(reply)) <= REPLY_BUDGET_BYTES or (step >= MOST_THINNING and spans <= 1):
            return reply
        step, spans = min(step * 2, MOST_THINNING), max(1, spans // 2)
