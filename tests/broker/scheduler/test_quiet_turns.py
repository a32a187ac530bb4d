"""A memory-bound waiter's remembered turn stands only while nothing it read changed.

Each story runs on a scheduler that keeps its line (and so remembers quiet turns) and
on one that serves every waiter in full on every event; both must act alike at every
step.  The stories first show that the head's turn is answered from memory at a tick,
then change one thing the turn depends on -- the holders, its band as it ages, the
memory NVML sees, a drain, the policy, a request joining ahead -- and check that the
turn is worked out again and does what a full turn does.  A wait that hangs on an idle
session (it could be parked once its cell ends) is never remembered.

The generated days of ``test_queue_notices`` compare the same two schedulers over busy
hubs (NVML readings, parking, drains, aging), the kept one answering turns from memory
where it can: that comparison covers the memo too.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_helpers import GIB, LOW, NORMAL, Hub, h200_devices, of_type

from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.scheduler.parking import HostMemory
from gpushare_ext.broker.scheduler.quiet_turns import QuietTurns
from gpushare_ext.broker.settings.policy import parse_policy

Story = Callable[[Hub], list[list[core.Action]]]


def quiet_turns(hub: Hub) -> QuietTurns:
    return hub.scheduler.passes.quiet_turns


def both(
    story: Story, policy: str = "[defaults]\nmax_leases = 100\n", devices: int = 1
) -> list[list]:
    """The actions of each step of ``story``, the same on both schedulers."""
    kept, everyone = Hub(), Hub()
    # A line (and remembered turns) even for a few waiters; every waiter served in full.
    kept.scheduler = core.Scheduler(h200_devices(devices), parse_policy(policy), line_from=0)
    everyone.scheduler = core.Scheduler(
        h200_devices(devices), parse_policy(policy), recompute_every_waiter=True
    )
    steps = story(kept)
    assert steps == story(everyone)
    return steps


def memory_bound(hub: Hub, *, holders: int = 4, priority: int = NORMAL) -> list[str]:
    """``holders`` leases of 30 GiB run on the 140 GiB GPU; three more wait, memory-bound
    (the head needs 10 GiB that nobody of a lower band holds); a tick remembers the
    head's turn.  The waiters' sessions."""
    for n in range(holders):
        hub.request(hub.open(f"h{n}"), f"H{n}", priority=priority, memory=30 * GIB)
    waiters = [hub.open(f"w{n}") for n in range(3)]
    for n, session in enumerate(waiters):
        hub.request(session, f"W{n}", memory=30 * GIB)
    hub.advance(1.0)
    return waiters


def recalled_at_a_tick(hub: Hub, head: str = "W0") -> list[core.Action]:
    """A tick that changes nothing: the head's turn comes from memory (on the scheduler
    that remembers turns) and says nothing."""
    before = quiet_turns(hub).recalled
    actions = hub.advance(1.0)
    if not hub.scheduler.passes.recompute_every_waiter:
        assert quiet_turns(hub).recalled == before + 1
        assert quiet_turns(hub).remembers(head)
    assert actions == []
    return actions


def test_a_memory_bound_head_is_answered_from_memory_while_nothing_changes():
    def story(hub: Hub) -> list[list[core.Action]]:
        memory_bound(hub)
        return [recalled_at_a_tick(hub) for _ in range(5)]

    both(story)


def test_a_holder_leaving_is_seen_by_the_head_at_once():
    def story(hub: Hub) -> list[list[core.Action]]:
        memory_bound(hub)
        steps = [recalled_at_a_tick(hub), hub.release("S1-h0", "H0")]
        assert hub.state("W0") == core.LeaseState.RUNNING
        return steps

    both(story)


def test_a_waiter_aging_into_a_higher_band_makes_room_at_the_band_crossing():
    # Holders low; the waiters start low too (90) and age 60 points a minute: about ten
    # seconds in they are normal, above the holders, and may evict one of them.
    policy = "[defaults]\nmax_leases = 100\naging_per_minute = 60\n"

    def story(hub: Hub) -> list[list[core.Action]]:
        for n in range(4):
            hub.request(hub.open(f"h{n}"), f"H{n}", priority=LOW, memory=30 * GIB)
        for n in range(3):
            hub.request(hub.open(f"w{n}"), f"W{n}", priority=90, memory=30 * GIB)
        steps = [hub.advance(1.0), recalled_at_a_tick(hub)]  # low still: nothing to do
        steps.append(hub.advance(9.0))  # 90 + 11 points: normal now
        assert of_type(steps[-1], core.PauseLease)
        return steps

    both(story, policy)


def test_memory_seen_outside_any_lease_changes_what_the_head_is_told():
    def story(hub: Hub) -> list[list[core.Action]]:
        memory_bound(hub, holders=3)  # 90 GiB held, 50 free: W0 runs, W1 waits
        steps = [recalled_at_a_tick(hub, "W1")]
        # A process the broker does not know holds 120 GiB: W1 now waits for memory no
        # lease declares (the GPU could not hold W1 beside it even if the leases ended).
        used = ((99_999, 120 * GIB),)
        seen = core.DeviceMemorySeen(now=hub.now, device_index=0, used_by_pid=used)
        steps.append(hub.handle(seen))
        told = {n.lease_id: n.reason for n in of_type(steps[-1], core.NotifyQueued)}
        assert "outside any lease" in told["W1"]
        return steps

    both(story)


def test_a_drain_changes_what_the_head_is_told():
    def story(hub: Hub) -> list[list[core.Action]]:
        memory_bound(hub)
        steps = [recalled_at_a_tick(hub), hub.drain(0)]
        assert "drained" in of_type(steps[-1], core.NotifyQueued)[0].reason
        return steps

    both(story)


def test_a_new_policy_is_read_by_the_next_turn():
    # Evictions allowed only by the new policy... of a lower band: holders low, waiters
    # normal, but the first policy evicts nobody.
    def story(hub: Hub) -> list[list[core.Action]]:
        hub.handle(
            core.PolicyChanged(
                now=hub.now,
                policy=parse_policy(
                    "[broker]\nevict_when_memory_needed = false\n[defaults]\nmax_leases = 100\n"
                ),
            )
        )
        memory_bound(hub, priority=LOW)
        steps = [recalled_at_a_tick(hub)]
        steps.append(
            hub.handle(
                core.PolicyChanged(
                    now=hub.now, policy=parse_policy("[defaults]\nmax_leases = 100\n")
                )
            )
        )
        assert of_type(steps[-1], core.PauseLease)  # a low holder is evicted for W0
        return steps

    both(story)


def test_a_request_joining_ahead_for_another_gpu_moves_the_head_back_and_it_is_told():
    # W0 waits for GPU 0, the first of its kind: served in turn whoever joins ahead for
    # GPU 1 (which is full too); its remembered turn read the queued requests ahead.
    def story(hub: Hub) -> list[list[core.Action]]:
        hub.request(hub.open("full1"), "FULL1", memory=140 * GIB, device="1")
        for n in range(4):
            hub.request(hub.open(f"h{n}"), f"H{n}", memory=30 * GIB, device="0")
        hub.request(hub.open("w0"), "W0", memory=30 * GIB, device="0")
        hub.advance(1.0)
        steps = [recalled_at_a_tick(hub)]
        early = hub.open("early")
        steps.append(hub.request(early, "EARLY", priority=NORMAL + 20, memory=30 * GIB, device="1"))
        positions = {n.lease_id: n.position for n in of_type(steps[-1], core.NotifyQueued)}
        assert positions == {"EARLY": 1, "W0": 2}
        return steps

    both(story, devices=2)


def test_a_request_joining_ahead_moves_the_head_back_and_it_is_told():
    def story(hub: Hub) -> list[list[core.Action]]:
        memory_bound(hub)
        steps = [recalled_at_a_tick(hub)]
        steps.append(hub.request(hub.open("early"), "EARLY", priority=NORMAL + 20, memory=30 * GIB))
        positions = {n.lease_id: n.position for n in of_type(steps[-1], core.NotifyQueued)}
        assert positions["EARLY"] == 1
        assert positions["W0"] == 2
        return steps

    both(story)


def test_a_wait_on_a_busy_notebook_is_not_remembered_and_ends_when_it_can_be_parked():
    # Three holders (90 GiB) and a notebook with a cell running that holds 40 GiB
    # outside any lease: W0 needs 20 GiB of it.  While its cell runs it cannot be
    # parked -- and nothing the memo compares changes when the cell ends, so the turn
    # is never remembered.
    def story(hub: Hub) -> list[list[core.Action]]:
        steps = [
            hub.handle(
                core.Tick(
                    now=hub.now, host=HostMemory(available_bytes=900 * GIB, total_bytes=1024 * GIB)
                )
            )
        ]
        for n in range(3):
            hub.request(hub.open(f"h{n}"), f"H{n}", memory=30 * GIB)
        notebook = hub.open("nb")
        steps.append(
            hub.handle(core.SessionActivity(now=hub.now, session_id=notebook, running=True))
        )
        seen = ((hub.pid_of(notebook), 40 * GIB),)
        steps.append(
            hub.handle(core.DeviceMemorySeen(now=hub.now, device_index=0, used_by_pid=seen))
        )
        for n in range(3):
            steps.append(hub.request(hub.open(f"w{n}"), f"W{n}", memory=30 * GIB))
        steps.append(hub.advance(1.0))
        if not hub.scheduler.passes.recompute_every_waiter:
            assert not quiet_turns(hub).remembers("W0")
        steps.append(
            hub.handle(core.SessionActivity(now=hub.now, session_id=notebook, running=False))
        )
        [park] = of_type(steps[-1], core.PauseLease)
        assert park.session_id == notebook
        return steps

    both(story)
