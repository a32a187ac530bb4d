"""What a paused session reads on the host: the broker's word in the control block.

Whether the broker asks this session to stop its kernels (:func:`asked_to_yield`),
whether a CUDA call would block because the process is locked (:func:`cuda_blocked`),
waiting until a yield is over (:func:`wait_until_resumed`), and the thread that sees a
Ctrl-C while the broker holds the session (:class:`PauseWatch`).

It only reads the block (a word of shared memory) and the shim's interrupt count; it
must not talk to the broker or decide what a Ctrl-C ends (the session does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from gpushare_ext.control_block import ControlBlock
from gpushare_ext.protocol import PreemptionLevel
from gpushare_ext.runtime import interpose

PAUSE_WATCH_S = 0.02  # how often a paused session looks for a Ctrl-C


def asked_to_yield(block: ControlBlock | None) -> bool:
    """The broker's control block asks the session to stop its kernels (a pause at the
    yield level or above). It is read on the host, so the session knows before the
    broker's own write of the yield flag has reached the GPU."""
    if block is None or block.closed or not block.paused:
        return False
    level = block.level
    return level is not None and level >= int(PreemptionLevel.YIELD)


def cuda_blocked(block: ControlBlock | None) -> bool:
    """The broker locks (or has evicted) this process: a CUDA call would block until it
    lets go, so waits must stay on the host meanwhile."""
    if block is None or block.closed or not block.paused:
        return False
    level = block.level
    return level is not None and level >= int(PreemptionLevel.LOCK)


def wait_until_resumed(
    block_of: Callable[[], ControlBlock | None],
    flag: Any,
    interrupted: Callable[[], bool] = lambda: False,
) -> None:
    """After a yield: wait until neither the control block nor the flag holds the launch,
    or until ``interrupted()`` (Ctrl-C).  The only thing waited for is the broker's word
    in the block, and every way the broker can go ends it: a resume, the lease ending (the
    state word goes to 0), the broker gone (the session opens the block itself), the
    session closed.  A flag still raised once nothing asks to yield is the session's own
    (the broker lowers its before it publishes), so it is lowered here."""
    delay = 1e-4
    while not interrupted():
        block = block_of()
        if not asked_to_yield(block):
            if flag.read() == 0:
                return
            if block is None or not block.paused:
                flag.set(0)
                return
        time.sleep(delay)
        delay = min(delay * 2, 2e-3)


class PauseWatch:
    """From the first pause on, a thread watches for Ctrl-C while the broker holds the
    session paused, and calls ``let_go`` for one.  It is needed because at the lock level
    the kernel's main thread may sit inside a CUDA call that returns only once the
    process is unlocked: Python's own handler would never run."""

    def __init__(
        self,
        block_of: Callable[[], ControlBlock | None],
        closed: Callable[[], bool],
        let_go: Callable[[], object],
    ) -> None:
        self._block_of = block_of
        self._closed = closed
        self._let_go = let_go
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start watching (once; not where the shim cannot count interrupts)."""
        if self._thread is not None or interpose.watch_interrupts() is None:
            return
        self._thread = threading.Thread(target=self._loop, name="gpushare-pause-watch", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # It reads the control block itself (a word of shared memory): the notice of a
        # pause may come before the broker has published the pause in the block.
        seen: int | None = None
        while not self._closed():
            time.sleep(PAUSE_WATCH_S)
            block = self._block_of()
            if block is None or block.closed or not block.paused:
                seen = None
                continue
            # The shim's handler goes in front again each time: Python code may have set
            # its own meanwhile (ipykernel at each cell, the launch hook for a launch).
            counted = interpose.watch_interrupts()
            if seen is None:
                seen = counted
            elif counted != seen:
                self._let_go()
                seen = None
