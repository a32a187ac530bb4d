"""What a client sees of the broker: the status snapshot, from one viewer's point of view.

Users see their own leases in full; others appear as ``user-xxxx`` (a salted hash of
the uid) without pid, notebook or label; admins see everything.  The snapshot feeds
``gpushare status``, the widget and the JupyterLab panel.  What people wrote (labels,
notebook and user names, reasons that quote a session's note) leaves here as
:func:`~gpushare_ext.plain_text.plain_text` makes it: one line, every character shown
as itself, so every viewer gets the same harmless text.  The once-a-second tick reads
:func:`tally` instead: counts of the active leases in one pass, without a view of each
(a snapshot of a thousand leases held up the event loop for 10-15 ms).

It reads the :class:`~gpushare_ext.broker.edges.context.BrokerContext` and changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field

from gpushare_ext.broker.edges.context import BrokerContext
from gpushare_ext.broker.edges.metrics import DeviceMemory
from gpushare_ext.broker.hands.inventory import MIB
from gpushare_ext.broker.hands.peers import Connection
from gpushare_ext.broker.scheduler import core
from gpushare_ext.devices import DeviceInfo
from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import (
    DeviceView,
    LeaseState,
    LeaseView,
    Snapshot,
    TimelinePause,
    TimelineSpan,
    priority_class,
    split_member_id,
)

DETACHED_NOTE = "waiting for its notebook to reconnect after a broker restart"


def anonymous_name(salt: str, uid: int) -> str:
    digest = hashlib.sha256(f"{salt}:{uid}".encode()).hexdigest()
    return f"user-{digest[:4]}"


def display_user(ctx: BrokerContext, identity: core.Identity, viewer: Connection | None) -> str:
    """``identity``'s user as ``viewer`` may see it: the name (as plain text: account
    names come from a directory service others may write) or ``user-xxxx``."""
    if viewer is None or viewer.is_admin or viewer.uid == identity.uid:
        return plain_text(identity.user)
    return anonymous_name(ctx.salt, identity.uid)


def _level_of(ctx: BrokerContext, lease: core.Lease) -> int | None:
    """The rung that holds the lease (a simulated GPU's gate), as the cell says it."""
    level = lease.stop.in_force
    return None if level is None else int(ctx.scheduler.rung_holding(level))


def _estimate_left(lease: core.Lease, now: float) -> float | None:
    """A queued lease's estimate, counted down to now.  The panel says a used-up estimate
    is the holder's usual time run out; one of memory being freed has no holder, so once
    used up it is left out (the reason still says what is being freed)."""
    if lease.estimate_s is None or lease.state != LeaseState.QUEUED:
        return None
    left = round(max(0.0, lease.estimate_s - (now - lease.estimated_at)), 1)
    return None if lease.freeing_bytes and left < 1.0 else left


def _lease_view(
    ctx: BrokerContext,
    lease: core.Lease,
    viewer: Connection | None,
    position: int | None,
    now: float,
) -> LeaseView:
    scheduler = ctx.scheduler
    own = viewer is not None and viewer.uid == lease.identity.uid
    detailed = viewer is None or own or viewer.is_admin
    slot = scheduler.slots.get(lease.slot or "")
    session = scheduler.sessions.get(lease.session_id)
    reason = lease.reason
    if lease.detached:
        reason = f"{reason}; {DETACHED_NOTE}" if reason else DETACHED_NOTE
    note = ctx.notes.get(lease.lease_id)
    if note:
        reason = f"{reason} ({note})" if reason else note
    return LeaseView(
        lease_id=lease.lease_id,
        user=display_user(ctx, lease.identity, viewer),
        own=own,
        priority=lease.base_priority,
        state=lease.state,
        device_index=slot.device_index if slot else None,
        mig_uuid=slot.mig_uuid if slot else None,
        memory_bytes=lease.memory_bytes,
        sm_share=lease.sm_share,
        since_s=round(now - lease.state_since, 3),
        waited_s=round(lease.waited_s if lease.granted_at else now - lease.requested_at, 3),
        position=position,
        reason=plain_text(reason, SENTENCE_LIMIT),
        label=plain_text(lease.label) if detailed else "",
        pid=lease.identity.pid if detailed else None,
        notebook=plain_text(session.notebook if session else "") if detailed else "",
        preemption_level=_level_of(ctx, lease),
        estimate_s=_estimate_left(lease, now),
        gang=lease.gang or "",
        rank=lease.rank if lease.gang else None,
    )


OTHER_PROCESSES = "other processes"


def _outside_leases(ctx: BrokerContext, key: str, viewer: Connection | None) -> dict[str, int]:
    """Memory held on slot ``key`` beyond the leases, in MiB per user as ``viewer`` may
    see them; processes of no session are "other processes"."""
    scheduler = ctx.scheduler
    outside = scheduler.unleased_by_pid(key)
    if not outside:  # the usual case: no walk over every session for each snapshot
        return {}
    identities = {record.identity.pid: record.identity for record in scheduler.sessions.values()}
    per_user: dict[str, int] = {}
    for pid, extra in outside.items():
        identity = identities.get(pid)
        who = OTHER_PROCESSES if identity is None else display_user(ctx, identity, viewer)
        per_user[who] = per_user.get(who, 0) + extra // MIB
    return {who: mib for who, mib in per_user.items() if mib > 0}


def _outside_leases_of_device(
    ctx: BrokerContext, device: DeviceInfo, viewer: Connection | None
) -> dict[str, int]:
    """:func:`_outside_leases` of a whole GPU, or summed over its MIG instances."""
    keys = [slot.key for slot in ctx.scheduler.slots_of_device(device.index)]
    if len(keys) == 1:
        return _outside_leases(ctx, keys[0], viewer)
    total: dict[str, int] = {}
    for key in keys:
        for who, mib in _outside_leases(ctx, key, viewer).items():
            total[who] = total.get(who, 0) + mib
    return total


def _device_views(ctx: BrokerContext, viewer: Connection | None, now: float) -> list[DeviceView]:
    scheduler = ctx.scheduler
    views = []
    for device in ctx.devices:
        reading = ctx.readings.get(device.index)
        leased = 0
        holders = []
        for lease in scheduler.active_leases():
            slot = scheduler.slots.get(lease.slot or "")
            if slot is None or slot.device_index != device.index:
                continue
            if lease.state in (LeaseState.RUNNING, LeaseState.PAUSED):
                leased += lease.memory_bytes
                holders.append(lease.lease_id)
        views.append(
            DeviceView(
                info=device,
                drained=device.index in scheduler.drained,
                memory_used_mib=reading.memory_used_mib if reading else 0,
                memory_leased_mib=leased // MIB,
                utilization_pct=reading.utilization_pct if reading else 0,
                utilization_history=list(ctx.history.get(device.index, ())),
                holders=holders,
                memory_outside_leases_mib=_outside_leases_of_device(ctx, device, viewer),
                timeline=_timeline(ctx, device.index, viewer, now),
            )
        )
    return views


def _timeline(
    ctx: BrokerContext, device_index: int, viewer: Connection | None, now: float
) -> list[TimelineSpan]:
    # A span outlives its lease (the panel shows ended ones too), so its gang is read
    # from its id, which names it, rather than from the core's lease record.
    return [
        TimelineSpan(
            lease_id=span.lease_id,
            user=display_user(ctx, span.identity, viewer),
            own=viewer is not None and viewer.uid == span.identity.uid,
            priority=span.priority,
            start=round(span.start, 3),
            end=None if span.end is None else round(span.end, 3),
            pauses=[
                TimelinePause(
                    start=round(p.start, 3),
                    end=None if p.end is None else round(p.end, 3),
                    level=p.level,
                )
                for p in span.pauses
            ],
            gang=membership[0] if membership else "",
            rank=membership[1] if membership else None,
        )
        for span in ctx.timeline.spans(device_index, now)
        for membership in [split_member_id(span.lease_id)]
    ]


def _notes(ctx: BrokerContext) -> list[str]:
    notes = []
    if ctx.inventory.kind == "simulated":
        notes.append(ctx.inventory.description)
        if ctx.inventory_note:
            notes.append(ctx.inventory_note)
    if ctx.simulated_control:
        notes.append(
            "simulated GPU: preemption gates the session's launch points; no process is locked"
        )
    unpausable: dict[str, int] = {}  # request (a gang's id for its ranks) -> leases
    for lease in ctx.scheduler.active_leases():
        if not lease.lockable:
            request = lease.gang or lease.lease_id
            unpausable[request] = unpausable.get(request, 0) + 1
    for request, count in unpausable.items():
        what = f"lease {request}" if count == 1 else f"gang {request} ({count} ranks)"
        notes.append(
            f"{what} cannot be paused (checkpoint lock unsupported, e.g. an MPS client): "
            "it time-slices"
        )
    for runner in ctx.chaos.values():  # everyone sees it: their GPU time is shared with it
        notes.append(runner.describe())
    return notes


def snapshot(ctx: BrokerContext, viewer: Connection | None) -> Snapshot:
    """The whole picture as ``viewer`` may see it (None: everything, for metrics)."""
    now = time.time()
    scheduler = ctx.scheduler
    queue_counts = {"low": 0, "normal": 0, "high": 0}
    positions: dict[str, int] = {}
    requests: dict[str, int] = {}  # a gang queues as one request: its ranks share a place
    for lease in scheduler.queue():
        if lease.state == LeaseState.QUEUED:
            request = lease.gang or lease.lease_id
            if request not in requests:
                requests[request] = len(requests) + 1
                queue_counts[priority_class(lease.base_priority)] += 1
            positions[lease.lease_id] = requests[request]
    leases = [
        _lease_view(ctx, lease, viewer, positions.get(lease.lease_id), now)
        for lease in sorted(scheduler.active_leases(), key=lambda item: item.arrival)
    ]
    return Snapshot(
        host=os.uname().nodename,
        node=ctx.node,
        broker_pid=os.getpid(),
        mode=ctx.paths.mode,
        inventory=ctx.inventory.kind,
        inventory_description=ctx.inventory.description,
        time=now,
        you=plain_text(viewer.user) if viewer else "",
        is_admin=bool(viewer and viewer.is_admin),
        devices=_device_views(ctx, viewer, now),
        leases=leases,
        queue_by_priority=queue_counts,
        notes=_notes(ctx),
        timeline_window_s=ctx.timeline.window_s,
    )


@dataclass(kw_only=True)
class Tally:
    """The active leases counted, per state, per queued priority class and per device."""

    by_state: dict[str, int] = field(default_factory=dict)
    queued: Counter[str] = field(default_factory=Counter)  # priority class -> queued leases
    leased_bytes: Counter[int] = field(default_factory=Counter)  # device -> running, paused
    leased_mib: Counter[int] = field(default_factory=Counter)  # the same, each lease in whole MiB
    busy: set[int] = field(default_factory=set)  # devices with a running lease

    def device_memory(self, ctx: BrokerContext) -> list[DeviceMemory]:
        """Memory used, leased and in all per device, as the snapshot's device views say."""
        rows = []
        for device in ctx.devices:
            reading = ctx.readings.get(device.index)
            rows.append(
                DeviceMemory(
                    index=device.index,
                    used_bytes=(reading.memory_used_mib if reading else 0) * MIB,
                    leased_bytes=self.leased_bytes[device.index] // MIB * MIB,
                    total_bytes=device.memory_total_mib * MIB,
                )
            )
        return rows


def tally(ctx: BrokerContext) -> Tally:
    """The counts the tick needs (gauges, simulated usage), in one pass over the leases.

    It compares states with local names rather than keying dicts by them: an enum's
    members are slow to look up and to hash, and this runs over every lease."""
    scheduler = ctx.scheduler
    queued_state, running_state, paused_state, evicted_state = (
        LeaseState.QUEUED, LeaseState.RUNNING, LeaseState.PAUSED, LeaseState.EVICTED,
    )  # fmt: skip
    running = paused = evicted = 0
    queued: list[int] = []  # their base priorities
    slots: dict[str | None, list[int]] = {}  # slot -> [bytes, whole MiB, running leases]
    for lease in scheduler.leases.values():
        state = lease.state
        if state == running_state:
            running += 1
        elif state == paused_state:
            paused += 1
        else:
            if state == queued_state:
                queued.append(lease.base_priority)
            elif state == evicted_state:
                evicted += 1
            continue
        load = slots.get(lease.slot)
        if load is None:
            load = slots[lease.slot] = [0, 0, 0]
        load[0] += lease.memory_bytes
        load[1] += lease.memory_bytes // MIB
        load[2] += state == running_state
    counts = Tally(
        by_state={
            LeaseState.QUEUED.value: len(queued),
            LeaseState.RUNNING.value: running,
            LeaseState.PAUSED.value: paused,
            LeaseState.EVICTED.value: evicted,
        },
        queued=Counter(priority_class(priority) for priority in queued),
    )
    for key, (held, held_mib, holders_running) in slots.items():
        slot = scheduler.slots.get(key or "")
        if slot is None:
            continue
        counts.leased_bytes[slot.device_index] += held
        counts.leased_mib[slot.device_index] += held_mib
        if holders_running:
            counts.busy.add(slot.device_index)
    return counts
