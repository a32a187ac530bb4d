"""The broker's side of a session's park service: ask its launch shim to move its
parkable memory to host memory or back, and wait, bounded, for the answer.

A session started with parkable memory (``runtime/parkable.py``) has a thread of its
launch shim following its control block; the broker writes a request there and the
thread carries it out inside the process, at the host link's speed, with the memory's
addresses kept.  The wait is bounded by the bytes to move at a slow rate plus a margin,
and never asks anything of the event loop: call it off the loop.  This module decides
neither whom nor how much to park (the scheduler does), and must not touch the journal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpushare_ext.control_block import ControlBlock
from gpushare_ext.units import format_size

SLOWEST_GIB_PER_S = 1.0  # a request moving slower than this is given up on
MARGIN_S = 10.0  # ... after this much more (the thread looks at least once a second)
POLL_S = 0.005


@dataclass(frozen=True)
class ServiceAnswer:
    """What the park service did with one request (``answer`` 0: all that was asked)."""

    moved_bytes: int
    answer: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.answer == 0

    def describe(self, verb: str) -> str:
        rate = self.moved_bytes / 2**30 / self.seconds if self.seconds > 0 else 0.0
        said = f"{format_size(self.moved_bytes)} {verb} by the session in {self.seconds:.1f} s"
        if self.moved_bytes:
            said += f" ({rate:.1f} GiB/s)"
        return said if self.complete else said + f", short of what was asked (answer {self.answer})"


def deadline_for(moved_bytes: int) -> float:
    """Seconds to wait for a request moving ``moved_bytes``."""
    return moved_bytes / 2**30 / SLOWEST_GIB_PER_S + MARGIN_S


def _wait(block: ControlBlock, request: int, timeout_s: float) -> ServiceAnswer | None:
    started = time.monotonic()
    while (found := block.park_answer(request)) is None:
        if block.closed or time.monotonic() - started > timeout_s:
            return None
        time.sleep(POLL_S)
    return ServiceAnswer(found[0], found[1], time.monotonic() - started)


def park(block: ControlBlock, want_bytes: int = 0) -> ServiceAnswer | None:
    """Ask the session to park ``want_bytes`` (0: all its parkable memory) and wait for
    its answer; None when it has none to park or did not answer in time."""
    resident = block.parkable_resident_bytes
    if resident == 0:
        return None
    request = block.request_park(want_bytes)
    return _wait(block, request, deadline_for(min(want_bytes or resident, resident)))


def restore(block: ControlBlock, parked_bytes: int) -> ServiceAnswer | None:
    """Ask the session to bring back what it parked and wait for its answer (None: no
    answer in time; the session's own first launch brings it back regardless)."""
    request = block.request_restore()
    return _wait(block, request, deadline_for(parked_bytes))
