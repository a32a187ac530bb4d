"""A lease's states and the tables of moves between them, for every side.

What it is for: the scheduler core, the wire protocol, the journal, the control block
and the notebook runtime all speak of a lease in these words.  A lease moves only
along :data:`MOVES`; :func:`check_move` is the one place that says whether a move is
allowed, and an illegal one raises :class:`IllegalMove` before anything has changed
(the caller changes the state only after the check, so a refused move leaves all as it
was).  The control block carries the state as a number a GPU or the launch shim can
read (:data:`CONTROL_BLOCK_CODES`); those numbers are part of the block's layout.

A stopped lease also has a preemption sub-state, :class:`StopState`: the ladder level
asked of the actuators, the level they confirmed, and three flags (held by the
watchdog, detached after a restart, a park's restore asked).  It moves along
:data:`STOP_MOVES` and :data:`FLAG_MOVES`, checked by :func:`check_stop` just as
:func:`check_move` checks the main state.  :func:`stopped_state` is the one place that
says which state a stop at a level results in (evicted at the checkpoint, else paused).

What it must not do: import anything of gpushare but the error base (it is the ground
floor), or hold any state itself.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from gpushare_ext.errors import GpushareError

__all__ = [
    "ACTIVE",
    "CONTROL_BLOCK_CODES",
    "ENDED",
    "FLAG_MOVES",
    "MOVES",
    "NO_STOP",
    "STOPPED",
    "STOP_MOVES",
    "IllegalMove",
    "IllegalStop",
    "LeaseState",
    "PreemptionLevel",
    "StopStage",
    "StopState",
    "check_move",
    "check_stop",
    "from_control_block_code",
    "state_told",
    "stopped_state",
]


class LeaseState(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"  # preempted at levels 0-3: holds its memory, does not compute
    EVICTED = "evicted"  # preempted at level 4: device memory checkpointed to the host
    RELEASED = "released"
    REFUSED = "refused"
    REVOKED = "revoked"

    def __str__(self) -> str:
        return self.value


class PreemptionLevel(enum.IntEnum):
    """The preemption ladder (docs/design.md): the broker picks the cheapest that suffices."""

    GATE = 0  # hold launches not yet issued (cuStreamWaitValue32 on the gate word)
    YIELD = 1  # instrumented kernels stop between logical blocks
    ABORT = 2  # instrumented kernels stop at loop back-edges; restart or roll back
    LOCK = 3  # cuCheckpointProcessLock: the whole process stops issuing CUDA work
    EVICT = 4  # cuCheckpointProcessCheckpoint: device memory moved to the host


_ENDINGS = frozenset({LeaseState.RELEASED, LeaseState.REVOKED})

# Where a lease may go from each state.  A running lease may "move" to running (placed
# again after a broker restart) and a paused one to paused (a pause raised a level); an
# evicted lease comes back by resuming, never by being paused again.
MOVES: dict[LeaseState, frozenset[LeaseState]] = {
    LeaseState.QUEUED: frozenset({LeaseState.RUNNING, LeaseState.REFUSED}) | _ENDINGS,
    LeaseState.RUNNING: frozenset({LeaseState.RUNNING, LeaseState.PAUSED}) | _ENDINGS,
    LeaseState.PAUSED: frozenset({LeaseState.PAUSED, LeaseState.RUNNING, LeaseState.EVICTED})
    | _ENDINGS,
    LeaseState.EVICTED: frozenset({LeaseState.RUNNING}) | _ENDINGS,
    LeaseState.RELEASED: frozenset(),
    LeaseState.REFUSED: frozenset(),
    LeaseState.REVOKED: frozenset(),
}

ENDED = frozenset(state for state, onward in MOVES.items() if not onward)
ACTIVE = frozenset(MOVES) - ENDED  # the broker still keeps it
STOPPED = frozenset({LeaseState.PAUSED, LeaseState.EVICTED})  # preempted, holds its place

# The control block's state word.  0 means no lease at all (an idle session); the launch
# shim (runtime/native/launch_interpose.c) holds launches on 3 and 4.
CONTROL_BLOCK_CODES: dict[LeaseState, int] = {
    LeaseState.QUEUED: 1,
    LeaseState.RUNNING: 2,
    LeaseState.PAUSED: 3,
    LeaseState.EVICTED: 4,
}
_FROM_CODE = {code: state for state, code in CONTROL_BLOCK_CODES.items()}


class IllegalMove(GpushareError):
    """A lease was asked to move where the table does not let it; nothing changed."""

    code = "illegal_move"

    def __init__(self, lease_id: str, current: LeaseState, wanted: LeaseState) -> None:
        self.lease_id = lease_id
        self.current = current
        self.wanted = wanted
        onward = ", ".join(sorted(s.value for s in MOVES[current])) or "nowhere: it has ended"
        self.message = (
            f"lease {lease_id} cannot go from {current.value} to {wanted.value} "
            f"(from {current.value} it may go to {onward})"
        )
        super().__init__(self.message)


def check_move(lease_id: str, current: LeaseState, wanted: LeaseState) -> LeaseState:
    """``wanted`` if the table allows ``current`` -> ``wanted``; else :class:`IllegalMove`."""
    if wanted not in MOVES[current]:
        raise IllegalMove(lease_id, current, wanted)
    return wanted


def from_control_block_code(code: int) -> LeaseState | None:
    """The state a control block's word says (None: no lease, or a word it never writes)."""
    return _FROM_CODE.get(code)


def state_told(before: LeaseState, level: PreemptionLevel) -> LeaseState:
    """The state a stop's notice puts the session's lease in, from the state the lease
    was in before the stop: a running lease is paused first (asked for level 4 too: it
    is evicted once the checkpoint is done), one already stopped takes the stop's state
    (a paused lease asked for level 4 is evicted)."""
    return stopped_state(level) if before in STOPPED else LeaseState.PAUSED


def stopped_state(level: PreemptionLevel) -> LeaseState:
    """The state a lease stopped at ``level`` is in once the stop is applied: evicted
    when its memory went to the host (level 4), paused below that."""
    return LeaseState.EVICTED if level == PreemptionLevel.EVICT else LeaseState.PAUSED


# ---------------------------------------------------------------- the stop sub-state


class StopStage(str, enum.Enum):
    """Where a lease's stop stands with the actuators (the levels of a :class:`StopState`)."""

    NONE = "none"  # nothing asked, nothing applied
    ASKED = "asked"  # a level asked, not confirmed yet
    HELD = "held"  # a level confirmed, nothing more asked
    RAISED = "raised"  # a level confirmed and another asked on top (an eviction, say)

    def __str__(self) -> str:
        return self.value


# Where a stop may go from each stage.  A level is confirmed only once asked; a failed
# or confirmed ask clears it, and a resume or an end clears everything.  A level may be
# asked again before it is confirmed (a paused rank asked to evict, a lease reclaimed
# after a restart paused as it was).
STOP_MOVES: dict[StopStage, frozenset[StopStage]] = {
    StopStage.NONE: frozenset({StopStage.NONE, StopStage.ASKED}),
    StopStage.ASKED: frozenset({StopStage.ASKED, StopStage.HELD, StopStage.NONE}),
    StopStage.HELD: frozenset({StopStage.HELD, StopStage.RAISED, StopStage.NONE}),
    StopStage.RAISED: frozenset({StopStage.RAISED, StopStage.HELD, StopStage.NONE}),
}

_EITHER = frozenset({(False, False), (False, True), (True, False), (True, True)})
# Each flag's allowed (before, after) pairs.  The watchdog holds a lease until it ends;
# only a lease restored after a restart is detached, until its process reclaims it.
FLAG_MOVES: dict[str, frozenset[tuple[bool, bool]]] = {
    "held_by_watchdog": _EITHER - {(True, False)},
    "detached": _EITHER - {(False, True)},
    "restore_wanted": _EITHER,
}


@dataclass(frozen=True, kw_only=True)
class StopState:
    """A lease's preemption sub-state: what the actuators were asked and confirmed."""

    pending_level: PreemptionLevel | None = None  # asked for, not yet confirmed
    applied_level: PreemptionLevel | None = None  # what the actuators confirmed
    held_by_watchdog: bool = False  # paused for breaking its quota: not resumed by the queue
    detached: bool = False  # restored after a restart, its process not yet reconnected
    restore_wanted: bool = False  # a park whose session asked for its memory back

    @property
    def stage(self) -> StopStage:
        if self.pending_level is None:
            return StopStage.NONE if self.applied_level is None else StopStage.HELD
        return StopStage.ASKED if self.applied_level is None else StopStage.RAISED

    @property
    def in_force(self) -> PreemptionLevel | None:
        """The level that stops the lease now: the one applied, else the one asked."""
        return self.applied_level if self.applied_level is not None else self.pending_level

    @property
    def highest(self) -> PreemptionLevel | None:
        """The highest level asked or applied: what an undo must take back."""
        levels = [lv for lv in (self.applied_level, self.pending_level) if lv is not None]
        return max(levels, default=None)

    # Built field by field rather than with dataclasses.replace: the core moves a stop on
    # most events, and replace() costs several times a constructor.

    def with_levels(
        self, pending: PreemptionLevel | None, applied: PreemptionLevel | None
    ) -> StopState:
        return StopState(
            pending_level=pending,
            applied_level=applied,
            held_by_watchdog=self.held_by_watchdog,
            detached=self.detached,
            restore_wanted=self.restore_wanted,
        )

    def asked(self, level: PreemptionLevel) -> StopState:
        """``level`` asked of the actuators, on top of what they applied."""
        return self.with_levels(level, self.applied_level)

    def confirmed(self, level: PreemptionLevel) -> StopState:
        """The actuators applied ``level`` for what was asked."""
        return self.with_levels(None, level)

    def failed(self) -> StopState:
        """The ask failed: what was applied before it stays."""
        return self.with_levels(None, self.applied_level)

    def cleared(self) -> StopState:
        """Nothing asked or applied any more (resumed, or running on, or ended)."""
        if not (self.held_by_watchdog or self.detached or self.restore_wanted):
            return NO_STOP
        return self.with_levels(None, None)

    def asks_restore_of(self, current: StopState) -> bool:
        """Whether this stop is ``current`` with a park's restore asked, nothing else
        changed (replace() runs only for a stop that asks a restore: rarely)."""
        return (
            self.restore_wanted and replace(self, restore_wanted=current.restore_wanted) == current
        )


# The stop of almost every lease: nothing asked, applied or flagged.  Shared, so that the
# core's most frequent moves (a grant, an end) make no new object.
NO_STOP = StopState()


class IllegalStop(GpushareError):
    """A lease's stop sub-state was asked to move where its tables do not let it; nothing
    changed."""

    code = "illegal_stop"

    def __init__(self, lease_id: str, current: StopState, wanted: StopState, why: str) -> None:
        self.lease_id = lease_id
        self.current = current
        self.wanted = wanted
        self.message = f"lease {lease_id}: {why}"
        super().__init__(self.message)


def _why_not(current: StopState, wanted: StopState, state: LeaseState) -> str:
    """Why ``current`` -> ``wanted`` is not allowed for a lease in ``state`` ("" if it is)."""
    before, after = current.stage, wanted.stage
    if after not in STOP_MOVES[before]:
        onward = ", ".join(sorted(stage.value for stage in STOP_MOVES[before]))
        return f"its stop cannot go from {before} to {after} (from {before} it may go to {onward})"
    if after is not StopStage.NONE and state not in STOPPED:
        asked, applied = wanted.pending_level, wanted.applied_level
        return f"a {state.value} lease has no stop level (asked {asked}, applied {applied})"
    if (current.held_by_watchdog, current.detached, current.restore_wanted) == (
        wanted.held_by_watchdog, wanted.detached, wanted.restore_wanted,
    ):  # fmt: skip
        return ""
    for flag, allowed in FLAG_MOVES.items():
        pair = (getattr(current, flag), getattr(wanted, flag))
        if pair not in allowed:
            return f"{flag} cannot go from {pair[0]} to {pair[1]}"
    return ""


def check_stop(
    lease_id: str, state: LeaseState, current: StopState, wanted: StopState
) -> StopState:
    """``wanted`` if the tables allow ``current`` -> ``wanted`` for a lease whose main
    state is (or becomes) ``state``; else :class:`IllegalStop`."""
    why = _why_not(current, wanted, state)
    if why:
        raise IllegalStop(lease_id, current, wanted, why)
    return wanted
