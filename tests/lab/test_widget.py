"""The occupancy widget's Python side: it follows the broker without blocking and stops cleanly.

What the widget draws is checked in a real browser (test_browser.py); here the synced
traits are checked directly, since they are the whole contract with occupancy.js.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpushare_ext.protocol import PRIORITY_CLASSES
from gpushare_ext.widgets import OccupancyWidget, widget


def eventually(condition: Callable[[], bool], within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def own_leases(view: OccupancyWidget) -> list[tuple[str, str]]:
    return [(lease["label"], lease["state"]) for lease in view.snapshot.get("leases", [])]


def test_widget_shows_the_h200_and_its_profiles_at_once(broker):
    view = widget(broker)
    try:
        assert eventually(lambda: bool(view.snapshot), within_s=3.0)
        device = view.snapshot["devices"][0]["info"]
        assert device["name"] == "NVIDIA H200"
        assert not device["mig_enabled"]
        assert [p["name"] for p in device["profiles"]] == [
            "1g.18gb",
            "1g.18gb+me",
            "1g.35gb",
            "2g.35gb",
            "3g.71gb",
            "4g.71gb",
            "7g.141gb",
        ]
        assert view.error == ""
    finally:
        view.close()


def test_widget_follows_sessions_live(broker, sessions):
    view = widget(broker)
    high, low = sessions(), sessions()
    try:
        assert eventually(lambda: bool(view.snapshot))
        grant = high.request_lease(priority=PRIORITY_CLASSES["high"], label="explore")
        low.request_lease(priority=PRIORITY_CLASSES["low"], label="train")
        assert eventually(
            lambda: sorted(own_leases(view)) == [("explore", "running"), ("train", "queued")]
        )
        high.release(grant.lease_id)
        assert eventually(lambda: own_leases(view) == [("train", "running")])
    finally:
        view.close()


def test_widget_says_when_no_broker_is_reachable_and_recovers(short_tmp, start_broker):
    view = widget(short_tmp / "broker.sock")
    try:
        assert eventually(lambda: view.error != "")
        assert view.error.startswith(f"No GPU broker reachable at {short_tmp / 'broker.sock'}")
        assert view.snapshot == {}

        start_broker(directory=short_tmp)  # at that socket: the widget finds it on a retry
        assert eventually(lambda: bool(view.snapshot), within_s=5.0)
        assert view.error == ""
    finally:
        view.close()


def test_closing_the_widget_stops_its_thread_and_connection(broker):
    view = widget(broker)
    assert eventually(lambda: bool(view.snapshot))
    started = time.monotonic()
    view.close()
    assert time.monotonic() - started < 2.0
    assert not view.following
    names = lambda: {t.name for t in threading.enumerate()}  # noqa: E731
    assert "gpushare-occupancy-widget" not in names()
    assert eventually(lambda: "gpushare-broker-reader" not in names())  # connection closed


def test_widget_without_following_draws_a_given_snapshot(sessions):
    view = OccupancyWidget(follow=False)
    view.show(sessions().status())
    assert not view.following
    assert view.snapshot["devices"][0]["info"]["name"] == "NVIDIA H200"
    view.close()


def test_a_frontend_without_widgets_gets_the_status_table_as_text(broker, sessions):
    view = widget(broker)
    try:
        first = view._repr_mimebundle_()[0]["text/plain"]  # before the first update, too
        assert "gpushare on" in first and "NVIDIA H200" in first
        assert eventually(lambda: bool(view.snapshot))
        sessions().request_lease(priority=PRIORITY_CLASSES["normal"], label="text-fallback")
        assert eventually(lambda: "text-fallback" in view._repr_mimebundle_()[0]["text/plain"])
        assert "application/vnd.jupyter.widget-view+json" in view._repr_mimebundle_()[0]
    finally:
        view.close()
