"""The lines a ``%%gpu`` cell shows about its lease, worded in one place.

For now: the receipt a cell shows when it ends, which answers "why was my cell slow?"
in one line (time queued, time running, each pause: for whom, at which rung, how long;
what the long kernels got).  The other lines (queue, pause, resume) are still worded in
``session.py``; they belong here too.

Pure: text from plain values; no clock, no broker, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpushare_ext.protocol import PreemptionLevel

SHOWN_PAUSES = 3  # a count past these
QUEUED_WORTH_SAYING_S = 0.05  # below this the grant came with the answer


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
    if got.get("unrivalled"):
        parts.append(f"{got['unrivalled']} run as they are while no one could preempt this cell")
    if got.get("unmodified"):
        parts.append(f"{got['unmodified']} run unmodified")
    return ", ".join(parts)
