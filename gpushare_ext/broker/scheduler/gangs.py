"""Gangs: one request for several slices, granted, paused and resumed as one unit.

A request with ``ranks=N`` becomes N *member* leases in the core, one per rank, each
its own slice of the request's memory and SM share: ``L7`` asks, ``L7.0`` … ``L7.3``
run.  The core places all of them in one step or none (:func:`assign_ranks`), stops
all of them when any is in a higher-priority request's way, resumes them together,
and ends all of them when one ends (a rank that dies takes its gang with it).  A
member's id names its gang, so a journal read back after a restart knows the gangs
without a column of its own.

This module holds what is pure arithmetic about gangs: where N ranks go given a test
of "k ranks fit on this slot" (the ids are the protocol's, since clients read them).
It must not hold scheduler state or decide priorities; the core does both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gpushare_ext.protocol import member_id, split_member_id

__all__ = ["assign_ranks", "member_id", "most_ranks", "split_member_id"]


def assign_ranks(
    ranks: int, slots: Sequence[str], fits: Callable[[str, int], bool]
) -> list[str] | None:
    """The slot of each rank, in rank order, or None when the ranks do not all fit.

    ``slots`` come best first; ``fits(slot, k)`` says whether ``k`` ranks fit on
    ``slot`` at once.  One rank per slot is tried first (MIG instances, several GPUs:
    each rank gets hardware of its own, and whole GPUs can talk NCCL); otherwise the
    ranks are packed, as many on each slot as fit, best slot first (one GPU cut into
    software slices)."""
    if ranks < 1:
        return None
    alone = [key for key in slots if fits(key, 1)]
    if len(alone) >= ranks:
        return alone[:ranks]
    placed: list[str] = []
    for key in alone:
        most = 1
        while len(placed) + most < ranks and fits(key, most + 1):
            most += 1
        placed.extend([key] * most)
        if len(placed) == ranks:
            return placed
    return None


def most_ranks(slot_memory: int, rank_memory: int, limit: int) -> int:
    """How many ranks of ``rank_memory`` bytes an empty slot of ``slot_memory`` bytes
    could ever hold, at most ``limit`` (SM shares do not bound it: ranks whose shares
    add up to more than one time-slice the slot)."""
    if rank_memory <= 0:
        return limit
    return max(0, min(limit, slot_memory // rank_memory))
