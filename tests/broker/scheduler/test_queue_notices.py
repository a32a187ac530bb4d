"""Queue notices: the pass that looks only at the waiters an event may concern tells
every session exactly what a pass over every waiter would.

Generated days of a busy hub (the property tests' scripts, with aging rates that differ
between groups so that waiters overtake each other) run on a scheduler that keeps its
waiting line and on one that serves every waiter on every event
(``recompute_every_waiter``): each event gives the same actions and leaves the same
state.  After every event, what each waiting request last heard (place, what it waits
for, their priority, the reason, the estimate) is what telling everyone anew would say.
A long queue hears nothing of events that leave its places alone; when the queue moves,
the requests near the head hear their new places, and those further back only when
their place as a notice tells it (rounded up: "200") changes.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from hypothesis import event as note
from hypothesis import given, settings
from hypothesis import strategies as st
from scheduler_helpers import GIB, HIGH, LOW, MIB, NORMAL, Hub, fingerprint, h200_devices, of_type
from test_core_properties import CAPABILITIES, DEVICES, PROPERTY_SETTINGS, play, scripts

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.lease_index import NEAR, TOP_PRIORITY, Trajectory, ahead_until
from gpushare_ext.broker.scheduler.parking import HostMemory
from gpushare_ext.broker.settings.policy import Limits, Policy, parse_policy
from gpushare_ext.protocol import LeaseState, PreemptionLevel, RequestLease, SliceWish

# The property tests' policies, with students aging at a rate of their own.
policies = st.builds(
    lambda sharing, aging, student_aging, quota, students_max: Policy(
        sharing=sharing,
        defaults=Limits(aging_per_minute=aging, memory_quota=quota, max_leases=6),
        groups={"students": {"max_priority": students_max, "aging_per_minute": student_aging}},
    ),
    sharing=st.sampled_from(["timeslice", "timeslice", "exclusive"]),
    aging=st.sampled_from([0.0, 10.0, 120.0]),
    student_aging=st.sampled_from([0.0, 10.0, 45.0, 120.0, 600.0]),
    quota=st.sampled_from([1 << 50, 64 * GIB]),
    students_max=st.sampled_from(["normal", "high", 120]),
)

Told = tuple  # (position, the holders' users, holder_priority, reason, notice)


def _told(notice: core.NotifyQueued, scheduler: core.Scheduler) -> Told:
    """What the request's session reads of ``notice``: the server names the holders'
    users, not their leases (``scheduler``: the one that sent it, just after)."""
    holders = [scheduler.lease_of(i) or scheduler.ended.get(i) for i in notice.waiting_for]
    return (
        notice.position,
        sorted({(h.identity.uid, h.identity.user) for h in holders if h is not None}),
        notice.holder_priority,
        notice.reason,
        notice.notice,
    )


def told_anew(scheduler: core.Scheduler) -> tuple[dict[str, tuple[Told, core.NotifyQueued]], list]:
    """What every waiting request would hear if each were looked at and told anew now,
    and whatever else that pass would do (nothing, on a settled hub)."""
    fresh = copy.deepcopy(scheduler)
    fresh.recompute_every_waiter = True
    for lease in fresh.leases.values():
        lease.last_queue_notice = None
    actions = fresh.handle(core.Tick(now=fresh.now))
    notices = {
        a.lease_id: (_told(a, fresh), a) for a in actions if isinstance(a, core.NotifyQueued)
    }
    return notices, [a for a in actions if not isinstance(a, core.NotifyQueued)]


# ------------------------------------------------------------------ generated days

# Busy days shaped for long queues: mostly large requests (many wait), holders paused by
# the watchdog or by higher bands, drains, NVML readings of idle notebooks, parking.
USERS = [("ada", ("staff",)), ("bo", ("students",)), ("cy", ("students", "staff")), ("di", ())]
LARGE = [8 * GIB, 30 * GIB, 60 * GIB, 60 * GIB, 100 * GIB, 139 * GIB]
WISHES = ["auto", "auto", "0", "0", "1", DEVICES[1].instances[1].uuid]
gaps = st.sampled_from([0.0, 0.0, 0.5, 5.0, 30.0, 120.0])
picks = st.integers(0, 60)
busy_ops = st.one_of(
    st.tuples(
        st.just("request"),
        gaps,
        picks,
        st.one_of(st.sampled_from([LOW, NORMAL, NORMAL, HIGH]), st.integers(0, 299)),
        st.sampled_from(LARGE),
        st.sampled_from(WISHES),
        st.sampled_from([SliceWish.AUTO] * 4 + list(SliceWish)),
        st.sampled_from([1.0, 1.0, 0.5]),
        st.sampled_from(CAPABILITIES),
    ),
    st.tuples(
        st.just("gang"),
        gaps,
        picks,
        st.sampled_from([LOW, NORMAL, HIGH]),
        st.sampled_from([15 * GIB, 30 * GIB, 60 * GIB]),
        st.integers(2, 3),
    ),
    st.tuples(st.just("open"), gaps, st.integers(0, len(USERS) - 1)),
    st.tuples(st.just("close"), gaps, picks),
    st.tuples(st.just("release"), gaps, picks),
    st.tuples(st.just("release"), gaps, picks),
    st.tuples(st.just("confirm"), gaps, picks, st.booleans()),
    st.tuples(st.just("confirm"), gaps, picks, st.just(True)),
    st.tuples(st.just("overuse"), gaps, picks),
    st.tuples(st.just("drain"), gaps, st.integers(0, 1), st.booleans()),
    st.tuples(
        st.just("seen"),
        gaps,
        st.lists(st.tuples(picks, st.sampled_from([0, 8, 60])), max_size=3),
        st.sampled_from([0, 0, 20, 90]),
    ),
    st.tuples(st.just("activity"), gaps, picks, st.booleans()),
    st.tuples(st.just("restore"), gaps, picks, st.booleans()),
    st.tuples(st.just("host"), gaps, st.sampled_from([0, 900])),
    st.tuples(st.just("tick"), gaps),
)
busy_days = st.builds(
    lambda first, rest: first + rest,
    st.lists(
        st.tuples(st.just("open"), st.just(0.0), st.integers(0, len(USERS) - 1)),
        min_size=3,
        max_size=6,
    ),
    st.lists(busy_ops, min_size=30, max_size=120),
)


@dataclass
class BusyDay:
    """Plays a busy day on ``schedulers`` at once, choosing each event from the first."""

    schedulers: tuple[core.Scheduler, ...]
    now: float = 10_000.0
    sessions: list[tuple[str, int]] = field(default_factory=list)  # (session, pid)
    pending: list[tuple[str, PreemptionLevel]] = field(default_factory=list)
    counter: int = 0

    def play(self, day: list[tuple]) -> Iterator[tuple[core.Event, list]]:
        """Each event and, per scheduler, its actions (or the refusal's message)."""
        for op in day:
            self.now += op[1]
            event = self.event(op)
            outcomes = []
            for scheduler in self.schedulers:
                try:
                    outcomes.append(scheduler.handle(event))
                except core.SchedulerError as error:
                    outcomes.append(error.message)
            if isinstance(outcomes[0], list):
                self.pending += [
                    (a.lease_id, a.level) for a in outcomes[0] if isinstance(a, core.PauseLease)
                ]
            yield event, outcomes

    def active(self) -> list[core.Lease]:
        return sorted(self.schedulers[0].active_leases(), key=lambda lease: lease.lease_id)

    def event(self, op: tuple) -> core.Event:
        kind, now = op[0], self.now
        pick = op[2] if len(op) > 2 and isinstance(op[2], int) else 0
        if kind == "open" or not self.sessions:
            return self._open(op[2] if kind == "open" else 0)
        session, pid = self.sessions[pick % len(self.sessions)]
        active = self.active()
        lease = active[pick % len(active)] if active else None
        running = [lease for lease in active if lease.state == LeaseState.RUNNING]
        parks = [lease for lease in active if lease.parks_session]
        if kind == "close":
            self.sessions.remove((session, pid))
            return core.SessionClosed(now=now, session_id=session)
        if kind in ("request", "gang"):
            self.counter += 1
            return core.LeaseRequested(now=now, session_id=session, lease_id=f"L{self.counter}",
                                       request=_request(op))  # fmt: skip
        if kind == "release" and lease is not None:
            return core.LeaseReleased(now=now, session_id=lease.session_id, lease_id=lease.lease_id)
        if kind == "confirm" and self.pending:
            lease_id, level = self.pending.pop(pick % len(self.pending))
            if op[3]:
                return core.PreemptionApplied(now=now, lease_id=lease_id, level=level)
            return core.PreemptionFailed(now=now, lease_id=lease_id, level=level, reason="test")
        if kind == "overuse" and running:  # the watchdog pauses it: its slot's holders change
            over = running[pick % len(running)]
            return core.MemoryObserved(now=now, pid=over.identity.pid,
                                       used_bytes=2 * over.memory_bytes + 4 * GIB)  # fmt: skip
        if kind == "drain":
            return core.DeviceDrained(now=now, device_index=op[2], drained=op[3])
        if kind == "seen":
            used = {self.sessions[p % len(self.sessions)][1]: gib * GIB for p, gib in op[2]}
            used[99_999] = op[3] * GIB  # a process the broker does not know
            return core.DeviceMemorySeen(now=now, device_index=0, used_by_pid=tuple(used.items()))
        if kind == "activity":
            return core.SessionActivity(now=now, session_id=session, running=op[3])
        if kind == "restore" and parks:
            park = parks[pick % len(parks)]
            return core.RestoreAsked(now=now, session_id=park.session_id, lease_id=park.lease_id,
                                     cancel=op[3])  # fmt: skip
        if kind == "host":
            return core.Tick(now=now, host=HostMemory(available_bytes=op[2] * GIB,
                                                      total_bytes=1024 * GIB))  # fmt: skip
        return core.Tick(now=now)

    def _open(self, user: int) -> core.Event:
        self.counter += 1
        name, groups = USERS[user]
        session, pid = f"S{self.counter}", 50_000 + self.counter
        self.sessions.append((session, pid))
        identity = core.Identity(uid=2000 + user, gid=100, pid=pid, user=name, groups=groups)
        return core.SessionOpened(now=self.now, session_id=session, identity=identity)


def _request(op: tuple) -> RequestLease:
    if op[0] == "gang":
        _, _, _, priority, memory, ranks = op
        return RequestLease(priority=priority, memory_bytes=memory, ranks=ranks)
    _, _, _, priority, memory, device, wish, share, capabilities = op
    return RequestLease(priority=priority, memory_bytes=memory, device=device, slice=wish,
                        sm_share=share, capabilities=capabilities)  # fmt: skip


# A line from the first waiter, or from a few more (as the broker keeps it): the second
# also goes between serving every waiter and keeping a line as queues grow and shrink.
line_froms = st.sampled_from([0, core.LINE_FROM])


@PROPERTY_SETTINGS
@given(day=busy_days, policy=policies, line_from=line_froms)
def test_the_kept_line_acts_as_a_pass_over_every_waiter(day, policy, line_from):
    kept = core.Scheduler(DEVICES, policy, line_from=line_from)
    everyone = core.Scheduler(DEVICES, policy, recompute_every_waiter=True)
    for event, (by_kept, by_everyone) in BusyDay((kept, everyone)).play(day):
        assert by_kept == by_everyone, f"after {event}"
        assert fingerprint(kept) == fingerprint(everyone), f"after {event}"
        mismatch = kept.index_mismatch()
        assert not mismatch, mismatch


@PROPERTY_SETTINGS
@given(script=scripts, policy=policies)
def test_the_kept_line_acts_as_a_pass_over_every_waiter_on_the_property_tests_days(script, policy):
    kept = core.Scheduler(DEVICES, policy, line_from=0)  # their queues are short
    everyone = core.Scheduler(DEVICES, policy, recompute_every_waiter=True)
    for event in play(script, policy).events:
        outcomes = []
        for scheduler in (kept, everyone):
            try:
                outcomes.append(scheduler.handle(event))
            except core.SchedulerError as error:
                outcomes.append(error.message)
        assert outcomes[0] == outcomes[1], f"after {event}"
        assert not kept.index_mismatch()
    assert fingerprint(kept) == fingerprint(everyone)


@settings(PROPERTY_SETTINGS, max_examples=50)
@given(day=busy_days, policy=policies, line_from=line_froms)
def test_every_waiting_request_last_heard_what_telling_it_anew_would_say(day, policy, line_from):
    # A notice says how things stood at the request's turn in the pass; a waiter served
    # later in the same pass (a paused gang resuming beside it) can change that, and the
    # request hears it at the next event, as it always has.  So the comparison is made
    # after one more pass at the same moment, on a copy, when that pass has nothing else
    # to do.
    scheduler = core.Scheduler(DEVICES, policy, line_from=line_from)
    last_heard: dict[str, tuple[Told, core.NotifyQueued]] = {}
    compared = 0
    for happened, (actions,) in BusyDay((scheduler,)).play(day):
        if not isinstance(actions, list):
            continue
        last_heard.update(
            {a.lease_id: (_told(a, scheduler), a) for a in of_type(actions, core.NotifyQueued)}
        )
        anew, other_actions = told_anew(scheduler)
        if other_actions:
            continue  # the pass would still place or stop someone: not settled
        once_more = copy.deepcopy(scheduler)
        settled = once_more.handle(core.Tick(now=scheduler.now))
        heard = {
            **last_heard,
            **{a.lease_id: (_told(a, once_more), a) for a in of_type(settled, core.NotifyQueued)},
        }
        told_now = {a.lease_id for a in of_type(actions + settled, core.NotifyQueued)}
        for lease_id, (told, notice) in anew.items():
            assert lease_id in heard, f"{lease_id} waits and was never told"
            assert heard[lease_id][0] == told, f"{lease_id} after {happened}"
            if lease_id in told_now:  # an estimate is worked out when the rest changes
                assert heard[lease_id][1].estimate_s == notice.estimate_s
            compared += 1
    note(f"compared {'some' if compared else 'no'} notices")


# ------------------------------------------------------------------ a long queue


class LongQueue:
    """Two GPUs: ``waiters`` requests wait for GPU 0, which one high lease fills, while
    four small time-sliced leases come and go on GPU 1."""

    def __init__(self, waiters: int) -> None:
        self.hub = Hub(h200_devices(2), parse_policy("[defaults]\nmax_leases = 10000\n"))
        holder = self.hub.open("holder")
        self.hub.request(holder, "FULL", priority=HIGH, memory=140 * GIB, device="0")
        self.queue = [self.hub.open(f"w{n}", uid=5000 + n % 30) for n in range(waiters)]
        for n, session in enumerate(self.queue):
            self.hub.request(session, f"W{n}", memory=10 * GIB, device="0")
        self.small = [(self.hub.open(f"s{n}", uid=6000 + n), f"S{n}") for n in range(4)]
        for session, lease_id in self.small:
            self.hub.request(session, lease_id, memory=64 * MIB, device="1")
        self.churned = 0

    def churn(self) -> list[core.Action]:
        """A small lease on GPU 1 released and asked for again, then a tick."""
        self.churned += 1
        n = self.churned % len(self.small)
        session, old = self.small[n]
        new = f"S{n}-{self.churned}"
        self.small[n] = (session, new)
        actions = self.hub.release(session, old)
        actions += self.hub.request(session, new, memory=64 * MIB, device="1")
        return actions + self.hub.advance(0.01)


def test_a_long_queue_hears_nothing_of_events_that_leave_its_places_alone():
    line = LongQueue(200)

    heard = [action for _ in range(10) for action in line.churn()]

    assert of_type(heard, core.GrantLease)
    assert not of_type(heard, core.NotifyQueued)
    assert [lease.lease_id for lease in line.hub.scheduler.queue()] == [f"W{n}" for n in range(200)]


def test_a_request_joining_the_back_is_the_only_one_told():
    line = LongQueue(200)
    late = line.hub.open("late")

    actions = line.hub.request(late, "LATE", memory=10 * GIB, device="0")

    [notice] = of_type(actions, core.NotifyQueued)
    # Place 201, told as the round number it is within.
    assert (notice.lease_id, notice.position, notice.waiting_for) == ("LATE", 500, ("FULL",))
    assert notice.estimate_s is None  # the GPU's likely free time is the head's, not its


def test_when_the_queue_moves_the_head_hears_its_places_and_the_rest_round_numbers():
    line = LongQueue(200)

    moved = of_type(line.hub.release(line.queue[5], "W5"), core.NotifyQueued)

    # W6..W10 stand at 6..10 (told exactly); W20 was within the first 50 and is 20th
    # now, W50 within 100 and W100 within 200; the others read the same as before.
    near = [(f"W{n}", n) for n in range(6, 11)]
    assert [(n.lease_id, n.position) for n in moved] == [*near, ("W20", 20), ("W50", 50),
                                                          ("W100", 100)]  # fmt: skip
    assert not of_type(line.hub.advance(1.0), core.NotifyQueued)


def test_a_request_joining_ahead_moves_the_rest_back_and_tells_those_whose_place_reads_otherwise():
    line = LongQueue(200)
    early = line.hub.open("early")

    actions = line.hub.request(early, "EARLY", priority=NORMAL + 20, memory=10 * GIB, device="0")

    # W0..W9 stand at 2..11 (W9 told "20"), W19 at 21 ("50"), W49 at 51, W99 at 101,
    # W199 at 201 ("500").
    moved = [(n.lease_id, n.position) for n in of_type(actions, core.NotifyQueued)]
    behind = [(f"W{n}", n + 2) for n in range(9)] + [("W9", 20), ("W19", 50), ("W49", 100),
                                                      ("W99", 200), ("W199", 500)]  # fmt: skip
    assert sorted(moved) == sorted([("EARLY", 1), *behind])


def test_a_waiter_overtaken_by_faster_aging_hears_its_new_place():
    policy = parse_policy(
        "[defaults]\nmax_leases = 100\naging_per_minute = 1\n"
        "[groups.staff]\naging_per_minute = 60\n"
    )
    hub = Hub(h200_devices(1), policy)
    hub.request(hub.open("holder"), "FULL", priority=HIGH, memory=140 * GIB)
    slow, fast = hub.open("slow"), hub.open("fast", groups=("staff",))
    hub.request(slow, "SLOW", priority=NORMAL + 10, memory=10 * GIB)
    hub.advance(1.0)
    [joined] = of_type(
        hub.request(fast, "FAST", priority=NORMAL, memory=10 * GIB), core.NotifyQueued
    )
    assert joined.position == 2

    # Ten points behind and 59 points a minute faster: ahead after about ten seconds.
    assert not of_type(hub.advance(5.0), core.NotifyQueued)
    heard = of_type(hub.advance(10.0), core.NotifyQueued)

    assert sorted((n.lease_id, n.position) for n in heard) == [("FAST", 1), ("SLOW", 2)]


# ------------------------------------------------------------------ what a passed-over request hears
# Each story runs on a scheduler that keeps its line and on one that serves every waiter
# on every event; both must say the same, and the request passed over must hear it.


def both(story: Callable[[Hub], list[list[core.Action]]], devices: int = 1) -> list[list]:
    """The actions of each step of ``story``, the same on both schedulers."""
    kept, everyone = Hub(h200_devices(devices)), Hub(h200_devices(devices))
    kept.scheduler.passes.line_from = 0  # a line even for these few waiters
    everyone.scheduler.passes.recompute_every_waiter = True
    steps = story(kept)
    assert steps == story(everyone)
    return steps


def test_a_grant_elsewhere_moves_the_requests_behind_it_up():
    def story(hub: Hub) -> list[list[core.Action]]:
        full1, full0 = hub.open("full1"), hub.open("full0")
        hub.request(full1, "F1", memory=140 * GIB, device="1")
        hub.request(full0, "F0", memory=140 * GIB, device="0")
        hub.request(hub.open("other"), "ONE", memory=20 * GIB, device="1")
        for n in range(3):
            hub.request(hub.open(f"w{n}"), f"W{n}", memory=20 * GIB, device="0")
        return [hub.release(full1, "F1")]

    [released] = both(story, devices=2)
    assert [(n.lease_id, n.position) for n in of_type(released, core.NotifyQueued)] == [
        ("W0", 1),
        ("W1", 2),
        ("W2", 3),
    ]


def test_a_reclaimed_request_hears_where_it_stands_even_when_passed_over():
    def restored(lease_id: str, pid: int, state: LeaseState, **what) -> core.LeaseRestored:
        identity = core.Identity(uid=4000, gid=100, pid=pid, user="ada")
        return core.LeaseRestored(now=hub_now, session_id=f"P{pid}", identity=identity,
                                  lease_id=lease_id, state=state, requested_at=900.0, **what)  # fmt: skip

    def story(hub: Hub) -> list[list[core.Action]]:
        hub.handle(restored("HOLD", 101, LeaseState.RUNNING, priority=HIGH,
                            memory_bytes=140 * GIB, slot="0", granted_at=950.0))  # fmt: skip
        hub.handle(
            restored("Q", 102, LeaseState.QUEUED, priority=NORMAL, memory_bytes=10 * GIB, slot=None)
        )
        hub.request(hub.open("bo"), "AHEAD", priority=HIGH, memory=10 * GIB)
        identity = core.Identity(uid=4000, gid=100, pid=102, user="ada")
        hub.handle(core.SessionOpened(now=hub.now, session_id="back", identity=identity))
        return [hub.handle(core.LeaseReclaimed(now=hub.now, session_id="back", lease_id="Q"))]

    hub_now = 1_000.0
    [reclaimed] = both(story)
    [notice] = of_type(reclaimed, core.NotifyQueued)
    assert (notice.session_id, notice.lease_id, notice.position) == ("back", "Q", 2)


def test_a_request_told_before_a_waiter_behind_it_resumed_hears_of_it_at_the_next_event():
    # W0 and W1 wait ahead of the paused P (aging ranks them by how long they waited),
    # W2 behind it.  When the high lease that paused P ends, W1 is told at its turn,
    # before P resumes; W2 after.  At the next event W1 hears that P runs, though W0
    # (served first) closes the way for it and nothing ahead of it came or went.
    def story(hub: Hub) -> list[list[core.Action]]:
        p, b = hub.open("p"), hub.open("b")
        hub.request(p, "P", memory=20 * GIB)
        hub.request(b, "B", memory=100 * GIB)
        waiters = [hub.open(f"w{n}") for n in range(3)]
        hub.request(waiters[0], "W0", memory=120 * GIB)
        hub.advance(1.0)
        hub.request(waiters[1], "W1", memory=120 * GIB)
        hub.advance(29.0)
        high = hub.open("high")
        for preempt in of_type(
            hub.request(high, "H", priority=HIGH, memory=20 * GIB), core.PauseLease
        ):
            hub.applied(preempt.lease_id, preempt.level)
        hub.advance(30.0)
        hub.request(waiters[2], "W2", memory=120 * GIB)
        hub.advance(10.0)
        return [hub.release(high, "H"), hub.advance(1.0)]

    released, ticked = both(story)
    assert {a.lease_id for a in of_type(released, core.ResumeLease)} == {"P", "B"}
    told = {n.lease_id: n.waiting_for for n in of_type(released, core.NotifyQueued)}
    assert told["W1"] == () and told["W2"] == ("B", "P")
    assert [(n.lease_id, n.waiting_for) for n in of_type(ticked, core.NotifyQueued)] == [
        ("W0", ("B", "P")),
        ("W1", ("B", "P")),
    ]


def _cost_of_quiet_events(waiters: int) -> float:
    """Best of five: µs per event (a small lease released and asked for again on GPU 1,
    a tick) while ``waiters`` requests wait for GPU 0."""
    line = LongQueue(waiters)
    line.hub.check_index = False  # the recount is what the line saves
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(20):
            line.churn()
        best = min(best, (time.perf_counter() - started) / 60)
    return best * 1e6


def test_an_event_that_concerns_no_waiter_costs_the_same_with_ten_or_a_thousand_waiting():
    few, many = _cost_of_quiet_events(10), _cost_of_quiet_events(1000)
    # Serving every waiter in turn made this ratio about a hundred.
    assert many < 4 * few, f"{few:.1f} µs per event with 10 waiting, {many:.1f} with 1000"


# ------------------------------------------------------------------ the order over time

starts = st.sampled_from([float(LOW), float(NORMAL), float(HIGH), 299.0])
trajectories = st.builds(
    Trajectory,
    start=st.one_of(starts, st.floats(0, 299)),
    since=st.one_of(st.sampled_from([1000.0, 1000.5, 1030.0]), st.floats(0, 2000)),
    rate=st.one_of(st.sampled_from([0.0, 10.0, 45.0, 120.0]), st.floats(0, 1000)),
    arrival=st.integers(1, 5),
)


@settings(max_examples=2000, deadline=None)
@given(
    first=trajectories,
    second=trajectories,
    now=st.floats(2000, 3000),
    later=st.lists(st.floats(0, 1), min_size=1, max_size=8),
)
def test_a_waiter_stays_ahead_until_the_line_says(first, second, now, later):
    if first.key_at(now) > second.key_at(now):
        first, second = second, first
    until = ahead_until(first, second, now)
    span = (until - now) if math.isfinite(until) else 1e7
    for fraction in later:
        at = now + fraction * span
        if at < until:
            assert first.key_at(at) <= second.key_at(at), (first, second, now, until, at)


def test_two_waiters_a_hair_apart_are_compared_at_every_event():
    first = Trajectory(start=150.0, since=1000.0, rate=10.0, arrival=1)
    second = Trajectory(start=150.0 - NEAR / 2, since=1000.0, rate=10.0, arrival=2)
    assert ahead_until(first, second, 1500.0) == 1500.0
    # One at the top stays ahead until the other, arrived earlier, reaches the top too
    # (at 1894 s), taken a little early.
    topped = Trajectory(start=TOP_PRIORITY, since=0.0, rate=10.0, arrival=3)
    assert 1893.99 < ahead_until(topped, first, 1500.0) < 1894.0
