"""What a GPU and its slices are, as both sides of the socket describe them.

What it is for: the static description of a device (``DeviceInfo``: memory, SMs, MIG
mode, its GPU-instance profiles and instances) and a reading of what it is doing
(``DeviceReading``).  The broker's inventory fills them in; they travel in protocol
messages unchanged, and the runtime and the status views read them.

What it must not do: read a device (``broker/hands/inventory.py`` does, through NVML or a
simulated twin) or import anything from gpushare_ext: it is the ground floor.
"""

from __future__ import annotations

import msgspec

__all__ = ["MIB", "DeviceInfo", "DeviceReading", "MigInstance", "MigProfile", "ProcessUsage"]

MIB = 1024 * 1024


class MigProfile(msgspec.Struct, frozen=True, kw_only=True):
    """One GPU-instance profile a device can be cut into (e.g. 3g.71gb)."""

    id: int
    name: str
    slice_count: int
    memory_mib: int
    multiprocessor_count: int
    instance_count: int
    memory_slices: int = 1
    placements: tuple[int, ...] = ()
    media_extensions: bool = False


class MigInstance(msgspec.Struct, frozen=True, kw_only=True):
    """One existing MIG instance (GPU instance + compute instance), addressed by its UUID."""

    uuid: str
    profile_id: int
    name: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_mib: int
    multiprocessor_count: int
    start: int = 0
    size: int = 1


class DeviceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Static description of one physical GPU."""

    index: int
    name: str
    uuid: str
    memory_total_mib: int
    multiprocessor_count: int
    compute_capability: tuple[int, int]
    driver_version: str
    mig_enabled: bool
    mig_pending: bool
    compute_mode: int
    profiles: tuple[MigProfile, ...] = ()
    instances: tuple[MigInstance, ...] = ()
    simulated: bool = False

    @property
    def memory_total_bytes(self) -> int:
        return self.memory_total_mib * MIB


class ProcessUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Device memory one process holds, as NVML reports it."""

    pid: int
    used_mib: int
    mig_uuid: str | None = None


class DeviceReading(msgspec.Struct, frozen=True, kw_only=True):
    """What a device is doing now."""

    index: int
    memory_used_mib: int
    utilization_pct: int
    processes: tuple[ProcessUsage, ...] = ()
