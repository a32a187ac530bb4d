"""A cell's lease as the session keeps it: what was asked, and what the broker said since.

:class:`LeaseOptions` is what a cell asks for, :class:`LeaseHandle` one lease's state
as the broker's notices moved it (through the one table of moves in ``lease_state``),
with what the cell's receipt needs.  The errors a request ends with live here too.

It must not talk to the broker or show anything: the session does both.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from gpushare_ext.lease_state import (
    ACTIVE,
    IllegalMove,
    LeaseState,
    check_move,
)
from gpushare_ext.protocol import (
    PRIORITY_CLASSES,
    Capabilities,
    Placement,
    Queued,
    RankPlacement,
    RequestLease,
    SliceWish,
    priority_value,
)
from gpushare_ext.runtime.cell_lines import PAUSED, PauseRecord
from gpushare_ext.runtime.cell_output import CellOutput
from gpushare_ext.runtime.errors import SessionError
from gpushare_ext.units import priority_band

OPEN_STATES = ACTIVE  # what a reconnect reclaims: queued, running, paused, evicted


class LeaseRefused(SessionError):
    """The broker refused the request (policy, impossible size, bad device)."""


class LeaseTimeout(SessionError, TimeoutError):
    """No grant within the cell's timeout; the request was withdrawn."""


class RankRequestError(SessionError, ValueError):
    """A gang asked for in a way that cannot work (the number of ranks, say)."""


@dataclass(frozen=True, kw_only=True)
class LeaseOptions:
    """What a cell asks for; ``%gpuconfig`` changes the session's defaults."""

    priority: int = priority_value("normal")
    memory_bytes: int | None = None
    device: str = "auto"
    timeout_s: float | None = None
    slice: SliceWish = SliceWish.AUTO
    sm_share: float = 1.0
    instrumented_only: bool = False
    ranks: int = 1  # more than one: a gang, one slice per worker process (run_gang)

    def request(self, capabilities: Capabilities, label: str = "") -> RequestLease:
        """What goes to the broker: the one request struct, sent and handed to its core
        unchanged (the timeout is the session's own business)."""
        return RequestLease(
            priority=self.priority,
            memory_bytes=self.memory_bytes,
            slice=self.slice,
            device=self.device,
            sm_share=self.sm_share,
            capabilities=capabilities,
            label=label[:256],
            ranks=self.ranks,
        )


@dataclass(eq=False)
class LeaseHandle:
    lease_id: str
    options: LeaseOptions
    output: CellOutput | None
    state: LeaseState = LeaseState.QUEUED
    bound: bool = False  # the process is bound to the placement (after a grant)
    placement: Placement | None = None
    granted_priority: int | None = None  # what the broker granted (a policy may lower it)
    ranks: list[RankPlacement] = field(default_factory=list)  # a gang's, once granted
    queued: Queued | None = None
    queued_at: float = 0.0  # monotonic time of the last queue notice (its estimate's start)
    # Memory freed for it (evictions, parks): the most it was told, and since when.
    freeing_bytes: int = 0
    freeing_since: float | None = None  # monotonic
    notice_said: bool = False  # the policy's word on the request was shown
    refusal: str = ""
    revoked: str = ""
    paused_since: float | None = None
    pauses_s: list[float] = field(default_factory=list)  # each pause's length, in order
    pause_log: list[PauseRecord] = field(default_factory=list)  # for the cell's receipt
    asked_at: float = field(default_factory=time.monotonic)
    granted_at: float | None = None  # monotonic, the first grant
    kernels_at_grant: dict[str, int] = field(default_factory=dict)
    pause_text: str = PAUSED
    events: list[tuple[float, str]] = field(default_factory=list)
    changed: threading.Event = field(default_factory=threading.Event)
    display_key: str = field(default_factory=lambda: f"gpushare-{uuid.uuid4().hex[:12]}")

    def note(self, what: str) -> None:
        self.events.append((time.time(), what))

    def move(self, state: LeaseState) -> bool:
        """Go to ``state`` if the state table allows it; otherwise keep the state, note
        why, and say False (a notice that came after the lease ended, say)."""
        try:
            self.state = check_move(self.lease_id, self.state, state)
        except IllegalMove as refused:
            self.note(f"ignored: {refused.message}")
            return False
        return True

    def show(self, suffix: str, text: str) -> None:
        """Show ``text`` as this lease's line ``suffix`` ("": the queue line), if it has
        a cell to show it in."""
        if self.output is not None:
            self.output.show(self.display_key + suffix, text)


def queue_is_bounded(handle: LeaseHandle) -> bool:
    """Whether the lease's work in flight is kept short: below the high band someone may
    pause it.  The priority the broker granted counts, not the one asked for: a "high"
    request the policy lowered can be paused like any other."""
    granted = handle.granted_priority
    if granted is None:
        granted = handle.options.priority
    return priority_band(granted) < priority_band(PRIORITY_CLASSES["high"])
