"""Helpers for the MIG tests: a scheduler on a shipped simulated layout, driven like a story.

``hub = Hub.on("h200-mig-mixed")`` builds :class:`core.Scheduler` on that fixture;
``hub.open("alice")`` opens a session; ``hub.request(alice, "L1", memory=8 * GIB)``
returns the actions of that one event, and ``hub.grant_of(actions)`` the placement.
No broker, no socket, no GPU.
"""

from __future__ import annotations

import itertools

from gpushare_ext.broker.hands.inventory import DeviceInfo, SimulatedInventory
from gpushare_ext.broker.scheduler import core
from gpushare_ext.protocol import Placement, RequestLease, SliceWish

GIB = 1024**3
NORMAL, HIGH = 150, 250


def devices_of(fixture: str) -> list[DeviceInfo]:
    return SimulatedInventory(fixture).devices()


def device_of(fixture: str, index: int = 0) -> DeviceInfo:
    return next(d for d in devices_of(fixture) if d.index == index)


class Hub:
    """A scheduler, a clock and sessions named after their users."""

    def __init__(self, devices: list[DeviceInfo]) -> None:
        self.scheduler = core.Scheduler(devices)
        self.now = 0.0
        self._pids = itertools.count(1000)

    @classmethod
    def on(cls, fixture: str) -> Hub:
        return cls(devices_of(fixture))

    def open(self, user: str) -> str:
        pid = next(self._pids)
        identity = core.Identity(uid=pid, gid=pid, pid=pid, user=user)
        session = f"s-{user}"
        self.scheduler.handle(
            core.SessionOpened(now=self.now, session_id=session, identity=identity)
        )
        return session

    def request(
        self,
        session: str,
        lease_id: str,
        *,
        memory: int,
        priority: int = NORMAL,
        slice: SliceWish = SliceWish.AUTO,
        device: str = "auto",
        sm_share: float = 1.0,
    ) -> list:
        self.now += 1.0
        return self.scheduler.handle(
            core.LeaseRequested(
                now=self.now,
                session_id=session,
                lease_id=lease_id,
                request=RequestLease(
                    priority=priority,
                    memory_bytes=memory,
                    slice=slice,
                    device=device,
                    sm_share=sm_share,
                ),
            )
        )

    def release(self, session: str, lease_id: str) -> list:
        self.now += 1.0
        return self.scheduler.handle(
            core.LeaseReleased(now=self.now, session_id=session, lease_id=lease_id)
        )

    @staticmethod
    def grant_of(actions: list) -> Placement:
        grants = [a for a in actions if isinstance(a, core.GrantLease)]
        assert len(grants) == 1, f"expected one grant, got {actions}"
        return grants[0].placement

    @staticmethod
    def refusal_of(actions: list) -> str:
        refusals = [a for a in actions if isinstance(a, core.RefuseRequest)]
        assert len(refusals) == 1, f"expected one refusal, got {actions}"
        return refusals[0].message
