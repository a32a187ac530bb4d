"""The queue line's estimate counts down between the broker's notices, and says so when
the wait would outlast the cell's timeout (it never promises a grant the timeout denies).
Once the holder's usual time is used up it says that, never "any moment now": the
estimate is a habit, not a promise the holder keeps."""

from __future__ import annotations

from gpushare_ext.protocol import Queued
from gpushare_ext.runtime.cell_lines import estimate_text as estimate_from
from gpushare_ext.runtime.cell_lines import queue_line
from gpushare_ext.runtime.leases import LeaseHandle, LeaseOptions


def _waiting(estimate_s: float | None, timeout_s: float | None = None) -> LeaseHandle:
    handle = LeaseHandle(lease_id="L7", options=LeaseOptions(timeout_s=timeout_s), output=None)
    handle.queued = Queued(
        lease_id="L7", position=1, waiting_for="user-3f2a", holder_priority=250,
        estimate_s=estimate_s, reason="the GPU is held by high-priority work",
    )  # fmt: skip
    handle.queued_at = 100.0
    return handle


def estimate_text(handle: LeaseHandle, waited_s: float, now: float) -> str:
    """The estimate as the session words it for ``handle`` at monotonic time ``now``."""
    return estimate_from(
        handle.queued,
        since_notice_s=now - handle.queued_at,
        waited_s=waited_s,
        timeout_s=handle.options.timeout_s,
    )


def test_the_estimate_counts_down_from_the_notice_that_gave_it():
    handle = _waiting(40.0)
    assert estimate_text(handle, waited_s=0.0, now=100.0) == ", about 40 s left"
    assert estimate_text(handle, waited_s=15.0, now=115.0) == ", about 25 s left"
    assert estimate_text(handle, waited_s=39.0, now=139.0) == ", about 1 s left"
    assert estimate_text(handle, waited_s=39.5, now=139.5) == ", the holder's usual time is up"
    assert estimate_text(handle, waited_s=41.0, now=141.0) == (
        ", the holder's usual time ran out 1 s ago"
    )
    assert estimate_text(handle, waited_s=52.0, now=152.0) == (
        ", the holder's usual time ran out 12 s ago"
    )


def test_no_moment_of_the_countdown_promises_any_moment_now():
    handle = _waiting(41.0, timeout_s=60.0)
    said = [estimate_text(handle, waited_s=t / 10, now=100.0 + t / 10) for t in range(0, 900)]
    assert not [text for text in said if "moment" in text]
    # A holder already past its usual time when the notice came (an estimate of 0).
    overdue = _waiting(0.0)
    assert estimate_text(overdue, waited_s=0.0, now=100.0) == ", the holder's usual time is up"


def test_an_estimate_past_the_timeout_says_so():
    handle = _waiting(40.0, timeout_s=30.0)
    assert estimate_text(handle, waited_s=10.0, now=110.0) == (
        ", about 30 s left, more than the 20 s before the timeout"
    )
    assert estimate_text(handle, waited_s=0.0, now=100.0) == (
        ", about 40 s left, more than the 30 s before the timeout"
    )
    short = _waiting(10.0, timeout_s=30.0)
    assert estimate_text(short, waited_s=0.0, now=100.0) == ", about 10 s left"


def test_no_estimate_no_words_and_the_line_still_reads_whole():
    handle = _waiting(None)
    assert estimate_text(handle, waited_s=3.0, now=103.0) == ""
    line = queue_line(handle.queued, 3.0, estimate_text(handle, waited_s=3.0, now=103.0))
    assert line.startswith("queued: position 1, waiting for user-3f2a (priority high) -- 3 s")
