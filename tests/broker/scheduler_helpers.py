"""Helpers for driving :class:`gpushare_ext.broker.scheduler.core.Scheduler` in tests.

:class:`Hub` is a scheduler plus a clock and named sessions, so a test reads like a
story: ``hub.open("alice")``, ``hub.request(alice, "L1", priority=HIGH)``,
``hub.applied("L1", LOCK)``, ``hub.advance(60)``.  Every call returns the actions the
core produced for that one event.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable

from gpushare_ext.broker.hands.inventory import DeviceInfo, fixture_path, parse_inventory
from gpushare_ext.broker.scheduler import core
from gpushare_ext.broker.settings.policy import Policy
from gpushare_ext.protocol import (
    Capabilities,
    LeaseState,
    PreemptionLevel,
    RequestLease,
    SliceWish,
)
from gpushare_ext.units import priority_band

GIB = 1024**3
MIB = 1024**2
LOW, NORMAL, HIGH = 50, 150, 250
H200_MEMORY = 143771 * MIB

UNINSTRUMENTED = Capabilities()
YIELDING = Capabilities(instrumented_only=True, yield_flag=True, gate=True)
GATED = Capabilities(instrumented_only=True, gate=True)


def h200_document() -> dict:
    return json.loads(fixture_path("h200").read_text())


def h200_devices(count: int = 1) -> list[DeviceInfo]:
    """``count`` whole H200s (MIG off), as the shipped readout describes one."""
    document = h200_document()
    base = document["devices"][0]
    raw = []
    for index in range(count):
        device = copy.deepcopy(base)
        device["index"] = index
        device["uuid"] = f"GPU-00000000-0000-0000-0000-00000000000{index}"
        raw.append(device)
    return parse_inventory({"devices": raw}, simulated=True)


# A MIG-enabled H200 cut into 3g.71gb (slices 0-3), 2g.35gb (4-5) and 1g.18gb (6).
MIG_INSTANCES = [
    {"profile_id": 2, "start": 0, "gpu_instance_id": 1},
    {"profile_id": 1, "start": 4, "gpu_instance_id": 5},
    {"profile_id": 0, "start": 6, "gpu_instance_id": 6},
]


def mig_document(instances: list[dict] | None = None) -> dict:
    document = h200_document()
    device = document["devices"][0]
    device["mig_mode"] = {"current": 1, "pending": 1}
    device["mig_instances"] = MIG_INSTANCES if instances is None else instances
    return document


def mig_devices(instances: list[dict] | None = None) -> list[DeviceInfo]:
    return parse_inventory(mig_document(instances), simulated=True)


def of_type(actions: Iterable[core.Action], kind: type) -> list:
    return [action for action in actions if isinstance(action, kind)]


def only(actions: Iterable[core.Action], kind: type):
    found = of_type(actions, kind)
    assert len(found) == 1, f"expected one {kind.__name__}, got {found}"
    return found[0]


class Hub:
    """A scheduler with a clock, users and sessions, for readable tests."""

    def __init__(
        self,
        devices: list[DeviceInfo] | None = None,
        policy: Policy | None = None,
        *,
        start: float = 1_000.0,
    ) -> None:
        self.scheduler = core.Scheduler(devices or h200_devices(), policy)
        self.now = start
        self._pids = 40_000
        self._sessions = 0
        self.events: list[core.Event] = []
        self.check_index = True  # off only where a test times the core

    def handle(self, event: core.Event) -> list[core.Action]:
        self.events.append(event)
        try:
            return self.scheduler.handle(event)
        finally:
            if self.check_index:
                mismatch = self.scheduler.index_mismatch()
                assert not mismatch, mismatch

    def advance(self, seconds: float) -> list[core.Action]:
        self.now += seconds
        return self.handle(core.Tick(now=self.now))

    def open(
        self,
        user: str,
        *,
        uid: int | None = None,
        groups: tuple[str, ...] = (),
        pid: int = 0,
        reachable: tuple[str, ...] | None = None,
    ) -> str:
        self._sessions += 1
        self._pids += 1
        session = f"S{self._sessions}-{user}"
        identity = core.Identity(
            uid=uid if uid is not None else 1000 + sum(map(ord, user)),
            gid=100,
            pid=pid or self._pids,
            user=user,
            groups=groups,
        )
        self.handle(
            core.SessionOpened(
                now=self.now, session_id=session, identity=identity, reachable=reachable
            )
        )
        return session

    def close(self, session: str, reason: str = "connection closed") -> list[core.Action]:
        return self.handle(core.SessionClosed(now=self.now, session_id=session, reason=reason))

    def request(
        self,
        session: str,
        lease_id: str,
        *,
        priority: int = NORMAL,
        memory: int | None = 8 * GIB,
        slice: SliceWish = SliceWish.AUTO,
        device: str = "auto",
        sm_share: float = 1.0,
        capabilities: Capabilities = UNINSTRUMENTED,
        ranks: int = 1,
    ) -> list[core.Action]:
        return self.handle(
            core.LeaseRequested(
                now=self.now, session_id=session, lease_id=lease_id,
                request=RequestLease(
                    priority=priority, memory_bytes=memory, slice=slice, device=device,
                    sm_share=sm_share, capabilities=capabilities, ranks=ranks,
                ),
            )
        )  # fmt: skip

    def release(self, session: str, lease_id: str, by_admin: bool = False) -> list[core.Action]:
        return self.handle(
            core.LeaseReleased(
                now=self.now, session_id=session, lease_id=lease_id, by_admin=by_admin
            )
        )

    def applied(self, lease_id: str, level: PreemptionLevel) -> list[core.Action]:
        return self.handle(core.PreemptionApplied(now=self.now, lease_id=lease_id, level=level))

    def failed(self, lease_id: str, level: PreemptionLevel, reason: str) -> list[core.Action]:
        return self.handle(
            core.PreemptionFailed(now=self.now, lease_id=lease_id, level=level, reason=reason)
        )

    def memory_seen(self, pid: int, used: int) -> list[core.Action]:
        return self.handle(core.MemoryObserved(now=self.now, pid=pid, used_bytes=used))

    def drain(self, device: int, drained: bool = True) -> list[core.Action]:
        return self.handle(core.DeviceDrained(now=self.now, device_index=device, drained=drained))

    # ---- looking

    def lease(self, lease_id: str) -> core.Lease:
        lease = self.scheduler.lease_of(lease_id) or self.scheduler.ended.get(lease_id)
        assert lease is not None, f"no lease {lease_id}"
        return lease

    def state(self, lease_id: str) -> LeaseState:
        return self.lease(lease_id).state

    def pid_of(self, session: str) -> int:
        return self.scheduler.sessions[session].identity.pid


def may_ask_band(scheduler: core.Scheduler, session_id: str) -> int:
    """The highest band a session may preempt with: its last accepted request's (before
    any, the default's), and each of its requests still queued (placed later, it
    preempts whatever its session asked since).  Aging is left out."""
    record = scheduler.sessions[session_id]
    queued = [
        scheduler.leases[i].base_priority
        for i in record.leases
        if scheduler.leases[i].state == LeaseState.QUEUED
    ]
    return max(priority_band(p) for p in [record.last_priority, *queued])


def fingerprint(scheduler: core.Scheduler) -> str:
    """Everything the scheduler knows, as text: equal text means equal state."""
    return repr(
        (
            sorted(scheduler.sessions.items()),
            sorted(scheduler.leases.items()),
            list(scheduler.ended.items()),
            sorted(scheduler.drained),
            scheduler.now,
            scheduler.book.arrivals,
            sorted(scheduler.book.hold_ema.items()),
            scheduler.policy,
        )
    )
