"""Which sessions could be asked to stop: the rivals of each session's leases.

A lease has a *rival* while another live session (connected, not a placeholder left by
a restart) could preempt it: its last request (or, before any, the default priority),
or one of its requests still queued, is in a higher priority band than the lease's, and
its process can use the lease's GPU.  A session none of whose placed leases has a rival
is *unrivalled*.  The broker writes that word into the session's control block, and the
launch shim keeps a tighter bound on the work in flight while it says "rivalled" (about
1 ms instead of 3 ms, ``GPUSHARE_QUEUE_US_RIVALLED``), so that a pause drains little.
Long kernels are launched ready to stop either way (docs/interposer.md): one launched
as it is while nobody waited could not be stopped for a session that comes later.

Why sessions and not only waiting requests: an interactive notebook's high cells come
and go, and the first request of a cell must not wait for work queued when nobody
waited.  A request that waits (for a drained GPU, say) preempts when it is placed,
whatever its session asked since: it keeps its session's band up until it leaves the
queue.  Aging is left out: a request that ages into a higher band stops its victim
after the launches under way, like any launch the shim only holds.

Pure: no I/O, no clock, no import of the core (the core feeds it what changed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from gpushare_ext.units import priority_band


class PlacedLease(NamedTuple):
    """What the rivalry of one placed lease depends on (a tuple: the watch makes one per
    placed lease of every session an event names)."""

    lease_id: str
    session_id: str
    priority: int  # its base priority
    gpu_names: frozenset[str]  # its GPU's UUID and host index (and MIG UUID), as a
    # session's reachable GPUs may name them


@dataclass
class Rivals:
    """Sessions by the band they may ask for, and what each session was last told."""

    _band: dict[str, int] = field(default_factory=dict)  # session -> band it may ask for
    _asked: dict[str, int] = field(default_factory=dict)  # session -> its last request's band
    _waiting: dict[str, int] = field(default_factory=dict)  # session -> its queued's top band
    _reach: dict[str, tuple[str, ...] | None] = field(default_factory=dict)
    _by_band: dict[int, set[str]] = field(default_factory=dict)
    _told: dict[str, bool] = field(default_factory=dict)  # session -> unrivalled, as told
    _chaos: set[str] = field(default_factory=set)  # sessions an admin's chaos mode pauses

    # ---- what the core tells it

    # Each returns the band below which leases may have gained or lost a rival (None:
    # none may have): the core looks again only at sessions with leases below it.

    def session_opened(
        self, session_id: str, priority: int, reachable: tuple[str, ...] | None
    ) -> int | None:
        self._reach[session_id] = reachable
        self._asked[session_id] = priority_band(priority)
        return self._set_band(session_id)

    def session_closed(self, session_id: str) -> int | None:
        band = self._band.pop(session_id, None)
        if band is not None:
            self._by_band[band].discard(session_id)
        self._reach.pop(session_id, None)
        self._asked.pop(session_id, None)
        self._waiting.pop(session_id, None)
        self._told.pop(session_id, None)
        self._chaos.discard(session_id)
        return band

    def asked(self, session_id: str, priority: int) -> int | None:
        """The session's newest request asked for ``priority``."""
        if session_id not in self._band:
            return None
        self._asked[session_id] = priority_band(priority)
        return self._set_band(session_id)

    def waiting(self, session_id: str, priority: int | None) -> int | None:
        """The highest priority among the session's requests still queued (None: none)."""
        if session_id not in self._band:
            return None
        if priority is None:
            self._waiting.pop(session_id, None)
        else:
            self._waiting[session_id] = priority_band(priority)
        return self._set_band(session_id)

    def chaos(self, session_id: str, on: bool) -> None:
        """Chaos mode pauses the session at random moments: a rival while it lasts."""
        if on:
            self._chaos.add(session_id)
        else:
            self._chaos.discard(session_id)

    def _set_band(self, session_id: str) -> int | None:
        band = max(self._asked[session_id], self._waiting.get(session_id, -1))
        old = self._band.get(session_id)
        if old == band:
            return None
        if old is not None:
            self._by_band[old].discard(session_id)
        self._band[session_id] = band
        self._by_band.setdefault(band, set()).add(session_id)
        return band if old is None else max(band, old)

    # ---- questions

    def rival_of(self, lease: PlacedLease) -> str | None:
        """A session that could preempt ``lease`` (the first found), or None."""
        if lease.session_id in self._chaos:
            return "chaos mode"
        for band in range(priority_band(lease.priority) + 1, 3):
            for session_id in self._by_band.get(band, ()):
                if session_id == lease.session_id:
                    continue
                reach = self._reach.get(session_id)
                if reach is None or not lease.gpu_names.isdisjoint(reach):
                    return session_id
        return None

    def changes(self, placed: dict[str, list[PlacedLease]]) -> list[tuple[str, bool]]:
        """For each session in ``placed`` (its leases on a GPU; an empty list: none), whether
        it is unrivalled, where that differs from what it was last told; now told."""
        changed = []
        for session_id, leases in placed.items():
            if session_id not in self._band:
                continue  # closed meanwhile: nothing to tell
            unrivalled = True
            for lease in leases:
                if self.rival_of(lease) is not None:
                    unrivalled = False
                    break
            if self._told.get(session_id) != unrivalled:
                self._told[session_id] = unrivalled
                changed.append((session_id, unrivalled))
        return changed

    def told(self, session_id: str) -> bool | None:
        """What ``session_id`` was last told (None: nothing yet)."""
        return self._told.get(session_id)
