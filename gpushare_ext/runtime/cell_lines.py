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

from gpushare_ext.protocol import (
    LEVEL_NAMES,
    Preempt,
    PreemptionLevel,
    Queued,
    applied_level,
    describe_priority,
)
from gpushare_ext.units import format_size

SHOWN_PAUSES = 3  # a count past these
QUEUED_WORTH_SAYING_S = 0.05  # below this the grant came with the answer
OVERDUE_AFTER_S = 5.0  # past the estimate this long, the queue line says so instead
PAUSED = "gpushare: paused for a higher-priority session"


def notice(text: str) -> str:
    """A line in gpushare's own voice: what the broker or the session says, as it is."""
    return f"gpushare: {text}"


# ---- waiting for a grant


def estimate_text(
    queued: Queued | None, *, since_notice_s: float, waited_s: float, timeout_s: float | None
) -> str:
    """The broker's estimate counted down since it came (``since_notice_s`` ago), and
    said against the cell's timeout when the wait would outlast it ("" without one)."""
    if queued is None or not queued.estimate_s:
        return ""
    left = max(0.0, queued.estimate_s - since_notice_s)
    overdue = since_notice_s - queued.estimate_s
    if overdue >= OVERDUE_AFTER_S:
        # "Any moment now" for ever would be a promise the holder is not keeping.
        return f", the holder's usual time ran out {overdue:.0f} s ago"
    if left < 1.0:
        return ", any moment now"
    if timeout_s is not None and left > timeout_s - waited_s:
        return (
            f", about {left:.0f} s left, more than the {max(0.0, timeout_s - waited_s):.0f} s "
            "before the timeout"
        )
    return f", about {left:.0f} s left"


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
        f"queued: position {queued.position}, waiting for {holder}{priority}{estimate} -- "
        f"{waited_s:.0f} s ({queued.reason}; interrupt the kernel to withdraw)"
    )


def queue_line_reconnecting(waited_s: float) -> str:
    return (
        f"queued -- {waited_s:.0f} s; the broker went away, reconnecting "
        "(interrupt the kernel to withdraw)"
    )


def granted_line(waited_s: float) -> str:
    return f"gpushare: granted after {waited_s:.1f} s in the queue"


def withdrawn_line(waited_s: float, why: str) -> str:
    """The queue line's last word when no grant came (``why``: interrupted, timed out)."""
    return f"gpushare: request withdrawn after {waited_s:.0f} s in the queue ({why})"


def timed_out_words(timeout_s: float, position: int | str) -> str:
    return (
        f"gpushare: no GPU within {timeout_s:g} s (still at position {position}); "
        "the request was withdrawn and the cell did not run"
    )


def refused_words(why: str) -> str:
    return f"gpushare: request refused: {why}"


def request_revoked_words(why: str) -> str:
    return f"gpushare: request revoked: {why}"


# ---- pauses


def times(count: int) -> str:
    return "once" if count == 1 else "twice" if count == 2 else f"{count} times"


def pause_line(preempt: Preempt, simulated: bool, how: str) -> str:
    """The cell's line for a pause: the rung that holds it, and the one the broker asked
    for where that differs (a simulated GPU only gates), as ``gpushare status`` says."""
    asked = preempt.level
    applied = applied_level(asked, simulated)
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
    return f"gpushare: the broker went away; reconnecting -- {waited_s:.0f} s"


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
    seconds: float | None = None  # how long, once resumed (None: still paused at the end)


def _pause_words(pause: PauseRecord) -> str:
    length = "until the end" if pause.seconds is None else f"{pause.seconds:.1f} s"
    return f"{length} for {pause.for_user} ({pause.level.name.lower()})"


def receipt_line(
    *, queued_s: float, ran_s: float, pauses: list[PauseRecord], kernels: str = ""
) -> str:
    """``gpushare: cell done: queued 2.0 s, ran 12.2 s; paused 2 times, 3.2 s in all
    (1.2 s for alice (gate), 2.0 s for bob (lock)); long kernels: ...``."""
    # A cell granted at once says nothing of a queue it never stood in.
    waited = f"queued {queued_s:.1f} s, " if queued_s >= QUEUED_WORTH_SAYING_S else ""
    line = f"gpushare: cell done: {waited}ran {ran_s:.1f} s"
    if not pauses:
        line += "; never paused"
    else:
        total = sum(p.seconds for p in pauses if p.seconds is not None)
        times = "once" if len(pauses) == 1 else f"{len(pauses)} times"
        shown = [_pause_words(p) for p in pauses[:SHOWN_PAUSES]]
        rest = pauses[SHOWN_PAUSES:]
        if rest:
            rest_s = sum(p.seconds for p in rest if p.seconds is not None)
            shown.append(f"{len(rest)} more, {rest_s:.1f} s")
        line += f"; paused {times}, {total:.1f} s in all ({', '.join(shown)})"
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
    if got.get("unrivalled"):
        parts.append(f"{got['unrivalled']} run as they are while no one could preempt this cell")
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
    unrivalled = counted.get("unrivalled", 0)
    if not launched and not fallbacks and not unrivalled:
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
    if unrivalled:  # the shim's count: no cost while nobody could preempt this session
        parts.append(f"{unrivalled} run as they are while no session could preempt this one")
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
