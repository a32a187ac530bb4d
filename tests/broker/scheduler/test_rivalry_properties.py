"""Properties of the rivalry policy: when a session's long kernels may run as they are.

A session told ``unrivalled=True`` runs its long kernels unmodified, so a stop must wait
for a whole kernel; it must be told so only while nobody could preempt it.  Generated
days of a hub (sessions opening and closing, some reaching only some GPUs, requests of
random priority, releases, confirmed or failed stops, ticks, an admin's chaos mode)
are fed to the real core, the :class:`~gpushare_ext.broker.scheduler.actions.RivalryChanged`
actions replayed into ``told[session]``, and after every event the last word told is
compared with a rule computed here from the scheduler's public state (never by asking
:mod:`~gpushare_ext.broker.scheduler.rivals`):

* a lease is *placed* while it holds a slot: running, paused, or evicted (an evicted
  lease keeps its slot and comes back there);
* a live session (open, not a restart's placeholder) *may ask for* the band of its last
  accepted request's priority, as the policy lowered it (before any: normal), and the
  band of each of its requests still queued;
* a placed lease of S has a *rival* T (another live session) when T may ask for a band
  above the lease's base priority's and T's process can use the lease's GPU (by its
  UUID, its MIG instance's UUID or its host index); a session in chaos mode has a rival
  while chaos lasts.  Aging is left out (a request that ages into a higher band stops
  its victim after the kernels under way, see ``rivals.py``).

SAFETY: a session last told ``unrivalled=True`` has no placed lease with a rival; in
particular no request of a higher band waits in the queue for a slot it holds a lease
on.  LIVENESS: a session with placed leases none of which has a rival was last told
``unrivalled=True`` (so the event that removed its last rival told it).

The second property checks :class:`~gpushare_ext.broker.scheduler.rivals.Rivals` alone: fed
opens, closes, requests, queued requests, chaos and placed leases at random, and asked
only about the sessions an event names or the band it answered may concern, its word
matches the same rule for every session.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from scheduler_helpers import GIB, HIGH, LOW, NORMAL, h200_document, may_ask_band, mig_document

from gpushare_ext.broker.hands.inventory import parse_inventory
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.rivals import PlacedLease, Rivals
from gpushare_ext.broker.settings.policy import Limits, Policy
from gpushare_ext.protocol import Capabilities, LeaseState, RequestLease
from gpushare_ext.units import priority_band

RIVALRY_SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RIVALS_SETTINGS = settings(max_examples=300, deadline=None)


def whole_and_cut() -> list:
    """Device 0: a whole H200.  Device 1: an H200 cut into 3g + 2g + 1g MIG instances."""
    whole = h200_document()["devices"][0]
    cut = dict(
        mig_document()["devices"][0], index=1, uuid="GPU-11111111-1111-1111-1111-111111111111"
    )
    return parse_inventory({"devices": [whole, cut]}, simulated=True)


DEVICES = whole_and_cut()
MIG_3G = DEVICES[1].instances[0].uuid
USERS = [("ada", ("staff",)), ("bo", ("students",)), ("cy", ())]
# What a session's process can use: every GPU, some of them by UUID, MIG UUID or host
# index, none of this broker's.
REACHES = [None] * 6 + [(DEVICES[0].uuid,), ("1",), (MIG_3G,), ("0", "1"), (), ("GPU-x",)]
PLACED_STATES = (LeaseState.RUNNING, LeaseState.PAUSED, LeaseState.EVICTED)

policies = st.builds(
    lambda sharing, aging, students_max: Policy(
        sharing=sharing,
        defaults=Limits(aging_per_minute=aging, max_leases=5),
        groups={"students": {"max_priority": students_max}},
    ),
    sharing=st.sampled_from(["timeslice", "exclusive"]),
    aging=st.sampled_from([0.0, 0.0, 120.0]),
    students_max=st.sampled_from(["high", "normal", 120]),
)
gaps = st.sampled_from([0.0, 0.0, 1.0, 30.0])
priorities = st.one_of(st.sampled_from([LOW, NORMAL, HIGH]), st.integers(0, 299))
requests = st.tuples(
    st.just("request"),
    gaps,
    st.integers(0, 30),  # which open session
    priorities,
    st.sampled_from([8 * GIB, 30 * GIB, 60 * GIB, 100 * GIB]),
    st.sampled_from(["auto", "auto", "0", "1", MIG_3G]),
    st.sampled_from([Capabilities(), Capabilities(lockable=False), Capabilities(gate=True)]),
    st.sampled_from([1.0, 1.0, 0.5]),
)
# Weighted by hand: one_of weighs a strategy named twice once.
OP_KINDS = ["request"] * 6 + ["open", "close", "release", "release", "confirm", "confirm"]
OP_KINDS += ["chaos", "drain", "tick"]
op_of_kind = {
    "request": requests,
    "open": st.tuples(
        st.just("open"), gaps, st.integers(0, len(USERS) - 1), st.sampled_from(REACHES)
    ),
    "close": st.tuples(st.just("close"), gaps, st.integers(0, 30)),
    "release": st.tuples(st.just("release"), gaps, st.integers(0, 30)),
    "confirm": st.tuples(st.just("confirm"), gaps, st.integers(0, 30), st.booleans()),
    "chaos": st.tuples(st.just("chaos"), gaps, st.integers(0, 30), st.booleans()),
    "drain": st.tuples(st.just("drain"), gaps, st.integers(0, 1), st.booleans()),
    "tick": st.tuples(st.just("tick"), gaps),
}
ops = st.sampled_from(OP_KINDS).flatmap(op_of_kind.__getitem__)
openings = st.lists(
    st.tuples(
        st.just("open"), st.just(0.0), st.integers(0, len(USERS) - 1), st.sampled_from(REACHES)
    ),
    min_size=2,
    max_size=4,
)
scripts = st.builds(
    lambda first, rest: first + rest, openings, st.lists(ops, min_size=15, max_size=60)
)


# ------------------------------------------------------------------ the rule, from the core's state


def reaches(reachable: tuple[str, ...] | None, slot: core.Slot) -> bool:
    """Whether a process that can use ``reachable`` (None: every GPU) can use ``slot``."""
    if reachable is None:
        return True
    names = {slot.device_uuid, str(slot.device_index)} | (
        {slot.mig_uuid} if slot.mig_uuid else set()
    )
    return bool(names & set(reachable))


def placed_leases(scheduler: core.Scheduler, session_id: str) -> list[core.Lease]:
    record = scheduler.sessions[session_id]
    leases = [scheduler.leases[i] for i in sorted(record.leases)]
    return [lease for lease in leases if lease.state in PLACED_STATES and lease.slot is not None]


def rival_of(scheduler: core.Scheduler, lease: core.Lease, chaos: set[str]) -> str | None:
    """Who could preempt a placed lease (None: nobody)."""
    if lease.session_id in chaos:
        return "chaos mode"
    slot = scheduler.slots[lease.slot]  # type: ignore[index]
    band = priority_band(lease.base_priority)
    for other_id, other in sorted(scheduler.sessions.items()):
        if other_id == lease.session_id or other.detached:
            continue
        if may_ask_band(scheduler, other_id) > band and reaches(other.reachable, slot):
            return other_id
    return None


def wanted_slots(scheduler: core.Scheduler, waiter: core.Lease) -> set[str]:
    """The slots a queued request waits for: the one it makes room on, else every slot
    its wishes name and its memory fits."""
    if waiter.awaiting_memory_from:
        return {waiter.target_slot} if waiter.target_slot else set()
    keys, _ = scheduler.finder.candidate_slots(waiter.device_wish, waiter.slice, waiter.reachable)
    return {k for k in keys if scheduler.slots[k].memory_bytes >= waiter.memory_bytes}


def waiting_above(scheduler: core.Scheduler, lease: core.Lease) -> list[str]:
    """Queued requests of other sessions, of a band above ``lease``'s, that wait for its
    slot."""
    return [
        waiter.lease_id
        for waiter in scheduler.leases.values()
        if waiter.state == LeaseState.QUEUED
        and waiter.session_id != lease.session_id
        and priority_band(waiter.base_priority) > priority_band(lease.base_priority)
        and lease.slot in wanted_slots(scheduler, waiter)
    ]


def check_told(scheduler: core.Scheduler, told: dict[str, bool], chaos: set[str]) -> None:
    for session_id, record in scheduler.sessions.items():
        placed = placed_leases(scheduler, session_id)
        if record.detached or not placed:
            continue
        rivals = {lease.lease_id: rival_of(scheduler, lease, chaos) for lease in placed}
        if told.get(session_id):  # SAFETY
            assert not any(rivals.values()), (
                f"{session_id} runs its kernels as they are, but its leases have rivals {rivals}"
            )
            for lease in placed:
                waiting = waiting_above(scheduler, lease)
                assert not waiting, (
                    f"{session_id} runs its kernels as they are, but {waiting} of a higher "
                    f"band wait for the slot of its lease {lease.lease_id}"
                )
        else:  # LIVENESS
            assert any(rivals.values()), (
                f"{session_id} has no rival but was last told unrivalled={told.get(session_id)}"
            )


# ------------------------------------------------------------------ running a script


@dataclass
class Day:
    scheduler: core.Scheduler
    now: float = 10_000.0
    sessions: list[str] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    pending: list[tuple[str, core.PreemptionLevel]] = field(default_factory=list)
    told: dict[str, bool] = field(default_factory=dict)
    chaos: set[str] = field(default_factory=set)
    counter: int = 0
    rivalled: int = 0  # words "a rival exists" told, for the statistics

    def feed(self, happened: core.Event) -> None:
        actions = self.scheduler.handle(happened)
        for action in actions:
            if isinstance(action, core.PauseLease):
                self.pending.append((action.lease_id, action.level))
            elif isinstance(action, core.RivalryChanged):
                assert action.session_id in self.scheduler.sessions, action
                assert self.told.get(action.session_id) != action.unrivalled, action
                self.told[action.session_id] = action.unrivalled
                self.rivalled += not action.unrivalled
        if isinstance(happened, core.SessionClosed):
            self.told.pop(happened.session_id, None)
            self.chaos.discard(happened.session_id)
        check_told(self.scheduler, self.told, self.chaos)

    def active(self) -> list[core.Lease]:
        return sorted(self.scheduler.active_leases(), key=lambda lease: lease.arrival)


def play(script: list[tuple], policy: Policy) -> Day:
    day = Day(core.Scheduler(DEVICES, policy))
    for op in script:
        kind, gap = op[0], op[1]
        day.now += gap
        now = day.now
        if kind == "open":
            user, groups = USERS[op[2]]
            day.counter += 1
            session, pid = f"S{day.counter}", 50_000 + day.counter
            identity = core.Identity(uid=2000 + op[2], gid=100, pid=pid, user=user, groups=groups)
            day.feed(core.SessionOpened(now=now, session_id=session, identity=identity, reachable=op[3]))  # fmt: skip
            day.sessions.append(session)
            day.pids[session] = pid
        elif kind == "close" and day.sessions:
            session = day.sessions.pop(op[2] % len(day.sessions))
            day.feed(core.SessionClosed(now=now, session_id=session))
        elif kind == "request" and day.sessions:
            _, _, pick, priority, memory, device, capabilities, share = op
            day.counter += 1
            request = RequestLease(priority=priority, memory_bytes=memory, device=device,
                                   capabilities=capabilities, sm_share=share)  # fmt: skip
            session = day.sessions[pick % len(day.sessions)]
            day.feed(core.LeaseRequested(now=now, session_id=session, lease_id=f"L{day.counter}",
                                         request=request))  # fmt: skip
        elif kind == "release" and day.active():
            lease = day.active()[op[2] % len(day.active())]
            day.feed(core.LeaseReleased(now=now, session_id=lease.session_id, lease_id=lease.lease_id))  # fmt: skip
        elif kind == "confirm" and day.pending:
            lease_id, level = day.pending.pop(op[2] % len(day.pending))
            if op[3]:
                day.feed(core.PreemptionApplied(now=now, lease_id=lease_id, level=level))
            else:
                day.feed(core.PreemptionFailed(now=now, lease_id=lease_id, level=level, reason="test"))  # fmt: skip
        elif kind == "chaos" and day.sessions:
            session = day.sessions[op[2] % len(day.sessions)]
            (day.chaos.add if op[3] else day.chaos.discard)(session)
            day.feed(core.ChaosChanged(now=now, pid=day.pids[session], on=op[3]))
        elif kind == "drain":
            day.feed(core.DeviceDrained(now=now, device_index=op[2], drained=op[3]))
        else:
            day.feed(core.Tick(now=now))
    return day


@RIVALRY_SETTINGS
@given(script=scripts, policy=policies)
def test_a_session_runs_kernels_as_they_are_only_while_nobody_could_preempt_it(script, policy):
    day = play(script, policy)
    if day.rivalled:
        event("tells a session it has a rival")
    if any(lease.state == LeaseState.QUEUED for lease in day.scheduler.leases.values()):
        event("ends with a request waiting")


# ------------------------------------------------------------------ Rivals alone

SESSIONS = ["A", "B", "C", "D"]
GPU_NAMES = [frozenset({"GPU-0", "0"}), frozenset({"GPU-1", "1", "MIG-1a"})]
PURE_REACHES = [None, None, ("GPU-0",), ("1",), ("MIG-1a",), (), ("GPU-0", "GPU-1")]

pure_ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("open"), st.sampled_from(SESSIONS), priorities, st.sampled_from(PURE_REACHES)
        ),
        st.tuples(st.just("close"), st.sampled_from(SESSIONS)),
        st.tuples(st.just("ask"), st.sampled_from(SESSIONS), priorities),
        # The top priority of its requests still queued (None: none waits).
        st.tuples(st.just("wait"), st.sampled_from(SESSIONS), st.none() | priorities),
        st.tuples(st.just("chaos"), st.sampled_from(SESSIONS), st.booleans()),
        st.tuples(st.just("place"), st.sampled_from(SESSIONS), priorities, st.integers(0, 1)),
        st.tuples(st.just("unplace"), st.sampled_from(SESSIONS)),
    ),
    min_size=10,
    max_size=40,
)


@dataclass
class Model:
    """What the rule says, kept apart from :class:`Rivals`."""

    asked: dict[str, int] = field(default_factory=dict)  # open sessions: last request's band
    waiting: dict[str, int] = field(default_factory=dict)  # top band of their queued requests
    reach: dict[str, tuple[str, ...] | None] = field(default_factory=dict)
    chaos: set[str] = field(default_factory=set)
    placed: dict[str, list[PlacedLease]] = field(default_factory=dict)

    def has_rival(self, lease: PlacedLease) -> bool:
        if lease.session_id in self.chaos:
            return True
        return any(
            other != lease.session_id
            and max(band, self.waiting.get(other, -1)) > priority_band(lease.priority)
            and (self.reach[other] is None or bool(lease.gpu_names & set(self.reach[other] or ())))
            for other, band in self.asked.items()
        )

    def close(self, session: str) -> None:
        del self.asked[session], self.reach[session]
        self.waiting.pop(session, None)
        self.chaos.discard(session)
        self.placed.pop(session, None)

    def place(self, session: str, priority: int, gpu: int) -> None:
        leases = self.placed.setdefault(session, [])
        lease_id = f"{session}{len(leases)}"
        leases.append(
            PlacedLease(
                lease_id=lease_id, session_id=session, priority=priority, gpu_names=GPU_NAMES[gpu]
            )
        )


def _apply(rivals: Rivals, model: Model, op: tuple) -> int | None:
    """Feed one operation to both; the band Rivals answered."""
    kind, session = op[0], op[1]
    if session not in model.asked:
        if kind == "open":
            model.asked[session], model.reach[session] = priority_band(op[2]), op[3]
            return rivals.session_opened(session, op[2], op[3])
        # A request or queue change of a session it does not know (closed meanwhile).
        assert rivals.asked(session, LOW) is None and rivals.waiting(session, HIGH) is None
        return None
    if kind == "close":
        model.close(session)
        return rivals.session_closed(session)
    if kind == "ask":
        model.asked[session] = priority_band(op[2])
        return rivals.asked(session, op[2])
    if kind == "wait":
        if op[2] is None:
            model.waiting.pop(session, None)
        else:
            model.waiting[session] = priority_band(op[2])
        return rivals.waiting(session, op[2])
    if kind == "chaos":
        rivals.chaos(session, op[2])
        (model.chaos.add if op[2] else model.chaos.discard)(session)
    elif kind == "place":
        model.place(session, op[2], op[3])
    elif kind == "unplace" and model.placed.get(session):
        model.placed[session].pop(0)
    return None


@RIVALS_SETTINGS
@given(script=pure_ops)
def test_rivals_asked_only_where_an_event_may_matter_match_the_rule(script):
    rivals, model = Rivals(), Model()
    for op in script:
        below = _apply(rivals, model, op)
        # What the core asks about: the session the event names, and those with a placed
        # lease in a band below the one that changed.
        touched = {op[1]} | {
            other
            for other, leases in model.placed.items()
            if below is not None
            and leases
            and min(priority_band(p.priority) for p in leases) < below
        }
        rivals.changes({s: list(model.placed.get(s, [])) for s in sorted(touched)})
        for other, leases in model.placed.items():
            if not leases:
                continue
            expected = not any(model.has_rival(lease) for lease in leases)
            assert rivals.told(other) == expected, (other, leases, model)
