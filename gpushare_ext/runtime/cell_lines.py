"""The lines a ``%%gpu`` cell shows about its lease, worded in one place.

Whoever changes what a cell says changes it here: the live queue line and its estimate,
the grant, the withdrawn and timed-out request, the pause and resume lines, a revoked
lease, the broker going away and coming back, a parked session's restore, and the
receipt a cell shows when it ends, which answers "why was my cell slow?" in one line
(time queued, time running, each pause: for whom, at which rung, how long; what the
long kernels got), and what a cell is told once about its launches (a long kernel run
unmodified, launches run as they are, no device gate).

Pure: text from plain values; no clock, no broker, no I/O.  It must not decide what is
shown when (the session does), only how it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare_ext.plain_text import SENTENCE_LIMIT, plain_text
from gpushare_ext.protocol import (
    EXACT_PLACES,
    LEVEL_NAMES,
    Preempt,
    PreemptionLevel,
    Queued,
    describe_priority,
)
from gpushare_ext.units import format_size

SHOWN_PAUSES = 3  # named in a receipt of more than four pauses; the rest are counted
PAUSED = "gpushare: paused for a higher-priority session"


def notice(text: str) -> str:
    """A line in gpushare's own voice: what the broker or the session says, as it is."""
    return f"gpushare: {text}"


# ---- waiting for a grant


def estimate_text(
    queued: Queued | None, *, since_notice_s: float, waited_s: float, timeout_s: float | None
) -> str:
    """The broker's estimate counted down since it came (``since_notice_s`` ago), and
    said against the cell's timeout when the wait would outlast it ("" without one).

    The estimate is the holder's usual hold time, not a promise: once it is used up the
    line says so ("the holder's usual time is up", then how long ago it ran out) and
    never "any moment now", which a holder with 41 s of work left does not keep."""
    if queued is None or queued.estimate_s is None:
        return ""
    left = queued.estimate_s - since_notice_s
    if queued.freeing_bytes:
        return _freeing_estimate_text(left, queued.freeing_bytes)
    if left < 1.0:
        overdue = -left
        if overdue < 1.0:
            return ", the holder's usual time is up"
        return f", the holder's usual time ran out {overdue:.0f} s ago"
    if timeout_s is not None and left > timeout_s - waited_s:
        return (
            f", about {left:.0f} s left, more than the {max(0.0, timeout_s - waited_s):.0f} s "
            "before the timeout"
        )
    return f", about {left:.0f} s left"


def _freeing_estimate_text(left_s: float, freeing_bytes: int) -> str:
    """The time left to free ``freeing_bytes`` at the rate the broker measured."""
    size = format_size(freeing_bytes)
    if left_s < 1.0:
        overdue = -left_s
        if overdue < 1.0:
            return f", {size} should be free about now at the measured rate"
        return f", freeing {size} is taking {overdue:.0f} s longer than its measured rate"
    return f", about {left_s:.0f} s left to free {size} at the measured rate"


def place_words(position: int | str) -> str:
    """A queue place as a cell says it: exact near the head, and past
    ``protocol.EXACT_PLACES`` (where the broker tells a rounded place) as the bound it is."""
    if isinstance(position, int) and position > EXACT_PLACES:
        return f"within the first {position}"
    return f"position {position}"


def queue_line(queued: Queued | None, waited_s: float, estimate: str = "") -> str:
    """The live line of a waiting request: where it stands, behind whom, for how long."""
    if queued is None:
        return f"queued -- {waited_s:.0f} s"
    holder = queued.waiting_for or "earlier requests"
    priority = (
        f" (priority {describe_priority(queued.holder_priority)})"
        if queued.holder_priority is not None
        else ""
    )
    return (
        f"queued: {place_words(queued.position)}, waiting for {holder}{priority}{estimate} -- "
        f"{waited_s:.0f} s ({queued.reason}; interrupt the kernel to withdraw)"
    )


def queue_line_reconnecting(waited_s: float) -> str:
    return (
        f"queued -- {waited_s:.0f} s; the broker is restarting, reconnecting "
        "(interrupt the kernel to withdraw)"
    )


def granted_line(waited_s: float) -> str:
    return f"gpushare: granted after {waited_s:.1f} s in the queue"


def withdrawn_line(waited_s: float, why: str) -> str:
    """The queue line's last word when no grant came (``why``: interrupted, timed out)."""
    return f"gpushare: request withdrawn after {waited_s:.0f} s in the queue ({why})"


def timed_out_words(timeout_s: float, position: int | str) -> str:
    place = place_words(position)
    where = place if place.startswith("within") else f"at {place}"
    return (
        f"gpushare: no GPU within {timeout_s:g} s (still {where}); "
        "the request was withdrawn and the cell did not run"
    )


def refused_words(why: str) -> str:
    return f"gpushare: request refused: {why}"


def request_revoked_words(why: str) -> str:
    return f"gpushare: request revoked: {why}"


# ---- pauses


def times(count: int) -> str:
    return "once" if count == 1 else "twice" if count == 2 else f"{count} times"


def pause_line(preempt: Preempt, how: str) -> str:
    """The cell's line for a pause: the rung that holds it, and the one the broker asked
    for where that differs (a simulated GPU only gates), as ``gpushare status`` says."""
    asked, applied = preempt.level, preempt.held_by
    rung = f"at ladder level {int(applied)}, {LEVEL_NAMES[applied]}"
    if applied != asked:
        rung += (
            f" (level {int(asked)}, {LEVEL_NAMES[asked]}, was asked; "
            "a simulated GPU is gated, not locked)"
        )
    line = f"{PAUSED} ({preempt.for_user}) {rung}"
    return f"{line}; {how}" if how else line


def paused_now_line(pause_text: str, earlier_pauses: int) -> str:
    """The live line while paused, counting the pauses that came before in this cell."""
    before = f" (paused {times(earlier_pauses)} before)" if earlier_pauses else ""
    return pause_text + before + " ..."


def resumed_words(pauses_s: list[float]) -> str:
    """How a cell's pauses read when the last one ends: every one counted, none lost."""
    if len(pauses_s) == 1:
        return f"resumed after {pauses_s[0]:.2f} s"
    shown = ", ".join(f"{p:.1f}" for p in pauses_s[-5:])
    earlier = "..., " if len(pauses_s) > 5 else ""
    return (
        f"resumed; paused {times(len(pauses_s))} in this cell ({earlier}{shown} s; "
        f"{sum(pauses_s):.1f} s in all)"
    )


def resumed_line(pause_text: str, pauses_s: list[float]) -> str:
    return f"{pause_text}; {resumed_words(pauses_s)}"


INTERRUPTED_WHILE_PAUSED = (
    "gpushare: interrupted while paused; the lease is given up so that this cell can stop"
)
BROKER_LEFT_WHILE_PAUSED = (
    "gpushare: the broker went away while this cell was paused; it runs on, and the "
    "broker decides again when it is back"
)


# ---- a lease taken away, the broker away


def revoked_line(reason: str, *, while_paused: bool) -> str:
    if while_paused:
        return f"gpushare: lease revoked while paused: {reason}; the cell goes on without a lease"
    return f"gpushare: lease revoked: {reason}; the cell goes on without a lease"


def not_reclaimed_words(still_queued: bool) -> str:
    """Why a lease is gone after a broker restart that did not give it back."""
    if still_queued:
        return "the broker restarted and did not keep this request; run the cell again"
    return "the broker restarted and did not give the lease back"


def broker_gone_words(where: object, waited_s: float, still_queued: bool) -> str:
    """Why a lease ends when its broker did not come back."""
    return f"the broker on {where} went away and was not back within {waited_s:g} s" + (
        "; the request is withdrawn" if still_queued else "; this cell runs on unmanaged"
    )


def reconnecting_line(waited_s: float) -> str:
    """The live line of a cell waiting for its broker to come back (``waited_s`` so far)."""
    return (
        f"gpushare: the broker is restarting; reconnecting -- {waited_s:.0f} s "
        "(interrupt the kernel to stop waiting)"
    )


def reconnect_abandoned_line(waited_s: float, why: str) -> str:
    """The reconnecting line's last word when the cell stopped waiting (``why``:
    interrupted, timed out, gave up, refused): it must not keep saying "restarting" or
    "reconnecting", as if the wait went on."""
    return f"gpushare: stopped waiting for the broker after {waited_s:.0f} s ({why})"


def broker_away_timed_out_words(timeout_s: float, where: object) -> str:
    """The error of a cell whose timeout ran out while its broker was away."""
    return (
        f"gpushare: no GPU within {timeout_s:g} s: the broker on {where} went away and was "
        "not back in time; the request was not made and the cell did not run"
    )


#: What an interrupt before the cell's code started says (its lines above say where it
#: stood: the queue, or the broker's absence).
INTERRUPTED_BEFORE_RUN = "the cell did not run"


RECONNECTED = "gpushare: reconnected to the broker"


def embedded_broker_started(path: object) -> str:
    return (
        f"gpushare: no system broker found; started your embedded broker on {path} "
        "(it serves all your notebooks on this host)"
    )


def launches_not_held_words(why: object) -> str:
    return (
        f"launches are not held on the host ({why}); the checkpoint lock pauses "
        "this session, after the work it has queued"
    )


# ---- a parked session's restore


def restoring_line(what: str, waited_s: float, queued_reason: str | None = None) -> str:
    """The live line while parked memory comes back (``queued_reason``: why it waits)."""
    if queued_reason is not None:
        return (
            f"gpushare: restoring {what}: waiting for the memory ({queued_reason}) -- "
            f"{waited_s:.0f} s (interrupt the kernel to leave it parked)"
        )
    return f"gpushare: restoring {what} ... {waited_s:.1f} s"


def restore_starts_line(what: str) -> str:
    return f"gpushare: restoring {what} ..."


def restore_failed_line(what: str, why: object) -> str:
    return f"gpushare: could not restore {what}: {why}; running the cell"


def restored_by_restart_line(what: str) -> str:
    return f"gpushare: {what} was restored when the broker started again"


def restore_withdrawn_line(what: str) -> str:
    return f"gpushare: restore of {what} withdrawn; it stays parked and the cell did not run"


def restored_line(what: str, took_s: float) -> str:
    return f"gpushare: restored {what} in {took_s:.1f} s"


# ---- the magics' own lines


def released_line(lease_ids: list[str]) -> str:
    """``%gpu release``: what it gave back."""
    return "released " + ", ".join(lease_ids) if lease_ids else "no lease was held"


def defaults_line(
    *,
    priority: int,
    memory_bytes: int | None,
    device: str,
    timeout_s: float | None,
    slice_wish: str,
    sm_share: float,
) -> str:
    """``%gpuconfig``: the session's defaults for ``%%gpu`` cells."""
    memory = format_size(memory_bytes) if memory_bytes else "policy default"
    timeout = f"{timeout_s:g}s" if timeout_s is not None else "none"
    return (
        f"gpushare defaults: priority={describe_priority(priority)} mem={memory} "
        f"device={device} timeout={timeout} slice={slice_wish} share={sm_share:g}"
    )


# ---- the receipt


@dataclass
class PauseRecord:
    """One pause of a cell's lease, as the cell was told."""

    for_user: str  # as the broker names them to this user (others anonymised)
    level: PreemptionLevel  # the rung that held it
    seconds: float | None = None  # how long, once resumed (None: not resumed, by the end)


def _pause_words(pause: PauseRecord, length_s: float | None, until_the_end: bool) -> str:
    # A user's name is someone else's text: one line, every character as itself.
    who = f"for {plain_text(pause.for_user)} ({pause.level.name.lower()})"
    if length_s is None:
        return f"{who}, length unknown"
    return f"{length_s:.1f} s {who}" + (", until the end" if until_the_end else "")


def receipt_line(
    *,
    queued_s: float,
    held_s: float,
    pauses: list[PauseRecord],
    open_pause_s: float | None = None,
    kernels: str = "",
    revoked: str = "",
    unleased_s: float = 0.0,
    freeing: tuple[float, int] | None = None,
) -> str:
    """``gpushare: cell done: queued 2.0 s, ran 9.0 s, paused 3.2 s (twice: 1.2 s for
    alice (gate), 2.0 s for bob (lock)); long kernels: ...``.

    ``held_s`` runs from the grant to the end of the cell, pauses included: the line
    splits it into the time the cell ran and the time it was paused.  ``open_pause_s``
    is how long the last pause lasted if it was still open at the end (or at the
    revocation); an earlier one never resumed (the broker went away meanwhile) has no
    known length.  ``revoked``: why the lease was taken away, ``unleased_s`` before the
    end.  ``freeing``: how long of the wait went to freeing memory for the cell (other
    sessions evicted or parked to the host), and how much.
    """
    last_open = bool(pauses) and pauses[-1].seconds is None
    lengths = [p.seconds for p in pauses]
    if last_open:
        lengths[-1] = open_pause_s
    paused_s = sum(length for length in lengths if length is not None)
    ran_s = max(0.0, held_s - paused_s)
    # The time queued is said when it is zero too: "no wait" is an answer as well.
    line = f"gpushare: cell done: queued {queued_s:.1f} s"
    if freeing is not None:
        freeing_s, freeing_bytes = freeing
        line += f" ({freeing_s:.1f} s of it freeing {format_size(freeing_bytes)} of GPU memory)"
    line += f", ran {ran_s:.1f} s"
    if not pauses:
        line += ", never paused"
    else:
        # All of them, or three and a count: a count of one would hide one pause only.
        named = len(pauses) if len(pauses) <= SHOWN_PAUSES + 1 else SHOWN_PAUSES
        shown = [
            _pause_words(p, lengths[n], last_open and n == len(pauses) - 1)
            for n, p in enumerate(pauses[:named])
        ]
        if named < len(pauses):
            rest_s = sum(length for length in lengths[named:] if length is not None)
            rest = len(pauses) - named
            shown[-1] = f"{shown[-1]} and {rest} more pauses of {rest_s:.1f} s in all"
        if len(pauses) == 1:
            line += f", paused {shown[0]}"
        else:
            line += f", paused {paused_s:.1f} s ({times(len(pauses))}: {', '.join(shown)})"
    if revoked:
        why = plain_text(revoked, SENTENCE_LIMIT)  # the broker's, which may quote others'
        line += f"; lease revoked ({why}): the last {unleased_s:.1f} s ran without a lease"
    if kernels:
        line += f"; long kernels: {kernels}"
    return line


def kernel_words(before: dict[str, int], after: dict[str, int]) -> str:
    """What the long kernels got between two :func:`preemptible.counts` readings, in a
    few words ("" when none ran)."""
    got = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    parts = []
    if got.get("preemptible"):
        stops = got.get("yields", 0) + got.get("aborts", 0) + got.get("saves", 0)
        parts.append(
            f"{got['preemptible']} launches ready to stop" + (f" ({stops} stops)" if stops else "")
        )
        parts.extend(_cost_words(got))
    parts.extend(_preparation_words(got))
    if got.get("unmodified"):
        parts.append(f"{got['unmodified']} run unmodified")
    return ", ".join(parts)


# What the launch shim and the preemptible registry say in the cell that ran a launch.


def unmodified_with_host_memory_line(kernel: str) -> str:
    return (
        f"gpushare: long kernel `{kernel}` runs unmodified when host or managed memory is "
        "among its arguments (which buffers it writes is not known); a pause waits for it "
        "to finish"
    )


def unmodified_line(kernel: str, reason: str) -> str:
    return (
        f"gpushare: long kernel `{kernel}` runs unmodified ({reason}); a pause waits for it "
        "to finish"
    )


#: Launches the shim holds and the checkpoint lock stops, but never makes preemptible,
#: by kind (the shim's counters): each kind is said once, in the cell that first ran one.
RUN_AS_IS = {
    "cooperative": "cooperative launches (their blocks wait on each other: none may stop alone)",
    "with_attributes": "launches with attributes (thread-block clusters, cooperative)",
    "graphs": "CUDA graph launches (the kernels of a graph are not launched one by one)",
}


def run_as_is_line(kind: str) -> str:
    return (
        f"gpushare: {RUN_AS_IS[kind]} run as they are: a pause holds the next one and the "
        "checkpoint lock stops the process, but one already on the GPU finishes first"
    )


def long_kernels_summary(counted: dict[str, int]) -> str:
    """A few words for the pause notice and status: what the long kernels got so far
    (``counted`` as :func:`preemptible.counts` reads it)."""
    launched, fallbacks = counted.get("preemptible", 0), counted.get("unmodified", 0)
    if not launched and not fallbacks:
        return "long kernels loaded from PTX are made preemptible"
    parts = [f"{launched} long kernel launches preemptible"]
    if launched:
        parts.extend(_cost_words(counted))
    parts.extend(_preparation_words(counted))
    yields, saves, aborts = (counted.get(k, 0) for k in ("yields", "saves", "aborts"))
    if yields or aborts or saves:
        stops = [f"{yields} yields"]
        if saves:
            stops.append(f"{saves} stops that kept their work")
        if aborts:
            stops.append(f"{aborts} aborts undone")
        parts.append(", ".join(stops))
    if fallbacks:
        parts.append(f"{fallbacks} run unmodified")
    return ", ".join(parts)


def _preparation_words(counted: dict[str, int]) -> list[str]:
    """What making kernels preemptible took on the host (once per kernel and process:
    the analysis, the transform and loading the result)."""
    made = counted.get("made_preemptible", 0)
    if made <= 0:
        return []
    ms = counted.get("preparation_ns", 0) / 1e6
    kernels = "1 kernel" if made == 1 else f"{made} kernels"
    return [f"{kernels} made preemptible in {ms:.0f} ms"]


def _cost_words(counted: dict[str, int]) -> list[str]:
    """What the preemptible launches cost against their originals, as the shim timed
    those: nothing until a launch with a known original time was counted."""
    original_ns = counted.get("original_ns", 0)
    if original_ns <= 0:
        return []
    ratio = counted.get("preemptible_ns", 0) / original_ns
    return [f"their GPU time {ratio:.2f} x their unmodified runs"]


def no_device_gate_words(why: object) -> str:
    return f"no device gate ({why}); launch points wait on the host"
