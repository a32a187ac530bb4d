"""The broker's reasons: the words the scheduler core gives a lease's stop, its wait and
its end, which the journal keeps, ``gpushare status`` shows and the session's cell says.

What it is for: one place for each reason, so that the core's parts (placement's moves,
the watchdog, admission after a restart, parking) word the same event the same way and
a change of wording is one edit.

What it must not do: decide anything or import any part of the broker; the reasons take
what they name (the lease that needs the room) as arguments.
"""

from __future__ import annotations

PAUSED_FOR_HIGHER = "paused for a higher-priority session"
EVICTED_FOR_HIGHER = "evicted for a higher-priority session"
NOT_PAUSED_AGAIN = "could not be paused again after the broker restarted"
EVICTING = "waiting for lower-priority sessions to be evicted"
PARKING = "parking idle sessions (their memory goes to the host)"


def freeing(size: str, evicting: bool) -> str:
    """A request waiting for ``size`` of memory (e.g. "61.0 GiB") to leave the GPU."""
    return f"freeing {size}: {EVICTING if evicting else PARKING}"


def paused_for(who: str) -> str:
    """A lease paused so that ``who`` (e.g. "high lease L2") can run."""
    return f"{PAUSED_FOR_HIGHER} ({who})"


def evicted_for(who: str) -> str:
    """A lease whose memory went to the host so that ``who`` fits."""
    return f"evicted for {who}"


def parked_for(who: str) -> str:
    """An idle session whose memory went to the host so that ``who`` fits."""
    return f"parked to free its GPU memory for {who}"


def over_quota(used: str, leased: str) -> str:
    """A lease the watchdog paused: its process holds more than it leased."""
    return f"over its memory quota: {used} in use, {leased} leased"
