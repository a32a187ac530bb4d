"""Parking idle sessions: a request that needs the memory idle notebooks hold gets it by
checkpointing them (lowest priority and longest idle first), within the host's memory;
a parked session gets its memory back when it asks, waiting like a request if it must."""

from __future__ import annotations

import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from scheduler_helpers import GIB, HIGH, LOW, NORMAL, Hub, h200_devices, mig_devices, of_type, only
from test_core_properties import PROPERTY_SETTINGS, Run

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.parking import HOST_MARGIN, HostMemory, IdleSession, plan_parks
from gpushare_ext.broker.settings.policy import HostShare, Limits, Policy, parse_policy
from gpushare_ext.broker.settings.schema import PolicyError
from gpushare_ext.protocol import LeaseState, PreemptionLevel, RequestLease

BIG_HOST = HostMemory(available_bytes=900 * GIB, total_bytes=1024 * GIB)


def _hub(policy: Policy | None = None, host: HostMemory = BIG_HOST, **kw) -> Hub:
    hub = Hub(policy=policy, **kw)
    hub.handle(core.Tick(now=hub.now, host=host))
    return hub


def _seen(hub: Hub, used: dict[int, int], device: int = 0) -> list[core.Action]:
    return hub.handle(
        core.DeviceMemorySeen(now=hub.now, device_index=device, used_by_pid=tuple(used.items()))
    )


def _idle_with(hub: Hub, user: str, *, priority: int = NORMAL, lease: str = "") -> str:
    """A session that ran one cell under a lease (what NVML then sees it keep on the GPU
    is each test's ``_seen``)."""
    session = hub.open(user)
    lease_id = lease or f"{user}-cell"
    hub.request(session, lease_id, priority=priority, memory=1 * GIB)
    hub.release(session, lease_id)
    # The cell ended, and its session said it may be checkpointed.
    hub.handle(core.SessionActivity(now=hub.now, session_id=session, running=False))
    return session


def _parks(actions: list[core.Action]) -> list[core.PauseLease]:
    return [a for a in of_type(actions, core.PauseLease) if a.parks_bytes]


def _a_high_request_beside_an_idle_notebook(hub: Hub) -> tuple[str, str, list[core.PauseLease]]:
    """Ada's low-priority notebook idles holding 100 GiB; Bo asks for 60 GiB at high
    priority (lease B1).  Returns both sessions and the parks that request made."""
    ada = _idle_with(hub, "ada", priority=LOW)
    bo = hub.open("bo")
    _seen(hub, {hub.pid_of(ada): 100 * GIB})
    return ada, bo, _parks(hub.request(bo, "B1", priority=HIGH, memory=60 * GIB))


def test_a_request_that_needs_idle_memory_parks_the_lowest_priority_idle_session_first():
    hub = _hub()
    ada = _idle_with(hub, "ada", priority=LOW)
    bo = _idle_with(hub, "bo")
    cy = hub.open("cy")
    _seen(hub, {hub.pid_of(ada): 60 * GIB, hub.pid_of(bo): 60 * GIB})

    actions = hub.request(cy, "H1", priority=HIGH, memory=80 * GIB)

    [park] = _parks(actions)  # 140 - 120 + 60 = 80: one park is enough
    assert park.session_id == ada and park.level == PreemptionLevel.EVICT
    assert park.parks_bytes == 60 * GIB and park.for_lease == "H1"
    assert not park.keeps_lock  # a failed park is undone whole: the session runs again
    assert "parked to free its GPU memory for high lease H1" in park.reason
    assert not of_type(actions, core.GrantLease)
    queued = only(actions, core.NotifyQueued)
    assert "parking idle sessions" in queued.reason

    actions = hub.applied(park.lease_id, PreemptionLevel.EVICT)
    assert only(actions, core.GrantLease).lease_id == "H1"
    assert hub.state(park.lease_id) == LeaseState.EVICTED


def test_among_equal_priorities_the_session_idle_longest_is_parked_first():
    hub = _hub()
    ada = _idle_with(hub, "ada")
    hub.now += 600
    bo = _idle_with(hub, "bo")
    cy = hub.open("cy")
    _seen(hub, {hub.pid_of(ada): 50 * GIB, hub.pid_of(bo): 50 * GIB})
    [park] = _parks(hub.request(cy, "C1", priority=NORMAL, memory=80 * GIB))
    assert park.session_id == ada


def test_an_idle_session_of_a_higher_band_is_not_parked_for_a_lower_request():
    hub = _hub()
    ada = _idle_with(hub, "ada", priority=HIGH)
    bo = hub.open("bo")
    _seen(hub, {hub.pid_of(ada): 100 * GIB})
    actions = hub.request(bo, "B1", priority=LOW, memory=60 * GIB)
    assert not _parks(actions) and not of_type(actions, core.GrantLease)
    assert "held outside any lease" in only(actions, core.NotifyQueued).reason


def test_a_session_with_a_cell_running_or_a_lease_is_never_parked():
    hub = _hub()
    ada = _idle_with(hub, "ada", priority=LOW)
    bo = hub.open("bo")
    hub.request(bo, "B0", memory=10 * GIB)  # bo holds a lease and more beside it
    hub.handle(core.SessionActivity(now=hub.now, session_id=ada, running=True))
    _seen(hub, {hub.pid_of(ada): 100 * GIB, hub.pid_of(bo): 30 * GIB})
    cy = hub.open("cy")
    actions = hub.request(cy, "H1", priority=HIGH, memory=60 * GIB)
    assert not _parks(actions)  # ada computes in a plain cell; bo is not idle

    actions = hub.handle(core.SessionActivity(now=hub.now, session_id=ada, running=False))
    assert [p.session_id for p in _parks(actions)] == [ada]


def test_the_host_memory_limit_skips_a_session_too_big_and_says_so():
    host = HostMemory(available_bytes=100 * GIB, total_bytes=128 * GIB)
    hub = _hub(Policy(park_host_limit=HostShare(percent=50.0)), host)  # room: 64 GiB
    ada = _idle_with(hub, "ada", priority=LOW)
    bo = hub.open("bo")
    _seen(hub, {hub.pid_of(ada): 90 * GIB})
    actions = hub.request(bo, "B1", priority=HIGH, memory=80 * GIB)
    assert not _parks(actions)
    reason = only(actions, core.NotifyQueued).reason
    assert "an idle session holds 90.0 GiB, but the host has room for 64.0 GiB" in reason

    # A smaller idle session fits the host and frees enough.
    cy = _idle_with(hub, "cy", priority=LOW)
    hub.release(bo, "B1")
    _seen(hub, {hub.pid_of(ada): 30 * GIB, hub.pid_of(cy): 40 * GIB})
    actions = hub.request(bo, "B2", priority=HIGH, memory=110 * GIB)
    assert [p.session_id for p in _parks(actions)] == [cy]


def test_without_a_reading_of_the_host_nothing_is_parked():
    hub = Hub()  # no tick has read the host's memory yet
    _ada, _bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    assert not parks


def test_parking_is_off_when_the_policy_says_so():
    hub = _hub(Policy(park_when_memory_needed=False))
    _ada, _bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    assert not parks


def test_mps_clients_and_mig_instances_are_never_parked():
    hub = _hub(Policy(mps=True))
    ada, bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    assert not parks

    hub = _hub(devices=mig_devices())  # 3g.71gb, 2g.35gb, 1g.18gb
    ada = _idle_with(hub, "ada", priority=LOW)
    _seen(hub, {hub.pid_of(ada): 100 * GIB})  # not read per instance: nothing to park
    bo = hub.open("bo")
    assert not _parks(hub.request(bo, "B1", priority=HIGH, memory=60 * GIB))


def test_a_failed_park_leaves_the_session_unlocked_and_it_is_never_tried_again():
    hub = _hub()
    ada, _bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    [park] = parks

    actions = hub.failed(park.lease_id, PreemptionLevel.EVICT, "cuCheckpointProcessCheckpoint: 2")
    ended = only(actions, core.LeaseEnded)
    assert ended.lease_id == park.lease_id and ended.undo_level is None
    assert "could not be parked" in hub.scheduler.sessions[ada].unparkable
    assert not _parks(hub.advance(1.0))
    assert hub.state("B1") == LeaseState.QUEUED


def test_a_parked_session_gets_its_memory_back_when_it_asks_and_waits_if_it_must():
    hub = _hub()
    ada, bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    [park] = parks
    hub.applied(park.lease_id, PreemptionLevel.EVICT)
    assert hub.state("B1") == LeaseState.RUNNING
    assert not of_type(hub.advance(60.0), core.ResumeLease)  # not before it asks

    actions = hub.handle(core.RestoreAsked(now=hub.now, session_id=ada, lease_id=park.lease_id))
    waiting = only(actions, core.NotifyQueued)  # 100 + 60 > 140: it waits for bo
    assert waiting.lease_id == park.lease_id

    actions = hub.release(bo, "B1")
    resume = only(actions, core.ResumeLease)
    assert resume.lease_id == park.lease_id and resume.undo_level == PreemptionLevel.EVICT
    assert resume.restores_park
    hub.release(ada, park.lease_id)  # the session lets its park lease go once restored
    assert hub.scheduler.sessions[ada].leases == set()


def test_a_cancelled_restore_stays_parked():
    hub = _hub()
    ada, bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    [park] = parks
    hub.applied(park.lease_id, PreemptionLevel.EVICT)
    hub.handle(core.RestoreAsked(now=hub.now, session_id=ada, lease_id=park.lease_id))
    hub.handle(core.RestoreAsked(now=hub.now, session_id=ada, lease_id=park.lease_id, cancel=True))
    assert not of_type(hub.release(bo, "B1"), core.ResumeLease)
    assert hub.state(park.lease_id) == LeaseState.EVICTED


def test_only_the_parked_session_may_ask_for_its_memory():
    hub = _hub()
    _ada, bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    [park] = parks
    with pytest.raises(core.SchedulerError, match="no parked memory"):
        hub.handle(core.RestoreAsked(now=hub.now, session_id=bo, lease_id=park.lease_id))
    with pytest.raises(core.SchedulerError, match="no parked memory"):
        hub.handle(core.RestoreAsked(now=hub.now, session_id=bo, lease_id="B1"))


def test_sessions_idle_longer_than_park_idle_after_are_parked_by_the_tick():
    policy = parse_policy(
        '[defaults]\npark_idle_after = "15m"\n[users.bo]\npark_idle_after = "off"\n'
    )
    hub = _hub(policy)
    ada = _idle_with(hub, "ada")
    bo = _idle_with(hub, "bo")
    _seen(hub, {hub.pid_of(ada): 30 * GIB, hub.pid_of(bo): 30 * GIB})
    assert not _parks(hub.advance(14 * 60))
    [park] = _parks(hub.advance(61))
    assert park.session_id == ada and park.for_lease == ""
    assert park.reason == "parked: idle for 15 min (park_idle_after 15 min)"
    assert not _parks(hub.advance(3600))  # bo's policy says never; ada is parked already


def test_a_parked_session_does_not_count_against_max_leases():
    hub = _hub(Policy(defaults=Limits(max_leases=1)))
    ada, _bo, parks = _a_high_request_beside_an_idle_notebook(hub)
    [park] = parks
    hub.applied(park.lease_id, PreemptionLevel.EVICT)
    assert not of_type(hub.request(ada, "A2", memory=1 * GIB), core.RefuseRequest)


def test_a_bad_park_setting_is_one_line_naming_the_key():
    with pytest.raises(PolicyError, match=r"defaults.park_idle_after = .soon.: must be a duration"):
        parse_policy('[defaults]\npark_idle_after = "soon"\n')
    with pytest.raises(PolicyError, match=r"broker.park_host_limit = .200%.: must be a share"):
        parse_policy('[broker]\npark_host_limit = "200%"\n')
    assert parse_policy('[broker]\npark_host_limit = "64GiB"\n').park_host_limit.of(0) == 64 * GIB


def test_plan_parks_takes_what_the_host_has_room_for_in_order():
    def idle(name: str, gib: int, priority: int = NORMAL, since: float = 0.0) -> IdleSession:
        return IdleSession(session_id=name, pid=1, user=name, held_bytes=gib * GIB,
                           last_priority=priority, idle_since=since)  # fmt: skip

    sessions = [idle("a", 50, since=5.0), idle("b", 30, priority=LOW), idle("c", 20, since=1.0)]
    plan = plan_parks(sessions, 60 * GIB, band=1, room_bytes=1000 * GIB)
    assert [s.session_id for s in plan.chosen] == ["b", "c", "a"][:3]
    assert plan.freed_bytes == 100 * GIB
    plan = plan_parks(sessions, 60 * GIB, band=1, room_bytes=45 * GIB)
    assert [s.session_id for s in plan.chosen] == ["b"] and "room for 15.0 GiB" in plan.refusal
    assert HOST_MARGIN == 4 * GIB


# ------------------------------------------------------------------ the property

idle_notebooks = st.lists(
    st.tuples(st.sampled_from([LOW, NORMAL, HIGH]), st.sampled_from([10, 30, 60, 90])),
    min_size=1,
    max_size=4,
)
steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("request"),
            st.sampled_from([LOW, NORMAL, HIGH]),
            st.sampled_from([10, 40, 80, 130]),
        ),
        st.tuples(st.just("confirm"), st.integers(0, 9), st.booleans()),
        st.tuples(st.just("release"), st.integers(0, 9)),
        st.tuples(st.just("restore"), st.integers(0, 9), st.booleans()),
        st.tuples(st.just("seen"), st.integers(0, 9), st.sampled_from([0, 20, 60])),
        st.tuples(st.just("tick"), st.sampled_from([1.0, 600.0])),
    ),
    min_size=5,
    max_size=40,
)


@PROPERTY_SETTINGS
@given(
    notebooks=idle_notebooks,
    steps=steps,
    available_gib=st.sampled_from([0, 60, 200, 900]),
    idle_after=st.sampled_from(["off", "15m"]),
)
def test_parking_never_grants_beyond_what_nvml_says_is_free_plus_what_it_freed(
    notebooks, steps, available_gib, idle_after
):
    run = Run(
        core.Scheduler(
            h200_devices(), parse_policy(f'[defaults]\npark_idle_after = "{idle_after}"')
        )
    )
    host = HostMemory(available_bytes=available_gib * GIB, total_bytes=1024 * GIB)
    run.feed(core.Tick(now=run.now, host=host))
    used: dict[int, int] = {}
    for index, (priority, gib) in enumerate(notebooks):
        session, pid = f"N{index}", 60_000 + index
        identity = core.Identity(uid=3000 + index, gid=100, pid=pid, user=f"u{index}")
        run.feed(core.SessionOpened(now=run.now, session_id=session, identity=identity))
        run.feed(core.LeaseRequested(now=run.now, session_id=session, lease_id=f"{session}-cell",
                                     request=RequestLease(priority=priority, memory_bytes=GIB)))  # fmt: skip
        run.feed(core.LeaseReleased(now=run.now, session_id=session, lease_id=f"{session}-cell"))
        run.feed(core.SessionActivity(now=run.now, session_id=session, running=False))
        run.sessions.append(session)
        run.pids[session] = pid
        used[pid] = gib * GIB
    run.feed(core.DeviceMemorySeen(now=run.now, device_index=0, used_by_pid=tuple(used.items())))
    asker = core.Identity(uid=4000, gid=100, pid=70_000, user="asker")
    run.feed(core.SessionOpened(now=run.now, session_id="A", identity=asker))
    for step in steps:
        run.now += 1.0
        kind = step[0]
        if kind == "request":
            run.counter += 1
            run.feed(core.LeaseRequested(now=run.now, session_id="A", lease_id=f"R{run.counter}",
                                         request=RequestLease(priority=step[1],
                                                              memory_bytes=step[2] * GIB)))  # fmt: skip
        elif kind == "confirm" and run.pending:
            lease_id, level = run.pending.pop(step[1] % len(run.pending))
            if step[2]:
                run.feed(core.PreemptionApplied(now=run.now, lease_id=lease_id, level=level))
                lease = run.scheduler.lease_of(lease_id)
                if lease is not None and lease.parks_session:
                    used.pop(lease.identity.pid, None)  # NVML: its memory is on the host now
            else:
                run.feed(core.PreemptionFailed(now=run.now, lease_id=lease_id, level=level,
                                               reason="test"))  # fmt: skip
        elif kind == "release":
            mine = [lease for lease in run.active() if lease.session_id == "A"]
            if mine:
                lease = mine[step[1] % len(mine)]
                run.feed(core.LeaseReleased(now=run.now, session_id="A", lease_id=lease.lease_id))
        elif kind == "restore":
            parks = [lease for lease in run.active() if lease.parks_session]
            if parks:
                park = parks[step[1] % len(parks)]
                run.feed(core.RestoreAsked(now=run.now, session_id=park.session_id,
                                           lease_id=park.lease_id, cancel=step[2]))  # fmt: skip
        elif kind == "seen":
            session = run.sessions[step[1] % len(run.sessions)]
            record = run.scheduler.sessions[session]
            if not record.leases:  # an idle notebook's arrays change size; parked ones do not
                used[run.pids[session]] = step[2] * GIB
            run.feed(core.DeviceMemorySeen(now=run.now, device_index=0,
                                           used_by_pid=tuple(used.items())))  # fmt: skip
        else:
            run.feed(core.Tick(now=run.now + step[1]))
            run.now += step[1]
        # Every park is of an idle known session, and the host's room was respected.
        for lease in run.active():
            if lease.parks_session:
                assert lease.session_id in run.sessions
        on_host = sum(
            lease.memory_bytes
            for lease in run.active()
            if lease.parks_session and lease.state == LeaseState.EVICTED
        )
        assert on_host <= max(0, min(512 * GIB, available_gib * GIB - HOST_MARGIN)) or not on_host
    actions = [a for outcome in run.outcomes if isinstance(outcome, list) for a in outcome]
    if any(isinstance(a, core.PauseLease) and a.parks_bytes for a in actions):
        event("parks an idle session")
    if any(isinstance(a, core.ResumeLease) and a.restores_park for a in actions):
        event("restores a parked session")


def test_a_notebook_may_be_parked_on_request_and_each_refusal_says_why():
    hub = _hub()
    ada = _idle_with(hub, "ada", priority=LOW)
    bo = hub.open("bo")
    hub.request(bo, "B1", memory=10 * GIB)
    _seen(hub, {hub.pid_of(ada): 40 * GIB})

    def ask(pid: int) -> list[core.Action]:
        return hub.handle(core.ParkAsked(now=hub.now, pid=pid, by="admin"))

    with pytest.raises(core.SchedulerError, match="not a notebook session of this broker"):
        ask(99_999)
    with pytest.raises(core.SchedulerError, match="holds a lease"):
        ask(hub.pid_of(bo))
    hub.handle(core.SessionActivity(now=hub.now, session_id=ada, running=True))
    with pytest.raises(core.SchedulerError, match="has a cell running"):
        ask(hub.pid_of(ada))
    hub.handle(core.SessionActivity(now=hub.now, session_id=ada, running=False))

    [park] = _parks(ask(hub.pid_of(ada)))
    assert park.reason == "parked by admin" and park.parks_bytes == 40 * GIB
    with pytest.raises(core.SchedulerError, match="is parked already"):
        ask(hub.pid_of(ada))


def test_a_park_on_request_respects_the_host_budget_and_needs_memory_to_park():
    host = HostMemory(available_bytes=30 * GIB, total_bytes=64 * GIB)
    hub = _hub(host=host)
    ada = _idle_with(hub, "ada")
    cy = _idle_with(hub, "cy")
    _seen(hub, {hub.pid_of(ada): 40 * GIB})
    with pytest.raises(core.SchedulerError, match=r"host has room for 26\.0 GiB"):
        hub.handle(core.ParkAsked(now=hub.now, pid=hub.pid_of(ada), by="ada"))
    with pytest.raises(core.SchedulerError, match="holds no GPU memory outside its leases"):
        hub.handle(core.ParkAsked(now=hub.now, pid=hub.pid_of(cy), by="cy"))


def test_a_session_that_says_it_cannot_be_checkpointed_or_never_said_is_not_parked():
    hub = _hub()
    ada = _idle_with(hub, "ada", priority=LOW)
    hub.handle(
        core.SessionActivity(
            now=hub.now, session_id=ada, running=False,
            unparkable="it opened another process's GPU memory (1 CUDA IPC import(s))",
        )
    )  # fmt: skip
    silent = hub.open("cy")  # a client that never runs the cell hooks
    _seen(hub, {hub.pid_of(ada): 60 * GIB, hub.pid_of(silent): 60 * GIB})
    bo = hub.open("bo")
    actions = hub.request(bo, "B1", priority=HIGH, memory=60 * GIB)
    assert not _parks(actions)
    with pytest.raises(core.SchedulerError, match="cannot be parked: it opened another process"):
        hub.handle(core.ParkAsked(now=hub.now, pid=hub.pid_of(ada), by="admin"))
    with pytest.raises(
        core.SchedulerError, match="has not said yet whether it can be checkpointed"
    ):
        hub.handle(core.ParkAsked(now=hub.now, pid=hub.pid_of(silent), by="admin"))


# ------------------------------------------------------------------ part of a session


def _idle_parkable(hub: Hub, user: str, parkable_gib: int, priority: int = LOW) -> str:
    """An idle session whose launch shim said it can park ``parkable_gib`` itself."""
    session = _idle_with(hub, user, priority=priority)
    hub.handle(
        core.SessionActivity(
            now=hub.now, session_id=session, running=False, parkable_bytes=parkable_gib * GIB
        )
    )
    return session


def test_only_what_a_request_needs_is_parked_of_a_session_whose_shim_can_park_part():
    hub = _hub()
    ada = _idle_parkable(hub, "ada", parkable_gib=95)
    bo = hub.open("bo")
    _seen(hub, {hub.pid_of(ada): 100 * GIB})

    [park] = _parks(hub.request(bo, "B1", priority=HIGH, memory=60 * GIB))

    # 140 GiB less Ada's 100 leaves 40: 20 more are needed, not all 100.
    assert park.session_id == ada and park.parks_part and park.parks_bytes == 20 * GIB
    actions = hub.applied(park.lease_id, PreemptionLevel.EVICT)
    assert only(actions, core.GrantLease).lease_id == "B1"
    # NVML then sees Ada keep the other 80 GiB: nothing more is granted beyond it.
    _seen(hub, {hub.pid_of(ada): 80 * GIB, hub.pid_of(bo): 60 * GIB})
    cy = hub.open("cy")
    assert not of_type(hub.request(cy, "C1", priority=LOW, memory=10 * GIB), core.GrantLease)


def test_a_whole_session_is_parked_where_its_shim_cannot_park_enough_of_it():
    hub = _hub()
    ada = _idle_parkable(hub, "ada", parkable_gib=10)  # less than the 20 GiB needed
    bo = hub.open("bo")
    _seen(hub, {hub.pid_of(ada): 100 * GIB})

    [park] = _parks(hub.request(bo, "B1", priority=HIGH, memory=60 * GIB))

    assert not park.parks_part and park.parks_bytes == 100 * GIB


def test_plan_parks_parks_part_of_the_last_session_only():
    def idle(name: str, gib: int, parkable: int, since: float) -> IdleSession:
        return IdleSession(session_id=name, pid=1, user=name, held_bytes=gib * GIB,
                           last_priority=LOW, idle_since=since,
                           parkable_bytes=parkable * GIB)  # fmt: skip

    sessions = [idle("a", 30, 30, since=1.0), idle("b", 50, 48, since=2.0)]
    plan = plan_parks(sessions, 45 * GIB + 1, band=1, room_bytes=1000 * GIB)
    assert [(s.session_id, s.held_bytes // GIB, s.part) for s in plan.chosen] == [
        ("a", 30, False),
        ("b", 16, True),  # 15 GiB and a byte, in whole GiB
    ]
    assert plan.freed_bytes == 46 * GIB
