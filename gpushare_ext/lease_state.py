"""A lease's states and the one table of moves between them, for every side.

What it is for: the scheduler core, the wire protocol, the journal, the control block
and the notebook runtime all speak of a lease in these words.  A lease moves only
along :data:`MOVES`; :func:`check_move` is the one place that says whether a move is
allowed, and an illegal one raises :class:`IllegalMove` before anything has changed
(the caller changes the state only after the check, so a refused move leaves all as it
was).  The control block carries the state as a number a GPU or the launch shim can
read (:data:`CONTROL_BLOCK_CODES`); those numbers are part of the block's layout.

What it must not do: import anything of gpushare but the error base (it is the ground
floor), or hold any state itself.
"""

from __future__ import annotations

import enum

from gpushare_ext.errors import GpushareError

__all__ = [
    "ACTIVE",
    "CONTROL_BLOCK_CODES",
    "ENDED",
    "MOVES",
    "STOPPED",
    "IllegalMove",
    "LeaseState",
    "check_move",
    "from_control_block_code",
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
