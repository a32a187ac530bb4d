"""Device memory as NVML sees it, beside what the leases declare.

What it is for: :class:`MemorySeen` keeps, per whole-GPU slot (or MIG instance), what
each process held there at the last reading (:class:`DeviceMemorySeen`), and says how
much of it no lease declares: placement counts that memory as taken, so memory an idle
notebook keeps is not granted a second time, and parking frees it.  It counts the
readings per slot, so a queue notice knows when what it said may be stale.

What it must not do: change leases or decide anything; it answers what is held.
"""

from __future__ import annotations

from gpushare_ext.broker.scheduler.actions import Action
from gpushare_ext.broker.scheduler.events import DeviceMemorySeen
from gpushare_ext.broker.scheduler.lease_index import LeaseIndex
from gpushare_ext.broker.scheduler.scheduler_records import Lease
from gpushare_ext.protocol import LeaseState


class MemorySeen:
    """The last NVML reading per slot, and what no lease declares of it."""

    def __init__(self, slot_keys: set[str], index: LeaseIndex) -> None:
        self._slot_keys = slot_keys
        self._index = index
        # Per slot, the memory each process holds there as last seen.
        self.by_slot: dict[str, dict[int, int]] = {}
        self.readings: dict[str, int] = {}  # per slot, NVML readings taken so far

    def on_device_memory_seen(self, event: DeviceMemorySeen, now: float) -> list[Action]:
        key = str(event.device_index)
        if event.mig_uuid is not None:
            key = f"{event.device_index}/{event.mig_uuid}"
        if key in self._slot_keys:  # a reading of a slot this broker has (not a stale layout)
            self.by_slot[key] = {pid: used for pid, used in event.used_by_pid if used > 0}
            self.readings[key] = self.readings.get(key, 0) + 1
        return []

    def forget_process(self, key: str, pid: int) -> None:
        """``pid``'s device memory on ``key`` went to the host: the last reading is stale."""
        self.by_slot.get(key, {}).pop(pid, None)
        self.readings[key] = self.readings.get(key, 0) + 1

    def unleased_memory(self, key: str, asking: Lease | None = None) -> int:
        """Memory seen on slot ``key`` beyond what the leases there declare: per process,
        what it holds over its leases' memory (the whole of it for an idle notebook or a
        process without a lease).  With ``asking``, that lease is counted as granted: a
        process asking for memory it already holds (a notebook's cached arrays) is not
        asked to find it twice."""
        return sum(self.unleased_by_pid(key, asking).values())

    def unleased_by_pid(self, key: str, asking: Lease | None = None) -> dict[int, int]:
        """:meth:`unleased_memory` per process (only those holding some)."""
        beyond: dict[int, int] = {}
        for pid, used in self.by_slot.get(key, {}).items():
            declared = sum(
                lease.memory_bytes
                for lease in self._index.by_pid.get(pid, {}).values()
                if lease.slot == key and lease.state in (LeaseState.RUNNING, LeaseState.PAUSED)
            )
            counted = asking is not None and asking.state in (LeaseState.RUNNING, LeaseState.PAUSED)
            if asking is not None and asking.identity.pid == pid and not counted:
                declared += asking.memory_bytes
            if used > declared:
                beyond[pid] = used - declared
        return beyond
