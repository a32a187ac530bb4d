"""Properties of the scheduler core over generated days of a busy hub (hypothesis).

A generated *script* opens and closes sessions, requests leases of random priority,
memory, SM share, slice and device wish (some instrumented, some not lockable),
releases them, confirms or fails the preemptions the core asked for, reports memory
use to the watchdog, drains devices and lets time pass.  After every event we check:

* never over capacity: the memory of the running and paused leases of a slot fits it;
* a higher band never waits behind a lower one longer than one preemption: no queued
  lease has a slot it could take by preempting (every holder is of a lower band,
  stoppable, evictable and not already being stopped, and no waiter ranked ahead of it
  wants that slot) -- such a lease is granted, or waits for exactly one eviction;
* every request ends granted, refused with a reason, or with its session;
* replaying the same events gives the same actions;
* the core's index (per slot, per user, per process) equals one recomputed from the
  leases, and a slot's aggregates judge every waiter as its running leases do;
* a gang (one request for several ranks) never runs in part: all its ranks run or none
  does, unless one of them could not be paused (then all run, time-sliced); and every
  gang is granted or ended by the time everyone's work is done, so two gangs never
  deadlock holding parts of what each other needs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_helpers import GIB, LOW, NORMAL, fingerprint, h200_document, may_ask_band

from gpushare_ext.broker.hands.inventory import parse_inventory
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.gangs import split_member_id
from gpushare_ext.broker.scheduler.parking import HostMemory
from gpushare_ext.broker.settings.policy import Limits, Policy
from gpushare_ext.protocol import Capabilities, LeaseState, PreemptionLevel, RequestLease, SliceWish
from gpushare_ext.units import priority_band

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def two_devices() -> list:
    """Device 0: a whole H200.  Device 1: an H200 cut into 3g + 2g + 1g MIG instances."""
    document = h200_document()
    whole = document["devices"][0]
    cut = dict(whole)
    cut.update(
        index=1,
        uuid="GPU-11111111-1111-1111-1111-111111111111",
        mig_mode={"current": 1, "pending": 1},
        mig_instances=[
            {"profile_id": 2, "start": 0, "gpu_instance_id": 1},
            {"profile_id": 1, "start": 4, "gpu_instance_id": 5},
            {"profile_id": 0, "start": 6, "gpu_instance_id": 6},
        ],
    )
    return parse_inventory({"devices": [whole, cut]}, simulated=True)


DEVICES = two_devices()
USERS = [("ada", ("staff",)), ("bo", ("students",)), ("cy", ("students", "staff")), ("di", ())]
MEMORY_CHOICES = [None, 1 * GIB, 8 * GIB, 15 * GIB, 30 * GIB, 60 * GIB, 100 * GIB, 139 * GIB]
CAPABILITIES = [
    Capabilities(),
    Capabilities(instrumented_only=True, yield_flag=True, gate=True),
    Capabilities(instrumented_only=True, gate=True),
    Capabilities(lockable=False),
    Capabilities(gate=True),
]
DEVICE_WISHES = ["auto", "auto", "auto", "0", "1", DEVICES[1].instances[1].uuid, "9"]

policies = st.builds(
    lambda sharing, aging, quota, students_max: Policy(
        sharing=sharing,
        defaults=Limits(aging_per_minute=aging, memory_quota=quota, max_leases=6),
        groups={"students": {"max_priority": students_max}},
    ),
    sharing=st.sampled_from(["timeslice", "timeslice", "exclusive"]),
    aging=st.sampled_from([0.0, 10.0, 120.0]),
    quota=st.sampled_from([1 << 50, 64 * GIB]),
    students_max=st.sampled_from(["normal", "high", 120]),
)

gaps = st.sampled_from([0.0, 0.0, 0.5, 5.0, 30.0, 120.0])
requests = st.tuples(
    st.just("request"),
    gaps,
    st.integers(0, 50),  # which open session
    st.one_of(st.sampled_from([LOW, NORMAL, 250]), st.integers(0, 299)),
    st.sampled_from(MEMORY_CHOICES),
    st.sampled_from([1.0, 1.0, 0.5, 0.25]),
    st.sampled_from([SliceWish.AUTO] * 3 + list(SliceWish)),
    st.sampled_from(DEVICE_WISHES),
    st.sampled_from(CAPABILITIES),
)
gangs = st.tuples(
    st.just("gang"),
    gaps,
    st.integers(0, 50),
    st.sampled_from([LOW, NORMAL, 250]),
    st.sampled_from([1 * GIB, 15 * GIB, 30 * GIB, 60 * GIB]),
    st.sampled_from([1.0, 0.5, 0.25]),
    st.sampled_from([SliceWish.AUTO, SliceWish.AUTO, SliceWish.MIG, SliceWish.SHARED]),
    st.sampled_from(CAPABILITIES),
    st.integers(2, 4),
)
ops = st.one_of(
    requests,
    requests,
    requests,
    gangs,
    st.tuples(st.just("open"), gaps, st.integers(0, len(USERS) - 1)),
    st.tuples(st.just("close"), gaps, st.integers(0, 50)),
    st.tuples(st.just("release"), gaps, st.integers(0, 50)),
    st.tuples(st.just("release"), gaps, st.integers(0, 50)),
    st.tuples(st.just("release_unknown"), gaps),
    st.tuples(st.just("confirm"), gaps, st.integers(0, 50), st.booleans()),
    st.tuples(st.just("confirm"), gaps, st.integers(0, 50), st.just(True)),
    st.tuples(st.just("confirm"), gaps, st.integers(0, 50), st.just(True)),
    st.tuples(st.just("tick"), gaps),
    st.tuples(st.just("memory"), gaps, st.integers(0, 50)),
    st.tuples(st.just("drain"), gaps, st.integers(0, 1), st.booleans()),
    # NVML's per-process reading of the whole GPU: some sessions' processes (leased or
    # idle) and a process the broker does not know, each holding some GiB.
    st.tuples(
        st.just("seen"),
        gaps,
        st.lists(st.tuples(st.integers(0, 50), st.sampled_from([0, 1, 8, 30, 60])), max_size=3),
        st.sampled_from([0, 0, 2, 20, 70]),
    ),
    # The host's memory (parking needs room there), a plain cell starting or ending in a
    # session (never parked while it runs), and a parked session asking for its memory.
    st.tuples(st.just("host"), gaps, st.sampled_from([0, 50, 900])),
    st.tuples(st.just("activity"), gaps, st.integers(0, 50), st.booleans()),
    st.tuples(st.just("restore"), gaps, st.integers(0, 50), st.booleans()),
)
openings = st.lists(
    st.tuples(st.just("open"), st.just(0.0), st.integers(0, len(USERS) - 1)), min_size=2, max_size=5
)
scripts = st.builds(
    lambda first, rest: first + rest, openings, st.lists(ops, min_size=20, max_size=80)
)


# ------------------------------------------------------------------ the invariants


def _declared_on(scheduler: core.Scheduler, key: str, *, grants_only: bool = False) -> int:
    return sum(
        lease.memory_bytes
        for lease in scheduler.leases.values()
        if lease.slot == key
        and lease.state in (LeaseState.RUNNING, LeaseState.PAUSED)
        and not (grants_only and lease.parks_session)
    )


def check_capacity(scheduler: core.Scheduler) -> None:
    """Granted memory never exceeds a slot.  A park lease is left out: it declares what
    NVML saw an idle session hold (memory on the GPU already, not a grant), and leases
    declare quotas, not use, so the two together may pass the slot's size."""
    for key, slot in scheduler.slots.items():
        held = _declared_on(scheduler, key, grants_only=True)
        assert held <= slot.memory_bytes, f"slot {key} over capacity: {held} > {slot.memory_bytes}"


def check_grants_fit_what_is_seen(scheduler: core.Scheduler, actions: list) -> None:
    """A grant never takes memory that NVML shows held by processes no lease accounts
    for (idle notebooks, unknown processes): leases plus that memory fit the slot."""
    for grant in (a for a in actions if isinstance(a, core.GrantLease)):
        ranks = [r.lease_id for r in grant.ranks] or [grant.lease_id]
        keys = {scheduler.leases[lease_id].slot for lease_id in ranks}
        assert None not in keys
        for key in sorted(keys):  # type: ignore[type-var]
            _check_slot_fits_what_is_seen(scheduler, key)


def _check_slot_fits_what_is_seen(scheduler: core.Scheduler, key: str) -> None:
    held = _declared_on(scheduler, key) + scheduler.unleased_memory(key)
    assert held <= scheduler.slots[key].memory_bytes, (
        f"a grant onto slot {key}: {held} bytes held with what is seen beyond the leases, "
        f"{scheduler.slots[key].memory_bytes} there"
    )


def _wanted_slots(scheduler: core.Scheduler, lease: core.Lease) -> set[str]:
    """The slots a waiter keeps lower-ranked waiters off (what the core reserves for it)."""
    if lease.pending_level is not None:
        return {lease.slot} if lease.slot else set()
    if lease.awaiting_memory_from:
        return {lease.target_slot} if lease.target_slot else set()
    if lease.slot is not None:
        return {lease.slot}
    keys, _ = scheduler.finder.candidate_slots(lease.device_wish, lease.slice)
    return {
        k
        for k in keys
        if scheduler.slots[k].memory_bytes >= lease.memory_bytes
        and scheduler.slots[k].device_index not in scheduler.drained
    }


def check_no_needless_wait(scheduler: core.Scheduler) -> None:
    """A queued lease never waits behind lower-band leases it could simply preempt."""
    now = scheduler.now
    waiters = scheduler.queue()
    for lease in waiters:
        if lease.state != LeaseState.QUEUED or lease.gang is not None:
            continue  # a gang needs all its slots at once: its own property covers it
        if lease.awaiting_memory_from:
            # Waiting for exactly one round of evictions, all of lower-band leases.
            band = priority_band(scheduler.book.effective(lease, now))
            for victim_id in lease.awaiting_memory_from:
                victim = scheduler.leases[victim_id]
                if victim.parks_session:  # an idle session of its band or lower
                    assert priority_band(victim.running_priority()) <= band
                else:
                    assert priority_band(victim.running_priority()) < band
                assert victim.pending_level == PreemptionLevel.EVICT
            continue
        key = scheduler.book.queue_key(lease, now)
        band = priority_band(scheduler.book.effective(lease, now))
        reserved: set[str] = set()
        for other in waiters:
            if (
                other is not lease
                and not other.held_by_watchdog
                and scheduler.book.queue_key(other, now) < key
            ):
                reserved |= _wanted_slots(scheduler, other)
        for slot in _wanted_slots(scheduler, lease) - reserved:
            holders = [
                other
                for other in scheduler.leases.values()
                if other.slot == slot and other.state in (LeaseState.RUNNING, LeaseState.PAUSED)
            ]
            takeable = all(
                priority_band(h.running_priority()) < band
                and h.pending_level is None
                and h.lockable
                and h.evictable
                for holder in holders
                # A rank is stopped with its whole gang: every rank must allow it.
                for h in scheduler.book.members(holder.lease_id)
                if h is holder or h.state == LeaseState.RUNNING
            )
            # Memory no lease accounts for is not freed by preempting (parking frees it).
            free_after = scheduler.slots[slot].memory_bytes - scheduler.unleased_memory(slot, lease)
            takeable = takeable and lease.memory_bytes <= free_after
            assert not takeable, (
                f"lease {lease.lease_id} (effective band {band}) waits although slot {slot} "
                f"is held only by preemptable lower-band leases "
                f"{[(h.lease_id, h.state, h.running_priority()) for h in holders]}"
            )


def check_bookkeeping(scheduler: core.Scheduler) -> None:
    for lease in scheduler.leases.values():
        assert lease.state in core.ACTIVE_STATES
        assert lease.session_id in scheduler.sessions
        assert lease.lease_id in scheduler.sessions[lease.session_id].leases
        if lease.state in (LeaseState.RUNNING, LeaseState.PAUSED, LeaseState.EVICTED):
            assert lease.slot in scheduler.slots


def check_index(scheduler: core.Scheduler) -> None:
    mismatch = scheduler.index_mismatch()
    assert not mismatch, mismatch
    now = scheduler.now
    for lease in scheduler.queue():
        band = scheduler.book.waiting_band(lease, now)
        for key in scheduler.slots:
            _, running = scheduler.slot_usage(key)
            load = scheduler.book.index.slots[key]
            assert scheduler.placer.compatible_with_slot(
                lease, load, band
            ) == scheduler.placer.compute_compatible(lease, running, band), (lease.lease_id, key)


def check_gangs_whole(scheduler: core.Scheduler) -> None:
    """All ranks of a gang run, or none does (but beside a rank that could not be paused)."""
    for gang, members in scheduler.gangs.items():
        leases = [scheduler.leases[m] for m in members]
        assert all(lease.gang == gang for lease in leases)
        running = [lease.state == LeaseState.RUNNING for lease in leases]
        if any(running) and not all(running):
            assert any(not lease.lockable or not lease.evictable for lease in leases), (
                f"gang {gang} runs in part: {[(m.lease_id, m.state) for m in leases]}"
            )


def _slot_names(slot: core.Slot) -> set[str]:
    return {slot.device_uuid, str(slot.device_index), *([slot.mig_uuid] if slot.mig_uuid else [])}


def check_rivalry(scheduler: core.Scheduler, told: dict[str, bool]) -> None:
    """A session with a lease on a GPU was last told it has no rival exactly when no
    other open session may ask for a higher band on that GPU (by its last request, or a
    request still queued): its long kernels run as they are only while nobody could
    preempt them, and are ready to stop otherwise."""
    for session_id, record in scheduler.sessions.items():
        placed = [
            scheduler.leases[i]
            for i in record.leases
            if i in scheduler.leases
            and scheduler.leases[i].state in core.ACTIVE_STATES
            and scheduler.leases[i].slot in scheduler.slots
        ]
        if record.detached or not placed:
            continue
        rival = any(
            other_id != session_id
            and not other.detached
            and may_ask_band(scheduler, other_id) > priority_band(lease.base_priority)
            and (
                other.reachable is None
                or bool(_slot_names(scheduler.slots[lease.slot]) & set(other.reachable))  # type: ignore[index]
            )
            for lease in placed
            for other_id, other in scheduler.sessions.items()
        )
        assert told.get(session_id) == (not rival), (
            f"session {session_id} was told unrivalled={told.get(session_id)}, "
            f"but a rival {'exists' if rival else 'does not exist'}"
        )


def check_all(scheduler: core.Scheduler) -> None:
    check_bookkeeping(scheduler)
    check_gangs_whole(scheduler)
    check_index(scheduler)
    check_capacity(scheduler)
    check_no_needless_wait(scheduler)


# ------------------------------------------------------------------ running a script


@dataclass
class Run:
    scheduler: core.Scheduler
    now: float = 10_000.0
    sessions: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    pending: list[tuple[str, PreemptionLevel]] = field(default_factory=list)
    events: list[core.Event] = field(default_factory=list)
    outcomes: list[object] = field(default_factory=list)  # actions, or the error, per event
    requested: list[str] = field(default_factory=list)
    counter: int = 0
    told: dict[str, bool] = field(default_factory=dict)  # unrivalled, as last told

    def feed(self, event: core.Event) -> list[core.Action]:
        self.events.append(event)
        actions = self.scheduler.handle(event)
        self.outcomes.append(actions)
        for action in actions:
            if isinstance(action, core.PauseLease):
                self.pending.append((action.lease_id, action.level))
            elif isinstance(action, core.RivalryChanged):
                self.told[action.session_id] = action.unrivalled
        check_all(self.scheduler)
        check_rivalry(self.scheduler, self.told)
        check_grants_fit_what_is_seen(self.scheduler, actions)
        return actions

    def active(self) -> list[core.Lease]:
        return sorted(self.scheduler.active_leases(), key=lambda lease: lease.arrival)


def play(script, policy: Policy) -> Run:
    run = Run(core.Scheduler(DEVICES, policy))
    for op in script:
        kind, gap = op[0], op[1]
        run.now += gap
        now = run.now
        if kind == "open":
            user, groups = USERS[op[2]]
            run.counter += 1
            session = f"S{run.counter}"
            pid = 50_000 + run.counter
            identity = core.Identity(uid=2000 + op[2], gid=100, pid=pid, user=user, groups=groups)
            run.feed(core.SessionOpened(now=now, session_id=session, identity=identity))
            run.sessions.append(session)
            run.pids[session] = pid
        elif kind == "close" and run.sessions:
            session = run.sessions.pop(op[2] % len(run.sessions))
            run.feed(core.SessionClosed(now=now, session_id=session))
        elif kind in ("request", "gang") and run.sessions:
            run.counter += 1
            lease_id = f"L{run.counter}"
            run.requested.append(lease_id)
            session = run.sessions[op[2] % len(run.sessions)]
            run.feed(core.LeaseRequested(now=now, session_id=session, lease_id=lease_id,
                                         request=_request_of(op)))  # fmt: skip
        elif kind == "release" and run.active():
            lease = run.active()[op[2] % len(run.active())]
            run.feed(
                core.LeaseReleased(now=now, session_id=lease.session_id, lease_id=lease.lease_id)
            )
        elif kind == "release_unknown" and run.sessions:
            event = core.LeaseReleased(now=now, session_id=run.sessions[0], lease_id="L-unknown")
            before = fingerprint(run.scheduler)
            run.events.append(event)
            with pytest.raises(core.SchedulerError):
                run.scheduler.handle(event)
            run.outcomes.append("SchedulerError")
            assert fingerprint(run.scheduler) == before
        elif kind == "confirm" and run.pending:
            lease_id, level = run.pending.pop(op[2] % len(run.pending))
            if op[3]:
                run.feed(core.PreemptionApplied(now=now, lease_id=lease_id, level=level))
            else:
                run.feed(
                    core.PreemptionFailed(now=now, lease_id=lease_id, level=level, reason="test")
                )
        elif kind == "memory" and run.active():
            lease = run.active()[op[2] % len(run.active())]
            used = lease.memory_bytes + (op[2] % 3) * GIB
            run.feed(core.MemoryObserved(now=now, pid=lease.identity.pid, used_bytes=used))
        elif kind == "drain":
            run.feed(core.DeviceDrained(now=now, device_index=op[2], drained=op[3]))
        elif kind == "seen":
            used = {
                run.pids[run.sessions[pick % len(run.sessions)]]: gib * GIB
                for pick, gib in op[2]
                if run.sessions
            }
            used[99_999] = op[3] * GIB  # not a session of the broker's
            run.feed(core.DeviceMemorySeen(now=now, device_index=0, used_by_pid=tuple(used.items())))  # fmt: skip
        elif kind == "host":
            host = HostMemory(available_bytes=op[2] * GIB, total_bytes=1024 * GIB)
            run.feed(core.Tick(now=now, host=host))
        elif kind == "activity" and run.sessions:
            session = run.sessions[op[2] % len(run.sessions)]
            run.feed(core.SessionActivity(now=now, session_id=session, running=op[3]))
        elif kind == "restore" and _parks(run):
            park = _parks(run)[op[2] % len(_parks(run))]
            run.feed(core.RestoreAsked(now=now, session_id=park.session_id, lease_id=park.lease_id,
                                       cancel=op[3]))  # fmt: skip
        else:
            run.feed(core.Tick(now=now))
    return run


def _request_of(op: tuple) -> RequestLease:
    """The request a generated "request" or "gang" operation makes."""
    if op[0] == "gang":
        _, _, _, priority, memory, share, wish, capabilities, ranks = op
        return RequestLease(priority=priority, memory_bytes=memory, slice=wish, sm_share=share,
                            capabilities=capabilities, ranks=ranks)  # fmt: skip
    _, _, _, priority, memory, share, wish, device, capabilities = op
    return RequestLease(priority=priority, memory_bytes=memory, slice=wish, device=device,
                        sm_share=share, capabilities=capabilities)  # fmt: skip


def _parks(run: Run) -> list[core.Lease]:
    return [lease for lease in run.active() if lease.parks_session]


def finish(run: Run) -> None:
    """Everyone finishes their work: confirm preemptions, release running leases, wait."""
    for index in sorted(run.scheduler.drained):
        run.feed(core.DeviceDrained(now=run.now, device_index=index, drained=False))
    # The idle notebooks and the unknown process let their memory go.
    run.feed(core.DeviceMemorySeen(now=run.now, device_index=0, used_by_pid=()))
    for session in run.sessions:  # no cell runs any more: idle sessions may be parked
        run.feed(core.SessionActivity(now=run.now, session_id=session, running=False))
    for _ in range(2_000):
        while run.pending:
            lease_id, level = run.pending.pop(0)
            run.feed(core.PreemptionApplied(now=run.now, lease_id=lease_id, level=level))
        # Every parked session comes back for its next cell: also one parked just above.
        for park in _parks(run):
            if park.state == LeaseState.EVICTED and not park.restore_wanted:
                run.feed(core.RestoreAsked(now=run.now, session_id=park.session_id,
                                           lease_id=park.lease_id))  # fmt: skip
        while run.pending:
            lease_id, level = run.pending.pop(0)
            run.feed(core.PreemptionApplied(now=run.now, lease_id=lease_id, level=level))
        active = run.active()
        if not active:
            return
        run.now += 7.0
        running = [lease for lease in active if lease.state == LeaseState.RUNNING]
        stuck = [lease for lease in active if lease.held_by_watchdog]
        if running or stuck:
            lease = (running or stuck)[0]
            run.feed(
                core.LeaseReleased(
                    now=run.now, session_id=lease.session_id, lease_id=lease.lease_id
                )
            )
        else:
            before = [(lease.lease_id, lease.state) for lease in active]
            run.feed(core.Tick(now=run.now))
            after = [(lease.lease_id, lease.state) for lease in run.active()]
            assert after != before or run.pending, (
                f"no lease runs and nothing moves: {before} "
                f"(reasons {[lease.reason for lease in run.active()]})"
            )
    raise AssertionError("the hub never emptied")


def lease_outcomes(run: Run) -> dict[str, list[core.Action]]:
    """Per request, what the core did about it (a gang's ranks' actions count as the
    gang's)."""
    by_lease: dict[str, list[core.Action]] = {lease_id: [] for lease_id in run.requested}
    for outcome in run.outcomes:
        if isinstance(outcome, list):
            for action in outcome:
                lease_id = getattr(action, "lease_id", None) or ""
                membership = split_member_id(lease_id)
                request = membership[0] if membership else lease_id
                if request in by_lease:
                    by_lease[request].append(action)
    return by_lease


# ------------------------------------------------------------------ the properties


@PROPERTY_SETTINGS
@given(script=scripts, policy=policies)
def test_capacity_and_priority_hold_after_every_event(script, policy):
    run = play(script, policy)  # check_all runs after each event
    actions = [a for outcome in run.outcomes if isinstance(outcome, list) for a in outcome]
    for kind in (
        core.GrantLease,
        core.PauseLease,
        core.ResumeLease,
        core.NotifyQueued,
        core.RefuseRequest,
    ):
        if any(isinstance(a, kind) for a in actions):
            event(f"has {kind.__name__}")
    if any(isinstance(a, core.RivalryChanged) and not a.unrivalled for a in actions):
        event("tells a session it has a rival")
    if any(isinstance(a, core.PauseLease) and a.parks_bytes for a in actions):
        event("parks an idle session")
    if any(isinstance(a, core.ResumeLease) and a.restores_park for a in actions):
        event("restores a parked session")


@PROPERTY_SETTINGS
@given(script=scripts, policy=policies)
def test_every_request_is_granted_refused_with_a_reason_or_ends_with_its_session(script, policy):
    run = play(script, policy)
    finish(run)

    assert not run.scheduler.queue()
    closed_sessions = {e.session_id for e in run.events if isinstance(e, core.SessionClosed)}
    withdrawn = {e.lease_id for e in run.events if isinstance(e, core.LeaseReleased)}
    for lease_id, actions in lease_outcomes(run).items():
        granted = [a for a in actions if isinstance(a, core.GrantLease)]
        refused = [a for a in actions if isinstance(a, core.RefuseRequest)]
        ended = [a for a in actions if isinstance(a, core.LeaseEnded)]
        if refused:
            assert refused[0].message, f"{lease_id} refused without a reason"
            assert not granted
        elif granted:
            assert len(granted) == 1, f"{lease_id} granted twice"
            ranks = len(granted[0].ranks) or 1
            assert len(ended) == ranks, f"{lease_id} granted but not every rank ended"
            assert len({a.lease_id for a in ended}) == ranks, f"a rank of {lease_id} ended twice"
        else:
            assert ended, f"{lease_id} was neither granted, refused nor ended"
            session = run.scheduler.ended[ended[0].lease_id].session_id
            asked = {lease_id} | {a.lease_id for a in ended}
            assert session in closed_sessions or asked & withdrawn, (
                f"{lease_id} ended unserved although nobody withdrew it"
            )


@PROPERTY_SETTINGS
@given(script=scripts, policy=policies)
def test_replaying_the_same_events_gives_the_same_actions(script, policy):
    first = play(script, policy)
    finish(first)

    replay = core.Scheduler(DEVICES, policy)
    outcomes: list[object] = []
    for recorded in first.events:
        try:
            outcomes.append(replay.handle(recorded))
        except core.SchedulerError:
            outcomes.append("SchedulerError")

    assert outcomes == first.outcomes
    assert fingerprint(replay) == fingerprint(first.scheduler)


# ------------------------------------------------------------------ aging


def _stream_with_low_waiting(aging_per_minute: float, minutes: int) -> float | None:
    scheduler = core.Scheduler(
        DEVICES[:1], Policy(defaults=Limits(aging_per_minute=aging_per_minute, max_leases=50))
    )
    for index in range(3):
        scheduler.handle(
            core.SessionOpened(
                now=0.0,
                session_id=f"S{index}",
                identity=core.Identity(
                    uid=3000 + index, gid=100, pid=60_000 + index, user=f"u{index}"
                ),
            )
        )
    # A normal cell is already running when the low request arrives.
    scheduler.handle(
        core.LeaseRequested(
            now=0.0, session_id="S1", lease_id="N0", request=RequestLease(priority=NORMAL)
        )
    )
    actions = scheduler.handle(
        core.LeaseRequested(
            now=1.0, session_id="S0", lease_id="low", request=RequestLease(priority=LOW)
        )
    )
    assert not any(isinstance(a, core.GrantLease) for a in actions)
    running = [(30.0, "S1", "N0")]
    now, number = 1.0, 0
    while now < minutes * 60:
        now += 10.0
        granted = []
        for item in [r for r in running if r[0] <= now]:
            running.remove(item)
            granted += scheduler.handle(
                core.LeaseReleased(now=now, session_id=item[1], lease_id=item[2])
            )
        number += 1
        lease_id = f"N{number}"
        granted += scheduler.handle(
            core.LeaseRequested(
                now=now,
                session_id=f"S{1 + number % 2}",
                lease_id=lease_id,
                request=RequestLease(priority=NORMAL),
            )
        )
        running.append((now + 30.0, f"S{1 + number % 2}", lease_id))
        if any(isinstance(a, core.GrantLease) and a.lease_id == "low" for a in granted):
            return now
    return None


def test_aging_lets_a_low_request_through_a_stream_of_normal_requests():
    # 10 points a minute lift a low (50) into the normal band (100) after 5 minutes.
    granted_at = _stream_with_low_waiting(aging_per_minute=10.0, minutes=30)
    assert granted_at is not None, "the low request starved"
    assert granted_at <= 5 * 60 + 20


def test_without_aging_the_same_stream_starves_the_low_request():
    assert _stream_with_low_waiting(aging_per_minute=0.0, minutes=30) is None


@settings(max_examples=40, deadline=None)
@given(aging=st.sampled_from([5.0, 10.0, 30.0, 60.0]))
def test_aging_bounds_the_wait_of_a_low_request(aging):
    bound = (100 - LOW) / aging * 60 + 20  # reach the normal band, then the next 10 s step
    granted_at = _stream_with_low_waiting(aging_per_minute=aging, minutes=30)
    assert granted_at is not None and granted_at <= bound


# ------------------------------------------------------------------ import hygiene


def test_the_core_and_policy_import_no_io_and_no_gpu_library():
    code = (
        "import sys, json\n"
        "import gpushare_ext.broker.scheduler.core, gpushare_ext.broker.settings.policy\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = set(json.loads(result.stdout))
    forbidden = {"asyncio", "socket", "cuda", "pynvml", "numba", "cupy", "sqlite3"}
    assert not loaded & forbidden, f"core pulls in {sorted(loaded & forbidden)}"
    assert not [m for m in loaded if m.startswith(("cuda.", "numba.", "cupy."))]


# ------------------------------------------------------------------ found by the properties

_LOCKABLE = Capabilities(gate=False, yield_flag=False, instrumented_only=False, lockable=True)


def _gang(priority: int, memory: int, ranks: int) -> tuple:
    return ("gang", 0.0, 0, priority, memory, 1.0, SliceWish.AUTO, _LOCKABLE, ranks)


def _plain(priority: int) -> tuple:
    return ("request", 0.0, 0, priority, None, 1.0, SliceWish.AUTO, "auto", _LOCKABLE)


# A normal gang's ranks make room on two slots at once: the plan for the MIG instance
# evicts one rank of a low gang and pauses its two others (a gang never runs in part);
# the plan for the whole GPU, made while those ran, must evict one of them.  It asked
# that rank's eviction as a pause (at the eviction's level, with a pause's cause), so
# the rank the other plan had paused already was passed over, and the normal gang
# waited for ever for memory nobody was asked to free.
def test_a_gang_waiting_for_the_memory_of_a_paused_lower_gang_is_not_left_waiting():
    script = [
        ("open", 0.0, 0), ("open", 0.0, 0), _gang(50, 1 << 30, 2), ("open", 0.0, 0),
        ("open", 0.0, 0), _plain(50), _plain(50), ("open", 0.0, 0), ("open", 0.0, 0),
        ("close", 0.0, 0), ("host", 0.0, 0), _gang(50, 60 << 30, 3), _gang(150, 30 << 30, 3),
        *[_plain(50) for _ in range(9)],
    ]  # fmt: skip
    policy = Policy(
        sharing="timeslice",
        defaults=Limits(aging_per_minute=0.0, memory_quota=1 << 50, max_leases=6),
        groups={"students": {"max_priority": "normal"}},
    )
    finish(play(script, policy))  # asserts that something runs or moves at every step
