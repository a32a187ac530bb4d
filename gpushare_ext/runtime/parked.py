"""This session's memory as the broker parked it, and how its restore goes.

A record the session keeps from the broker's ``Parked`` notice on, moved by the
broker's notices about its restore; :mod:`parking` shows and drives the restore.  Also
whether this process may be parked at all.  It must not talk to the broker or show
anything.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpushare_ext.protocol import BrokerMessage, Parked, Queued, Released, Resume, Revoked
from gpushare_ext.runtime import interpose
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

    def follow(self, message: BrokerMessage, forget: Callable[[], None]) -> None:
        """How the restore goes, as the broker says; ``forget`` drops the park from the
        session (the memory is back on the GPU without a restore)."""
        if isinstance(message, Queued):
            self.queued = message
        elif isinstance(message, Resume):
            self.done.set()
        elif isinstance(message, Revoked) and not self.asked:
            # An admin cancelled the park: the broker restored it on the way out.
            forget()
            self.done.set()
        elif isinstance(message, Revoked):
            self.failed = message.reason
            self.done.set()
        elif isinstance(message, Released):
            # Ended without a restore: the park failed (nothing was moved), or an admin
            # cancelled it (which restores it).  Either way the memory is on the GPU.
            if not self.asked:
                forget()
            self.done.set()
        self.changed.set()


def why_not_parkable(simulated: bool) -> str:
    """Why the broker must not checkpoint this process ("" if it may): on the H200 a
    process that opened another process's GPU memory is checkpointed and then cannot
    be restored, and only the launch shim sees such imports."""
    if simulated:
        return ""  # nothing is checkpointed on a simulated GPU
    imports = interpose.ipc_imports()
    if imports is None:
        return (
            "started without the launch shim, so whether it opened another process's "
            "GPU memory (which a checkpoint cannot restore) is not known"
        )
    if imports:
        return (
            f"it opened another process's GPU memory ({imports} CUDA IPC import(s)), "
            "which a checkpoint cannot restore"
        )
    return ""
