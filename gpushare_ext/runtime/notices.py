"""The broker's notices about one lease, applied to its handle and shown in its cell.

A grant, a queue notice, a refusal, a pause and its resume, a revocation, a release:
each moves the :class:`LeaseHandle` through the state table, keeps what the receipt
needs, and shows its one line (worded in :mod:`cell_lines`).  Runs on the broker's
listener thread, and on the cell's thread for notices that came before the handle.
When the cell ends, :func:`say_receipt` sums up what its lease went through.

It must not talk to the broker or touch the process's holds; what it needs of the
session comes through :class:`PauseContext`.
"""

from __future__ import annotations

import time
from typing import Protocol

from gpushare_ext.lease_state import LeaseState
from gpushare_ext.protocol import (
    BrokerMessage,
    Granted,
    Preempt,
    Queued,
    Refused,
    Released,
    Resume,
    Revoked,
)
from gpushare_ext.runtime import cell_lines, preemptible
from gpushare_ext.runtime.cell_lines import PauseRecord, kernel_words, receipt_line
from gpushare_ext.runtime.leases import LeaseHandle

# The note a revocation leaves in the lease's events: the receipt reads its time back.
REVOKED_NOTE = "revoked: "


class PauseContext(Protocol):
    """What a pause notice needs of the session."""

    def protection(self) -> str:
        """How this session is stopped when paused, in a few words."""

    def watch_interrupts_while_paused(self) -> None:
        """From the first pause on, a Ctrl-C while paused must be seen."""


def record_grant(handle: LeaseHandle, granted: Granted) -> None:
    """The lease runs on ``granted``'s placement (the first grant starts the receipt)."""
    if handle.granted_at is None:
        handle.granted_at = time.monotonic()
        handle.kernels_at_grant = preemptible.counts()
    handle.placement = granted.placement
    handle.granted_priority = granted.priority
    handle.ranks = list(granted.ranks)
    handle.move(LeaseState.RUNNING)


def record_queued(handle: LeaseHandle, queued: Queued) -> None:
    handle.queued = queued
    handle.queued_at = time.monotonic()  # the estimate counts down from here
    if queued.freeing_bytes and handle.granted_at is None:
        if handle.freeing_since is None:
            handle.freeing_since = handle.queued_at
        handle.freeing_bytes = max(handle.freeing_bytes, queued.freeing_bytes)


def say_grant_notice(handle: LeaseHandle, answer: Granted | Queued) -> None:
    """What the policy changed in the request (a priority it lowered): one line, once,
    as soon as the broker says it, whether the request waits first or not."""
    if not answer.notice or handle.notice_said:
        return
    handle.notice_said = True
    handle.note(answer.notice)
    handle.show("-notice", cell_lines.notice(answer.notice))


def say_revoked(handle: LeaseHandle, text: str) -> None:
    """A line for a lease taken away.  A request still waiting gets none: the error
    its cell ends with says the same, and two lines would tell one thing twice."""
    if handle.placement is not None:
        handle.show("-revoked", text)


def revoke(handle: LeaseHandle, why: str) -> None:
    """The lease is gone for ``why`` (a restart that did not keep it, a broker that did
    not come back): its waiters wake, and its cell says so."""
    handle.revoked = why
    if handle.move(LeaseState.REVOKED):
        handle.note(REVOKED_NOTE + why)
    handle.changed.set()
    say_revoked(handle, cell_lines.notice(why))


def apply_notice(handle: LeaseHandle, message: BrokerMessage, session: PauseContext) -> None:
    if isinstance(message, Granted):
        record_grant(handle, message)
        handle.note("granted")
        say_grant_notice(handle, message)
    elif isinstance(message, Queued):
        record_queued(handle, message)
        say_grant_notice(handle, message)
        handle.note(f"queued at position {message.position}")
    elif isinstance(message, Refused):
        handle.refusal = message.message
        handle.move(LeaseState.REFUSED)
    elif isinstance(message, Preempt):
        _paused(handle, message, session)
    elif isinstance(message, Resume):
        _resumed(handle, message)
    elif isinstance(message, Revoked):
        _revoked(handle, message)
    elif isinstance(message, Released):
        handle.move(LeaseState.RELEASED)
    handle.changed.set()


def _paused(handle: LeaseHandle, message: Preempt, session: PauseContext) -> None:
    if not handle.move(message.state):
        return
    session.watch_interrupts_while_paused()
    handle.paused_since = time.time()
    handle.pause_log.append(PauseRecord(message.for_user, message.held_by))
    handle.note(f"paused at level {int(message.level)} for {message.for_user}")
    handle.pause_text = cell_lines.pause_line(message, session.protection())
    if handle.output is not None:
        handle.show("-pause", cell_lines.paused_now_line(handle.pause_text, len(handle.pauses_s)))


def _resumed(handle: LeaseHandle, message: Resume) -> None:
    if not handle.move(LeaseState.RUNNING):
        return
    open_pause = (
        handle.pause_log[-1] if handle.pause_log and handle.pause_log[-1].seconds is None else None
    )
    if not message.note:
        handle.pauses_s.append(message.paused_s)
        if open_pause is not None:
            open_pause.seconds = message.paused_s
    elif open_pause is not None:  # the pause never took effect
        handle.pause_log.pop()
    text = (
        cell_lines.notice(message.note)
        if message.note
        else cell_lines.resumed_line(handle.pause_text, handle.pauses_s)
    )
    handle.note(text)
    handle.show("-pause", text)


def _revoked(handle: LeaseHandle, message: Revoked) -> None:
    handle.revoked = message.reason
    was_paused = handle.state in (LeaseState.PAUSED, LeaseState.EVICTED)
    if handle.move(LeaseState.REVOKED):
        handle.note(REVOKED_NOTE + message.reason)
    if was_paused:
        # The live pause line would say "paused ..." for ever: it becomes the
        # revocation, so the cell shows one true line, not two.
        handle.show("-pause", cell_lines.revoked_line(message.reason, while_paused=True))
    else:
        say_revoked(handle, cell_lines.revoked_line(message.reason, while_paused=False))


# ---- the cell's receipt


def say_receipt(handle: LeaseHandle) -> None:
    """The cell's last line: what its lease went through, shown once the cell's own
    output and traceback are out (only for a lease that was granted; a request that
    never was ends with its own error).  A revoked lease gets one too: the cell ran on
    without it, and the receipt says for how long."""
    if handle.output is None or handle.granted_at is None:
        return
    now = time.time()
    held_s = time.monotonic() - handle.granted_at
    revoked_at = _revoked_at(handle) if handle.state == LeaseState.REVOKED else None
    # A pause still open ended at the revocation, or lasts to the end of the cell.
    open_pause_s = None
    if handle.paused_since is not None:
        open_pause_s = max(0.0, (revoked_at or now) - handle.paused_since)
    handle.output.show_last(
        handle.display_key + "-receipt",
        receipt_line(
            queued_s=handle.granted_at - handle.asked_at,
            freeing=freeing_wait(handle),
            held_s=held_s,
            pauses=handle.pause_log,
            open_pause_s=open_pause_s,
            kernels=kernel_words(handle.kernels_at_grant, preemptible.counts()),
            revoked=handle.revoked if handle.state == LeaseState.REVOKED else "",
            unleased_s=max(0.0, now - revoked_at) if revoked_at is not None else 0.0,
        ),
    )


def freeing_wait(handle: LeaseHandle) -> tuple[float, int] | None:
    """How long the request waited for memory to be freed for it, and how much: from the
    first notice that said so to the grant (None if it never waited for that)."""
    if handle.freeing_since is None or handle.granted_at is None:
        return None
    return max(0.0, handle.granted_at - handle.freeing_since), handle.freeing_bytes


def _revoked_at(handle: LeaseHandle) -> float | None:
    """When (``time.time()``) the lease was revoked, from the note its revocation left."""
    for when, what in reversed(handle.events):
        if what.startswith(REVOKED_NOTE):
            return when
    return None
