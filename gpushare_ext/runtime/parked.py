"""This session's memory as the broker parked it, and how its restore goes.

A record the session keeps from the broker's ``Parked`` notice on; :mod:`parking`
shows and drives the restore.  It must not talk to the broker or show anything.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gpushare_ext.protocol import Parked, Queued
from gpushare_ext.units import format_duration, format_size


@dataclass(eq=False)
class ParkedMemory:
    """This session's memory as the broker parked it, and how its restore goes."""

    lease_id: str
    memory_bytes: int
    device_index: int
    reason: str
    since: float = field(default_factory=time.time)
    queued: Queued | None = None
    asked: bool = False  # its restore was asked for (a revoke then means it failed)
    failed: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    changed: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_notice(cls, notice: Parked) -> ParkedMemory:
        return cls(
            lease_id=notice.lease_id,
            memory_bytes=notice.memory_bytes,
            device_index=notice.device_index,
            reason=notice.reason,
        )

    def describe(self, now: float | None = None) -> str:
        ago = format_duration((now or time.time()) - self.since)
        return f"{format_size(self.memory_bytes)} parked {ago} ago"
