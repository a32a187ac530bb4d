"""A waiter's estimate is when its GPU is likely free: when every lease holding it is
likely done, each by its user's habits, not when the first of them is.

A short lease beside a long one used to make the estimate "any moment now" while the
long one had 41 s to go (issue 43); a holder whose user has no habits yet gave an
estimate from the other holders alone.
"""

from __future__ import annotations

from scheduler_helpers import GIB, LOW, NORMAL, Hub, h200_devices, of_type

from gpushare_ext.broker.scheduler import core


def hold_for(hub: Hub, session: str, lease_id: str, seconds: float) -> None:
    """One lease held ``seconds`` and released: the user's habit the estimate reads."""
    hub.request(session, lease_id, priority=NORMAL, memory=10 * GIB, device="0")
    hub.advance(seconds)
    hub.release(session, lease_id)


def waiter_told(hub: Hub) -> core.NotifyQueued:
    """What a request for the whole GPU, behind the holders, hears when it asks."""
    waiter = hub.open("waiter")
    actions = hub.request(waiter, "WAIT", priority=LOW, memory=140 * GIB, device="0")
    (notice,) = [n for n in of_type(actions, core.NotifyQueued) if n.lease_id == "WAIT"]
    return notice


def test_a_short_holder_beside_a_long_one_does_not_make_the_wait_look_over():
    hub = Hub(h200_devices(1))
    long_user, short_user = hub.open("ada"), hub.open("bo")
    hold_for(hub, long_user, "ADA-0", 60.0)  # ada's cells take a minute
    hold_for(hub, short_user, "BO-0", 1.0)  # bo's a second
    hub.request(long_user, "ADA-1", priority=NORMAL, memory=10 * GIB, device="0")
    hub.request(short_user, "BO-1", priority=NORMAL, memory=10 * GIB, device="0")
    hub.advance(19.0)  # bo is past his usual time; ada has 41 s of hers left

    notice = waiter_told(hub)

    assert set(notice.waiting_for) == {"ADA-1", "BO-1"}
    assert notice.estimate_s == 41.0


def test_a_user_s_latest_lease_is_the_one_with_the_most_time_left():
    hub = Hub(h200_devices(1))
    ada = hub.open("ada")
    hold_for(hub, ada, "ADA-0", 30.0)
    hub.request(ada, "ADA-1", priority=NORMAL, memory=10 * GIB, device="0")
    hub.advance(20.0)
    hub.request(hub.open("ada", uid=hub.scheduler.sessions[ada].identity.uid), "ADA-2",
                priority=NORMAL, memory=10 * GIB, device="0")  # fmt: skip
    hub.advance(5.0)  # ADA-1 has 5 s left by her habit, ADA-2 25 s

    assert waiter_told(hub).estimate_s == 25.0


def test_a_holder_with_no_habits_yet_leaves_the_wait_unestimated():
    hub = Hub(h200_devices(1))
    known, newcomer = hub.open("bo"), hub.open("cy")
    hold_for(hub, known, "BO-0", 5.0)
    hub.request(known, "BO-1", priority=NORMAL, memory=10 * GIB, device="0")
    hub.request(newcomer, "CY-1", priority=NORMAL, memory=10 * GIB, device="0")

    notice = waiter_told(hub)

    assert set(notice.waiting_for) == {"BO-1", "CY-1"}
    assert notice.estimate_s is None  # cy could hold it for a second or for an hour


def test_one_holder_counts_down_from_its_user_s_habit():
    hub = Hub(h200_devices(1))
    ada = hub.open("ada")
    hold_for(hub, ada, "ADA-0", 8.0)
    hub.request(ada, "ADA-1", priority=NORMAL, memory=10 * GIB, device="0")
    hub.advance(3.0)

    assert waiter_told(hub).estimate_s == 5.0
