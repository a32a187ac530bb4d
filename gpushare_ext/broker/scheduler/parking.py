"""Which idle sessions to park, and whether the host can take their memory.

A notebook keeps its arrays on the GPU after its cell ended.  When a request needs that
memory, or a session has sat idle longer than its policy's ``park_idle_after``, the core
*parks* the session: a park lease is made for the memory it holds and evicted at once
(level 4: lock, then checkpoint to host memory), and it is restored before the
session's next cell.  This module holds the choices the core makes about it:

* who may be parked: only sessions the broker knows, idle (no lease queued, running or
  paused), on a whole GPU (the checkpoint API does not support MIG instances), not MPS
  clients, and not a session whose checkpoint failed once;
* in which order: lowest priority first (the priority of the session's last lease),
  then idle longest, then the most memory;
* how much of each: all it holds, except the last one a request needs, of which only
  what is still needed is parked where its launch shim can park that much itself
  (``parkable_bytes``; a checkpoint always moves a whole process);
* whether the host has room: parked and evicted memory together stay under
  ``park_host_limit`` and leave :data:`HOST_MARGIN` of the host's memory available.

Pure functions over plain values: no clock, no I/O.  It must not import the core (the
core imports it) and must not decide anything about leases that are not parks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from gpushare_ext.units import GIB, format_duration, format_size, priority_band

HOST_MARGIN = 4 * GIB  # host memory a park must leave available to everyone else


@dataclass(frozen=True, kw_only=True)
class IdleSession:
    """A session holding GPU memory outside any lease, as the core sees it."""

    session_id: str
    pid: int
    user: str
    held_bytes: int  # what NVML sees it hold beyond its leases
    last_priority: int  # its last lease's priority (normal if it never had one)
    idle_since: float
    parkable_bytes: int = 0  # what its launch shim can park itself, in part if need be
    part: bool = False  # the park moves only ``held_bytes`` of it, through its shim


@dataclass(frozen=True, kw_only=True)
class HostMemory:
    """The host's memory as last read (``/proc/meminfo``): None until the first reading."""

    available_bytes: int
    total_bytes: int


def park_order(session: IdleSession) -> tuple:
    """Lowest priority first, then idle longest, then the most memory."""
    return (session.last_priority, session.idle_since, -session.held_bytes, session.session_id)


def host_room(
    host: HostMemory | None, limit_bytes: int, on_host_bytes: int, since_reading_bytes: int = 0
) -> int:
    """Bytes the host may still take for parks: under the limit (minus what parked and
    evicted sessions hold there already) and leaving :data:`HOST_MARGIN` available, the
    reading less what went to the host after it (``since_reading_bytes``)."""
    if host is None:
        return 0
    under_limit = limit_bytes - on_host_bytes
    available = host.available_bytes - since_reading_bytes - HOST_MARGIN
    return max(0, min(under_limit, available))


@dataclass(frozen=True)
class ParkPlan:
    """The sessions to park for ``need`` bytes, or why that cannot be done."""

    chosen: tuple[IdleSession, ...]
    freed_bytes: int
    refusal: str = ""  # why idle memory was not parked ("" when nothing stood in the way)


def plan_parks(
    idle: Iterable[IdleSession], need_bytes: int, band: int, room_bytes: int
) -> ParkPlan:
    """Idle sessions of ``band`` or lower to park, in :func:`park_order`, until
    ``need_bytes`` are freed; each must fit in what is left of ``room_bytes``.  A
    session that does not fit the host is skipped (a smaller one may) and named in the
    refusal; so is the host's room when nothing could be parked at all."""
    chosen: list[IdleSession] = []
    freed = 0
    too_big: list[IdleSession] = []
    for session in sorted(idle, key=park_order):
        if freed >= need_bytes:
            break
        if priority_band(session.last_priority) > band:
            continue
        session = part_needed(session, need_bytes - freed)
        if session.held_bytes > room_bytes:
            too_big.append(session)
            continue
        chosen.append(session)
        freed += session.held_bytes
        room_bytes -= session.held_bytes
    refusal = ""
    if freed < need_bytes and too_big:
        biggest = max(too_big, key=lambda s: s.held_bytes)
        refusal = (
            f"an idle session holds {format_size(biggest.held_bytes)}, but the host has room "
            f"for {format_size(max(0, room_bytes))} of parked memory (park_host_limit)"
        )
    return ParkPlan(chosen=tuple(chosen), freed_bytes=freed, refusal=refusal)


def part_needed(session: IdleSession, still_needed: int) -> IdleSession:
    """``session`` to park for ``still_needed`` bytes: only that much of it (rounded up
    to whole GiB) where its shim can park that much itself and it holds more; else all
    of it."""
    part = -(-still_needed // GIB) * GIB
    if part >= session.held_bytes or part > session.parkable_bytes:
        return session
    return replace(session, held_bytes=part, part=True)


def idle_reason(idle_s: float, after_s: float) -> str:
    return (
        f"parked: idle for {format_duration(idle_s)} (park_idle_after {format_duration(after_s)})"
    )
